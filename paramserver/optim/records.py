"""One record per row-wise optimizer: what the shard, the job, the docs and the tests know of it.

Owns ``RowOptimizer``, the declaration of an optimizer that updates a table's rows (as FBGEMM declares each
of its embedding optimizers once, ``codegen/genscript/optimizers.py``):

* its classes: the local ones a user names (``torch.optim.SGD``, ``QHM``...) and the functional class a
  shard runs, whose ``step_rows`` (or ``step``) is its row update;
* its row state (``StateKind``: names, layouts, initial values, which hyperparameters keep a kind), the
  same declaration its functional class makes with ``RowState`` (a shard checks the two agree when it
  builds one, and the tests for every record);
* its hyperparameters (the functional class's keyword arguments and defaults) and their checks;
* the options it refuses on rows (``RowRefusal``): a table refuses them when its optimizer is made;
* its capabilities: ``rows_independent`` (a row's update reads only that row, its gradient and its state,
  so a push may be applied in parts at once), ``half_rows`` (float16 / bfloat16 rows, updated in float32),
  ``native`` (the name of its update in the native row kernel, ``row_kernel.py``, which then applies its
  pushes' rows in one pass each where a build is loaded);
* where the CTR job lists it (``JobChoice``: its ``sparse_optimizer`` name and tuned options) and what the
  docs' table says of it.

A built-in optimizer's record sits in its own module, beside its functional class, as the module constant
``ROW_OPTIMIZER``; ``builtin_records()`` finds them there, so adding one is that module (and its tests).  A
class a user registers (``register_functional_optim``) gets a record too, passed or ``derived`` from its
functional class; ``functional_optim_map`` keeps them (``record_of``).  It owns no optimizer math.
"""

import dataclasses
import functools
import importlib
import inspect
import pkgutil
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

#: The module constant a built-in optimizer's module declares its record as.
RECORD_NAME = "ROW_OPTIMIZER"

#: Hyperparameters a functional constructor takes that are not the optimizer's own (PyTorch's conventions).
NOT_HYPERPARAMETERS = ("params", "_allow_empty_param_list")


def always(hyperparameters: Mapping[str, Any]) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class StateKind:
    """One kind of row state: its ``name``, ``layout`` (``"element"``, ``"row"``, ``"scalar"``,
    ``"row_flag"``: ``row_sparse.RowState``), ``initial`` value (a number, or the name of the hyperparameter
    it starts at), and ``kept(hyperparameters)``: whether the optimizer keeps it with those settings
    (``kept_doc`` says when, for the docs)."""

    name: str
    layout: str
    initial: Union[float, str] = 0.0
    kept: Callable[[Mapping[str, Any]], bool] = always
    kept_doc: str = ""

    def initial_value(self, hyperparameters: Mapping[str, Any]) -> float:
        return float(hyperparameters[self.initial]) if isinstance(self.initial, str) else float(self.initial)


@dataclasses.dataclass(frozen=True)
class RowRefusal:
    """An option the optimizer cannot apply to rows: ``refuses(hyperparameters)`` says whether these settings
    are refused, ``reason`` why (named in the refusal, with the table and the optimizer)."""

    options: Tuple[str, ...]
    refuses: Callable[[Mapping[str, Any]], bool]
    reason: str


@dataclasses.dataclass(frozen=True)
class JobChoice:
    """The optimizer as the CTR job's ``sparse_optimizer`` names it: ``name``, the local class it stands for,
    and its keyword arguments tuned on the planted data (``make demo``'s 1500 steps: docs/demo-job.md)."""

    name: str
    local: type
    options: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class RowOptimizer:
    """The record of a row-wise optimizer (see the module).

    ``state`` is ``None`` when only the functional class knows its state (a ``derived`` record: read from an
    instance's ``RowState``); ``refusals`` is ``None`` when its refusals are not declared (a shard then tries
    a scratch row when the optimizer is made on a table).  ``check(hyperparameters)`` raises ``ValueError``
    for values out of range (``None``: the functional constructor's own checks only).  ``example``: settings
    that keep every kind of state, for tests and benchmarks.  ``native``: the name of its update in the native
    row kernel (a key of ``row_kernel.RowKernel.updates``; only for rows that update independently), or
    ``None``.  ``rank``: where it is listed (the job's names, the docs' table); ``state_doc`` / ``update_doc``:
    the docs' table's cells."""

    name: str
    functional: type
    local: Tuple[type, ...]
    state: Optional[Tuple[StateKind, ...]]
    check: Optional[Callable[[Mapping[str, Any]], None]] = None
    refusals: Optional[Tuple[RowRefusal, ...]] = ()
    rows_independent: bool = False
    half_rows: bool = True
    native: Optional[str] = None
    example: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    job: Optional[JobChoice] = None
    rank: int = 1000
    state_doc: str = ""
    update_doc: str = ""

    def __post_init__(self):
        if self.native is not None and not self.rows_independent:
            raise TypeError(f"optimizer {self.name}: its record names a native row update ({self.native}), which "
                            f"updates rows independently, but says its rows do not")
        if self.rows_independent and not steps_in_parts(self.functional):
            raise TypeError(f"optimizer {self.name}: its record says its rows update independently, but "
                            f"{self.functional.__qualname__} has no prepare_step(gradients) and "
                            f"step_rows(gradients) -> List[Tensor] to apply a push's rows in parts with")

    @classmethod
    def derived(cls, local_cls: type, functional_cls: type,
                rows_independent: Optional[bool] = None) -> "RowOptimizer":
        """The record of a class a user registers without one: its state read from its ``RowState``, its
        refusals tried on a scratch row, its rows independent when it steps in parts (``prepare_step`` and
        ``step_rows``) unless ``rows_independent`` says otherwise."""
        return cls(name=local_cls.__name__, functional=functional_cls, local=(local_cls,), state=None,
                   refusals=None,
                   rows_independent=steps_in_parts(functional_cls) if rows_independent is None else rows_independent)

    @property
    def row_update(self) -> Callable:
        """The functional class's update of a push's rows: ``step_rows`` where rows update independently (after
        one ``prepare_step``), else the whole ``step``."""
        return self.functional.step_rows if self.rows_independent else self.functional.step

    def hyperparameters(self) -> Dict[str, Any]:
        """The functional class's keyword arguments and their defaults (``inspect.Parameter.empty``: none)."""
        found = {}
        for name, parameter in list(inspect.signature(self.functional.__init__).parameters.items())[1:]:
            if name not in NOT_HYPERPARAMETERS and parameter.kind not in (parameter.VAR_POSITIONAL,
                                                                          parameter.VAR_KEYWORD):
                found[name] = parameter.default
        return found

    def bind(self, args: Sequence[Any] = (), kwargs: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
        """``args`` and ``kwargs`` (as given after the parameters) as every hyperparameter's value, the defaults
        filled in; ``TypeError`` naming the optimizer for arguments its class does not take."""
        signature = inspect.signature(self.functional.__init__)
        try:
            bound = signature.bind(None, None, *args, **dict(kwargs or {}))
        except TypeError as error:
            raise TypeError(f"optimizer {self.name}: {error}") from None
        bound.apply_defaults()
        return {name: value for name, value in list(bound.arguments.items())[2:] if name not in NOT_HYPERPARAMETERS}

    def check_hyperparameters(self, args: Sequence[Any] = (), kwargs: Optional[Mapping[str, Any]] = None) -> None:
        """``ValueError`` naming the first hyperparameter out of range (``TypeError`` for one not taken)."""
        bound = self.bind(args, kwargs)
        if self.check is not None:
            self.check(bound)

    def state_for(self, hyperparameters: Mapping[str, Any]) -> Optional[Tuple[List[str], List[str], List[float]]]:
        """The row state it keeps with ``hyperparameters`` (bound): names, layouts, initial values, as its
        functional class's ``RowState`` declares them; ``None`` when the record does not declare it."""
        if self.state is None:
            return None
        kept = [kind for kind in self.state if kind.kept(hyperparameters)]
        return ([kind.name for kind in kept], [kind.layout for kind in kept],
                [kind.initial_value(hyperparameters) for kind in kept])

    def refusal(self, hyperparameters: Mapping[str, Any]) -> Optional[str]:
        """Why rows refuse these (bound) settings, or ``None`` when they take them (or the record does not
        declare its refusals)."""
        for refusal in self.refusals or ():
            if refusal.refuses(hyperparameters):
                named = ", ".join(f"{option}={hyperparameters[option]!r}" for option in refusal.options)
                return f"{named}: {refusal.reason}"
        return None


def steps_in_parts(functional_cls) -> bool:
    """Whether ``functional_cls`` splits its step into ``prepare_step(gradients)``, what a step does once, and
    ``step_rows(gradients) -> List[Tensor]``, the update of some rows."""
    return callable(getattr(functional_cls, "prepare_step", None)) and \
        callable(getattr(functional_cls, "step_rows", None))


@functools.lru_cache(maxsize=None)
def builtin_records() -> Tuple[RowOptimizer, ...]:
    """The records of the optimizers that ship, by ``rank``: every public module of ``paramserver.optim`` that
    declares a ``ROW_OPTIMIZER`` (a name starting with ``_`` is private: the row kernel's compiled builds are
    among them, extension files that are loaded with ctypes, never imported)."""
    package = importlib.import_module(__package__)
    found = []
    for module in pkgutil.iter_modules(package.__path__):
        if module.name.startswith("_"):
            continue
        record = getattr(importlib.import_module(f"{__package__}.{module.name}"), RECORD_NAME, None)
        if isinstance(record, RowOptimizer):
            found.append(record)
    return tuple(sorted(found, key=lambda record: (record.rank, record.name)))


def job_choices() -> Dict[str, JobChoice]:
    """The CTR job's ``sparse_optimizer`` names, in the records' order."""
    return {record.job.name: record.job for record in builtin_records() if record.job is not None}


def local_names() -> List[str]:
    """The local classes the built-in records take, by name (said where an optimizer cannot apply rows)."""
    return [local.__name__ for record in builtin_records() for local in record.local]


def _state_cell(record: RowOptimizer) -> str:
    return record.state_doc or ", ".join(kind.name for kind in record.state or ())


def _refusals_cell(record: RowOptimizer) -> str:
    if not record.refusals:
        return "-"
    return "; ".join(" or ".join(f"`{option}`" for option in refusal.options) for refusal in record.refusals)


def docs_table() -> str:
    """The table of docs/optimizers.md ("Sparse optimizers for tables"), made from the records."""
    lines = ["| local class | functional form | state per row of a `[rows, dim]` table | update (touched rows only) "
             "| refused on rows | pushes in parts | half-precision rows | native row kernel | CTR job name |",
             "|---|---|---|---|---|---|---|---|---|"]
    for record in builtin_records():
        local = ", ".join(f"`{cls.__module__.split('.')[0]}.optim.{cls.__name__}`" for cls in record.local)
        job = "-" if record.job is None else f"`{record.job.name}`" + (" (default)" if record.rank == 0 else "")
        lines.append(f"| {local} | `{record.functional.__name__}` | {_state_cell(record)} | {record.update_doc} | "
                     f"{_refusals_cell(record)} | {'yes' if record.rows_independent else 'no'} | "
                     f"{'yes' if record.half_rows else 'no'} | {'yes' if record.native else 'no'} | {job} |")
    return "\n".join(lines) + "\n"
