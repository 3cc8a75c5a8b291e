"""The row store's log-structured engine of our own: ``RowLog``, the ``RowStoreEngine`` over ``row_log.c``.

Owns loading ``row_log.c`` (beside this module, through ``paramserver.native``: built at install by
``setup.py``, else on first use with the system's C compiler, digest-checked; one build, no vector code) and
calling it with ctypes, which releases the GIL for every call; never what a record holds.  Linux only
(O_DIRECT, pthreads).

The design (DeepRec's ``ssd_hash_kv``), in ``row_log.c``: an index id -> (segment, offset) in memory (open
addressing, 16 bytes a slot); records appended as ``[int64 id][record]`` through a write buffer to segment
files ``segment-NNNNNNNN.log`` (O_DIRECT where the filesystem takes it), a writer thread writing full buffers
behind ``put``; ``get`` resolving every id under the index's lock, then reading from disk many reads at once:
on the kernel's asynchronous I/O (128 in flight from the calling thread) where the files are O_DIRECT, else on
a pool of ``read_threads`` threads (records still in a buffer are copied from memory); a compaction thread
rewriting the current records of the emptiest sealed segment and deleting its file when the files hold more
than twice the live bytes.

The store is never reopened: its index lives in memory only, and a shard's checkpoints are the durable copy.
Opening a folder removes the segment files an earlier store left there and refuses a folder holding anything
else.  Every error of the C side (a folder that is not writable, ENOSPC on a write) is raised as an
``OSError`` with its errno and the path it concerns; a failed write is sticky (every later write raises it
again; reads are still answered).  Arguments are checked before each call (``ValueError`` naming what was
wrong): the C side trusts them.
"""

import ctypes
import errno
import os
import pathlib
import threading
import weakref
from typing import Dict, Iterator, Optional, Set, Tuple

import torch
from torch import Tensor

from ....native import KernelSource, NativeBuilds, library_digest
from .engine import ENGINE_STATS

#: The library's source, shipped as package data.
SOURCE_PATH = pathlib.Path(__file__).with_name("row_log.c")
#: The install-time build's module name (``setup.py``'s ``KERNELS``), in this package: one build.
INSTALLED_MODULES = {"baseline": "_row_log"}
#: Its compiler flags (``setup.py`` passes the same).
FLAGS = ("-O2", "-pthread")

#: A segment file's size before the next one begins.
SEGMENT_BYTES = 64 << 20
#: A write buffer's size: what one write to a segment file holds (a multiple of 4096).
BUFFER_BYTES = 1 << 20
#: Threads reading a ``get``'s records at once (the calling thread is one of them).
READ_THREADS = 8
#: The segment files' names in the folder.
SEGMENT_PATTERN = "segment-*.log"
#: The library's counters, in its order: the contract's, then the live bytes, the segment files, whether the
#: files are written with O_DIRECT, whether they are read on the kernel's asynchronous I/O, and the bytes of
#: memory the index and the buffers take.
NATIVE_STATS = ENGINE_STATS + ("live_bytes", "segments", "direct_io", "kernel_aio", "index_memory",
                               "buffer_memory")

_ERROR_BYTES = 4096


def library_source() -> KernelSource:
    """The library as ``paramserver.native`` builds it (``SOURCE_PATH`` read now)."""
    return KernelSource(SOURCE_PATH, __package__, INSTALLED_MODULES, "row-log", FLAGS, label="the row log's C library",
                        fallback="the row log engine cannot be used")


class Library:
    """One loaded build of ``row_log.c`` (``variant``, from the file ``origin``), its functions typed."""

    def __init__(self, library: ctypes.CDLL, variant: str, origin: pathlib.Path, installed: bool):
        self.variant = variant
        self.origin = origin
        #: Whether it was built at install time (otherwise on first use, in the cache directory).
        self.installed = installed
        #: The digest of the source it was built from (``paramserver.native.source_digest``).
        self.digest = library_digest(library)
        pointer, count, status = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        signatures = {
            "open": (status, [ctypes.c_char_p, count, count, count, status, status, status,
                              ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, count]),
            "error_path": (None, [pointer, ctypes.c_char_p, count]),
            "put": (status, [pointer, pointer, pointer, count]),
            "get": (status, [pointer, pointer, count, pointer, pointer]),
            "delete": (status, [pointer, pointer, count]),
            "flush": (status, [pointer]),
            "compact": (status, [pointer]),
            "stats": (None, [pointer, pointer]),
            "stat_count": (status, []),
            "scan_open": (status, [pointer, ctypes.POINTER(ctypes.c_void_p)]),
            "scan_next": (count, [pointer, pointer, count, pointer, pointer]),
            "scan_close": (None, [pointer, pointer]),
            "close": (status, [pointer, status, ctypes.c_char_p, count]),
        }
        for name, (restype, argtypes) in signatures.items():
            function = getattr(library, f"paramserver_row_log_{name}")
            function.restype = restype
            function.argtypes = argtypes
            setattr(self, name, function)
        if self.stat_count() != len(NATIVE_STATS):
            raise AttributeError(f"the row log's C library has {self.stat_count()} counters, not {len(NATIVE_STATS)}")

    def __repr__(self) -> str:
        return f"Library({'installed' if self.installed else 'built on first use'}: {self.origin})"

    def cpu_has_avx2(self) -> bool:
        return False  # one build: nothing to choose


class RowLogBuilds(NativeBuilds):
    """The library's build for one owner (a shard's row store), loaded on first use, once.  Thread-safe."""

    def __init__(self):
        super().__init__(library_source, Library, "baseline")

    def library(self) -> Library:
        """The loaded library; ``RuntimeError`` where it can be neither found nor built."""
        library = self.build("baseline")
        if library is None:
            raise RuntimeError("the row log's C library is neither installed nor buildable here (it needs a C "
                               "compiler, cc or $CC, on Linux); the log says why")
        return library


def _os_error(code: int, path: str, doing: str) -> OSError:
    return OSError(code, f"{os.strerror(code)} (the row log, {doing})", path)


def _count(value, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int of at least {least}, got {value!r}")
    return value


def _prepare_folder(folder: pathlib.Path) -> None:
    """Makes ``folder``; removes the segment files an earlier store left (unreadable without its index);
    refuses anything else in it."""
    folder.mkdir(parents=True, exist_ok=True)
    others = [path.name for path in folder.iterdir() if not path.match(SEGMENT_PATTERN)]
    if others:
        raise FileExistsError(errno.EEXIST, f"the row log's folder holds files that are not its own: "
                                            f"{', '.join(sorted(others)[:5])}", str(folder))
    for path in folder.glob(SEGMENT_PATTERN):
        path.unlink()


class RowLog:
    """Records of ``record_bytes`` bytes keyed by int64 ids, in segment files under ``folder`` (the contract:
    ``engine.RowStoreEngine``).  ``direct_io``: write and read the files with O_DIRECT where the filesystem
    takes it (the page cache neither holds them nor flatters the reads); ``kernel_aio``: read O_DIRECT files on
    the kernel's asynchronous I/O (io_submit; on a virtual disk here, 1.5-2x the reads a second of 8 threads);
    ``read_threads``: threads reading a ``get``'s records at once otherwise; ``buffer_bytes``,
    ``segment_bytes``: a write buffer's and a segment file's size;
    ``builds``: the library's loader (a ``RowLogBuilds``, shared by the stores of one process; a new one when
    ``None``).  Every method may be called from several threads at once, but ``close`` from none beside it."""

    def __init__(self, folder, record_bytes: int, *, direct_io: bool = True, read_threads: int = READ_THREADS,
                 kernel_aio: bool = True, buffer_bytes: int = BUFFER_BYTES, segment_bytes: int = SEGMENT_BYTES,
                 builds: Optional[RowLogBuilds] = None):
        self.record_bytes = _count(record_bytes, "record_bytes", 1)
        _count(read_threads, "read_threads", 1)
        _count(buffer_bytes, "buffer_bytes", 4096)
        _count(segment_bytes, "segment_bytes", 4096)
        if buffer_bytes % 4096 or buffer_bytes < record_bytes + 8:
            raise ValueError(f"buffer_bytes must be a multiple of 4096 holding a record of {record_bytes} bytes and "
                             f"its 8-byte id, got {buffer_bytes}")
        if segment_bytes % buffer_bytes:
            raise ValueError(f"segment_bytes must be a multiple of buffer_bytes ({buffer_bytes}), got {segment_bytes}")
        for name, value in (("direct_io", direct_io), ("kernel_aio", kernel_aio)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r}")
        self.folder = pathlib.Path(folder).absolute()
        self._lib = (builds or RowLogBuilds()).library()
        _prepare_folder(self.folder)
        handle = ctypes.c_void_p()
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        rc = self._lib.open(os.fsencode(self.folder), record_bytes, buffer_bytes, segment_bytes, int(direct_io),
                            read_threads, int(kernel_aio), ctypes.byref(handle), error, _ERROR_BYTES)
        if rc:
            raise _os_error(-rc, os.fsdecode(error.value) or str(self.folder), "opening its folder")
        self._handle: Optional[int] = handle.value
        self._scans: Set[int] = set()
        self._scans_lock = threading.Lock()
        # a store dropped unclosed still stops its threads and closes its files (its folder stays)
        self._finalizer = weakref.finalize(self, self._lib.close, handle.value, 0, None, 0)

    def __repr__(self) -> str:
        return f"RowLog({str(self.folder)!r}, record_bytes={self.record_bytes})"

    @property
    def direct_io(self) -> bool:
        """Whether the files are written and read with O_DIRECT (False where asked not to or the filesystem
        refused it)."""
        return bool(self._native_stats()["direct_io"])

    @property
    def kernel_aio(self) -> bool:
        """Whether ``get`` reads the files on the kernel's asynchronous I/O (O_DIRECT files only; False where
        asked not to or the kernel refused it: the read threads read them)."""
        return bool(self._native_stats()["kernel_aio"])

    def _open(self) -> int:
        handle = self._handle
        if handle is None:
            raise ValueError(f"the row log at {self.folder} is closed")
        return handle

    def _check(self, rc: int, doing: str) -> None:
        if rc < 0:
            path = ctypes.create_string_buffer(_ERROR_BYTES)
            self._lib.error_path(self._open(), path, _ERROR_BYTES)
            raise _os_error(-rc, os.fsdecode(path.value) or str(self.folder), doing)

    @staticmethod
    def _ids(ids: Tensor) -> int:
        if not isinstance(ids, Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError(f"ids must be a 1-D int64 tensor, got {_describe(ids)}")
        if ids.device.type != "cpu" or not ids.is_contiguous():
            raise ValueError(f"ids must be a contiguous CPU tensor, got {_describe(ids)}")
        return ids.numel()

    def _records(self, records: Tensor, n: int, name: str) -> None:
        if not isinstance(records, Tensor) or records.dtype != torch.uint8 or \
                tuple(records.shape) != (n, self.record_bytes):
            raise ValueError(f"{name} must be a uint8 tensor of shape [{n}, {self.record_bytes}], "
                             f"got {_describe(records)}")
        if records.device.type != "cpu" or not records.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor, got {_describe(records)}")

    def put(self, ids: Tensor, records: Tensor) -> None:
        """Each id's record replaces the one it had; seen by every later ``get`` at once."""
        n = self._ids(ids)
        self._records(records, n, "records")
        handle = self._open()
        if n:
            self._check(self._lib.put(handle, ids.data_ptr(), records.data_ptr(), n), "writing records")

    def get(self, ids: Tensor, out: Tensor) -> Tensor:
        """Copies each held id's record into its row of ``out``; returns a bool tensor, True where held."""
        n = self._ids(ids)
        self._records(out, n, "out")
        handle = self._open()
        found = torch.zeros(n, dtype=torch.bool)
        if n:
            self._check(self._lib.get(handle, ids.data_ptr(), n, out.data_ptr(), found.data_ptr()), "reading records")
        return found

    def delete(self, ids: Tensor) -> None:
        """The ids are no longer held (ids not held are ignored)."""
        n = self._ids(ids)
        handle = self._open()
        if n:
            self._check(self._lib.delete(handle, ids.data_ptr(), n), "deleting records")

    def scan(self, batch: int) -> Iterator[Tuple[Tensor, Tensor]]:
        """Every id held and its record, in batches of at most ``batch`` rows, segment by segment.  Compaction
        waits while a scan is open; a scan beside puts and deletes may give an id more than once (its newer
        record later)."""
        _count(batch, "batch", 1)
        return self._scan(batch)

    def _scan(self, batch: int) -> Iterator[Tuple[Tensor, Tensor]]:
        handle = self._open()
        cursor = ctypes.c_void_p()
        self._check(self._lib.scan_open(handle, ctypes.byref(cursor)), "opening a scan")
        with self._scans_lock:
            self._scans.add(cursor.value)
        try:
            while True:
                ids = torch.empty(batch, dtype=torch.int64)
                records = torch.empty(batch, self.record_bytes, dtype=torch.uint8)
                n = self._lib.scan_next(self._open(), cursor, batch, ids.data_ptr(), records.data_ptr())
                self._check(n, "scanning records")
                if n == 0:
                    return
                yield ids[:n], records[:n]
        finally:
            with self._scans_lock:
                still_open = cursor.value in self._scans
                self._scans.discard(cursor.value)
            if still_open and self._handle is not None:
                self._lib.scan_close(self._handle, cursor)

    def flush(self) -> None:
        """Every record put is written to the files, and the files fsynced."""
        self._check(self._lib.flush(self._open()), "flushing")

    def compact(self) -> None:
        """Runs compaction now, while it is due (the compaction thread runs it by itself too)."""
        self._check(self._lib.compact(self._open()), "compacting")

    def _native_stats(self) -> Dict[str, int]:
        counters = (ctypes.c_int64 * len(NATIVE_STATS))()
        self._lib.stats(self._open(), counters)
        return dict(zip(NATIVE_STATS, counters))

    def stats(self) -> Dict[str, int]:
        """The contract's counters (``ENGINE_STATS``), since the store was opened."""
        counters = self._native_stats()
        return {name: counters[name] for name in ENGINE_STATS}

    def memory_bytes(self) -> Dict[str, int]:
        """The memory the store holds: its index (16 bytes a slot, at most 5/8 of them full) and its buffers."""
        counters = self._native_stats()
        return {"index": counters["index_memory"], "buffers": counters["buffer_memory"]}

    def close(self, remove: bool = False) -> None:
        """Stops the store's threads and closes its files (records not flushed are dropped: the store is never
        reopened); ``remove`` deletes its files and its folder.  Closing a closed store does nothing."""
        handle = self._handle
        if handle is None:
            return
        with self._scans_lock:
            scans, self._scans = self._scans, set()
        for cursor in scans:
            self._lib.scan_close(handle, cursor)
        self._handle = None
        self._finalizer.detach()
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        rc = self._lib.close(handle, int(bool(remove)), error, _ERROR_BYTES)
        if rc:
            raise _os_error(-rc, os.fsdecode(error.value) or str(self.folder), "removing its files")


def _describe(value) -> str:
    if isinstance(value, Tensor):
        return (f"{value.dtype} of shape {list(value.shape)} on {value.device}"
                f"{'' if value.is_contiguous() else ', not contiguous'}")
    return type(value).__name__
