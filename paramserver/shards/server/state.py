"""``ShardState``: everything a process that owns parameters keeps, in one object.

Owns, for a shard server (or any torch RPC peer that owns parameters, such
as a trainer in a test): the hosted tensors, their names and their integer handles (held weakly:
a tensor lives as long as some RRef to it does), the shared tables (kept
for the process's life: the model the shard serves), the dynamic table
parts among them (``paramserver.shards.server.dynamic``, by their slab; ``dynamic_stats`` reads their
figures for metrics and heartbeats), the owner-side
optimizers over them (by what they were asked for and by handle), a lock
per parameter in one global order, the TorchScript compile lock, where
restored values come from (``restore_source``), its push log (``push_log``: every push applied since
its checkpoint, which a restarted process replays), where its optimizer steps are
counted (``recorder``), the stop request, whether it failed inside a step (``fault``: it then serves no step
or snapshot again, and its process ends to be restarted), and what its dynamic tables call
outside Python: the C kernel's builds (``kernels``, loaded when it hosts
its first dynamic table, not before) and huge pages (``huge_pages``).

A shard process makes one and hands it to ``run_shard_server``, which
installs it in the shard service (``paramserver.shards.server.service``),
the one place an RPC finds it; everything else is handed the object.  Two
can live in one process (tests).  What the optimizers are is
``optimizers``' business: this module holds them as objects.
"""

import itertools
import secrets
import threading
import weakref
from typing import Callable, Dict, List, Optional, Protocol, Set, Tuple

import torch
from torch import Tensor

from .changes import RowMarks
from .dynamic.huge_pages import HugePages
from .dynamic.native import NativeKernels
from .part_threads import PartThreads
from .push_log import PushLog


class RestoreSource(Protocol):
    """Where a restarted or resharded shard finds the values it hosted before
    (``paramserver.checkpoint.shard_part.CheckpointSource``)."""

    def rows(self, name: str, num_rows: int, embedding_dim: int, dtype: torch.dtype) -> Optional[Tensor]: ...

    def dynamic_part(self, table: str, index: int, count: int) -> Optional[Dict]: ...

    def check_row_type(self, table: str, held: torch.dtype, wanted: torch.dtype) -> None: ...

    def optimizer_of(self, name: str) -> Optional[str]: ...

    def optimizer_state(self, name: str, optimizer: str) -> Optional[Dict[str, Tensor]]: ...

    def ledger(self, tag: int) -> Dict[int, int]: ...

    @property
    def key(self) -> str: ...


class OwnerStepRecorder(Protocol):
    """What the owner side records of its optimizer steps (``paramserver.metrics.data_plane.DataPlaneMetrics``
    has it): one call per step applied, after its locks are released."""

    def owner_step(self, optimizer: str, seconds: float, peer: str, rows: int, gradient_bytes: int,
                   rpc: str = "step") -> None: ...


class ShardFault(RuntimeError):
    """A step failed inside its kernels (out of memory, an internal error) after its checks passed, so after it
    may have written rows: what this process holds can no longer be vouched for.  Not the request's fault (never
    a refusal): the shard is lost, and restarted from its newest checkpoint, where the push is applied again."""


class ShardState:
    """One process's hosted tensors, their optimizers and locks, its restore source and stop request."""

    def __init__(self, restore_source: Optional[RestoreSource] = None, recorder: Optional["OwnerStepRecorder"] = None,
                 kernels: Optional[NativeKernels] = None, huge_pages: Optional[HugePages] = None,
                 row_kernels: Optional[object] = None):
        self.restore_source = restore_source
        #: Where the optimizer steps applied here are counted (the process's data-plane metrics), or ``None``.
        self.recorder = recorder
        #: The C kernel's builds its dynamic tables' lookups run in (``chosen()``), loaded on first use.
        self.kernels = kernels if kernels is not None else NativeKernels()
        #: The row-wise optimizers' C kernel's builds its tables' pushes run in (``optim.row_kernel.RowKernels``,
        #: made by its first optimizer when none is given: ``shards/server/optimizers.py``), loaded on first use.
        self.row_kernels = row_kernels
        #: The threads that apply a large push's parts beside the thread that received it (made on first use).
        self.part_threads = PartThreads()
        #: Where every push applied here is logged until a checkpoint holds it (``push_log.PushLog``), or ``None``.
        self.push_log: Optional[PushLog] = None
        #: Where its dynamic tables keep the rows their memory does not hold (``row_store.RowStores``), or
        #: ``None``: they drop them.
        self.row_stores: Optional[object] = None
        #: What makes its dynamic tables' large tensors (on huge pages where the system offers them).
        self.huge_pages = huge_pages if huge_pages is not None else HugePages()
        #: Names this process among every process that serves under the same RPC name (a restarted shard is
        #: another): integer handles made here are good only where it matches.
        self.incarnation = secrets.randbits(62)
        self._tensors_lock = threading.Lock()
        self._by_name: "weakref.WeakValueDictionary[str, Tensor]" = weakref.WeakValueDictionary()
        self._names_by_id: Dict[int, str] = {}
        self._shared: Dict[str, Tensor] = {}
        self._dynamic: Dict[int, object] = {}  # id of a dynamic table's slab -> its DynamicRows
        self._row_marks: Dict[int, RowMarks] = {}  # id of a fixed hosted tensor -> its rows changed since an export
        self._nearest: Set[int] = set()  # ids of half-precision tables whose updates round to nearest
        self._tables_by_handle: "weakref.WeakValueDictionary[int, Tensor]" = weakref.WeakValueDictionary()
        self._table_handles: Dict[int, int] = {}
        self._table_handle_counter = itertools.count(1)
        self._optimizers_lock = threading.Lock()
        self._optimizers_by_request: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()
        self._optimizers_by_handle: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
        self._handles = itertools.count(1)
        self._param_locks_guard = threading.Lock()
        self._param_locks: Dict[int, Tuple[int, threading.Lock]] = {}
        self._lock_order = itertools.count()
        self._stop = threading.Event()
        self.stop_graceful = True
        #: A stop of the whole cluster: leave an open group with the other members that leave now
        #: (``peer.leave_together``) rather than alone.
        self.stop_together = False
        #: Why a step failed inside its kernels here (``fault``), or ``None``.
        self.faulted: Optional[str] = None
        #: Called once, with the reason, when a step fails inside its kernels: a shard process ends itself there
        #: (its supervisor restarts it from the newest checkpoint); elsewhere (tests) the fault is only raised.
        self.on_fault: Callable[[str], None] = lambda reason: None
        #: Called once, with the reason, when its row store could not write (``store_failed``), before
        #: ``on_fault``: a shard process ends there, and is not restarted.
        self.on_store_failure: Callable[[str], None] = lambda reason: None

    # -- the push log ------------------------------------------------------
    def flush_log(self) -> None:
        """Write what the push log took so far (before a request is answered)."""
        if self.push_log is not None:
            self.push_log.flush()

    def restored_key(self) -> str:
        """The checkpoint its tables came from as the push log names it (``""``: their initial values)."""
        return self.restore_source.key if self.restore_source is not None else ""

    # -- faults ------------------------------------------------------------
    def fault(self, reason: str) -> ShardFault:
        """A step failed inside its kernels for ``reason``: from now on this state serves no step or snapshot
        (``refuse_if_faulted``); ``on_fault`` is called the first time.  Returns the error to raise."""
        first = self.faulted is None
        if first:
            self.faulted = reason
            self.on_fault(reason)
        return ShardFault(f"this shard failed inside a step and holds rows it cannot vouch for: {self.faulted}")

    def store_failed(self, error: OSError) -> ShardFault:
        """Its row store could not write (``error``: a full disk, most often): ``on_store_failure`` called once
        with a reason naming the folder (a shard process ends there, not to be restarted), then ``fault``."""
        folder = self.row_stores.folder if self.row_stores is not None else "?"
        reason = (f"its row store in {folder} could not write ({error.strerror or error}): it keeps every row it "
                  f"holds, serves no step again, and its tables are as of the newest checkpoint")
        if self.faulted is None:
            self.on_store_failure(reason)
        return self.fault(reason)

    def refuse_if_faulted(self) -> None:
        """``ShardFault`` when a step failed here (``fault``)."""
        if self.faulted is not None:
            raise self.fault(self.faulted)

    # -- hosted tensors ----------------------------------------------------
    def register(self, name: str, tensor: Tensor) -> Tensor:
        with self._tensors_lock:
            return self._register_locked(name, tensor)

    def _register_locked(self, name: str, tensor: Tensor) -> Tensor:
        if name in self._by_name:
            raise ValueError(f"a tensor named {name!r} is already hosted here")
        self._by_name[name] = tensor
        self._names_by_id[id(tensor)] = name
        weakref.finalize(tensor, self._forget, id(tensor))
        return tensor

    def _forget(self, tensor_id: int) -> None:
        with self._tensors_lock:
            self._names_by_id.pop(tensor_id, None)
            self._row_marks.pop(tensor_id, None)

    def shared_table(self, name: str, create: Callable[[], Tensor]) -> Tensor:
        """The shared table ``name``, made by ``create()`` (under the lock: one creator wins) if there is none."""
        with self._tensors_lock:
            existing = self._shared.get(name)
            if existing is not None:
                return existing
            table = self._register_locked(name, create())
            self._shared[name] = table
            return table

    def shared_dynamic(self, name: str, create: Callable[[], object]) -> object:
        """The dynamic table part ``name`` (a ``paramserver.shards.server.dynamic.DynamicRows``), made by ``create()``
        if there is none; its slab is hosted as a shared table under ``name``."""
        with self._tensors_lock:
            existing = self._shared.get(name)
            if existing is not None:
                rows = self._dynamic.get(id(existing))
                if rows is None:
                    raise ValueError(f"a table named {name!r} is hosted here with a fixed size")
                return rows
            rows = create()
            self._shared[name] = self._register_locked(name, rows.slab)
            self._dynamic[id(rows.slab)] = rows
            return rows

    def row_marks(self, tensor: Tensor) -> RowMarks:
        """The rows of ``tensor`` (hosted here) changed since a live export took them (``changes``); callers
        hold its lock."""
        dynamic = self._dynamic.get(id(tensor))
        if dynamic is not None:
            return dynamic.marks
        marks = self._row_marks.get(id(tensor))
        if marks is None:
            with self._tensors_lock:
                marks = self._row_marks.setdefault(id(tensor), RowMarks())
        return marks

    def set_rounding(self, tensor: Tensor, rounding: str) -> None:
        """How updates are written into hosted ``tensor``'s rows when they are half-precision
        (``paramserver.optim.rounding.ROUNDINGS``): ``"nearest"``, or ``"stochastic"`` (the default)."""
        with self._tensors_lock:
            if rounding == "nearest":
                self._nearest.add(id(tensor))
                weakref.finalize(tensor, self._nearest.discard, id(tensor))
            else:
                self._nearest.discard(id(tensor))

    def rounds_to_nearest(self, tensor: Tensor) -> bool:
        """Whether updates to ``tensor``'s half-precision rows round to nearest (``set_rounding``)."""
        return id(tensor) in self._nearest

    def dynamic_rows(self, tensor: Tensor) -> Optional[object]:
        """The ``DynamicRows`` whose slab ``tensor`` is, or ``None`` (a fixed tensor)."""
        return self._dynamic.get(id(tensor))

    def dynamic_stats(self) -> Dict[str, Dict[str, object]]:
        """Each dynamic table part's ``stats()`` (rows, admitted, evicted, not_admitted, bytes; its row store's
        figures where it has one), by part name
        (``"t@0/2"``), in name order; each part's figures are read under its own lock, one part at a time."""
        with self._tensors_lock:
            parts = {name: self._dynamic[id(table)] for name, table in self._shared.items()
                     if id(table) in self._dynamic}
        return {name: parts[name].stats() for name in sorted(parts)}

    def shared_tables(self) -> Dict[str, Tensor]:
        """The shared tables hosted here, by name (what a checkpoint of this shard holds)."""
        with self._tensors_lock:
            return dict(self._shared)

    def is_shared_table(self, tensor: Tensor) -> bool:
        """Whether ``tensor`` is one of the shared tables hosted here (fixed or a dynamic table's slab)."""
        with self._tensors_lock:
            return any(table is tensor for table in self._shared.values())

    def name_of(self, tensor: Tensor) -> Optional[str]:
        """The name ``tensor`` is hosted under, or ``None``."""
        with self._tensors_lock:
            return self._names_by_id.get(id(tensor))

    def table_handle(self, tensor: Tensor) -> int:
        """A small integer naming hosted ``tensor`` in a step's fused lookups (held weakly, like the tensor's
        name): the same tensor always gets the same handle."""
        with self._tensors_lock:
            handle = self._table_handles.get(id(tensor))
            if handle is None:
                handle = next(self._table_handle_counter)
                self._table_handles[id(tensor)] = handle
                self._tables_by_handle[handle] = tensor
                weakref.finalize(tensor, self._table_handles.pop, id(tensor), None)
            return handle

    def table(self, handle: int) -> Tensor:
        """The hosted tensor with ``handle``; ``KeyError`` naming it when it was released."""
        tensor = self._tables_by_handle.get(handle)
        if tensor is None:
            raise KeyError(f"no hosted table with handle {handle} here (every handle on it was released, "
                           "or this shard process was restarted)")
        return tensor

    # -- owner optimizers and their locks -----------------------------------
    def lock_for(self, param: Tensor) -> Tuple[int, threading.Lock]:
        """``param``'s lock and its place in the global order (steps take their locks in that order)."""
        with self._param_locks_guard:
            entry = self._param_locks.get(id(param))
            if entry is None:
                entry = (next(self._lock_order), threading.Lock())
                self._param_locks[id(param)] = entry
                weakref.finalize(param, self._param_locks.pop, id(param), None)
            return entry

    def optimizer_for(self, request: tuple, create: Callable[[int], object]) -> Tuple[object, bool]:
        """The optimizer asked for by ``request`` (held weakly), made by ``create(handle)`` if there is none;
        and whether it was made now."""
        with self._optimizers_lock:
            optimizer = self._optimizers_by_request.get(request)
            if optimizer is not None:
                return optimizer, False
            handle = next(self._handles)
            optimizer = create(handle)
            self._optimizers_by_request[request] = optimizer
            self._optimizers_by_handle[handle] = optimizer
            return optimizer, True

    def optimizer(self, handle: int):
        """The live optimizer with ``handle``; ``KeyError`` naming it when there is none."""
        optimizer = self._optimizers_by_handle.get(handle)
        if optimizer is None:
            raise KeyError(f"no optimizer with handle {handle} here (its DistributedOptimizer was deleted)")
        return optimizer

    def optimizers(self) -> List[object]:
        """Every live optimizer, oldest first."""
        with self._optimizers_lock:
            return [optimizer for _, optimizer in sorted(self._optimizers_by_handle.items(), key=lambda e: e[0])]

    # -- stopping ----------------------------------------------------------
    def request_stop(self, graceful: bool = True, together: bool = False) -> None:
        """Ask the process to leave: ``graceful`` (a static group's barrier), or not; ``together``: with
        the other members of an open group that leave now (a cluster's shutdown)."""
        self.stop_graceful = graceful
        self.stop_together = together
        self._stop.set()

    def wait_for_stop(self) -> bool:
        """Block until a stop is requested; returns whether it is graceful."""
        self._stop.wait()
        return self.stop_graceful
