"""The shard service: every RPC target and custom op of a process that owns parameters, behind one door.

Owns the data plane's entry points on the owner's side, and nothing else:
each target resolves the process's ``ShardState`` once (``_state()``) and
hands it to plain objects that know nothing of RPC (``hosted``, ``rows``,
``optimizers``, ``checkpoint_part``), then wraps what they return for the
wire (RRefs, JSON).  Trainers name these functions in ``rpc_async`` (torch
RPC sends a function by its qualified name), so this module is the one list
of what a shard answers:

* hosting: ``host_tensor``, ``host_rows``, ``host_dynamic`` (RRefs to what
  is hosted), ``read_dynamic``, ``lookup_rows`` and ``gather`` (TorchScript:
  differentiable reads inside a ``dist_autograd`` context), ``values``;
* a step's rows: ``table_handles``, ``lookup``, ``push`` and
  ``push_lookup`` (one or more steps' pushes that carry later steps' lookups; TorchScript
  functions over the custom ops ``paramserver::lookup``,
  ``paramserver::push`` and ``paramserver::push_lookup``: requests and replies are TorchScript calls, no
  Python pickling; the ops' Python kernels hold the GIL to look handles up,
  and the row copies and the scripted update release it);
* optimizers: ``new_owner_optimizer``, ``optimizer_step`` (TorchScript over
  ``paramserver::owner_step``), ``optimizer_step_stats``, ``push_ledger``,
  ``optimizer_state_dict``, ``optimizer_load_state_dict``;
* checkpoints and live exports: ``write_checkpoint_part``, ``checkpoint_committed`` (the push log is cut
  there), ``write_export_part``;
* figures: ``dynamic_table_parts``, ``dynamic_table_figures`` (``figures``);
* the process: ``request_stop``.

The state is installed here once, by the shard process that made it
(``run_shard_server``); torch RPC has one agent per process, so the door is
per process too.  A process that owns parameters without being a shard
server (a trainer in a test, whose RRefs other trainers use) gets a state of
its own on first use.  Nothing else in the package looks the state up.
"""

import logging
import threading
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed.rpc as rpc
from torch import Tensor
from torch.distributed.rpc import RRef

from ...filesystems import locate
from ...tables import DynamicOptions
from ...torchscript import script
from .. import wire
from . import checkpoint_part, export_part, figures, hosted, optimizers, rows
from .state import ShardState

logger = logging.getLogger(__name__)


class _ProcessState:
    """The process's ``ShardState``, installed once by its shard server (or made on first use)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._state: Optional[ShardState] = None

    def install(self, state: ShardState) -> None:
        with self._lock:
            self._state = state

    def state(self) -> ShardState:
        installed = self._state  # every request reads it: no lock once there is one
        if installed is not None:
            return installed
        with self._lock:
            if self._state is None:
                self._state = ShardState()
            return self._state


#: The one place the process's state is found (see the module's docstring).
_process_state = _ProcessState()


def install(state: ShardState) -> None:
    """Serve ``state`` from now on (a shard server, before peers can reach it)."""
    _process_state.install(state)


def _state() -> ShardState:
    return _process_state.state()


# -- hosting ------------------------------------------------------------------
def host_tensor(name: str, value: Tensor) -> RRef:
    """RPC target: host a copy of ``value`` as a trainable parameter named ``name``; the RRef the caller keeps."""
    return RRef(hosted.host_tensor(_state(), name, value))


def host_rows(name: str, num_rows: int, embedding_dim: int, dtype: torch.dtype, seed: int,
              start_row: int, shared: bool = False, init_std: float = 1.0, rounding: str = "stochastic") -> RRef:
    """RPC target: host embedding rows (``hosted.host_rows``); the RRef the caller keeps."""
    return RRef(hosted.host_rows(_state(), name, num_rows, embedding_dim, dtype, seed, start_row, shared, init_std,
                                 rounding))


def host_dynamic(table: str, embedding_dim: int, dtype: torch.dtype, seed: int, init_std: float,
                 options: DynamicOptions, index: int, count: int, rounding: str = "stochastic") -> RRef:
    """RPC target: host this shard's part of a dynamic table (``hosted.host_dynamic``); an RRef to its slab."""
    return RRef(hosted.host_dynamic(_state(), table, embedding_dim, dtype, seed, init_std, options, index, count,
                                    rounding))


def read_dynamic(slab: RRef, ids: Tensor) -> Tensor:
    """RPC target: rows of ``ids`` (distinct) in a dynamic table's part, read only (zeros for ids without one)."""
    return hosted.read_dynamic(_state(), slab.local_value(), ids)


@script
def lookup_rows(table: RRef[Tensor], rows: Tensor) -> Tensor:
    """RPC target: rows ``rows`` (local indices) of a hosted table; backward yields a row-sparse gradient."""
    return torch.embedding(table.local_value(), rows, -1, False, True)


@script
def gather(params: List[RRef[Tensor]]) -> List[Tensor]:
    """RPC target: the hosted parameters themselves (differentiable inside a dist_autograd context)."""
    return [param.local_value() for param in params]


def values(params: List[RRef]) -> List[Tensor]:
    """RPC target: detached copies of the current values, for evaluation."""
    return [param.local_value().detach().clone() for param in params]


# -- a step's rows: one lookup and one push per shard -----------------------------
def table_handles(tables: List[RRef]) -> Tuple[int, List[int]]:
    """RPC target: this process's incarnation and the handles naming ``tables`` in ``lookup`` and ``push``."""
    return rows.table_handles(_state(), [table.local_value() for table in tables])


def _lookup_kernel(incarnation: int, tables: List[int], ids: Tensor, counts: List[int], step: int) -> Tensor:
    return rows.lookup(_state(), incarnation, tables, ids, counts, step)


def _push_kernel(incarnation: int, optimizer: int, params: List[int], ids: Tensor, counts: List[int],
                 gradients: Tensor, peer: str, pusher: int, step: int) -> int:
    return rows.push(_state(), incarnation, optimizer, params, ids, counts, gradients, peer, pusher, step)


def _push_lookup_kernel(incarnation: int, optimizer: int, params: List[int], param_counts: List[int], ids: Tensor,
                        counts: List[int], gradients: Tensor, peer: str, pusher: int, steps: List[int],
                        tables: List[int], lookup_ids: Tensor, lookup_counts: List[int], lookup_step: int) -> Tensor:
    state = _state()
    if tables and lookup_step >= 0:  # rows on disk read while the pushes are applied
        rows.prefetch(state, tables, lookup_ids, lookup_counts)
    rows.pushes(state, incarnation, optimizer, params, param_counts, ids, counts, gradients, peer, pusher, steps)
    if not tables:  # a push that reads nothing (its incarnation was checked)
        return wire.NO_ROWS
    return rows.lookup(state, incarnation, tables, lookup_ids, lookup_counts, lookup_step)


def _owner_step_kernel(handle: int, context_id: int) -> int:
    state = _state()
    owner_optimizer = state.optimizer(handle)
    try:
        owner_optimizer.step(context_id)
    except ValueError as error:
        logger.warning("optimizer %d refused a step: %s", handle, error)
        raise
    finally:
        state.flush_log()
    return len(owner_optimizer.params)


# The TorchScript targets reach the state through custom ops with Python kernels.  Each op returns
# something, and each script function returns it, because TorchScript drops calls whose results nobody uses.
_ops = torch.library.Library("paramserver", "DEF")
_ops.define("lookup(int incarnation, int[] tables, Tensor ids, int[] counts, int step) -> Tensor")
_ops.define("push(int incarnation, int optimizer, int[] params, Tensor ids, int[] counts, Tensor gradients, "
            "str peer, int pusher, int step) -> int")
_ops.define("push_lookup(int incarnation, int optimizer, int[] params, int[] param_counts, Tensor ids, int[] counts, "
            "Tensor gradients, str peer, int pusher, int[] steps, int[] tables, Tensor lookup_ids, "
            "int[] lookup_counts, int lookup_step) -> Tensor")
_ops.define("owner_step(int handle, int context_id) -> int")
_ops.impl("lookup", _lookup_kernel, "CompositeExplicitAutograd")
_ops.impl("push", _push_kernel, "CompositeExplicitAutograd")
_ops.impl("push_lookup", _push_lookup_kernel, "CompositeExplicitAutograd")
_ops.impl("owner_step", _owner_step_kernel, "CompositeExplicitAutograd")


@script
def lookup(incarnation: int, tables: List[int], ids: Tensor, counts: List[int], step: int = -1) -> Tensor:
    """RPC target: the rows of table handle ``tables[i]`` for its ``counts[i]`` ids of ``ids`` (local indices;
    ids of a dynamic table), packed (``rows.lookup``, ``paramserver.shards.wire``).  ``step``: the trainer's
    step (a dynamic table touches and admits ids then); negative to read only (evaluation)."""
    return torch.ops.paramserver.lookup(incarnation, tables, ids, counts, step)


@script
def push(incarnation: int, optimizer: int, params: List[int], ids: Tensor, counts: List[int], gradients: Tensor,
         peer: str, pusher: int = 0, step: int = -1) -> int:
    """RPC target: apply a step's row gradients (packed) with optimizer handle ``optimizer``, at most once per
    ``(pusher, step)`` when ``step`` >= 0 (``rows.push``); returns the number of parameters named."""
    return torch.ops.paramserver.push(incarnation, optimizer, params, ids, counts, gradients, peer, pusher, step)


@script
def push_lookup(incarnation: int, optimizer: int, params: List[int], param_counts: List[int], ids: Tensor,
                counts: List[int], gradients: Tensor, peer: str, pusher: int, steps: List[int], tables: List[int],
                lookup_ids: Tensor, lookup_counts: List[int], lookup_step: int) -> Tensor:
    """RPC target: the pushes of one or more steps in order (``rows.pushes``: push ``j`` names the next
    ``param_counts[j]`` parameters and is for ``steps[j]``), then ``lookup`` of later steps' rows (none when
    ``tables`` is empty), read after these pushes are applied: the push-pull of a pipelined step, one message
    each way per shard for a step's push and a later step's reads (or, with a row cache, for several steps'
    pushes and the reads of several later steps)."""
    return torch.ops.paramserver.push_lookup(incarnation, optimizer, params, param_counts, ids, counts, gradients,
                                             peer, pusher, steps, tables, lookup_ids, lookup_counts, lookup_step)


# -- optimizers ---------------------------------------------------------------
def new_owner_optimizer(optimizer_cls, param_rrefs: List[RRef], indices: List[int], args: tuple,
                        kwargs: dict) -> Tuple[RRef, int, bool]:
    """RPC target: the OwnerOptimizer for these parameters (``optimizers.owner_optimizer_for``, shared when it
    exists): an RRef that keeps it alive, the handle that steps use, and whether it is scripted."""
    owner_optimizer = optimizers.owner_optimizer_for(_state(), optimizer_cls, [rref.local_value() for rref in param_rrefs],
                                                     indices, args, kwargs)
    return RRef(owner_optimizer), owner_optimizer.handle, owner_optimizer.is_scripted


@script
def optimizer_step(handle: int, context_id: int) -> int:
    """RPC target: one step of an OwnerOptimizer with the gradients of ``dist_autograd`` context ``context_id``
    (the scripted step runs without the GIL)."""
    return torch.ops.paramserver.owner_step(handle, context_id)


def optimizer_step_stats(handle: int) -> Dict[str, float]:
    """RPC target: the OwnerOptimizer's step counters."""
    return _state().optimizer(handle).step_stats()


def push_ledger(handle: int, pusher: int) -> Tuple[int, int]:
    """RPC target: the newest step of ``pusher`` that the OwnerOptimizer applied in this process (-1: none), and
    how many of ``pusher``'s pushes this process replayed from its push log (``OwnerOptimizer.ledger``)."""
    return _state().optimizer(handle).ledger(pusher)


def optimizer_state_dict(handle: int) -> optimizers.StateDict:
    """RPC target: the OwnerOptimizer's state (copies)."""
    return _state().optimizer(handle).state_dict()


def optimizer_load_state_dict(handle: int, state: optimizers.StateDict) -> None:
    """RPC target: restore the OwnerOptimizer's state (the push log cannot replay across it)."""
    shard_state = _state()
    owner_optimizer = shard_state.optimizer(handle)
    owner_optimizer.load_state_dict(state)
    owner_optimizer.journal_gap()
    shard_state.flush_log()


# -- checkpoints, figures and the process -----------------------------------------
def write_checkpoint_part(directory: str, storage_options: Optional[Dict] = None) -> Dict:
    """RPC target: write this shard's part into checkpoint ``directory`` (a path or URL, on the filesystem
    ``storage_options`` configure); its ``FileRecord`` as JSON."""
    return checkpoint_part.write_part(_state(), locate(directory, storage_options), rpc.get_worker_info().name).to_json()


def checkpoint_committed(directory: str) -> None:
    """RPC target: checkpoint ``directory`` (a path or URL) committed: this shard's push log is cut there."""
    checkpoint_part.committed(_state(), directory)


def write_export_part(directory: str, storage_options: Optional[Dict], whole: bool) -> Dict:
    """RPC target: write this shard's part of live export ``directory`` (what changed since the last one, or
    ``whole``); its ``FileRecord`` as JSON."""
    return export_part.write_export_part(_state(), directory, storage_options, rpc.get_worker_info().name,
                                         whole).to_json()


def dynamic_table_parts() -> List[figures.PartStats]:
    """RPC target: each dynamic table part hosted here, ``(table, "index/count", stats)`` (``figures``)."""
    return figures.dynamic_parts(_state())


def dynamic_table_figures() -> Dict[str, float]:
    """RPC target: the ``dynamic.*`` figures summed over the dynamic table parts hosted here (``figures``)."""
    return figures.dynamic_figures(_state())


def request_stop(graceful: bool = True) -> None:
    """RPC target: ask this shard server to leave.

    Graceful: it waits for every peer to leave and for outstanding work;
    otherwise it leaves at once (for when some peer is known to be gone).
    """
    _state().request_stop(graceful)
