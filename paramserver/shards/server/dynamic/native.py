"""The dynamic tables' hot path in C: finding ids in an ``IdIndex``, touching and reading their rows.

Owns loading the C kernel and calling it.  The source is ``kernel.c``,
beside this module.  A lookup in torch operations reads each id's bucket,
then writes its touch, then reads its row, each a separate pass over the
batch with tensors in between; the kernel makes two passes (find and
touch; copy), each asking for the memory of the id 16 places ahead, so
the processor overlaps the misses of consecutive ids, and compares a
bucket's 8 keys at once in vector registers.  It is loaded with ctypes,
which releases the GIL for the call.

There are two builds: ``baseline`` (SSE2 on x86-64, plain C elsewhere),
which also says whether the processor runs AVX2, and ``avx2`` (x86-64),
used where it does.  Each is found, in this order:

1. built at install time: ``setup.py`` compiles ``kernel.c`` into the
   extension files ``_kernel_baseline`` and ``_kernel_avx2`` beside this
   module (``pip install``; ``pip install -e``, as ``make test`` runs it,
   builds them in place in the source tree), found by their module names
   (``importlib.util.find_spec``).  The build is optional: without a
   compiler the install succeeds without them;
2. built on first use with the system's C compiler (``cc``, or ``$CC``)
   into a cache directory (``$PARAMSERVER_CACHE``, else
   ``~/.cache/paramserver``, else the temporary directory), named by a hash
   of the source, the compiler and the flags;
3. neither: no kernel; callers keep their torch path, which gives the
   same results (``tests/test_dynamic_tables.py`` checks every build and
   the torch path).

A build carries the digest of the source it was made from, and is loaded
only if that is the ``kernel.c`` beside this module: an install-time
build left from an older source (an edited checkout) is passed over for
a fresh one.

Nothing is loaded at import: a ``NativeKernels`` object loads the builds
for its owner (each ``ShardState`` has one, used when it hosts its first
dynamic table) on first use, once each.  ``PARAMSERVER_NATIVE=0`` makes it
choose the torch path, ``PARAMSERVER_NATIVE=baseline`` the baseline build.
The kernel trusts its arguments: ``IdIndex`` and ``DynamicRows`` pass
contiguous tensors of the layouts they own, checked here before every call.
"""

import ctypes
import hashlib
import importlib.util
import logging
import os
import pathlib
import subprocess
import tempfile
import threading
from typing import Dict, Iterator, Optional

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

#: ``0``: the torch path; ``baseline``: the baseline build; anything else (or unset): the best build.
NATIVE_ENV = "PARAMSERVER_NATIVE"
#: Where builds made on first use are kept, before ``~/.cache/paramserver``.
CACHE_ENV = "PARAMSERVER_CACHE"
#: The C compiler a build on first use runs (``cc`` when unset).
COMPILER_ENV = "CC"

#: The kernel's source, shipped as package data.
SOURCE_PATH = pathlib.Path(__file__).with_name("kernel.c")

#: Lanes per bucket the kernel reads (the source's ``LANES``): ``IdIndex.LANES``.
LANES = 8

#: The builds: ``baseline`` for any processor the compiler targets by default (SSE2 vectors on x86-64),
#: ``avx2`` for processors that run AVX2, used where this one does.  ``setup.py`` uses the same flags.
BUILD_FLAGS = {"baseline": [], "avx2": ["-mavx2"]}

#: The install-time builds' module names (``setup.py``'s ``ext_modules``), in this package.
INSTALLED_MODULES = {"baseline": "_kernel_baseline", "avx2": "_kernel_avx2"}

#: What a ``NativeKernels`` may use: the best build here, the baseline build, or no kernel (the torch path).
CHOICES = ("best", "baseline", "torch")


def source_digest(source: bytes) -> str:
    """The digest a build of ``source`` carries (``setup.py`` computes it alike)."""
    return hashlib.sha256(source).hexdigest()[:16]


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
        self._has_avx2 = library.paramserver_cpu_has_avx2
        self._has_avx2.restype = ctypes.c_int
        self._has_avx2.argtypes = []
        digest = library.paramserver_kernel_digest
        digest.restype = ctypes.c_char_p
        digest.argtypes = []
        #: The digest of the source it was built from (``source_digest``).
        self.digest = digest().decode()

    def __repr__(self) -> str:
        return f"Kernel({self.variant!r}, {'installed' if self.installed else 'built on first use'}: {self.origin})"

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


class NativeKernels:
    """The kernel's builds for one owner (a ``ShardState``), each loaded on first use, once.

    ``choice`` is one of ``CHOICES``; ``None`` reads it from ``PARAMSERVER_NATIVE`` now.  Thread-safe."""

    def __init__(self, choice: Optional[str] = None):
        if choice is None:
            choice = {"0": "torch", "baseline": "baseline"}.get(os.environ.get(NATIVE_ENV, "1"), "best")
        if choice not in CHOICES:
            raise ValueError(f"the C kernel's choice must be one of {CHOICES}, got {choice!r}")
        self.choice = choice
        self._lock = threading.Lock()
        self._builds: Dict[str, Optional[Kernel]] = {}

    def chosen(self) -> Optional[Kernel]:
        """The build to use (the AVX2 build where this processor runs it, unless the choice is ``baseline``), or
        ``None``: the torch path (the choice is ``torch``, or no build could be found or made)."""
        if self.choice == "torch":
            return None
        with self._lock:
            baseline = self._load_locked("baseline")
            if self.choice == "baseline" or baseline is None or not baseline.cpu_has_avx2():
                return baseline
            return self._load_locked("avx2") or baseline

    def build(self, variant: str) -> Optional[Kernel]:
        """The build ``variant`` (a key of ``BUILD_FLAGS``), whatever the choice; ``None`` where it cannot be had."""
        with self._lock:
            return self._load_locked(variant)

    def loaded(self) -> Dict[str, Optional[Kernel]]:
        """The builds looked for so far, by variant (``None``: it could not be had); empty before first use."""
        with self._lock:
            return dict(self._builds)

    def _load_locked(self, variant: str) -> Optional[Kernel]:
        if variant not in self._builds:
            self._builds[variant] = self._load(variant)
        return self._builds[variant]

    @staticmethod
    def _load(variant: str) -> Optional[Kernel]:
        try:
            source = SOURCE_PATH.read_bytes()
        except OSError as error:
            logger.info("dynamic tables: the C kernel's source is missing (%s); they use their torch path", error)
            return None
        digest = source_digest(source)
        installed = installed_library(variant)
        if installed is not None:
            try:
                kernel = Kernel(ctypes.CDLL(str(installed)), variant, installed, installed=True)
                if kernel.digest == digest:
                    return kernel
                logger.info("dynamic tables: the C kernel's %s build at %s was made from another kernel.c; "
                            "building it again", variant, installed)
            except (OSError, AttributeError) as error:
                logger.info("dynamic tables: the C kernel's %s build at %s does not load (%s); building it again",
                            variant, installed, error)
        try:
            library = build_on_first_use(source, digest, variant)
            return Kernel(ctypes.CDLL(str(library)), variant, library, installed=False)
        except (OSError, AttributeError, subprocess.SubprocessError) as error:
            logger.info("dynamic tables: the C kernel's %s build failed (%s); %s", variant, error,
                        "they use their torch path" if variant == "baseline" else "the baseline build runs")
            return None


def installed_library(variant: str) -> Optional[pathlib.Path]:
    """The file of ``variant``'s install-time build (``setup.py``), or ``None`` where the install made none."""
    try:
        spec = importlib.util.find_spec(f"{__package__}.{INSTALLED_MODULES[variant]}")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    return pathlib.Path(spec.origin)


def build_on_first_use(source: bytes, digest: str, variant: str) -> pathlib.Path:
    """``variant`` of ``source`` built with the system's compiler into the cache (reused when already there)."""
    compiler = os.environ.get(COMPILER_ENV, "cc")
    flags = [*BUILD_FLAGS[variant], f'-DPARAMSERVER_KERNEL_DIGEST="{digest}"']
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    key = hashlib.sha256(source + (version + " ".join(flags)).encode()).hexdigest()[:16]
    for directory in cache_directories():
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        library = directory / f"dynamic-tables-{variant}-{key}.so"
        if library.exists():
            return library
        copy = directory / f"dynamic-tables-{variant}-{key}.{os.getpid()}.c"
        partial = directory / f"dynamic-tables-{variant}-{key}.{os.getpid()}.so"
        try:
            copy.write_bytes(source)  # the very bytes of the digest
            subprocess.run([compiler, "-O2", *flags, "-shared", "-fPIC", "-o", str(partial), str(copy)],
                           capture_output=True, text=True, timeout=120, check=True)
            os.replace(partial, library)  # whole or not at all, if processes build it at once
            return library
        except OSError:
            continue
        finally:
            for leftover in (copy, partial):
                leftover.unlink(missing_ok=True)
    raise OSError("no writable cache directory for the built kernel")


def cache_directories() -> Iterator[pathlib.Path]:
    """Where builds made on first use go, first choice first."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        yield pathlib.Path(configured)
    yield pathlib.Path.home() / ".cache" / "paramserver"
    yield pathlib.Path(tempfile.gettempdir()) / f"paramserver-{os.getuid()}"
