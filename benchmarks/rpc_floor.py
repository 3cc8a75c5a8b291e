"""The floor of a push over torch RPC: a TorchScript target that takes a push's arguments and does nothing.

``shard_throughput.py`` sends it the very requests it sends ``service.push_lookup``
(the same types, the same packed ids and gradients), so the shard's CPU per
request for it is what receiving, deserializing and answering a push costs
before any of the shard's own work: the part of a push no shard code can cut.
A module of its own so that the shard process (which imports the benchmark)
and the pushers compile it under one qualified name.
"""

from typing import List

import torch
from torch import Tensor


@torch.jit.script
def push_floor(incarnation: int, optimizer: int, params: List[int], param_counts: List[int], ids: Tensor,
               counts: List[int], gradients: Tensor, peer: str, pusher: int, steps: List[int], tables: List[int],
               lookup_ids: Tensor, lookup_counts: List[int], lookup_step: int) -> Tensor:
    """``service.push_lookup``'s arguments in, an empty answer out (as a push with no read answers)."""
    return torch.empty(0)
