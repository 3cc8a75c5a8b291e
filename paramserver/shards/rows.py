"""A step's row traffic on the owner: one fused lookup and one fused push per shard per step.

Owns the RPC targets that a trainer's ``EmbeddingCollection``
(``paramserver.shards.collection``) calls on each shard server:

* ``table_handles`` (once, when the collection is built): the integer
  handles naming its row ranges here.  A step names tables by handle, not
  by RRef, which spares it the RRef fork and acknowledge messages that
  every RRef argument costs.  Every request carries the process's
  incarnation with them: a restarted shard serves under the same name,
  and handles of the process that died are refused (``StaleHandles``),
  never taken for its successor's.
* ``lookup``: the rows of every table this shard serves to the step, in
  one request and one reply (plain values: no autograd is recorded); a
  dynamic table's part (``paramserver.shards.dynamic``) is asked by id,
  and admits and touches them at the step.
* ``push``: the step's row gradients for every one of those tables,
  applied on arrival by the owner-side optimizer named by its handle (an
  ``OwnerOptimizer`` of ``paramserver.optim.owner``, reached through the
  process's ``ShardState``), under its parameters' locks, with the same
  compiled update that ``DistributedOptimizer.step`` runs on a
  ``dist_autograd`` context's row-sparse gradients: the rows come out
  equal to the unfused path's.

``lookup`` and ``push`` are TorchScript functions, so requests and replies
are TorchScript calls (no Python pickling on the way in or out).  Each
reaches the process's state through a custom op with a Python kernel,
which holds the GIL to look handles up; the row copies and the compiled
update release it.  This module never sends RPCs and never imports
``paramserver.optim``: the optimizer is an object the state holds.
"""

import logging
from typing import List, Tuple

import torch
from torch import Tensor
from torch.distributed.rpc import RRef

from .state import ShardState

logger = logging.getLogger(__name__)


class StaleHandles(RuntimeError):
    """A request names handles made by another process serving under this shard's name (it was restarted)."""


def table_handles(tables: List[RRef]) -> Tuple[int, List[int]]:
    """RPC target: this process's incarnation and the handles naming ``tables`` (row ranges hosted here) in
    ``lookup``; every request carries the incarnation, so that handles made by a process that died are never
    taken for those of the one that replaced it under the same name."""
    state = ShardState.current()
    return state.incarnation, [state.table_handle(table.local_value()) for table in tables]


def _current(incarnation: int) -> ShardState:
    state = ShardState.current()
    if state.incarnation != incarnation:
        raise StaleHandles("the handles were made by an earlier process of this shard (it was restarted): "
                           "build the tables' handles again")
    return state


_library = torch.library.Library("paramserver_rows", "DEF")
_library.define("lookup(int incarnation, int[] tables, Tensor[] ids, int step) -> Tensor[]")
_library.define("push(int incarnation, int optimizer, int[] params, Tensor[] ids, Tensor[] gradients, str peer, "
                "int pusher, int step) -> int")


def _lookup_kernel(incarnation: int, tables: List[int], ids: List[Tensor], step: int) -> List[Tensor]:
    state = _current(incarnation)
    with torch.no_grad():
        return [_rows(state, state.table(handle), rows, step) for handle, rows in zip(tables, ids)]


def _rows(state: ShardState, table: Tensor, ids: Tensor, step: int) -> Tensor:
    dynamic = state.dynamic_rows(table)
    return torch.index_select(table, 0, ids) if dynamic is None else dynamic.lookup(ids, step)


def _push_kernel(incarnation: int, optimizer: int, params: List[int], ids: List[Tensor], gradients: List[Tensor],
                 peer: str, pusher: int, step: int) -> int:
    owner_optimizer = _current(incarnation).optimizer(optimizer)
    try:
        owner_optimizer.apply_rows(params, ids, gradients, peer, (pusher, step) if step >= 0 else None)
    except ValueError as error:
        logger.warning("optimizer %d refused a push from %s: %s", optimizer, peer, error)
        raise
    return len(params)


_library.impl("lookup", _lookup_kernel, "CompositeExplicitAutograd")
_library.impl("push", _push_kernel, "CompositeExplicitAutograd")


@torch.jit.script
def lookup(incarnation: int, tables: List[int], ids: List[Tensor], step: int = -1) -> List[Tensor]:
    """RPC target: rows ``ids[i]`` (local indices; ids of a dynamic table) of table handle ``tables[i]``, for
    every ``i``.  ``step``: the trainer's step (a dynamic table touches and admits ids then); negative to
    read only (evaluation)."""
    return torch.ops.paramserver_rows.lookup(incarnation, tables, ids, step)


@torch.jit.script
def push(incarnation: int, optimizer: int, params: List[int], ids: List[Tensor], gradients: List[Tensor],
         peer: str, pusher: int = 0, step: int = -1) -> int:
    """RPC target: apply row gradients ``gradients[i]`` (rows ``ids[i]``, local indices) to parameter
    ``params[i]`` of optimizer handle ``optimizer``, all in one step of it, unless ``step`` >= 0 and this
    optimizer already applied a push of ``pusher`` for that step or a later one (a step's push sent again is
    applied once); returns the number of parameters named (TorchScript drops calls whose results nobody
    uses)."""
    return torch.ops.paramserver_rows.push(incarnation, optimizer, params, ids, gradients, peer, pusher, step)
