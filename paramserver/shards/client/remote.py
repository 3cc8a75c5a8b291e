"""Placing a model's dense parameters on shard servers, and reading them back.

Owns the trainer/driver side of dense parameters: ``place_parameters``
(plan with ``placement.plan_dense``, host each tensor on its shard, return
RRefs), ``gather`` (the parameters for a forward pass, one RPC per owner,
differentiable inside a ``dist_autograd`` context), ``fetch`` (current
values, for evaluation and tests) and ``PlacedModule``, which runs an
``nn.Module`` whose parameters live on the shards.
"""

import copy
import uuid
from collections import OrderedDict
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed.rpc as rpc
from torch import Tensor, nn
from torch.distributed.rpc import RRef

from ..server import service
from .placement import plan_dense


def place_parameters(named_tensors: Iterable[Tuple[str, Tensor]], shards: Sequence[str],
                     prefix: str = "", initial_load: Optional[Mapping[str, int]] = None) -> Dict[str, RRef]:
    """Host each ``(name, tensor)`` on a shard chosen by size; returns ``{name: RRef}`` in input order.

    The hosted copies are named ``prefix + name`` on their shards.
    ``initial_load`` (bytes per shard already held) lets placement fill around it.
    """
    tensors = OrderedDict(named_tensors)
    sizes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    plan = plan_dense(sizes, list(shards), initial_load)
    futures = {name: rpc.rpc_async(plan[name], service.host_tensor, args=(prefix + name, tensor.detach()))
               for name, tensor in tensors.items()}
    return {name: future.wait() for name, future in futures.items()}


def _per_owner(rrefs: Sequence[RRef], function) -> List:
    """Call ``function(list of rrefs)`` once on each owner; results back in ``rrefs`` order."""
    by_owner: "OrderedDict[str, List[int]]" = OrderedDict()
    for index, rref in enumerate(rrefs):
        by_owner.setdefault(rref.owner().name, []).append(index)
    futures = {owner: rpc.rpc_async(owner, function, args=([rrefs[i] for i in indices],))
               for owner, indices in by_owner.items()}
    results: List = [None] * len(rrefs)
    for owner, indices in by_owner.items():
        for index, value in zip(indices, futures[owner].wait()):
            results[index] = value
    return results


def gather(rrefs: Sequence[RRef]) -> List[Tensor]:
    """The parameters, for a forward pass: inside a dist_autograd context, backward reaches their owners."""
    return _per_owner(rrefs, service.gather)


def fetch(rrefs: Sequence[RRef]) -> List[Tensor]:
    """Detached copies of the parameters' current values."""
    return _per_owner(rrefs, service.values)


class PlacedModule(nn.Module):
    """Runs ``module`` with its parameters living on ``shards``.

    The parameters are placed (by size) when this is built.  ``forward``
    gathers their current values (one RPC per shard) and calls the module
    with them, so inside a ``dist_autograd`` context the gradients go to the
    shards, where ``DistributedOptimizer(..., placed.remote_parameters())``
    applies them.  Buffers stay local.  The wrapped module's own parameter
    tensors are only the template; use ``fetch_state_dict`` or
    ``materialize`` to read the trained values.
    """

    def __init__(self, module: nn.Module, shards: Sequence[str], name: Optional[str] = None):
        super().__init__()
        self.module = module
        self.name = name or f"{type(module).__name__}-{uuid.uuid4().hex[:8]}"
        self._param_rrefs = place_parameters(module.named_parameters(), shards, prefix=self.name + ".")

    def remote_parameters(self) -> List[RRef]:
        return list(self._param_rrefs.values())

    def placement(self) -> Dict[str, str]:
        """Parameter name -> shard holding it."""
        return {name: rref.owner().name for name, rref in self._param_rrefs.items()}

    def forward(self, *args, **kwargs):
        values = gather(self.remote_parameters())
        return torch.func.functional_call(self.module, dict(zip(self._param_rrefs, values)), args, kwargs)

    def fetch_state_dict(self) -> Dict[str, Tensor]:
        """Current parameter values (and local buffers), like ``module.state_dict()``."""
        state = dict(zip(self._param_rrefs, fetch(self.remote_parameters())))
        state.update({name: buf.detach().clone() for name, buf in self.module.named_buffers()})
        return state

    def materialize(self) -> nn.Module:
        """A local copy of the module holding the current values, for evaluation."""
        local = copy.deepcopy(self.module)
        local.load_state_dict(self.fetch_state_dict(), strict=False)
        return local
