"""The optimizers a shard applies: ``OwnerOptimizer``, the owner's side of ``DistributedOptimizer``.

Owns, in each process that owns parameters (shard servers, or any torch RPC
peer), as plain objects of its ``ShardState`` (``service`` holds the RPC
targets that reach them):

* ``OwnerOptimizer``: the optimizer over the parameters one
  DistributedOptimizer has here.  With a functional class (looked up in
  ``functional_optim_map``) it is a TorchScript module, compiled under a
  process-wide lock (TorchScript compilation is not thread-safe; each
  functional class is compiled once per process and reused), whose ``step``
  reads the context's gradients, validates them and applies the step without
  the GIL; with TorchScript off the same module runs eagerly.  Without one, a
  Python optimizer is stepped instead (dense parameters only: a table needs an
  optimizer on the row-sparse driver, and refuses others when it is created).
* Dispatch by the optimizer's record (``paramserver.optim.records``, from
  ``functional_optim_map.record_of``, or derived from a class on the row-sparse
  driver): which step module it gets, whether a push is applied in parts (its
  rows update independently), what a table refuses (no record; settings its
  record refuses on rows; half-precision rows it does not take).  No decision
  is made by class name.
* Refusals: a checkpoint's state for a table kept by another optimizer class,
  and an optimizer that cannot apply a table's rows, when it is created; a
  push's bad shapes, rows, types or devices, checked whole before any row
  changes.  Anything that fails after those checks (out of memory, an internal
  error, perhaps after some parts of a push wrote their rows) is the shard's
  fault, not the request's: ``ShardState.fault`` (the state serves no step or
  snapshot again; a shard process ends, to be restarted from its newest
  checkpoint) and a ``ShardFault``, never a refusal.
* Serialization: every parameter has a lock; a step takes the locks of its
  parameters in one global order, so concurrent steps from several trainers
  are applied one after another per parameter and none is lost.  What a
  push's rows need before that (checks, a fixed table's sparse gradient,
  built by a compiled function) is done before its locks are taken, so a
  push being applied and the next one's preparation overlap.
* Sharing (``owner_optimizer_for``): trainers that ask for the same optimizer
  (class, hyperparameters, parameters) get the same ``OwnerOptimizer``, so the
  server keeps one optimizer state per parameter, which all trainers'
  gradients update (the parameter-server semantics) and which checkpoints
  save; a shard started from a checkpoint restores that state.
* Step figures: when the state has a recorder (the process serves metrics),
  each step's time (measured around the scripted call) goes there, with the
  rows and bytes of the gradients it applied (counted inside the scripted
  step, without the GIL, and only then).

This module never sends RPCs.
"""

import functools
import logging
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor, nn

from ..._torch_compat import torchscript_enabled
from ..._torch_compat import autograd_context_creator, current_rpc_agent
from ...logs import one_line
from ...optim.records import RowOptimizer, local_names
from ...optim.registry import class_name, functional_optim_map
from ...optim.kernels import check_gradients, row_slice_fused_min_elements, sparse_rows
from ...optim.rounding import stream_seed
from ...optim.row_kernel import Rounding, RowKernels
from ...optim.row_sparse import RowState, state_dtype
from ...optim.scripted import reraise_script_error
from ...tables.row_types import is_half
from ...torchscript import compiling, script
from .hosted import rounding_place
from .part_threads import PartThreads
from .push_log import end_to_end, tag_of
from .replay import replay
from .state import ShardState

StateDict = Dict[int, Dict[str, Tensor]]

#: The types row gradients may be pushed in, whatever the rows' type: read in the type the update is computed in.
PUSHED_TYPES = (torch.float32, torch.bfloat16, torch.float16)

#: What a step raises for a fault of the request's own (its checks, before any row changes): a refusal.
REFUSALS = (ValueError, TypeError, IndexError, KeyError)

#: The peer named in a step's figures when the RPC agent cannot name the trainer (gone, or no agent).
UNKNOWN_PEER = "unknown"

logger = logging.getLogger(__name__)


@script
def context_gradients(context_id: int, params: List[Tensor]) -> List[Optional[Tensor]]:
    """The gradients ``dist_autograd`` context ``context_id`` holds for ``params`` (``None`` if none)."""
    all_gradients = dist_autograd.get_gradients(context_id)
    gradients: List[Optional[Tensor]] = []
    for param in params:
        if param in all_gradients:
            gradients.append(all_gradients[param])
        else:
            gradients.append(None)
    return gradients


@script
def _refuse_gradient_shape(name: str, gradient: Tensor, param: Tensor) -> None:
    raise ValueError(
        "gradient for parameter {} has shape {} but the parameter has shape {}; "
        "no parameter on this owner was changed".format(name, list(gradient.shape), list(param.shape)))


@script
def check_gradient_shapes(names: List[str], params: List[Tensor], gradients: List[Optional[Tensor]]) -> None:
    """Raise ``ValueError`` naming the first parameter whose gradient has another shape."""
    for i in range(len(params)):
        gradient = gradients[i]
        if gradient is not None:
            if gradient.shape != params[i].shape:
                _refuse_gradient_shape(names[i], gradient, params[i])


@script
def checked_context_gradients(context_id: int, names: List[str], params: List[Tensor]) -> List[Optional[Tensor]]:
    """``context_gradients`` and ``check_gradient_shapes`` in one pass over the parameters (a step's way in)."""
    all_gradients = dist_autograd.get_gradients(context_id)
    gradients: List[Optional[Tensor]] = []
    for i in range(len(params)):
        param = params[i]
        if param in all_gradients:
            gradient = all_gradients[param]
            if gradient.shape != param.shape:
                _refuse_gradient_shape(names[i], gradient, param)
            gradients.append(gradient)
        else:
            gradients.append(None)
    return gradients


@script
def check_state_shapes(names: List[str], params: List[Tensor], state: Dict[int, Dict[str, Tensor]]) -> None:
    """Raise ``ValueError`` unless every entry of a per-element optimizer state fits its parameter
    (scalars such as a step count are free)."""
    for i, entry in state.items():
        if i < 0 or i >= len(params):
            raise ValueError("optimizer state for parameter index {} out of range for {} parameters".format(
                i, len(params)))
        for key, value in entry.items():
            if value.dim() > 0 and value.shape != params[i].shape:
                raise ValueError("optimizer state '{}' of parameter {} has shape {} but the parameter has shape {}"
                                 .format(key, names[i], list(value.shape), list(params[i].shape)))


@script
def gradient_stats(gradients: List[Optional[Tensor]]) -> Tuple[int, int]:
    """(rows of the row-sparse gradients, bytes of the gradients' values): what a step applies.

    Rows are the sparse gradients' entries (a row sent twice in one context
    counts twice); bytes are what the gradients' values hold (a sparse
    gradient's indices are made on the owner, not sent).
    """
    rows = 0
    values_bytes = 0
    for gradient in gradients:
        if gradient is not None:
            if gradient.is_sparse:
                values = gradient._values()
                rows += gradient._nnz()
                values_bytes += values.numel() * values.element_size()
            else:
                values_bytes += gradient.numel() * gradient.element_size()
    return rows, values_bytes


class _ScriptedStep(nn.Module):
    """Compiled with TorchScript: one functional optimizer and its step from a context.

    (A script object's state can only be changed through compiled methods:
    reading ``module.optim`` from Python yields a copy.  The subclasses below
    add the state methods for the two kinds of functional classes.)
    """

    def __init__(self, optim, params: List[Tensor], names: List[str]):
        super().__init__()
        self.params = params
        self.names = names
        self.optim = optim

    @torch.jit.export
    def step(self, context_id: int, measure: bool) -> Tuple[int, int]:
        """Apply the context's gradients; with ``measure``, return their ``gradient_stats`` (else zeros)."""
        gradients = checked_context_gradients(context_id, self.names, self.params)
        self.optim.step(gradients)
        if measure:
            return gradient_stats(gradients)
        return 0, 0

    @torch.jit.export
    def apply(self, gradients: List[Optional[Tensor]], measure: bool) -> Tuple[int, int]:
        """Apply ``gradients`` (one per parameter, ``None`` to skip one); ``measure`` as in ``step``."""
        check_gradient_shapes(self.names, self.params, gradients)
        self.optim.step(gradients)
        if measure:
            return gradient_stats(gradients)
        return 0, 0


class _ScriptedStepWithStateDict(_ScriptedStep):
    """For functional classes with ``state_dict()`` / ``load_state_dict()`` (ours)."""

    @torch.jit.export
    def optimizer_state(self) -> Dict[int, Dict[str, Tensor]]:
        return self.optim.state_dict()

    @torch.jit.export
    def load_optimizer_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        self.optim.load_state_dict(state)


class _ScriptedStepWithRowState(_ScriptedStepWithStateDict):
    """For functional classes on the row-sparse driver (``state: RowState``: ours), whose per-row state follows
    the rows, which tables need: dynamic ones as their slabs grow and their slots take new ids.  A push is
    applied in one part (see ``_ScriptedStepInParts`` for those applied in several)."""

    @torch.jit.export
    def resize_rows(self, index: int, rows: int) -> None:
        self.optim.state.resize_rows(index, rows)

    @torch.jit.export
    def reset_rows(self, index: int, rows: Tensor) -> None:
        self.optim.state.reset_rows(index, rows)

    @torch.jit.export
    def set_rounding(self, index: int, key: int, nearest: bool, first_row: int, ids: Optional[Tensor]) -> None:
        self.optim.state.set_rounding(index, key, nearest, first_row, ids)

    @torch.jit.export
    def state_rows(self, index: int, make: bool) -> Optional[List[Tensor]]:
        """Parameter ``index``'s state tensors that have rows (every kind's but ``scalar`` ones), in its order:
        the tensors themselves; ``None`` while it has no state, unless ``make`` (made at initial values)."""
        state = self.optim.state
        if not make and not state.has(index):
            return None
        tensors = state.of(index)
        rows: List[Tensor] = []
        for k in range(len(tensors)):
            if state.layouts[k] != "scalar":
                rows.append(tensors[k])
        return rows

    @torch.jit.export
    def initial_state_rows(self, index: int, count: int) -> List[Tensor]:
        """``count`` rows of each of ``state_rows``' tensors, at their initial values."""
        state = self.optim.state
        tensors = state.of(index)
        rows: List[Tensor] = []
        for k in range(len(tensors)):
            if state.layouts[k] != "scalar":
                shape = [count]
                for size in tensors[k].shape[1:]:
                    shape.append(size)
                rows.append(torch.full(shape, state.initial[k], dtype=tensors[k].dtype))
        return rows


class _ScriptedStepInParts(_ScriptedStepWithRowState):
    """For functional classes on the row-sparse driver whose record says their rows update independently
    (``RowOptimizer.rows_independent``), stepping in two halves: what a step does once (``prepare_step``: a rescaled momentum, the state made, the rounding step counted) and the update of
    some rows (``step_rows``), which reads only those rows, their gradient and their state, and writes only
    those rows.

    A push is applied in ``parts`` parts at once (``set_parts``: 1 by default) when it is large enough: it is
    checked whole, then the step's once-work is done, then its rows split into consecutive runs, each stepped
    by ``step_rows`` on a thread of the inter-op pool (``torch.jit.fork``), without the GIL.  The parts share
    nothing they write, so the rows and their state come out as one step gives them (half-precision rows too:
    their rounding bits are hashed from each row's id, not drawn from one stream)."""

    #: Tensors the last step's parts wrote (kept live: TorchScript's dead-code elimination may otherwise drop an
    #: in-place list kernel whose list was built in the graph; written after the parts are joined).
    last_written: List[Tensor]

    def __init__(self, optim, params: List[Tensor], names: List[str]):
        super().__init__(optim, params, names)
        self.parts = 1
        self.optimizer_name: str = type(optim).__name__
        self.last_written = []

    @torch.jit.export
    def set_parts(self, parts: int) -> None:
        self.parts = parts

    @torch.jit.export
    def apply(self, gradients: List[Optional[Tensor]], measure: bool) -> Tuple[int, int]:
        """Apply ``gradients`` (one per parameter, ``None`` to skip one) as one step, in parts where it pays;
        ``measure`` as in ``step``."""
        check_gradient_shapes(self.names, self.params, gradients)
        return self._apply_checked(gradients, measure)

    @torch.jit.export
    def step(self, context_id: int, measure: bool) -> Tuple[int, int]:
        """Apply the context's gradients as ``apply`` applies its own."""
        return self._apply_checked(checked_context_gradients(context_id, self.names, self.params), measure)

    def _apply_checked(self, gradients: List[Optional[Tensor]], measure: bool) -> Tuple[int, int]:
        check_gradients(self.optimizer_name, self.params, gradients)  # every gradient, before any row changes
        self.optim.prepare_step(gradients)
        pieces = split_rows(gradients, self.parts, row_slice_fused_min_elements())
        futures: List[torch.jit.Future[List[Tensor]]] = []
        for part in range(1, len(pieces)):
            futures.append(torch.jit.fork(self._step_part, pieces[part]))
        written = self._step_part(pieces[0])
        for future in futures:
            written = written + torch.jit.wait(future)
        self.last_written = written
        if measure:
            return gradient_stats(gradients)
        return 0, 0

    def _step_part(self, gradients: List[Optional[Tensor]]) -> List[Tensor]:
        return self.optim.step_rows(gradients)

    @torch.jit.export
    def prepare(self, gradients: List[Optional[Tensor]]) -> Tuple[List[List[Tensor]], List[Tuple[int, int, bool, int,
                                                                                              Optional[Tensor]]]]:
        """``gradients`` checked whole, then the step's once-work done (``prepare_step``): what the native row
        kernel's step (``NativeRows``) does before it updates the rows in place of ``step_rows``.  Returns, per
        parameter, its state tensors (``RowState.of``: the tensors themselves, updated in place; none for a
        parameter without a gradient) and how its rows are rounded this step (``RowState.set_rounding``: its
        table's key, the step's rounding count, to nearest or not, its first row's id, its rows' ids)."""
        check_gradient_shapes(self.names, self.params, gradients)
        check_gradients(self.optimizer_name, self.params, gradients)
        return self._prepared(gradients)

    @torch.jit.export
    def prepare_rows(self, present: List[bool]) -> Tuple[List[List[Tensor]], List[Tuple[int, int, bool, int,
                                                                                       Optional[Tensor]]]]:
        """``prepare`` for a push the caller checked whole (``OwnerOptimizer.apply_rows``' native way: distinct
        rows of each parameter, float32 gradients of its width), given only which parameters it has rows of:
        the once-work of every row-wise optimizer the kernel runs reads no more of a step's gradients."""
        stand_ins: List[Optional[Tensor]] = []
        for index in range(len(self.params)):
            stand_ins.append(torch.empty(0) if present[index] else None)
        return self._prepared(stand_ins)

    def _prepared(self, gradients: List[Optional[Tensor]]) -> Tuple[List[List[Tensor]], List[Tuple[int, int, bool,
                                                                                                  int, Optional[Tensor]]]]:
        self.optim.prepare_step(gradients)
        state = self.optim.state
        tensors: List[List[Tensor]] = []
        roundings: List[Tuple[int, int, bool, int, Optional[Tensor]]] = []
        for index in range(len(self.params)):
            tensors.append(state.of(index) if gradients[index] is not None else [])
            roundings.append((state.rounding_keys[index], state.rounding_steps[index], state.rounds_nearest[index],
                              state.rounding_first_rows[index], state.rounding_ids[index]))
        return tensors, roundings

    @torch.jit.export
    def row_state(self, index: int) -> List[Tensor]:
        """Parameter ``index``'s state tensors (``RowState.of``: the tensors themselves)."""
        return self.optim.state.of(index)


class LockSet:
    """Locks held together, as a context manager: taken in the order given, released in reverse.  It keeps no
    state of its own, so threads may enter it at once (each waits for the locks in turn)."""

    def __init__(self, locks: List):
        self.locks = locks
        self._reversed = list(reversed(locks))

    def __enter__(self) -> None:
        for lock in self.locks:
            lock.acquire()

    def __exit__(self, *exc_info) -> None:
        for lock in self._reversed:
            lock.release()


class NativeRows:
    """A push's rows applied by the native row kernel (``paramserver.optim.row_kernel``) in place of the step
    module's ``step_rows``, for an optimizer whose record names its update there (``RowOptimizer.native``):
    the same checks and once-work first (the module's ``prepare``), then each parameter's rows, gradient and
    state (the module's own ``RowState`` tensors) in calls that release the GIL: a large push's rows in up to
    ``parts`` runs of consecutive rows at once (``part_threads``; each run at least ``least`` values, as the
    step module splits them), which write disjoint rows and state, and round each row by its id, so any split
    gives the same bits.  It takes a push only where every gradient is row-sparse over a table the kernel
    writes (``takes``); the module steps the others."""

    def __init__(self, module, kernel, update: str, hyperparameters: Dict, params: List[Tensor],
                 part_threads: PartThreads, parts: int):
        self.module = module
        self.kernel = kernel
        self.update = update
        self.hyperparameters = hyperparameters
        self.params = params
        self.part_threads = part_threads
        self.parts = parts
        self.least = row_slice_fused_min_elements()

    def takes(self, gradients: List[Optional[Tensor]]) -> bool:
        return all(gradient is None or (gradient.is_sparse and gradient.dtype == torch.float32
                                        and self.kernel.takes(param))
                   for param, gradient in zip(self.params, gradients))

    def apply(self, gradients: List[Optional[Tensor]], measure: bool) -> Tuple[int, int]:
        tensors, roundings = self.module.prepare(gradients)
        for index, gradient in enumerate(gradients):
            if gradient is not None:
                rows, values = sparse_rows(gradient)
                self._update(index, rows, values, tensors[index], roundings[index])
        return gradient_stats(gradients) if measure else (0, 0)

    def apply_pushed(self, pushed: Sequence[Tuple[int, Tensor, Tensor]], measure: bool) -> Tuple[int, int]:
        """``apply`` of a push given as ``(parameter, rows, gradients)``, checked whole by the caller (distinct
        rows of the parameter, contiguous float32 gradients of its width), without a sparse gradient made."""
        present = [False] * len(self.params)
        for index, _, _ in pushed:
            present[index] = True
        tensors, roundings = self.module.prepare_rows(present)
        for index, rows, values in pushed:
            self._update(index, rows, values, tensors[index], roundings[index], self.kernel.step_laid_out)
        if not measure:
            return 0, 0
        return (sum(rows.numel() for _, rows, _ in pushed),
                sum(values.numel() * values.element_size() for _, _, values in pushed))

    def _update(self, index: int, rows: Tensor, values: Tensor, tensors: List[Tensor], rounding_of: Tuple,
                step: Optional[Callable] = None) -> None:
        """Parameter ``index``'s rows by ``step`` (the kernel's ``step``, which checks its arguments, unless
        given another), in parts where the push is large enough (``PartThreads.run`` calls a single part here,
        on the rows as given: slicing them would cost more than the kernel's call on a small push)."""
        key, step_count, nearest, first_row, ids = rounding_of
        rounding = Rounding(nearest, stream_seed(key, step_count), first_row, ids)
        step = step or self.kernel.step
        count = max(1, min(self.parts, values.numel() // self.least))
        bounds = [rows.numel() * part // count for part in range(count + 1)]
        pieces = [(rows, values)] if count == 1 else \
            [(rows[start:stop], values[start:stop]) for start, stop in zip(bounds, bounds[1:])]
        self.part_threads.run([functools.partial(step, self.update, self.params[index], part_rows, part_values,
                                                 tensors, self.hyperparameters, rounding)
                               for part_rows, part_values in pieces])


@script
def split_rows(gradients: List[Optional[Tensor]], parts: int, least: int) -> List[List[Optional[Tensor]]]:
    """``gradients`` as up to ``parts`` lists of the same kind, each holding a run of
    consecutive rows of each gradient split, of at least ``least`` values (``kernels.row_slice_fused_min_elements``:
    so that a run takes the same kernel as the whole); ``[gradients]`` when none splits.  Only coalesced
    row-sparse gradients split (of any row type: half-precision rows are rounded with bits hashed from each
    row's id, the same in any part); the others go whole into the first list."""
    counts: List[int] = []
    most = 1
    for i in range(len(gradients)):
        gradient = gradients[i]
        count = 1
        if gradient is not None and gradient.is_sparse and gradient.is_coalesced():
            count = max(1, min(parts, gradient._values().numel() // least))
        counts.append(count)
        most = max(most, count)
    if most < 2:
        return [gradients]
    pieces: List[List[Optional[Tensor]]] = []
    for part in range(most):
        piece: List[Optional[Tensor]] = []
        for i in range(len(gradients)):
            gradient = gradients[i]
            count = counts[i]
            if gradient is None or part >= count:
                piece.append(None)
            elif count == 1:
                piece.append(gradient)
            else:
                rows = gradient._nnz()
                start = rows * part // count
                stop = rows * (part + 1) // count
                piece.append(torch.ops.aten._sparse_coo_tensor_unsafe(
                    gradient._indices()[:, start:stop], gradient._values()[start:stop], gradient.shape,
                    is_coalesced=True))
        pieces.append(piece)
    return pieces


class _ScriptedStepWithStateAttribute(_ScriptedStep):
    """For PyTorch's functional classes, which keep ``state: Dict[param, Dict[str, Tensor]]``."""

    @torch.jit.export
    def optimizer_state(self) -> Dict[int, Dict[str, Tensor]]:
        state: Dict[int, Dict[str, Tensor]] = {}
        for i in range(len(self.params)):
            param = self.params[i]
            if param in self.optim.state:
                entry: Dict[str, Tensor] = {}
                for key, value in self.optim.state[param].items():
                    entry[key] = value.clone()
                state[i] = entry
        return state

    @torch.jit.export
    def load_optimizer_state(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        check_state_shapes(self.names, self.params, state)
        restored: Dict[Tensor, Dict[str, Tensor]] = {}
        for i, entry in state.items():
            copied: Dict[str, Tensor] = {}
            for key, value in entry.items():
                copied[key] = value.clone()
            restored[self.params[i]] = copied
        self.optim.state = restored


def _compile_step(optimizer_cls, functional_cls, record: Optional[RowOptimizer], params: List[Tensor],
                  names: List[str], args, kwargs) -> Tuple[object, Optional[RowOptimizer]]:
    """The most capable step module ``functional_cls`` supports, compiled with TorchScript where it is on, else
    the same module run eagerly (the same operations, so the same rows; the GIL held); and the record of the
    row-wise optimizer it is (``record``, or one derived from a class on the row-sparse driver set in the map
    without one; ``None`` for a class that is not).  Its rows are applied in parts where the record says they
    update independently; a record whose state is not the class's is a ``TypeError`` naming both."""
    optim = functional_cls(params, *args, **kwargs)
    compile_module = script if torchscript_enabled() else (lambda module: module)
    row_state = getattr(optim, "state", None)
    if isinstance(row_state, RowState):
        if record is None:
            record = RowOptimizer.derived(optimizer_cls, functional_cls)
        _check_declared_state(record, row_state, args, kwargs)
        module = _ScriptedStepInParts if record.rows_independent else _ScriptedStepWithRowState
        return compile_module(module(optim, params, names)), record
    if record is not None:
        raise TypeError(f"optimizer {record.name}: its record declares row state, but {functional_cls.__qualname__} "
                        f"keeps no RowState ('state' attribute)")
    if hasattr(functional_cls, "state_dict") and hasattr(functional_cls, "load_state_dict"):
        return compile_module(_ScriptedStepWithStateDict(optim, params, names)), None
    try:
        return compile_module(_ScriptedStepWithStateAttribute(optim, params, names)), None
    except RuntimeError:  # no ``state`` attribute of that type: steps only
        return compile_module(_ScriptedStep(optim, params, names)), None


def _check_declared_state(record: RowOptimizer, row_state: RowState, args, kwargs) -> None:
    """``TypeError`` unless the state ``record`` declares for these settings is the ``RowState`` its functional
    class made (names, layouts, initial values); nothing to check where the record declares none."""
    declared = record.state_for(record.bind(args, kwargs))
    if declared is not None and declared != (list(row_state.names), list(row_state.layouts),
                                             [float(value) for value in row_state.initial]):
        raise TypeError(f"optimizer {record.name}: its record declares the row state {declared} (names, layouts, "
                        f"initial values), but {record.functional.__qualname__} keeps "
                        f"{(row_state.names, row_state.layouts, row_state.initial)}")


class _PythonStep:
    """A ``torch.optim`` optimizer stepped from a context's gradients (holds the GIL)."""

    def __init__(self, optimizer_cls, params: List[Tensor], names: List[str], args, kwargs):
        self.params = params
        self.names = names
        self.optim = optimizer_cls(params, *args, **kwargs)

    def step(self, context_id: int, measure: bool) -> Tuple[int, int]:
        return self.apply(context_gradients(context_id, self.params), measure)

    def apply(self, gradients: List[Optional[Tensor]], measure: bool) -> Tuple[int, int]:
        check_gradient_shapes(self.names, self.params, gradients)
        for param, gradient in zip(self.params, gradients):
            param.grad = gradient
        try:
            self.optim.step()
        finally:
            for param in self.params:
                param.grad = None
        return gradient_stats(gradients) if measure else (0, 0)


class OwnerOptimizer:
    """The optimizer over one DistributedOptimizer's parameters on this owner."""

    def __init__(self, optimizer_cls, functional_cls, params: Sequence[Tensor], names: Sequence[str],
                 args: tuple, kwargs: dict, state: ShardState, handle: int = 0,
                 record: Optional[RowOptimizer] = None):
        """``record``: the row-wise optimizer's (``functional_optim_map.record_of``; looked up when not given)."""
        self.handle = handle
        self.optimizer_cls = optimizer_cls
        self.functional_cls = functional_cls
        self.params = list(params)
        self.names = list(names)
        #: The row-wise optimizer's record (``paramserver.optim.records``): ``None`` for one that cannot apply rows.
        self.record: Optional[RowOptimizer] = None
        if functional_cls is not None:
            if record is None:
                record = functional_optim_map.record_of(optimizer_cls)
            if record is not None:
                record.check_hyperparameters(args, kwargs)  # refused before anything compiles
            with compiling():
                if state.row_kernels is None:  # the state's, made once (loaded at its first push)
                    state.row_kernels = RowKernels()
                self._impl, self.record = _compile_step(optimizer_cls, functional_cls, record, self.params,
                                                        self.names, args, kwargs)
        else:
            self._impl = _PythonStep(optimizer_cls, self.params, self.names, args, kwargs)
        self._state = state
        self._locks = LockSet([lock for _, lock in sorted({state.lock_for(p) for p in self.params},
                                                          key=lambda e: e[0])])
        #: Dynamic tables' slabs among the parameters (``paramserver.shards.server.dynamic``): pushes name their rows
        #: by id, and their per-row state follows the rows.
        self._dynamic = [state.dynamic_rows(p) for p in self.params]
        #: Each parameter's rows changed since a live export (``ShardState.row_marks``: one object for its life).
        self._marks = [state.row_marks(p) for p in self.params]
        self._refuse_unless_rows_apply(state, args, kwargs)
        if self.record is not None and self.record.rows_independent:
            # a large push in as many parts as the shard's inter-op pool has threads (its cores' share)
            self._impl.set_parts(torch.get_num_interop_threads())
        #: The native row kernel's step of pushes (``NativeRows``), made at the first push; ``False``: none.
        self._native: Union[None, bool, NativeRows] = None
        #: Whether its functional optimizer keeps its first state kind scaled (``state_scale``); ``None``: not
        #: asked yet.
        self._scaled: Optional[bool] = None
        self._hyperparameters = self.record.bind(args, kwargs) if self.record is not None else {}
        for index, param in enumerate(self.params):
            if is_half(param.dtype):  # keyed by the table and each row's id in it: the same bits however cut
                key, first_row, ids = rounding_place(state, param)
                self._impl.set_rounding(index, key, state.rounds_to_nearest(param), first_row, ids)
        for index, rows in enumerate(self._dynamic):
            if rows is not None:
                rows.attach(self, index)
        #: Idempotent pushes: the last step applied per pusher (``apply_rows(once=...)``).
        self._last_push: Dict[int, int] = {}
        #: Pushes of each pusher applied again from the shard's push log when this optimizer was made (``replay``).
        self.replayed_pushes: Dict[int, int] = {}
        #: Names this optimizer in the shard's push log, the same in the process that replays it (``push_log``).
        self.tag = tag_of("\0".join([class_name(optimizer_cls), *self.names]))
        #: While its push log is replayed: what it applies then is not logged again.
        self.replaying = False
        self.steps = 0
        self.step_seconds_total = 0.0
        #: When the last step's work began and ended (its locks held), on ``time.monotonic()``: on Linux one
        #: clock for every process of the host, so a trainer there can place the owners' steps in its own.
        self.last_step_began = self.last_step_ended = 0.0

    @property
    def is_scripted(self) -> bool:
        return self.functional_cls is not None

    def _refuse_unless_rows_apply(self, state: ShardState, args: tuple, kwargs: dict) -> None:
        """Tables (fixed or dynamic) are updated by row-sparse pushes, and their per-row state must follow their
        rows: ``TypeError`` naming the table and the optimizer when it has no record (no per-row state,
        ``RowState``) or its record takes no half-precision rows and the table has them, ``ValueError`` when its
        record refuses its settings on rows (a record that declares no refusals: its class tried here on a
        scratch row), so that the refusal comes now, not at every push."""
        tables = [index for index, param in enumerate(self.params)
                  if self._dynamic[index] is not None or state.is_shared_table(param) or is_half(param.dtype)]
        if not tables:
            return
        first = tables[0]
        table = self._dynamic[first].name if self._dynamic[first] is not None else self.names[first]
        optimizer = self.optimizer_cls.__qualname__
        record = self.record
        choices = ", ".join(local_names()[:-1]) + " or " + local_names()[-1]
        halves = [index for index in tables if is_half(self.params[index].dtype)]
        if halves and (record is None or not record.half_rows):
            param = self.params[halves[0]]
            raise TypeError(f"table {self.names[halves[0]]} has {param.dtype} rows: optimizer {optimizer} cannot "
                            f"update them in float32 and round them back stochastically ("
                            f"{'it has no form on the row-sparse driver' if record is None else 'its record says so'}"
                            f"; use {choices}, or float32 rows)")
        if record is None:
            raise TypeError(f"table {table}: optimizer {optimizer} cannot apply row-sparse gradients with per-row "
                            f"state that follows the table's rows (it has no form on the row-sparse driver; "
                            f"use {choices})")
        if record.refusals is not None:
            reason = record.refusal(record.bind(args, kwargs))
            if reason is not None:
                raise ValueError(f"table {table}: optimizer {optimizer} with {kwargs} cannot apply row-sparse "
                                 f"gradients: {reason}")
            return
        param = self.params[first]
        scratch = torch.zeros((1,) + tuple(param.shape[1:]), dtype=param.dtype, device=param.device)
        # A valid one-row gradient built here: no invariant check wanted (said explicitly, so torch does not warn
        # that the checks are implicitly off).
        gradient = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64),
                                           torch.ones(scratch.shape, dtype=state_dtype(scratch)), scratch.shape,
                                           check_invariants=False)
        try:
            self.functional_cls([scratch], *args, **kwargs).step([gradient])
        except (ValueError, RuntimeError) as error:
            raise ValueError(f"table {table}: optimizer {optimizer} with {kwargs} cannot apply row-sparse "
                             f"gradients: {one_line(error)}") from None

    def _locked(self) -> "LockSet":
        """Hold every parameter's lock (in the global order)."""
        return self._locks

    def step(self, context_id: int) -> None:
        """One step with the gradients ``dist_autograd`` context ``context_id`` holds here."""
        def run(measure: bool) -> Tuple[int, int]:
            for marks in self._marks:  # a live export carries them whole next time
                marks.mark_whole()
            return self._impl.step(context_id, measure)
        self._timed(run, lambda: context_peer(context_id), "step", journal=self.journal_gap)

    def journal_gap(self) -> None:
        """The parameters changed in a way the shard's push log does not hold (a ``dist_autograd`` step, a state
        loaded): no replay crosses this point (the caller holds the locks, or no step runs meanwhile)."""
        log = self._state.push_log
        if log is not None and not self.replaying:
            log.append_gap(self.tag)

    def _journal_push(self, params: Sequence[int], ids: Sequence[Tensor], gradients: Sequence[Tensor],
                      once: Optional[Tuple[int, int]], packed: Optional[Tuple[Tensor, Tensor]]
                      ) -> Optional[Callable[[], None]]:
        """What logs a push once applied (under the locks), or ``None`` without a push log: its ids and
        gradients as ``packed`` (``apply_rows``), or as the pieces given, end to end where they lie so."""
        log = self._state.push_log
        if log is None or self.replaying:
            return None
        pusher, step = once if once is not None else (-1, -1)
        counts = [rows.numel() for rows in ids]
        widths = [values.size(1) if values.dim() == 2 else 0 for values in gradients]
        if packed is not None:
            id_pieces, gradient_pieces = [packed[0].to(torch.int64)], [packed[1]]
        else:
            id_pieces = end_to_end([rows.to(torch.int64) for rows in ids])
            kinds = {values.dtype for values in gradients}
            gradient_pieces = end_to_end(gradients if len(kinds) < 2 else
                                         [values.to(torch.float32) for values in gradients])
        return lambda: log.append_push(self.tag, pusher, step, params, counts, widths, id_pieces, gradient_pieces)

    def dynamic_parts(self) -> List[Optional[object]]:
        """Each parameter's ``DynamicRows`` (a dynamic table's part), or ``None`` for a fixed one."""
        return list(self._dynamic)

    def row_width(self, index: int) -> int:
        """The width of parameter ``index``'s rows (``ValueError`` when there is no such 2-D parameter)."""
        if not 0 <= index < len(self.params) or self.params[index].dim() != 2:
            raise ValueError(f"a push names parameter {index} of an optimizer over {len(self.params)} parameters, "
                             f"which has no rows")
        return self.params[index].size(1)

    def apply_rows(self, params: Sequence[int], ids: Sequence[Tensor], gradients: Sequence[Tensor],
                   peer: str, once: Optional[Tuple[int, int]] = None,
                   packed: Optional[Tuple[Tensor, Tensor]] = None) -> bool:
        """One step with row gradients pushed by ``peer``: ``gradients[i]`` (rows x dim) for rows ``ids[i]``
        (local, distinct) of parameter ``params[i]``; the others are skipped.  The same update as ``step``
        with the row-sparse gradients a backward pass through those rows delivers.  ``once``: ``(pusher,
        step)``: skipped (returns False) when a push of ``pusher`` for ``step`` or a later step was applied.
        ``packed``: the same ids and gradients, each end to end in one tensor as the message brought them
        (what the shard's push log writes; made from the pieces when not given)."""
        named = set()
        for index, rows, values in zip(params, ids, gradients):
            if not 0 <= index < len(self.params):
                raise ValueError(f"a push names parameter {index} of an optimizer over {len(self.params)} parameters")
            if index in named:
                raise ValueError(f"a push names parameter {index} ({self.names[index]}) twice")
            named.add(index)
            param = self.params[index]
            if param.dim() != 2 or values.dim() != 2 or rows.dim() != 1 or values.size(0) != rows.numel() or \
                    values.size(1) != param.size(1):
                raise ValueError(f"a push for {self.names[index]} (shape {list(param.shape)}) has "
                                 f"{list(rows.shape)} rows and gradients of shape {list(values.shape)}")

        pushed = self._natively_pushed(params, ids, gradients)
        if pushed is not None:
            def run_native(measure: bool) -> Tuple[int, int]:  # under the locks
                for index, rows, _ in pushed:
                    self._marks[index].mark(rows)
                return self._native.apply_pushed(pushed, measure)
            return self._timed(run_native, lambda: peer, "push", once, self._journal_push(params, ids, gradients, once, packed))

        # A fixed table's gradient is built (and its rows checked) before the locks are taken: a push being
        # applied does not wait for the next one's preparation.  A dynamic table's ids name rows only under them.
        by_param: List[Optional[Tensor]] = [None] * len(self.params)
        by_id = []
        for index, rows, values in zip(params, ids, gradients):
            param = self.params[index]
            if values.dtype != state_dtype(param) and values.dtype in PUSHED_TYPES:  # (``push_dtype``)
                values = values.to(state_dtype(param))
            if self._dynamic[index] is None:
                by_param[index] = row_gradient(rows, values, list(param.shape), self.names[index])
            else:
                by_id.append((index, rows, values))

        def run(measure: bool) -> Tuple[int, int]:  # under the locks
            for index, rows, values in by_id:  # ids -> slots; gradients of ids without a row are dropped
                slots = self._dynamic[index].slots_locked(rows)
                held = (slots >= 0).nonzero().view(-1)
                rows, values = (slots, values) if held.numel() == slots.numel() else \
                    (slots.index_select(0, held), values.index_select(0, held))
                by_param[index] = row_gradient(rows, values, list(self.params[index].shape), self.names[index])
            for index, gradient in enumerate(by_param):
                if gradient is not None:
                    self._marks[index].mark(gradient._indices()[0])
            native = self._native_rows()
            if native is not None and native.takes(by_param):
                return native.apply(by_param, measure)
            return self._impl.apply(by_param, measure)
        return self._timed(run, lambda: peer, "push", once, self._journal_push(params, ids, gradients, once, packed))

    def _natively_pushed(self, params: Sequence[int], ids: Sequence[Tensor],
                         gradients: Sequence[Tensor]) -> Optional[List[Tuple[int, Tensor, Tensor]]]:
        """A push (its shapes checked) as the native kernel's step takes it whole, ``(parameter, rows,
        gradients)``: where the kernel runs this optimizer and every table pushed is a fixed one it writes, sent
        its rows increasing (as trainers send them), float32 gradients; ``None`` for the step module's way
        (which sorts, sums duplicates, and names a row outside its table)."""
        native = self._native_rows()
        if native is None:
            return None
        pushed = []
        for index, rows, values in zip(params, ids, gradients):
            param = self.params[index]
            if values.dtype != torch.float32 and values.dtype in PUSHED_TYPES:  # (``push_dtype``)
                values = values.to(torch.float32)
            if self._dynamic[index] is not None or not native.kernel.takes(param) or rows.dtype != torch.int64 or \
                    values.dtype != torch.float32 or not (rows.is_contiguous() and values.is_contiguous()) or \
                    native.kernel.rows_increasing(rows, param.size(0)) != 0:
                return None
            pushed.append((index, rows, values))
        return pushed

    def _native_rows(self) -> Optional[NativeRows]:
        """The native row kernel's step, where the record names its update, a build is loaded (first call:
        loaded now) and it has the update with these settings; ``None``: the step module's torch path."""
        if self._native is None:
            kernel = None
            if self.record is not None and self.record.native is not None and self.record.rows_independent:
                kernel = self._state.row_kernels.chosen()
                if kernel is not None and not kernel.accepts(self.record.native, self._hyperparameters):
                    kernel = None  # (settings the kernel has no update for)
            self._native = False if kernel is None else NativeRows(
                self._impl, kernel, self.record.native, self._hyperparameters, self.params, self._state.part_threads,
                torch.get_num_interop_threads())
        return self._native or None

    def resize_rows(self, index: int, rows: int) -> None:
        """Parameter ``index`` (a dynamic table's slab) grew to ``rows`` rows: its state too.  The caller holds
        the parameter's lock."""
        self._impl.resize_rows(index, rows)

    def reset_rows(self, index: int, rows: Tensor) -> None:
        """Rows ``rows`` of parameter ``index`` were given new ids: their state starts afresh.  The caller
        holds the parameter's lock."""
        self._impl.reset_rows(index, rows)

    def state_rows(self, index: int, make: bool) -> Optional[List[Tensor]]:
        """Parameter ``index``'s state tensors that have rows, in its record's order (what a row store keeps of
        a row: ``row_store.layout``); ``None`` while it has none (unless ``make``: made now at initial values),
        and for an optimizer that keeps no state by row.  The caller holds the parameter's lock."""
        state_rows = getattr(self._impl, "state_rows", None)
        return None if state_rows is None else state_rows(index, make)

    def state_scale(self) -> float:
        """What the first kind of its state rows is kept multiplied by: QHM keeps its momentum so
        (``FunctionalQHM.buffer_scale``); 1 for the others.  Its ``state_dict`` divides by it."""
        if self._scaled is None:  # (asked once: a scripted module's attribute costs microseconds)
            optim = getattr(self._impl, "optim", None)
            self._scaled = optim is not None and hasattr(optim, "buffer_scale")
        # (read each time: the attribute is a copy of the scripted object as it is now)
        return float(self._impl.optim.buffer_scale) if self._scaled else 1.0

    def initial_state_rows(self, index: int, count: int) -> List[Tensor]:
        """``count`` rows of each of ``state_rows``' tensors at their initial values (the caller holds the lock)."""
        return self._impl.initial_state_rows(index, count)

    def load_state_rows(self, index: int, rows: Tensor, state: Optional[List[Tensor]],
                        fresh: Optional[Tensor] = None) -> None:
        """Rows ``rows`` of parameter ``index`` came back from a row store with ``state`` (``state_rows``'
        tensors' rows, in order; ``None``: written before it had state, so they start afresh; ``fresh``: which
        of them start afresh).  The caller holds the parameter's lock."""
        if state is None:
            self.reset_rows(index, rows)
            return
        tensors = self.state_rows(index, True)
        if tensors is None or len(tensors) != len(state):
            raise RuntimeError(f"{self.names[index]}: the row store holds {len(state)} state rows per row; "
                               f"its optimizer keeps {0 if tensors is None else len(tensors)}")
        for tensor, values in zip(tensors, state):
            tensor.index_copy_(0, rows, values.to(tensor.dtype))
        if fresh is not None and bool(fresh.any()):
            self.reset_rows(index, rows[fresh])

    def _timed(self, run: Callable[[bool], Tuple[int, int]], peer: Callable[[], str], rpc: str,
               once: Optional[Tuple[int, int]] = None, journal: Optional[Callable[[], None]] = None) -> bool:
        """``run(measure)`` under the parameters' locks, timed, and counted in the process's metrics as served
        for ``peer()`` by an RPC of kind ``rpc``; with ``once`` (see ``apply_rows``) at most once per step;
        ``journal()`` once it applied, still under the locks (the shard's push log takes it in the order
        applied)."""
        metrics = self._state.recorder
        with self._locked():
            self._state.refuse_if_faulted()
            if once is not None and self._last_push.get(once[0], -1) >= once[1]:
                return False
            began = time.monotonic()
            try:
                try:
                    rows, gradient_bytes = run(metrics is not None)
                except torch.jit.Error as error:
                    reraise_script_error(error)
            except REFUSALS:  # the request's own: checked before any row changed
                raise
            except (RuntimeError, MemoryError) as error:  # after the checks: the shard's, perhaps half-applied
                reason = (f"optimizer {self.optimizer_cls.__qualname__} failed applying a {rpc} to "
                          f"{', '.join(self.names)}: {one_line(error)}")
                logger.error("%s; this shard serves no step again", reason)
                raise self._state.fault(reason) from error
            if once is not None:
                self._last_push[once[0]] = once[1]
            if journal is not None:
                journal()
            ended = time.monotonic()
            elapsed = ended - began
            self.steps += 1
            self.step_seconds_total += elapsed
            self.last_step_began, self.last_step_ended = began, ended
        if metrics is not None:  # after the locks: the next step need not wait for this
            metrics.owner_step(self.optimizer_cls.__qualname__, elapsed, peer(), rows, gradient_bytes, rpc)
        return True

    def step_stats(self) -> Dict[str, float]:
        """Steps applied here, and seconds spent applying them (locks held, waiting excluded); when the last
        one began and ended, on ``time.monotonic()``."""
        return {"steps": self.steps, "total_seconds": self.step_seconds_total,
                "last_seconds": self.last_step_ended - self.last_step_began,
                "last_began": self.last_step_began, "last_ended": self.last_step_ended}

    def state_dict(self) -> StateDict:
        """``{local parameter index: {name: tensor}}`` (copies)."""
        with self._locked():
            self._state.refuse_if_faulted()
            return self._state_locked()

    def _state_locked(self) -> StateDict:
        if not self.is_scripted:
            state = self._impl.optim.state_dict()["state"]
            return {i: {k: _copy(v) for k, v in entry.items()} for i, entry in state.items()}
        return self._scripted_state_method("optimizer_state")()

    def snapshot(self, on_locked: Optional[Callable[[], None]] = None) -> Tuple[List[Union[Tensor, Dict]], StateDict]:
        """Copies of the parameters and of their state, taken together between two steps.  A dynamic table's
        slab comes as its checkpoint entry instead (``DynamicRows.checkpoint_entry``: the rows held, by id,
        with their state), and its state is not in the state returned.  ``on_locked()`` runs under the same
        locks (a checkpoint's mark in the push log, and the ledger it keeps: ``ledger_locked``)."""
        with self._locked():
            self._state.refuse_if_faulted()  # a checkpoint never holds a half-applied push
            if on_locked is not None:
                on_locked()
            try:
                state = self._state_locked()
            except NotImplementedError:  # a class without state methods: values only
                state = {}
            self._settle_state_locked()
            values: List[Union[Tensor, Dict]] = []
            for index, (param, dynamic) in enumerate(zip(self.params, self._dynamic)):
                values.append(param.detach().clone() if dynamic is None else
                              dynamic.checkpoint_entry_locked(self.class_name, state.pop(index, {})))
            return values, state

    def _settle_state_locked(self) -> None:
        """The state kept rounded to what a restore of the snapshot just taken holds, where the functional class
        keeps it otherwise (``FunctionalQHM.settle_buffers``: scaled buffers): the checkpoint's state and this
        one's go on bit for bit alike (a shard restored from it and its push log holds what this one held)."""
        settle = getattr(getattr(self._impl, "optim", None), "settle_buffers", None)
        if settle is not None:
            settle()

    @property
    def class_name(self) -> str:
        return class_name(self.optimizer_cls)

    def ledger_locked(self) -> Dict[int, int]:
        """The last step applied per pusher (a copy; the caller holds the locks): what a checkpoint keeps so that
        a restored shard still recognises the pushes it holds."""
        return dict(self._last_push)

    def ledger(self, pusher: int) -> Tuple[int, int]:
        """The last step of ``pusher`` applied here (-1: none), and how many of its pushes this process applied
        again from its push log."""
        with self._locked():
            return self._last_push.get(pusher, -1), self.replayed_pushes.get(pusher, 0)

    def restore_ledger(self, ledger: Dict[int, int]) -> None:
        """Start from a checkpoint's ledger (``ledger_locked``), before any push."""
        with self._locked():
            self._last_push.update(ledger)

    def load_state_dict(self, state: StateDict) -> None:
        with self._locked():
            if not self.is_scripted:
                try:
                    check_state_shapes(self.names, self.params, state)
                except torch.jit.Error as error:
                    reraise_script_error(error)
                full = self._impl.optim.state_dict()
                full["state"] = {i: dict(entry) for i, entry in state.items()}
                self._impl.optim.load_state_dict(full)
                return
            load = self._scripted_state_method("load_optimizer_state")
            try:
                load(state)
            except torch.jit.Error as error:
                reraise_script_error(error)

    def _scripted_state_method(self, name: str):
        if not hasattr(self._impl, name):
            raise NotImplementedError(f"{self.functional_cls.__qualname__} exposes no optimizer state "
                                      "(give it state_dict() and load_state_dict())")
        return getattr(self._impl, name)


def _copy(value):
    return value.detach().clone() if isinstance(value, Tensor) else value


def _parameter_name(state: ShardState, param: Tensor, index: int) -> str:
    hosted = state.name_of(param)
    return repr(hosted) if hosted is not None else f"#{index} of the optimizer"


def context_peer(context_id: int) -> str:
    """The RPC name of the worker that created dist_autograd context ``context_id`` (``UNKNOWN_PEER`` if none).

    A context id carries its creator's worker id in its top bits: the trainer
    whose backward pass sent the gradients and who asks for the step.
    """
    agent = current_rpc_agent()
    if agent is None:
        return UNKNOWN_PEER
    try:
        return agent.get_worker_info(autograd_context_creator(context_id)).name
    except RuntimeError:  # a peer that has left
        return UNKNOWN_PEER


def owner_optimizer_for(state: ShardState, optimizer_cls, params: List[Tensor], indices: List[int], args: tuple,
                        kwargs: dict) -> OwnerOptimizer:
    """The OwnerOptimizer over ``params`` (hosted in ``state``; ``indices``: their places in the trainer's
    optimizer) that ``optimizer_cls(params, *args, **kwargs)`` asks for, shared when it exists; a new one runs
    compiled when this process's ``functional_optim_map`` has the class, and starts from the state the
    checkpoint ``state`` was restored from kept for its parameters."""
    functional_cls = functional_optim_map.get(optimizer_cls)
    for index, param in zip(indices, params):
        if not isinstance(param, Tensor):
            raise TypeError(f"parameter #{index} of the optimizer is a {type(param).__name__}, not a tensor")
    _refuse_another_optimizers_state(state, class_name(optimizer_cls), params)
    # Trainers asking for the same optimizer share it (and its state); steps name it by a small integer
    # handle rather than an RRef, which spares every step the RRef fork/acknowledge messages.  The state
    # holds optimizers weakly: the RRefs that DistributedOptimizers keep are what keeps one alive.
    key = (optimizer_cls, functional_cls, tuple(id(p) for p in params), repr(args), repr(sorted(kwargs.items())))

    def create(handle: int) -> OwnerOptimizer:
        names = [_parameter_name(state, p, i) for p, i in zip(params, indices)]
        made = OwnerOptimizer(optimizer_cls, functional_cls, params, names, args, kwargs, state, handle)
        logger.info("optimizer %d: %s over %d parameters (%s)", made.handle, optimizer_cls.__qualname__,
                    len(params), ("Python, under a lock" if functional_cls is None else
                                  "TorchScript" if torchscript_enabled() else "eager: TorchScript is off"))
        # Restored, and brought to where this shard's killed process left it, before any other caller sees it.
        _restore_state(state, made)
        replay(state, made)
        return made

    owner_optimizer, _ = state.optimizer_for(key, create)
    return owner_optimizer


def _refuse_another_optimizers_state(state: ShardState, optimizer: str, params: List[Tensor]) -> None:
    """A shard started from a checkpoint whose state for one of ``params`` was kept by another optimizer class
    than ``optimizer``: ``ValueError`` naming the table and both classes, before anything is made or changed
    (that state cannot be read as this optimizer's, and starting it afresh would silently drop it)."""
    source = state.restore_source
    for param in params:
        name = state.name_of(param)
        dynamic = state.dynamic_rows(param)
        kept = dynamic.restored_optimizer() if dynamic is not None else \
            source.optimizer_of(name) if name is not None and source is not None else None
        if kept and kept != optimizer:
            raise ValueError(f"table {name!r}: the checkpoint holds its optimizer state for {kept}, but {optimizer} "
                             f"is configured (a checkpoint's optimizer state is read only by the optimizer that "
                             f"kept it): train the table with {kept.rsplit('.', 1)[-1]}")


def _restore_state(state: ShardState, owner_optimizer: OwnerOptimizer) -> None:
    """A shard started from a checkpoint: the state its parameters had there follows them here."""
    source = state.restore_source
    if source is None:
        return
    restored = {}
    for index, param in enumerate(owner_optimizer.params):
        name = state.name_of(param)
        dynamic = state.dynamic_rows(param)
        if dynamic is not None:  # restored with its rows, in the order of its slots
            entry = dynamic.restored_optimizer_state(owner_optimizer.class_name)
        else:
            entry = source.optimizer_state(name, owner_optimizer.class_name) if name is not None else None
        if entry:
            restored[index] = entry
    if restored:
        owner_optimizer.load_state_dict(restored)
        logger.info("optimizer %d: state of %d of its %d parameters restored from the checkpoint",
                    owner_optimizer.handle, len(restored), len(owner_optimizer.params))
    owner_optimizer.restore_ledger(source.ledger(owner_optimizer.tag))


def row_gradient(rows: Tensor, values: Tensor, shape: List[int], name: str) -> Tensor:
    """``_row_gradient``; its refusals raised as the ``ValueError`` they are."""
    try:
        return _row_gradient(rows, values, shape, name)
    except torch.jit.Error as error:
        reraise_script_error(error)  # always raises


@script
def _row_gradient(rows: Tensor, values: Tensor, shape: List[int], name: str) -> Tensor:
    """The row-sparse gradient of ``values`` at ``rows``, built coalesced when the rows are distinct (as pushes
    send them: sorted for a fixed table, in slot order for a dynamic one), so that the optimizer's step does
    not sort and deduplicate them again; the same tensor ``coalesce()`` would make, so the same update.
    ``ValueError`` naming parameter ``name`` when a row is not one of its rows: the rows are checked here, by
    their ends once sorted, not again by the sparse tensor (whose checks cost more than a small table's update).
    Compiled: a push's checks cost a few operations, not a few Python calls each."""
    increasing = rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all())
    if not increasing:  # a dynamic table's slots, or duplicates
        rows, order = rows.sort()
        values = values.index_select(0, order)
        increasing = bool((rows[1:] > rows[:-1]).all())  # false only with duplicates: coalesce() sums them
    if rows.numel() > 0:  # sorted: its ends are the least and the greatest row
        least = int(rows[0])
        greatest = int(rows[-1])
        if least < 0 or greatest >= shape[0]:
            raise ValueError("a push names row {} of parameter {}, which has {} rows; no parameter on this owner "
                             "was changed".format(least if least < 0 else greatest, name, shape[0]))
    return torch.ops.aten._sparse_coo_tensor_unsafe(rows.unsqueeze(0), values, shape, is_coalesced=increasing)
