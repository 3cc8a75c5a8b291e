"""A step's row traffic on the owner: one fused lookup and one fused push per shard per step.

Owns what a trainer's ``EmbeddingCollection`` (``paramserver.shards.client.collection``)
asks of each shard, as plain functions of the shard's ``ShardState``
(``service`` holds the RPC targets and custom ops that call them):

* ``table_handles`` (once, when the collection is built): the integer
  handles naming its row ranges here.  A step names tables by handle, not
  by RRef, which spares it the RRef fork and acknowledge messages that
  every RRef argument costs.  Every request carries the process's
  incarnation with them: a restarted shard serves under the same name,
  and handles of the process that died are refused (``StaleHandles``),
  never taken for its successor's.
* ``lookup``: the rows of every table this shard serves to the step (plain
  values: no autograd is recorded; ids and rows travel packed, ``wire``); a dynamic table's part
  (``dynamic.DynamicRows``) is asked by id, and admits and touches them at
  the step.
* ``push`` (``pushes``: several steps' in one message, in order): the step's row gradients for every one of those tables,
  applied on arrival by the owner-side optimizer named by its handle (an
  ``optimizers.OwnerOptimizer``), under its parameters' locks, with the
  same scripted update that ``DistributedOptimizer.step`` runs on a
  ``dist_autograd`` context's row-sparse gradients: the rows come out
  equal to the unfused path's.  What a push applied (and a dynamic table's
  training lookups) reaches the shard's push log before the answer leaves.
"""

import logging
from typing import List, Tuple

import torch
from torch import Tensor

from .. import wire
from .state import ShardState

logger = logging.getLogger(__name__)


class StaleHandles(RuntimeError):
    """A request names handles made by another process serving under this shard's name (it was restarted)."""


def table_handles(state: ShardState, tables: List[Tensor]) -> Tuple[int, List[int]]:
    """This process's incarnation and the handles naming ``tables`` (row ranges hosted here) in ``lookup``."""
    return state.incarnation, [state.table_handle(table) for table in tables]


def check_incarnation(state: ShardState, incarnation: int) -> ShardState:
    """``state``, when ``incarnation`` is its own; ``StaleHandles`` otherwise."""
    if state.incarnation != incarnation:
        raise StaleHandles("the handles were made by an earlier process of this shard (it was restarted): "
                           "build the tables' handles again")
    return state


def lookup(state: ShardState, incarnation: int, tables: List[int], ids: Tensor, counts: List[int],
           step: int) -> Tensor:
    """The rows of table handle ``tables[i]`` for its ``counts[i]`` ids of ``ids`` (local indices; ids of a
    dynamic table), every table's in turn, packed (``wire``).  ``step``: the trainer's step (a dynamic table
    touches and admits ids then); negative to read only."""
    check_incarnation(state, incarnation)
    with torch.no_grad():
        try:
            pieces = [_rows(state, state.table(handle), rows, step)
                      for handle, rows in zip(tables, wire.unpack_ids(ids, counts))]
        finally:
            if step >= 0:  # a dynamic table's admissions are in the push log before the rows are answered
                state.flush_log()
        if len({piece.dtype for piece in pieces}) > 1:  # tables of several types: one packed tensor, in float32
            pieces = [piece.to(torch.float32) for piece in pieces]
        return wire.pack_rows(pieces)


def prefetch(state: ShardState, tables: List[int], ids: Tensor, counts: List[int]) -> None:
    """A lookup of ``ids`` in ``tables`` (as ``lookup`` takes them) comes next, after a push: dynamic tables with a
    row store start reading the rows they hold on disk now, while the push is applied."""
    if state.row_stores is None or len(tables) != len(counts) or ids.dim() != 1 or \
            any(count < 0 for count in counts) or sum(counts) != ids.numel():
        return  # (the lookup itself refuses what is wrong with it, after the push)
    for handle, rows in zip(tables, wire.unpack_ids(ids, counts)):
        try:
            table = state.table(handle)
        except KeyError:
            continue
        dynamic = state.dynamic_rows(table)
        if dynamic is not None:
            dynamic.prefetch(rows)


def _rows(state: ShardState, table: Tensor, ids: Tensor, step: int) -> Tensor:
    dynamic = state.dynamic_rows(table)
    return torch.index_select(table, 0, ids) if dynamic is None else dynamic.lookup(ids, step)


def _span(packed: Tensor, start: int, stop: int) -> Tensor:
    """``packed[start:stop]``: ``packed`` itself where that is all of it (a message of one step's push), as a
    view costs more than a small push's update."""
    return packed if start == 0 and stop == packed.numel() else packed[start:stop]


def push(state: ShardState, incarnation: int, optimizer: int, params: List[int], ids: Tensor, counts: List[int],
         gradients: Tensor, peer: str, pusher: int, step: int) -> int:
    """Apply the row gradients of parameter ``params[i]`` of optimizer handle ``optimizer``: ``counts[i]``
    rows of ``ids`` (local indices) and of ``gradients`` (packed, ``wire``), all in one step of it, unless
    ``step`` >= 0 and this optimizer already applied a push of ``pusher`` for that step or a later one (a
    step's push sent again is applied once); returns the number of parameters named."""
    return pushes(state, incarnation, optimizer, params, [len(params)], ids, counts, gradients, peer, pusher, [step])


def pushes(state: ShardState, incarnation: int, optimizer: int, params: List[int], param_counts: List[int],
           ids: Tensor, counts: List[int], gradients: Tensor, peer: str, pusher: int, steps: List[int]) -> int:
    """Several steps' pushes of one pusher in one message, applied in order, each as ``push`` applies one:
    push ``j`` names the next ``param_counts[j]`` entries of ``params`` (and of ``counts``, ids and
    gradients) and is for ``steps[j]``.  A push refused (``ValueError``) leaves the earlier ones applied:
    each is idempotent per step, so the message sent again applies only the rest.  Returns the number of
    parameters named."""
    owner_optimizer = check_incarnation(state, incarnation).optimizer(optimizer)
    try:
        if len(param_counts) != len(steps) or sum(param_counts) != len(params) or min(param_counts, default=0) < 0:
            raise ValueError(f"pushes for steps {list(steps)} name {list(param_counts)} parameters each, "
                             f"which do not add up to the {len(params)} named")
        widths = [owner_optimizer.row_width(index) for index in params]
        all_ids, all_gradients = wire.unpack_ids(ids, counts), wire.unpack_rows(gradients, counts, widths)
        start = id_start = value_start = 0
        for count, step in zip(param_counts, steps):
            stop = start + count
            id_stop = id_start + sum(counts[start:stop])
            value_stop = value_start + sum(rows * width for rows, width in zip(counts[start:stop], widths[start:stop]))
            owner_optimizer.apply_rows(params[start:stop], all_ids[start:stop], all_gradients[start:stop], peer,
                                       (pusher, step) if step >= 0 else None,
                                       packed=(_span(ids, id_start, id_stop), _span(gradients, value_start, value_stop)))
            start, id_start, value_start = stop, id_stop, value_stop
    except ValueError as error:
        logger.warning("optimizer %d refused a push from %s: %s", optimizer, peer, error)
        raise
    finally:
        state.flush_log()  # what it applied is in the push log before it answers
    return len(params)
