"""Loading the package's C kernels with ctypes: built at install, else on first use, each build digest-checked.

Owns how a C source shipped in the package (``KernelSource``: the dynamic tables' ``kernel.c``, the
optimizers' ``row_kernel.c``, the row store's ``row_log.c``) becomes a loaded library, for any such kernel;
never what a kernel computes (its ``ctypes`` signatures belong to the module that calls it).

There are two builds of each (``row_log.c``, with no vector code, has the first alone): ``baseline`` (SSE2 on
x86-64, plain C elsewhere), which also says whether the processor runs AVX2 (``paramserver_cpu_has_avx2``),
and ``avx2`` (x86-64), used where it does.  Each is found, in this order:

1. built at install time: ``setup.py`` compiles the source into extension files (``KernelSource.modules``)
   beside it (``pip install``; ``pip install -e`` builds them in place in the source tree), found by their
   module names (``importlib.util.find_spec``).  The build is optional: without a compiler the install
   succeeds without them;
2. built on first use with the system's C compiler (``cc``, or ``$CC``) into a cache directory
   (``$PARAMSERVER_CACHE``, else ``~/.cache/paramserver``, else the temporary directory), named by a hash of
   the source, the compiler and the flags;
3. neither: no kernel; callers keep their torch path, which gives the same results.

A build carries the digest of the source it was made from (``paramserver_kernel_digest``), and is loaded only
if that is the source shipped beside it: an install-time build left from an older source (an edited
checkout) is passed over for a fresh one.

Nothing is loaded at import: a ``NativeBuilds`` object loads the builds for its owner on first use, once each.
``PARAMSERVER_NATIVE=0`` makes it choose the torch path, ``PARAMSERVER_NATIVE=baseline`` the baseline build.
"""

import ctypes
import dataclasses
import hashlib
import importlib.util
import logging
import os
import pathlib
import subprocess
import tempfile
import threading
from typing import Callable, Dict, Generic, Iterator, Mapping, Optional, Sequence, TypeVar

logger = logging.getLogger(__name__)

#: ``0``: the torch path; ``baseline``: the baseline build; anything else (or unset): the best build.
NATIVE_ENV = "PARAMSERVER_NATIVE"
#: Where builds made on first use are kept, before ``~/.cache/paramserver``.
CACHE_ENV = "PARAMSERVER_CACHE"
#: The C compiler a build on first use runs (``cc`` when unset).
COMPILER_ENV = "CC"

#: The builds: ``baseline`` for any processor the compiler targets by default (SSE2 vectors on x86-64),
#: ``avx2`` for processors that run AVX2, used where this one does.  ``setup.py`` uses the same flags.
BUILD_FLAGS = {"baseline": [], "avx2": ["-mavx2"]}

#: What a ``NativeBuilds`` may use: the best build here, the baseline build, or no kernel (the torch path).
CHOICES = ("best", "baseline", "torch")


@dataclasses.dataclass(frozen=True)
class KernelSource:
    """A C kernel shipped in the package: ``path`` (its source), ``package`` (where its install-time builds
    are), ``modules`` (their module names by variant, as ``setup.py`` names them), ``cache_name`` (the prefix
    of builds made on first use), ``flags`` (compiler flags besides the variant's, as ``setup.py`` passes
    them), ``variant_flags`` (more flags for some variants), ``label`` (how the logs name it) and
    ``fallback`` (what its callers do without it)."""

    path: pathlib.Path
    package: str
    modules: Dict[str, str]
    cache_name: str
    flags: Sequence[str] = ("-O2",)
    variant_flags: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    label: str = "the C kernel"
    fallback: str = "its callers use their torch path"


def source_digest(source: bytes) -> str:
    """The digest a build of ``source`` carries (``setup.py`` computes it alike)."""
    return hashlib.sha256(source).hexdigest()[:16]


def library_digest(library: ctypes.CDLL) -> str:
    """The digest ``library`` was built with (``paramserver_kernel_digest``)."""
    digest = library.paramserver_kernel_digest
    digest.restype = ctypes.c_char_p
    digest.argtypes = []
    return digest().decode()


def library_has_avx2(library: ctypes.CDLL) -> bool:
    """Whether this processor runs AVX2, as ``library``'s ``paramserver_cpu_has_avx2`` says."""
    has_avx2 = library.paramserver_cpu_has_avx2
    has_avx2.restype = ctypes.c_int
    has_avx2.argtypes = []
    return bool(has_avx2())


K = TypeVar("K")


class NativeBuilds(Generic[K]):
    """A kernel's builds for one owner, each loaded on first use, once, and wrapped by ``wrap(library, variant,
    origin, installed)`` (an object with ``digest`` and ``cpu_has_avx2()``).  ``source()`` says what to build
    (read at each load).  ``choice`` is one of ``CHOICES``; ``None`` reads it from ``PARAMSERVER_NATIVE``
    now.  Thread-safe."""

    def __init__(self, source: Callable[[], KernelSource], wrap: Callable[[ctypes.CDLL, str, pathlib.Path, bool], K],
                 choice: Optional[str] = None):
        if choice is None:
            choice = {"0": "torch", "baseline": "baseline"}.get(os.environ.get(NATIVE_ENV, "1"), "best")
        if choice not in CHOICES:
            raise ValueError(f"the C kernel's choice must be one of {CHOICES}, got {choice!r}")
        self.choice = choice
        self._source = source
        self._wrap = wrap
        self._lock = threading.Lock()
        self._builds: Dict[str, Optional[K]] = {}

    def chosen(self) -> Optional[K]:
        """The build to use (the AVX2 build where this processor runs it, unless the choice is ``baseline``), or
        ``None``: the torch path (the choice is ``torch``, or no build could be found or made)."""
        if self.choice == "torch":
            return None
        with self._lock:
            baseline = self._load_locked("baseline")
            if self.choice == "baseline" or baseline is None or not baseline.cpu_has_avx2():
                return baseline
            return self._load_locked("avx2") or baseline

    def build(self, variant: str) -> Optional[K]:
        """The build ``variant`` (a key of ``BUILD_FLAGS``), whatever the choice; ``None`` where it cannot be had."""
        with self._lock:
            return self._load_locked(variant)

    def loaded(self) -> Dict[str, Optional[K]]:
        """The builds looked for so far, by variant (``None``: it could not be had); empty before first use."""
        with self._lock:
            return dict(self._builds)

    def _load_locked(self, variant: str) -> Optional[K]:
        if variant not in self._builds:
            self._builds[variant] = self._load(self._source(), variant)
        return self._builds[variant]

    def _load(self, kernel: KernelSource, variant: str) -> Optional[K]:
        try:
            source = kernel.path.read_bytes()
        except OSError as error:
            logger.info("%s: its source is missing (%s); %s", kernel.label, error, kernel.fallback)
            return None
        digest = source_digest(source)
        installed = installed_library(kernel, variant)
        if installed is not None:
            try:
                loaded = self._wrap(ctypes.CDLL(str(installed)), variant, installed, True)
                if loaded.digest == digest:
                    return loaded
                logger.info("%s: its %s build at %s was made from another source; building it again",
                            kernel.label, variant, installed)
            except (OSError, AttributeError) as error:
                logger.info("%s: its %s build at %s does not load (%s); building it again", kernel.label, variant,
                            installed, error)
        try:
            library = build_on_first_use(kernel, source, digest, variant)
            return self._wrap(ctypes.CDLL(str(library)), variant, library, False)
        except (OSError, AttributeError, subprocess.SubprocessError) as error:
            logger.info("%s: its %s build failed (%s); %s", kernel.label, variant, error,
                        kernel.fallback if variant == "baseline" else "the baseline build runs")
            return None


def installed_library(kernel: KernelSource, variant: str) -> Optional[pathlib.Path]:
    """The file of ``variant``'s install-time build (``setup.py``), or ``None`` where the install made none."""
    try:
        spec = importlib.util.find_spec(f"{kernel.package}.{kernel.modules[variant]}")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    return pathlib.Path(spec.origin)


def build_on_first_use(kernel: KernelSource, source: bytes, digest: str, variant: str) -> pathlib.Path:
    """``variant`` of ``source`` built with the system's compiler into the cache (reused when already there)."""
    compiler = os.environ.get(COMPILER_ENV, "cc")
    flags = [*kernel.flags, *BUILD_FLAGS[variant], *kernel.variant_flags.get(variant, ()),
             f'-DPARAMSERVER_KERNEL_DIGEST="{digest}"']
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30,
                             check=True).stdout
    key = hashlib.sha256(source + (version + " ".join(flags)).encode()).hexdigest()[:16]
    for directory in cache_directories():
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        library = directory / f"{kernel.cache_name}-{variant}-{key}.so"
        if library.exists():
            return library
        copy = directory / f"{kernel.cache_name}-{variant}-{key}.{os.getpid()}.c"
        partial = directory / f"{kernel.cache_name}-{variant}-{key}.{os.getpid()}.so"
        try:
            copy.write_bytes(source)  # the very bytes of the digest
            subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", str(partial), str(copy), "-lm"],
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
