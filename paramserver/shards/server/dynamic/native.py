"""The dynamic tables' hot path in C: finding ids in an ``IdIndex``, touching and reading their rows.

Owns a small C kernel (the source is below), built on first use with the
system's C compiler (``cc``, or ``$CC``) into a cache directory
(``$PARAMSERVER_CACHE``, else ``~/.cache/paramserver``, else the temporary
directory), named by a hash of the source, the compiler and the flags, and
loaded with ctypes, which releases the GIL for the call.  A lookup in torch
operations reads each id's bucket, then writes its touch, then reads its
row, each a separate pass over the batch with tensors in between; the
kernel makes two passes (find and touch; copy), each asking for the
memory of the id 16 places ahead, so the processor overlaps the misses of
consecutive ids, and compares a bucket's 8 keys at once in vector
registers.  It is built twice where the processor runs AVX2: a
baseline build (SSE2 on x86-64, plain C elsewhere), which also says
whether the processor has AVX2, and an AVX2 build, used where it does.

Without a compiler (or with ``PARAMSERVER_NATIVE=0``) ``kernel()`` is
``None`` and callers keep their torch path, which gives the same results
(``tests/test_dynamic_tables.py`` checks every build and the torch path).
The kernel trusts its arguments: ``IdIndex`` and ``DynamicRows`` pass
contiguous tensors of the layouts they own, checked here before every call.
"""

import ctypes
import hashlib
import logging
import os
import pathlib
import subprocess
import tempfile
import threading
from typing import Dict, Optional

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
/* Lanes per bucket: IdIndex.LANES (the caller checks).  A bucket is 2 * LANES int64 words: the lanes' keys,
   then their slots (int32), then their last touches (int32). */
#define LANES 8
#define BUCKET_WORDS (2 * LANES)

static inline uint64_t home_bucket(int64_t id, int bits) {
    return bits ? ((uint64_t)id * GOLDEN) >> (64 - bits) : 0;
}

/* Bit `lane` set where keys[lane] == id (match_mask) and where slots[lane] is empty, -1 (empty_mask): one
   bucket compared at once, in AVX2 or SSE2 vectors where the build has them, lane by lane otherwise. */
#if defined(__AVX2__)
#include <immintrin.h>
static inline uint32_t match_mask(const int64_t *keys, int64_t id) {
    const __m256i wanted = _mm256_set1_epi64x(id);
    uint32_t mask = 0;
    for (int quad = 0; quad < LANES / 4; quad++) {
        __m256i equal = _mm256_cmpeq_epi64(_mm256_loadu_si256((const __m256i *)(keys + 4 * quad)), wanted);
        mask |= (uint32_t)_mm256_movemask_pd(_mm256_castsi256_pd(equal)) << (4 * quad);
    }
    return mask;
}
#elif defined(__SSE2__)
#include <emmintrin.h>
static inline uint32_t match_mask(const int64_t *keys, int64_t id) {
    const __m128i wanted = _mm_set1_epi64x(id);
    uint32_t mask = 0;
    for (int pair = 0; pair < LANES / 2; pair++) {
        /* SSE2 compares 32-bit halves: a key matches where both of its halves do */
        __m128i halves = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(keys + 2 * pair)), wanted);
        __m128i both = _mm_and_si128(halves, _mm_shuffle_epi32(halves, _MM_SHUFFLE(2, 3, 0, 1)));
        mask |= (uint32_t)_mm_movemask_pd(_mm_castsi128_pd(both)) << (2 * pair);
    }
    return mask;
}
#else
static inline uint32_t match_mask(const int64_t *keys, int64_t id) {
    uint32_t mask = 0;
    for (int lane = 0; lane < LANES; lane++) mask |= (uint32_t)(keys[lane] == id) << lane;
    return mask;
}
#endif

static inline uint32_t empty_mask(const int32_t *slots) {
    uint32_t mask = 0;
    for (int lane = 0; lane < LANES; lane++) mask |= (uint32_t)(slots[lane] == -1) << lane;
    return mask;
}

/* 1 where this processor runs AVX2 code (the kernel is then built again with it), 0 otherwise. */
int paramserver_cpu_has_avx2(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") ? 1 : 0;
#else
    return 0;
#endif
}

/* For each of ids[0..n): its slot in the index (buckets of LANES lanes, see above; slots -1 empty, -2 removed),
   probing from its Fibonacci-hashed bucket through full buckets, at most max_run further; -1 where it is not
   held.  When step >= 0 the touch of every id found is set to step, in its bucket (the lines just read).  When
   rows_out is not NULL, the id's row (row_bytes of table) is copied to rows_out, zeros where it is not held.
   Two passes (find and touch, then copy), each asking for the memory of the id AHEAD places on.  Returns the
   number of ids found. */
int64_t paramserver_find(int64_t *index, int64_t buckets, int bits, int64_t max_run, const int64_t *ids, int64_t n,
                         int64_t *out, int32_t step, const char *table, int64_t row_bytes, char *rows_out) {
    const uint64_t mask = (uint64_t)buckets - 1;
    int64_t found_count = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n) {
            const int64_t *ahead = index + home_bucket(ids[i + AHEAD], bits) * BUCKET_WORDS;
            __builtin_prefetch(ahead, 1);
            __builtin_prefetch(ahead + 8, 1);
        }
        const int64_t id = ids[i];
        uint64_t bucket = home_bucket(id, bits);
        int64_t found = -1;
        for (int64_t run = 0; run <= max_run; run++) {
            int64_t *keys = index + bucket * BUCKET_WORDS;
            int32_t *slots = (int32_t *)(keys + LANES);
            /* an unused lane's key never matches an id looked for in its bucket: a match is the id */
            const uint32_t matches = match_mask(keys, id);
            if (matches) {
                const int lane = __builtin_ctz(matches);
                found = slots[lane];
                if (step >= 0) slots[LANES + lane] = step;
                break;
            }
            if (empty_mask(slots)) break;
            bucket = (bucket + 1) & mask;
        }
        out[i] = found;
        found_count += found >= 0;
    }
    if (!rows_out) return found_count;
    for (int64_t i = 0; i < n; i++) {
        if (i + AHEAD < n && out[i + AHEAD] >= 0) __builtin_prefetch(table + out[i + AHEAD] * row_bytes);
        const int64_t found = out[i];
        if (found >= 0) memcpy(rows_out + i * row_bytes, table + found * row_bytes, (size_t)row_bytes);
        else memset(rows_out + i * row_bytes, 0, (size_t)row_bytes);
    }
    return found_count;
}
"""


#: Lanes per bucket the kernel reads (the source's ``LANES``): ``IdIndex.LANES``.
LANES = 8

#: The builds: ``baseline`` for any processor the compiler targets by default (SSE2 vectors on x86-64),
#: ``avx2`` for processors that run AVX2, used where this one does.
BUILD_FLAGS = {"baseline": [], "avx2": ["-mavx2"]}


class Kernel:
    """The loaded kernel: ``find`` (see ``SOURCE``), of one build (``variant``)."""

    def __init__(self, library: ctypes.CDLL, variant: str):
        self.variant = variant
        self._find = library.paramserver_find
        self._find.restype = ctypes.c_int64
        self._find.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p]
        self._has_avx2 = library.paramserver_cpu_has_avx2
        self._has_avx2.restype = ctypes.c_int
        self._has_avx2.argtypes = []

    def cpu_has_avx2(self) -> bool:
        return bool(self._has_avx2())

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


class _Loader:
    """Builds and loads the kernel once per process and build (``None`` when it cannot be built)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kernels: Dict[str, Optional[Kernel]] = {}

    def kernel(self) -> Optional[Kernel]:
        choice = os.environ.get("PARAMSERVER_NATIVE", "1")
        if choice == "0":
            return None
        with self._lock:
            baseline = self._load_locked("baseline")
            if choice == "baseline" or baseline is None or not baseline.cpu_has_avx2():
                return baseline
            return self._load_locked("avx2") or baseline

    def _load_locked(self, variant: str) -> Optional[Kernel]:
        if variant not in self._kernels:
            self._kernels[variant] = None
            try:
                self._kernels[variant] = Kernel(ctypes.CDLL(str(self._build(variant))), variant)
            except (OSError, subprocess.SubprocessError) as error:
                logger.info("dynamic tables: the C kernel's %s build failed (%s); %s", variant, error,
                            "they use their torch path" if variant == "baseline" else "the baseline build runs")
        return self._kernels[variant]

    @staticmethod
    def _build(variant: str) -> pathlib.Path:
        compiler = os.environ.get("CC", "cc")
        flags = BUILD_FLAGS[variant]
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30,
                                 check=True).stdout
        digest = hashlib.sha256((SOURCE + version + " ".join(flags)).encode()).hexdigest()[:16]
        for directory in _cache_directories():
            try:
                directory.mkdir(parents=True, exist_ok=True)
            except OSError:
                continue
            library = directory / f"dynamic-tables-{variant}-{digest}.so"
            if library.exists():
                return library
            source = directory / f"dynamic-tables-{variant}-{digest}.{os.getpid()}.c"
            partial = directory / f"dynamic-tables-{variant}-{digest}.{os.getpid()}.so"
            try:
                source.write_text(SOURCE)
                subprocess.run([compiler, "-O2", *flags, "-shared", "-fPIC", "-o", str(partial), str(source)],
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
    """The built kernel (the AVX2 build where this processor runs it), or ``None`` (no compiler, or
    ``PARAMSERVER_NATIVE=0``): use the torch path.  ``PARAMSERVER_NATIVE=baseline`` keeps the baseline build."""
    return _loader.kernel()
