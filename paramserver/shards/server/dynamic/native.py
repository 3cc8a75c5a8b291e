"""The dynamic tables' hot path in C: finding ids in an ``IdIndex``, touching and reading their rows.

Owns loading the C kernel and calling it.  The source is ``kernel.c``,
beside this module.  A lookup in torch operations reads each id's bucket,
then writes its touch, then reads its row, each a separate pass over the
batch with tensors in between; the kernel makes two passes (find and
touch; copy), each asking for the memory of the id 16 places ahead, so
the processor overlaps the misses of consecutive ids, and compares a
bucket's 8 keys at once in vector registers.  It is loaded with ctypes,
which releases the GIL for the call.

Its builds (baseline and AVX2, installed by ``setup.py`` or built on first use, each checked against the
digest of the ``kernel.c`` beside this module) are found and loaded by ``paramserver.native``; without
one, callers keep their torch path, which gives the same results (``tests/test_dynamic_tables.py``
checks every build and the torch path).

Nothing is loaded at import: a ``NativeKernels`` object loads the builds
for its owner (each ``ShardState`` has one, used when it hosts its first
dynamic table) on first use, once each.  ``PARAMSERVER_NATIVE=0`` makes it
choose the torch path, ``PARAMSERVER_NATIVE=baseline`` the baseline build.
The kernel trusts its arguments: ``IdIndex`` and ``DynamicRows`` pass
contiguous tensors of the layouts they own, checked here before every call.
"""

import ctypes
import pathlib
from typing import Optional

import torch
from torch import Tensor

from ....native import CACHE_ENV, CHOICES, NATIVE_ENV, KernelSource, NativeBuilds, library_digest, \
    library_has_avx2, source_digest
from ....native import installed_library as _installed_library

__all__ = ["CACHE_ENV", "CHOICES", "NATIVE_ENV", "Kernel", "NativeKernels", "installed_library", "source_digest"]

#: The kernel's source, shipped as package data.
SOURCE_PATH = pathlib.Path(__file__).with_name("kernel.c")

#: Lanes per bucket the kernel reads (the source's ``LANES``): ``IdIndex.LANES``.
LANES = 8

#: The install-time builds' module names (``setup.py``'s ``ext_modules``), in this package.
INSTALLED_MODULES = {"baseline": "_kernel_baseline", "avx2": "_kernel_avx2"}


def kernel_source() -> KernelSource:
    """The kernel as ``paramserver.native`` builds it (``SOURCE_PATH`` read now)."""
    return KernelSource(SOURCE_PATH, __package__, INSTALLED_MODULES, "dynamic-tables", ("-O2",),
                        label="the dynamic tables' C kernel", fallback="they use their torch path")


def installed_library(variant: str) -> Optional[pathlib.Path]:
    """The file of ``variant``'s install-time build (``setup.py``), or ``None`` where the install made none."""
    return _installed_library(kernel_source(), variant)


class Kernel:
    """One loaded build (``variant``) of the kernel: ``find`` (see ``kernel.c``), from the file ``origin``."""

    def __init__(self, library: ctypes.CDLL, variant: str, origin: pathlib.Path, installed: bool):
        self.variant = variant
        self.origin = origin
        #: Whether it was built at install time (otherwise on first use, in the cache directory).
        self.installed = installed
        self._find = library.paramserver_find
        self._find.restype = ctypes.c_int64
        self._find.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p]
        self._has_avx2 = library_has_avx2(library)
        #: The digest of the source it was built from (``source_digest``).
        self.digest = library_digest(library)

    def __repr__(self) -> str:
        return f"Kernel({self.variant!r}, {'installed' if self.installed else 'built on first use'}: {self.origin})"

    def cpu_has_avx2(self) -> bool:
        return self._has_avx2

    def find(self, index: Tensor, bits: int, max_run: int, ids: Tensor, step: int = -1,
             table: Optional[Tensor] = None) -> tuple:
        """(slot per id, -1 where not held; the ids' rows of ``table`` (zeros where not held) or ``None``;
        how many were found).  ``index``: ``IdIndex.table``.  With ``step`` >= 0 every id found is touched."""
        buckets, words = index.shape
        if not (index.dtype == torch.int64 and words == 2 * LANES and index.is_contiguous()
                and buckets == 1 << bits):
            raise ValueError("the index's tensor is not laid out as the kernel reads it")
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), dtype=torch.int64)
        rows = None
        row_bytes = 0
        if table is not None:
            if not table.is_contiguous() or table.dim() != 2:
                raise ValueError("the table must be a contiguous 2-D tensor")
            rows = torch.empty(ids.numel(), table.size(1), dtype=table.dtype)
            row_bytes = table.size(1) * table.element_size()
        found = self._find(index.data_ptr(), buckets, bits, max_run, ids.data_ptr(), ids.numel(), out.data_ptr(),
                           step, table.data_ptr() if table is not None else None, row_bytes,
                           rows.data_ptr() if rows is not None else None)
        return out, rows, found


class NativeKernels(NativeBuilds):
    """The kernel's builds for one owner (a ``ShardState``), each loaded on first use, once
    (``paramserver.native.NativeBuilds``: ``chosen()``, ``build(variant)``, ``loaded()``).

    ``choice`` is one of ``CHOICES``; ``None`` reads it from ``PARAMSERVER_NATIVE`` now.  Thread-safe."""

    def __init__(self, choice: Optional[str] = None):
        super().__init__(kernel_source, Kernel, choice)
