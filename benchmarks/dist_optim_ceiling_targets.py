"""RPC targets of ``benchmarks/dist_optim_ceiling.py`` (a module of its own, so that owners import them by name).

``fused_step``: the least an owner's dense SGD step can do, the fused kernel over lists made beforehand by
``prepare`` (no gradient lookup, no checks, no locks, no timing); ``noop``: nothing.
"""

from typing import List

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from paramserver.shards.server import service

_LISTS = {}


def prepare(handle: int, context_id: int) -> int:
    """RPC target: keep the parameters of optimizer ``handle``, their gradients in ``context_id`` and fresh
    momentum buffers, for ``fused_step``."""
    params = service._state().optimizer(handle).params
    gradients = dist_autograd.get_gradients(context_id)
    _LISTS[handle] = (params, [gradients[p] for p in params], [torch.zeros_like(p) for p in params])
    return len(params)


def _fused_kernel(handle: int, context_id: int) -> int:
    params, grads, buffers = _LISTS[handle]
    with torch.no_grad():
        torch._fused_sgd_(params, grads, buffers, weight_decay=0.0, momentum=0.9, lr=1e-6, dampening=0.0,
                          nesterov=False, maximize=False, is_first_step=False)
    return len(params)


_ops = torch.library.Library("dist_optim_ceiling", "DEF")
_ops.define("fused_step(int handle, int context_id) -> int")
_ops.impl("fused_step", _fused_kernel, "CompositeExplicitAutograd")


@torch.jit.script
def fused_step(handle: int, context_id: int) -> int:
    """RPC target (TorchScript, as ours): the fused kernel alone."""
    return torch.ops.dist_optim_ceiling.fused_step(handle, context_id)


@torch.jit.script
def noop(handle: int, context_id: int) -> int:
    """RPC target (TorchScript): nothing."""
    return handle


def send(owners: List[str], handles: List[int], context_id: int, fused: bool) -> List[torch.futures.Future[int]]:
    """``fused_step`` (or ``noop``) on every owner at once (compiled, as ``DistributedOptimizer`` sends)."""
    futures: List[torch.futures.Future[int]] = []
    for i in range(len(owners)):
        if fused:
            futures.append(rpc.rpc_async(owners[i], fused_step, (handles[i], context_id)))
        else:
            futures.append(rpc.rpc_async(owners[i], noop, (handles[i], context_id)))
    return futures
