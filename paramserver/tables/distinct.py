"""A lookup's distinct ids: the step's deduplication, done once, wherever it is cheapest to do.

Owns ``DistinctIds`` (the sorted distinct ids of an id tensor and, for
every id, its place among them) and ``distinct_ids``, the one function
that computes them.  A table's route (``paramserver.shards.client``) needs
exactly this before it can split ids by shard; the Trainer's batch reader
computes it for every batch it reads ahead (``Batch.find_distinct_ids``),
in its own thread, so that a step's routing on the training thread starts
from it.  Both sides call the same function, so a route made from a
batch's ``DistinctIds`` is the route made from its ids.  No state.
"""

from typing import NamedTuple, Optional

import torch
from torch import Tensor


class DistinctIds(NamedTuple):
    """``ids``: the distinct ids (int64, ascending); ``inverse``: for every id of the tensor, flattened, the
    index of its value in ``ids``."""

    ids: Tensor
    inverse: Tensor


def distinct_ids(ids: Tensor, given: Optional[DistinctIds] = None, table: str = "") -> DistinctIds:
    """The distinct ids of ``ids`` (any shape, int32 or int64) and where each id is among them.  ``given``:
    those found already (by this function, ahead of time): returned once checked to be for as many ids
    (``ValueError`` naming ``table`` if not: they would route another batch's ids)."""
    if given is None:
        unique, inverse = torch.unique(ids.long().reshape(-1), sorted=True, return_inverse=True)
        return DistinctIds(unique, inverse)
    if given.inverse.numel() != ids.numel():
        raise ValueError(f"table {table!r}: distinct ids found for {given.inverse.numel()} ids are handed with "
                         f"{ids.numel()} ids")
    return given
