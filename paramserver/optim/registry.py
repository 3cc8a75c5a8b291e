"""The ``functional_optim_map`` registry: local optimizer class -> functional class.

Owns the mapping that parameter servers consult to turn the optimizer class
a user names (``QHM``, ``torch.optim.SGD``, ...) into the TorchScript class
they run over their shards, and ``register_functional_optim``, which checks a
user's class against the functional contract before adding it:

* it compiles under TorchScript;
* its constructor takes the parameter list (``List[Tensor]``) first;
* ``step`` accepts ``List[Optional[Tensor]]`` (one gradient per parameter,
  ``None`` for "no gradient");
* for tables (the default), its state is a ``RowState`` (``state`` attribute), so
  that per-row state follows a table's rows.

With a class for tables, the map keeps its record (``records.RowOptimizer``: passed, or derived from the
class), which the shard reads (``functional_optim_map.record_of``); ours come from their records.  It owns
no optimizer math.
"""

import inspect
import threading
from collections.abc import MutableMapping
from typing import Dict, Iterator, List, Optional

import torch
from torch import Tensor

from .._torch_compat import script_class, torchscript_enabled
from ..torchscript import compiling

from .records import RowOptimizer, builtin_records
from .row_sparse import RowState


class FunctionalOptimMap(MutableMapping):
    """local optimizer class -> TorchScript functional class: a mapping, filled with ours (every built-in
    optimizer's record, ``records.builtin_records``: ``QHM``, and ``SGD``, ``Adagrad``, ``Adam`` replaced by
    ours: fused, row-sparse gradients, ``state_dict``) and with PyTorch's own functional optimizers (AdamW,
    RMSprop, ...); beside it, each row-wise optimizer's record (``record_of``).

    Ours are read the first time the map is read (their modules are this package's, imported by then); PyTorch's
    from ``torch.distributed.optim`` the first time a class that is not ours is looked up, or the whole map is
    read: importing that package costs every process about a second (it loads DTensor), and a shard running QHM
    or SGD never needs it.  A class set here (``register_functional_optim``) is kept over ours and PyTorch's for
    the same local class.
    """

    def __init__(self):
        self._entries: Dict[type, type] = {}
        #: local class -> its record (ours, and those registered); one counts only while the map still maps the
        #: class to the record's functional class.
        self._records: Dict[type, RowOptimizer] = {}
        self._lock = threading.Lock()
        self._with_ours = False
        self._with_torchs = False

    def _ours(self) -> Dict[type, type]:
        """The entries, ours read in first if they were not yet."""
        if not self._with_ours:
            records = builtin_records()  # (imports this package's modules: not under the lock)
            with self._lock:
                if not self._with_ours:
                    for record in records:
                        for local_cls in record.local:
                            if local_cls not in self._entries:
                                self._entries[local_cls] = record.functional
                                self._records[local_cls] = record
                    self._with_ours = True
        return self._entries

    def _all(self) -> Dict[type, type]:
        """Every entry, ours and PyTorch's read in first if they were not yet."""
        self._ours()
        with self._lock:
            if not self._with_torchs:
                from torch.distributed.optim import utils as torch_functional  # about a second: see the class
                for local_cls, functional_cls in torch_functional.functional_optim_map.items():
                    self._entries.setdefault(local_cls, functional_cls)
                self._with_torchs = True
        return self._entries

    def __getitem__(self, local_cls: type) -> type:
        found = self._ours().get(local_cls)
        return found if found is not None else self._all()[local_cls]

    def __setitem__(self, local_cls: type, functional_cls: type) -> None:
        self._ours()
        self._entries[local_cls] = functional_cls

    def __delitem__(self, local_cls: type) -> None:
        del self._all()[local_cls]

    def __iter__(self) -> Iterator[type]:
        return iter(list(self._all()))

    def __len__(self) -> int:
        return len(self._all())

    def __repr__(self) -> str:
        return f"FunctionalOptimMap({self._all()!r})"

    def register(self, local_cls: type, functional_cls: type, record: Optional[RowOptimizer]) -> None:
        """Map ``local_cls`` to ``functional_cls`` with its ``record`` (``None``: dense parameters only)."""
        self._ours()
        self._entries[local_cls] = functional_cls
        if record is None:
            self._records.pop(local_cls, None)
        else:
            self._records[local_cls] = record

    def record_of(self, local_cls: type) -> Optional[RowOptimizer]:
        """The record of the row-wise optimizer ``local_cls`` maps to, or ``None`` (no record: a class PyTorch
        ships, one registered for dense parameters only, or one set without ``register_functional_optim``)."""
        record = self._records.get(local_cls)
        if record is not None and self._ours().get(local_cls) is record.functional:
            return record
        return None

    def records(self) -> List[RowOptimizer]:
        """Every record the map holds now: ours (by rank), then those registered."""
        self._ours()
        found: List[RowOptimizer] = []
        for local_cls in list(self._records):
            record = self.record_of(local_cls)
            if record is not None and record not in found:
                found.append(record)
        return found


#: local optimizer class -> TorchScript functional class (``FunctionalOptimMap``), and the row-wise ones'
#: records.  The tests step each of them in TorchScript against its local optimizer.
functional_optim_map = FunctionalOptimMap()

_PROBE_SOURCE = """
def _step_contract(optimizer: FunctionalClass, gradients: List[Optional[Tensor]]) -> None:
    optimizer.step(gradients)
"""


def _first_error_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def check_functional_contract(functional_cls) -> None:
    """Raise ``TypeError`` saying how ``functional_cls`` breaks the functional contract."""
    name = getattr(functional_cls, "__qualname__", repr(functional_cls))
    if not inspect.isclass(functional_cls):
        raise TypeError(f"functional optimizer must be a class, got {functional_cls!r}")
    init_params = list(inspect.signature(functional_cls.__init__).parameters.values())[1:]
    if not init_params or init_params[0].annotation not in (List[Tensor], list[Tensor]):
        raise TypeError(f"{name}.__init__ must take the parameters first, annotated List[Tensor]")
    if not callable(getattr(functional_cls, "step", None)):
        raise TypeError(f"{name} has no step(gradients: List[Optional[Tensor]]) method")
    if not torchscript_enabled():
        return
    try:
        script_class(functional_cls)
    except Exception as error:
        raise TypeError(f"{name} does not compile under TorchScript: {_first_error_line(error)}") from error
    names = {"FunctionalClass": functional_cls, "List": List, "Optional": Optional, "Tensor": Tensor}
    try:
        with compiling():
            torch.jit.CompilationUnit().define(_PROBE_SOURCE, rcb=names.get)
    except Exception as error:
        raise TypeError(
            f"{name}.step must accept a List[Optional[Tensor]] (one gradient per parameter): "
            f"{_first_error_line(error)}") from error


_ROW_STATE_PROBE = """
def _row_state_contract(optimizer: FunctionalClass, index: int, rows: Tensor) -> RowState:
    optimizer.state.resize_rows(index, 0)
    optimizer.state.reset_rows(index, rows)
    return optimizer.state
"""


def check_row_state(functional_cls) -> None:
    """Raise ``TypeError`` saying what ``functional_cls`` lacks of the row-state part of the protocol: a
    ``state`` attribute of type ``RowState`` (``paramserver.optim.row_sparse``), through which a table's
    per-row state follows its rows (made at the optimizer's initial values, grown, reset, saved)."""
    name = getattr(functional_cls, "__qualname__", repr(functional_cls))
    names = {"FunctionalClass": functional_cls, "RowState": RowState, "Tensor": Tensor}
    try:
        with compiling():
            torch.jit.CompilationUnit().define(_ROW_STATE_PROBE, rcb=names.get)
    except Exception as error:
        raise TypeError(
            f"{name} keeps no per-row state that can follow a table's rows: it needs a 'state' attribute of type "
            f"paramserver.optim.RowState, made in __init__ with its state's names, layouts and initial values "
            f"(docs/optimizers.md, 'Adding an optimizer'); register it with rows=False to use it on dense "
            f"parameters only ({_first_error_line(error)})") from error


def register_functional_optim(local_cls, functional_cls, rows: bool = True,
                              record: Optional[RowOptimizer] = None) -> None:
    """Map ``local_cls`` (a ``torch.optim.Optimizer`` subclass) to ``functional_cls``, with its record.

    Raises ``TypeError`` if either class does not qualify (``check_functional_contract``; with ``rows``,
    the default, also ``check_row_state``: tables need it); the map is left unchanged then.  With
    TorchScript off (``PYTORCH_JIT=0``) nothing compiles, so only the Python-level checks run.

    With ``rows`` the class gets a record (``record``, whose ``functional`` must be ``functional_cls``, or
    ``RowOptimizer.derived`` from it: its rows update independently, and a shard applies a push to it in
    parts, when it has ``prepare_step`` and ``step_rows``); ``rows=False`` registers it for dense parameters
    only, with none.
    """
    if not (inspect.isclass(local_cls) and issubclass(local_cls, torch.optim.Optimizer)):
        raise TypeError(f"local optimizer must be a torch.optim.Optimizer subclass, got {local_cls!r}")
    check_functional_contract(functional_cls)
    if rows and torchscript_enabled():
        check_row_state(functional_cls)
    if record is not None and not rows:
        raise TypeError(f"{local_cls.__qualname__} is registered for dense parameters only (rows=False): a "
                        f"row-wise optimizer's record does not apply")
    if record is not None and record.functional is not functional_cls:
        raise TypeError(f"the record of {record.name} is for {record.functional.__qualname__}, not "
                        f"{functional_cls.__qualname__}")
    if rows and record is None:
        record = RowOptimizer.derived(local_cls, functional_cls)
    functional_optim_map.register(local_cls, functional_cls, record if rows else None)


def class_name(cls) -> str:
    """How checkpoints name an optimizer class (``module.QualName``)."""
    return f"{cls.__module__}.{cls.__qualname__}"
