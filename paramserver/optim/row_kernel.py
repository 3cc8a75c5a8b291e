"""The row-wise optimizers' native kernel: one pass per touched row, without the GIL.

Owns loading ``row_kernel.c`` (beside this module, through ``paramserver.native``: built at install by
``setup.py``, else on first use, digest-checked; a baseline build and an AVX2 build) and calling it on a
push's rows.  The torch path (a functional class's ``step_rows`` on the row-sparse driver: a gather of the
rows and of each state tensor, a dozen element-wise operations, a scatter of each) makes a dozen passes over
a push's rows; the kernel reads each row and its state once, applies the update in float32 and writes both
back once, half-precision rows rounded in the same pass with ``rounding.py``'s bits (so to the same values).

A record (``records.RowOptimizer.native``) names the kernel's update for its optimizer (``UPDATES``); the
functional class stays the reference, the dense path, and the path where no kernel was built.  The
kernel's rows and state equal the torch path's bit for bit (``tests/test_row_kernel.py``): both take the same
order of arithmetic, a row's mean square (row-wise Adagrad) summed in double and rounded once, and square
roots correctly rounded (``kernels.rounded_sqrt`` on the torch path, ``sqrtf`` here).
It owns no state: the caller hands it the tensors (``RowState``'s) and the rounding of each table.
"""

import ctypes
import dataclasses
import math
import pathlib
from typing import Callable, Dict, List, Mapping, Optional

import torch
from torch import Tensor

from ..native import KernelSource, NativeBuilds, library_digest, library_has_avx2
from .kernels import row_slice_fused_min_elements

#: The kernel's source, shipped as package data.
SOURCE_PATH = pathlib.Path(__file__).with_name("row_kernel.c")

#: The install-time builds' module names (``setup.py``'s ``KERNELS``), in this package.
INSTALLED_MODULES = {"baseline": "_row_kernel_baseline", "avx2": "_row_kernel_avx2"}

#: The row types the kernel reads and writes (``rows_t.type`` in ``row_kernel.c``).
ROW_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def kernel_source() -> KernelSource:
    """The kernel as ``paramserver.native`` builds it (``setup.py`` passes the same flags)."""
    return KernelSource(SOURCE_PATH, __package__, INSTALLED_MODULES, "row-kernel",
                        ("-O3", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno"),
                        {"avx2": ("-mfma", "-mf16c")}, label="the row-wise optimizers' C kernel",
                        fallback="tables' rows are updated by the torch path")


class _Rows(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("dim", ctypes.c_int64), ("count", ctypes.c_int64), ("type", ctypes.c_int32),
                ("nearest", ctypes.c_int32), ("seed", ctypes.c_uint32), ("unused", ctypes.c_int32),
                ("first_row", ctypes.c_int64), ("ids", ctypes.c_void_p)]


@dataclasses.dataclass(frozen=True)
class Rounding:
    """How a half-precision table's rows are written back (``RowState.set_rounding`` and the step's stream):
    to ``nearest``, or stochastically in stream ``seed`` (``rounding.stream_seed``), row ``r``'s id being
    ``ids[r]`` (when given) or ``first_row + r``."""

    nearest: bool = False
    seed: int = 0
    first_row: int = 0
    ids: Optional[Tensor] = None


class RowKernel:
    """One loaded build (``variant``) of the kernel, from the file ``origin``; ``step`` runs an update."""

    def __init__(self, library: ctypes.CDLL, variant: str, origin: pathlib.Path, installed: bool):
        self.variant = variant
        self.origin = origin
        #: Whether it was built at install time (otherwise on first use, in the cache directory).
        self.installed = installed
        rows = ctypes.POINTER(_Rows)
        pointer, count, real = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._adagrad = library.paramserver_rowwise_adagrad
        self._adagrad.restype = ctypes.c_int
        self._adagrad.argtypes = [rows, pointer, count, pointer, pointer, real, real, real]
        self._sgd = library.paramserver_sgd
        self._sgd.restype = ctypes.c_int
        self._sgd.argtypes = [rows, pointer, count, pointer, pointer, pointer, real, real, real, real,
                              ctypes.c_int32, ctypes.c_int32, real, count]
        self._increasing = library.paramserver_rows_increasing
        self._increasing.restype = ctypes.c_int
        self._increasing.argtypes = [pointer, count, count]
        self._elementwise_adagrad = library.paramserver_adagrad
        self._elementwise_adagrad.restype = ctypes.c_int
        self._elementwise_adagrad.argtypes = [rows, pointer, count, pointer, pointer, real, real, ctypes.c_int32]
        self._ftrl = library.paramserver_ftrl
        self._ftrl.restype = ctypes.c_int
        self._ftrl.argtypes = [rows, pointer, count, pointer, pointer, pointer, real, ctypes.c_int32, real, real, real]
        self._adam = library.paramserver_adam
        self._adam.restype = ctypes.c_int
        self._adam.argtypes = [rows, pointer, count, pointer, pointer, pointer, real, real, real, real, ctypes.c_int32]
        self._has_avx2 = library_has_avx2(library)
        #: The digest of the source it was built from (``paramserver.native.source_digest``).
        self.digest = library_digest(library)
        #: Each update the kernel has, by the name a record gives it (``RowOptimizer.native``).
        self.updates: Dict[str, Callable[..., int]] = {"rowwise_adagrad": self._rowwise_adagrad, "sgd": self._sgd_rows,
                                                       "qhm": self._qhm_rows, "adagrad": self._adagrad_rows,
                                                       "ftrl": self._ftrl_rows, "adam": self._adam_rows}

    def __repr__(self) -> str:
        return f"RowKernel({self.variant!r}, {'installed' if self.installed else 'built on first use'}: {self.origin})"

    def cpu_has_avx2(self) -> bool:
        return self._has_avx2

    def accepts(self, update: str, hyperparameters: Mapping) -> bool:
        """Whether the kernel runs update ``update`` with these settings: only where it gives the torch path's
        rows (a push's rows equal whichever path applied it, as a fused push's equal a plain step's): QHM only
        where it has a fused form (``qhm_as_sgd``); FTRL with powers of the accumulator in ``FTRL_POWERS``;
        Adagrad without weight decay and Adam without weight decay or ``amsgrad`` (which a table refuses anyway:
        torch's Adagrad and SparseAdam have none for row-sparse gradients)."""
        if update not in self.updates:
            return False
        if update == "ftrl":
            return -hyperparameters["lr_power"] in FTRL_POWERS
        if update == "adagrad":
            return hyperparameters["weight_decay"] == 0.0
        if update == "adam":
            return hyperparameters["weight_decay"] == 0.0 and not hyperparameters["amsgrad"]
        return update != "qhm" or qhm_as_sgd(hyperparameters) is not None

    def rows_increasing(self, rows: Tensor, count: int) -> int:
        """0 where ``rows`` (a contiguous int64 vector) increase strictly and are rows of a table of ``count``
        rows; 1 where they do not increase; -2 where one is outside the table."""
        return self._increasing(rows.data_ptr(), rows.numel(), count)

    def takes(self, param: Tensor) -> bool:
        """Whether the kernel writes ``param``'s rows (a contiguous 2-D CPU tensor of a type it knows)."""
        return param.dim() == 2 and param.dtype in ROW_TYPES and param.is_contiguous() and param.device.type == "cpu"

    def step(self, update: str, param: Tensor, rows: Tensor, grads: Tensor, state: List[Tensor],
             hyperparameters: Mapping, rounding: Rounding) -> None:
        """Update ``update`` (a key of ``updates``) of rows ``rows`` (int64, distinct) of ``param`` (``takes``)
        with ``grads`` (float32, a row each) and ``state`` (the optimizer's ``RowState`` tensors of ``param``,
        float32 / bool, as its record keeps them with ``hyperparameters``), in place; ``ValueError`` for
        arguments not laid out as the kernel reads them (nothing written)."""
        if not self.takes(param):
            raise ValueError(f"the row kernel writes contiguous 2-D CPU rows of {list(ROW_TYPES)}, not "
                             f"{param.dtype} of shape {list(param.shape)}")
        rows = rows.to(torch.int64).contiguous()
        grads = grads.to(torch.float32).contiguous()
        if rows.dim() != 1 or list(grads.shape) != [rows.numel(), param.size(1)]:
            raise ValueError(f"{rows.numel()} rows with gradients of shape {list(grads.shape)} for rows of "
                             f"width {param.size(1)}")
        for tensor in state:
            if tensor.dim() == 0 and tensor.dtype == torch.float32:
                continue  # (a count of the table's steps)
            if not (tensor.is_contiguous() and tensor.dtype in (torch.float32, torch.bool)
                    and tensor.size(0) == param.size(0) and tensor.numel() in (param.size(0), param.numel())):
                raise ValueError(f"state of shape {list(tensor.shape)} and type {tensor.dtype} for a table of shape "
                                 f"{list(param.shape)}")
        ids = rounding.ids
        if ids is not None and not (ids.dtype == torch.int64 and ids.is_contiguous() and ids.numel() >= param.size(0)):
            raise ValueError("the rows' ids must be a contiguous int64 tensor with an id per row")
        self.step_laid_out(update, param, rows, grads, state, hyperparameters, rounding)

    def step_laid_out(self, update: str, param: Tensor, rows: Tensor, grads: Tensor, state: List[Tensor],
                      hyperparameters: Mapping, rounding: Rounding) -> None:
        """``step`` for arguments already laid out as the kernel reads them (a caller that checked them whole:
        ``OwnerOptimizer.apply_rows``' native way, ``state`` its optimizer's own tensors): only the kernel's own
        checks (rows in range) run."""
        ids = rounding.ids
        table = _Rows(param.data_ptr(), param.size(1), param.size(0), ROW_TYPES[param.dtype], int(rounding.nearest),
                      rounding.seed & 0xFFFFFFFF, 0, rounding.first_row, ids.data_ptr() if ids is not None else None)
        failed = self.updates[update](ctypes.byref(table), rows, grads, state, hyperparameters)
        if failed == -2:  # (checked before any row is written)
            raise ValueError(f"rows out of range for a table of {param.size(0)} rows")
        if failed != 0:
            raise MemoryError("the row kernel found no scratch memory for a row")

    def _rowwise_adagrad(self, table, rows: Tensor, grads: Tensor, state: List[Tensor], h: Mapping) -> int:
        (sums,) = state
        return self._adagrad(table, rows.data_ptr(), rows.numel(), grads.data_ptr(), sums.data_ptr(), h["lr"],
                             h["eps"], h["weight_decay"])

    def _sgd_rows(self, table, rows: Tensor, grads: Tensor, state: List[Tensor], h: Mapping) -> int:
        buffers = state[0].data_ptr() if len(state) > 0 else None
        flags = state[1].data_ptr() if len(state) > 1 else None
        # Nesterov's second step on small pushes (torch's multi-tensor form), its alpha rounded from double as
        # torch rounds a Scalar; and the size from which the torch path takes its fused form.
        return self._sgd(table, rows.data_ptr(), rows.numel(), grads.data_ptr(), buffers, flags, h["lr"],
                         h["momentum"], 1.0 - h["dampening"], h["weight_decay"], int(h["nesterov"]),
                         int(h["maximize"]), -h["lr"] * h["momentum"], row_slice_fused_min_elements())


    def _qhm_rows(self, table, rows: Tensor, grads: Tensor, state: List[Tensor], h: Mapping) -> int:
        settings = qhm_as_sgd(h)
        if settings is None:
            raise ValueError("the row kernel has no QHM update with momentum or nu 0, or direct weight decay")
        return self._sgd_rows(table, rows, grads, state, settings)

    def _adagrad_rows(self, table, rows: Tensor, grads: Tensor, state: List[Tensor], h: Mapping) -> int:
        steps, sums = state
        step = float(steps.item())  # (counted by the step's prepare_step; the rate as FunctionalAdagrad has it)
        rate = h["lr"] / (1 + (step - 1) * h["lr_decay"])
        return self._elementwise_adagrad(table, rows.data_ptr(), rows.numel(), grads.data_ptr(), sums.data_ptr(),
                                         -rate, h["eps"], int(h["maximize"]))

    def _ftrl_rows(self, table, rows: Tensor, grads: Tensor, state: List[Tensor], h: Mapping) -> int:
        accumulators, linears = state
        return self._ftrl(table, rows.data_ptr(), rows.numel(), grads.data_ptr(), accumulators.data_ptr(),
                          linears.data_ptr(), h["lr"], FTRL_POWERS[-h["lr_power"]], h["l1"], 2.0 * h["l2"], h["beta"])

    def _adam_rows(self, table, rows: Tensor, grads: Tensor, state: List[Tensor], h: Mapping) -> int:
        steps, exp_avgs, exp_avg_sqs = state
        step = float(steps.item())  # (counted by the step's prepare_step; the step size as FunctionalAdam has it)
        beta1, beta2 = h["betas"]
        step_size = h["lr"] * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        return self._adam(table, rows.data_ptr(), rows.numel(), grads.data_ptr(), exp_avgs.data_ptr(),
                          exp_avg_sqs.data_ptr(), 1 - beta1, 1 - beta2, h["eps"], -step_size, int(h["maximize"]))


#: The powers of FTRL's accumulator (``-lr_power``) the kernel takes, as ``row_kernel.c``'s ``FTRL_POWER_*``: those
#: ``FunctionalFTRL`` computes exactly (1; the square root, correctly rounded; the value itself); others are
#: declined (torch's general ``pow`` is within an ulp or so, which FTRL's difference of two powers magnifies).
FTRL_POWERS = {0.0: 0, 0.5: 1, 1.0: 2}


def qhm_as_sgd(h: Mapping) -> Optional[Dict]:
    """QHM's settings ``h`` as the SGD settings of its fused form (``functional_qhm.py``: Nesterov momentum SGD on
    the buffer rescaled by ``nu / ((1 - nu) * momentum)``, which its ``prepare_step`` keeps it at), computed as
    ``FunctionalQHM`` computes them; ``None`` where it has none (``momentum`` or ``nu`` 0: the reference's
    operations; ``direct`` weight decay)."""
    beta, nu, decay = h["momentum"], h["nu"], h["weight_decay"]
    if beta == 0.0 or nu == 0.0 or (decay != 0.0 and h["weight_decay_type"] == "direct"):
        return None
    if nu == 1.0:
        return dict(lr=h["lr"], momentum=beta, dampening=beta, weight_decay=decay, nesterov=False, maximize=False)
    scale = nu / ((1.0 - nu) * beta)
    return dict(lr=h["lr"] * (1.0 - nu), momentum=beta, dampening=1.0 - scale * (1.0 - beta), weight_decay=decay,
                nesterov=True, maximize=False)


class RowKernels(NativeBuilds):
    """The kernel's builds for one owner (a ``ShardState``), each loaded on first use, once
    (``paramserver.native.NativeBuilds``: ``chosen()``, ``build(variant)``, ``loaded()``); ``choice`` as
    there (``None``: ``PARAMSERVER_NATIVE``).  Thread-safe."""

    def __init__(self, choice: Optional[str] = None):
        super().__init__(kernel_source, RowKernel, choice)
