"""The dynamic tables' hot path in C: finding ids in an ``IdIndex``, touching and reading their rows, in one pass.

Owns a small C kernel (the source is below), built on first use with the
system's C compiler (``cc``, or ``$CC``) into a cache directory
(``$PARAMSERVER_CACHE``, else ``~/.cache/paramserver``, else the temporary
directory), named by a hash of the source and the compiler, and loaded
with ctypes, which releases the GIL for the call.  A lookup in torch
operations reads each id's bucket, then its slot, then writes its touch,
then reads its row, each a separate pass of random memory accesses; the
kernel does all four for one id before the next, so the processor
overlaps the misses of consecutive ids.

Without a compiler (or with ``PARAMSERVER_NATIVE=0``) ``kernel()`` is
``None`` and callers keep their torch path, which gives the same results
(``tests/test_dynamic_tables.py`` checks both).  The kernel trusts its
arguments: ``IdIndex`` and ``DynamicRows`` pass contiguous tensors of the
layouts they own, checked here before every call.
"""

import ctypes
import hashlib
import logging
import os
import pathlib
import subprocess
import tempfile
import threading
from typing import Optional

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

SOURCE = r"""
#include <stdint.h>
#include <string.h>

#define GOLDEN 0x9E3779B97F4A7C15ULL
/* How many ids ahead the memory an id needs is asked for (prefetched), so that the misses of consecutive ids
   overlap instead of following one another. */
#define AHEAD 16

static inline uint64_t home_bucket(int64_t id, int bits) {
    return bits ? ((uint64_t)id * GOLDEN) >> (64 - bits) : 0;
}

/* For each of ids[0..n): its slot in the index (buckets of `lanes` lanes: keys int64, slots int32, -1 empty,
   -2 removed), probing from its Fibonacci-hashed bucket through full buckets, at most max_run further;
   -1 where it is not held.  Then, when touch is not NULL, touch[slot] = step for every id found; when
   rows_out is not NULL, the id's row (row_bytes of table) is copied to rows_out, zeros where it is not held.
   Two passes (find, then touch and copy), each asking for the memory of the id AHEAD places on.  Returns the
   number of ids found. */
int64_t paramserver_find(const int64_t *keys, const int32_t *slots, int64_t buckets, int bits, int lanes,
                         int64_t max_run, const int64_t *ids, int64_t n, int64_t *out, int32_t *touch, int32_t step,
                         const char *table, int64_t row_bytes, char *rows_out) {
    const uint64_t mask = (uint64_t)buckets - 1;
    int64_t found_count = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            uint64_t ahead = home_bucket(ids[i + AHEAD], bits);
            __builtin_prefetch(keys + ahead * lanes);
            __builtin_prefetch(keys + ahead * lanes + 8);
            __builtin_prefetch(slots + ahead * lanes);
        }
        const int64_t id = ids[i];
        uint64_t bucket = home_bucket(id, bits);
        int64_t found = -1;
        for (int64_t run = 0; run <= max_run; run++) {
            const int64_t *k = keys + bucket * lanes;
            const int32_t *s = slots + bucket * lanes;
            int empty = 0;
            for (int lane = 0; lane < lanes; lane++) {
                if (s[lane] >= 0 && k[lane] == id) { found = s[lane]; break; }
                if (s[lane] == -1) empty = 1;
            }
            if (found >= 0 || empty) break;
            bucket = (bucket + 1) & mask;
        }
        out[i] = found;
        found_count += found >= 0;
    }
    if (!touch && !rows_out) return found_count;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n && out[i + AHEAD] >= 0) {
            if (touch) __builtin_prefetch(touch + out[i + AHEAD], 1);
            if (rows_out) __builtin_prefetch(table + out[i + AHEAD] * row_bytes);
        }
        const int64_t found = out[i];
        if (found >= 0) {
            if (touch) touch[found] = step;
            if (rows_out) memcpy(rows_out + i * row_bytes, table + found * row_bytes, (size_t)row_bytes);
        } else if (rows_out) {
            memset(rows_out + i * row_bytes, 0, (size_t)row_bytes);
        }
    }
    return found_count;
}
"""


class Kernel:
    """The loaded kernel: ``find`` (see ``SOURCE``)."""

    def __init__(self, library: ctypes.CDLL):
        self._find = library.paramserver_find
        self._find.restype = ctypes.c_int64
        self._find.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]

    def find(self, keys: Tensor, slots: Tensor, bits: int, max_run: int, ids: Tensor,
             touch: Optional[Tensor] = None, step: int = -1, table: Optional[Tensor] = None) -> tuple:
        """(slot per id, -1 where not held; the ids' rows of ``table`` (zeros where not held) or ``None``;
        how many were found).  With ``touch``, ``touch[slot] = step`` for every id found."""
        buckets, lanes = keys.shape
        if not (keys.dtype == torch.int64 and slots.dtype == torch.int32 and slots.shape == keys.shape
                and keys.is_contiguous() and slots.is_contiguous() and buckets == 1 << bits):
            raise ValueError("the index's tensors are not laid out as the kernel reads them")
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), dtype=torch.int64)
        rows = None
        row_bytes = 0
        if table is not None:
            if not table.is_contiguous() or table.dim() != 2:
                raise ValueError("the table must be a contiguous 2-D tensor")
            rows = torch.empty(ids.numel(), table.size(1), dtype=table.dtype)
            row_bytes = table.size(1) * table.element_size()
        if touch is not None and (touch.dtype != torch.int32 or not touch.is_contiguous()):
            raise ValueError("touches must be a contiguous int32 tensor")
        found = self._find(keys.data_ptr(), slots.data_ptr(), buckets, bits, lanes, max_run, ids.data_ptr(),
                           ids.numel(), out.data_ptr(), touch.data_ptr() if touch is not None else None,
                           step, table.data_ptr() if table is not None else None, row_bytes,
                           rows.data_ptr() if rows is not None else None)
        return out, rows, found


class _Loader:
    """Builds and loads the kernel once per process (``None`` when it cannot be built)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._tried = False
        self._kernel: Optional[Kernel] = None

    def kernel(self) -> Optional[Kernel]:
        if os.environ.get("PARAMSERVER_NATIVE", "1") == "0":
            return None
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self._kernel = Kernel(ctypes.CDLL(str(self._build())))
                except (OSError, subprocess.SubprocessError) as error:
                    logger.info("dynamic tables use their torch path: the C kernel could not be built (%s)", error)
            return self._kernel

    @staticmethod
    def _build() -> pathlib.Path:
        compiler = os.environ.get("CC", "cc")
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30,
                                 check=True).stdout
        digest = hashlib.sha256((SOURCE + version).encode()).hexdigest()[:16]
        for directory in _cache_directories():
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError:
                continue
            library = directory / f"dynamic-tables-{digest}.so"
            if library.exists():
                return library
            source = directory / f"dynamic-tables-{digest}.{os.getpid()}.c"
            partial = directory / f"dynamic-tables-{digest}.{os.getpid()}.so"
            try:
                source.write_text(SOURCE)
                subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(source)],
                               capture_output=True, text=True, timeout=120, check=True)
                os.replace(partial, library)  # whole or not at all, if processes build it at once
                return library
            except OSError:
                continue
            finally:
                for leftover in (source, partial):
                    leftover.unlink(missing_ok=True)
        raise OSError("no writable cache directory for the built kernel")


def _cache_directories():
    configured = os.environ.get("PARAMSERVER_CACHE")
    if configured:
        yield pathlib.Path(configured)
    yield pathlib.Path.home() / ".cache" / "paramserver"
    yield pathlib.Path(tempfile.gettempdir()) / f"paramserver-{os.getuid()}"


_loader = _Loader()


def kernel() -> Optional[Kernel]:
    """The built kernel, or ``None`` (no compiler, or ``PARAMSERVER_NATIVE=0``): use the torch path."""
    return _loader.kernel()
