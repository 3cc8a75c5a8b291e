"""A row store engine on RocksDB (through rocksdict): ``RocksRows``.

Owns one RocksDB database in the engine's folder, tuned as FBGEMM's SSD
embedding cache tunes it for rows: keys are the ids as 8 bytes big-endian,
values the records' bytes as they are (raw mode: no pickling); universal
compaction, no compression; no write-ahead log (a shard's durability is its
checkpoint: records put since the last ``flush`` may be lost with the
process); direct I/O for reads and for flushes and compactions, so the page
cache holds none of it; a Bloom filter of 10 bits a key in every file, so an
id never put costs no read (FBGEMM drops the last level's filters since its
reads always hit; a shard asks for ids it never evicted).  Puts and deletes
go in one ``WriteBatch`` a call; ``get`` is RocksDB's batched multi-get,
which rocksdict runs without the GIL, split over a pool of threads.

``stats()["rows"]`` is exact by default: RocksDB only estimates its keys (a
replaced or deleted record counts until compaction merges it), so a put or a
delete first asks which of its ids are held: the Bloom filters and memtables
answer for ids never put, every other id costs a read, which is as dear as a
``get`` of it (a step's evictions are ids held: it about doubles a step's
time); opening a folder with records counts them once.  ``exact_rows=False``
skips that and gives RocksDB's estimate.

Memory: at most ``MEMTABLE_BYTES`` x ``MEMTABLES`` of memtables (32 MiB) and a
``BLOCK_CACHE_BYTES`` block cache (8 MiB), bounded whatever the rows; beside
them the files' indexes and filters, about 1.3 bytes a row held plus 16 a
4 KiB block (about 2 bytes a row of 36-byte records).  ``memory_bytes()``
reads RocksDB's own figures for the three.

RocksDB's I/O failures (a full disk, a folder not writable) are raised as an
``OSError`` with its errno and the folder; after a failed write in the
background (a flush, a compaction) every later write raises it again, and
reads are still answered.  ``close(remove=True)`` removes the folder even so.

Owns nothing of what a record means, nor which ids a shard keeps in memory.
"""

import errno
import logging
import os
import pathlib
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

import rocksdict

from .engine import ENGINE_STATS

logger = logging.getLogger(__name__)

#: Each memtable's size, and how many may be held (one filling, one being written out).
MEMTABLE_BYTES = 16 << 20
MEMTABLES = 2
#: RocksDB's cache of data blocks read (direct reads bypass the page cache: this is the only one).
BLOCK_CACHE_BYTES = 8 << 20
#: Bits a key of the files' Bloom filters (about 1% false positives, as FBGEMM).
BLOOM_BITS_PER_KEY = 10
#: Universal compaction as FBGEMM's defaults: merge runs within 10% of each other's size, at least 2 at a
#: time, once 8 files wait; slow writes at 32 files, stop them at 64.  The folder is kept within 3x the
#: live records (FBGEMM allows 5x: a shard's disk is shared with its checkpoints).
SIZE_RATIO, MIN_MERGE_WIDTH, COMPACTION_TRIGGER = 10, 2, 8
SLOWDOWN_FILES, STOP_FILES = 32, 64
MAX_SIZE_AMPLIFICATION_PERCENT = 200
#: Background flushes and compactions at once.
BACKGROUND_JOBS = 2
#: A ``get`` of fewer ids than this a thread stays in one multi-get.
MIN_IDS_PER_READ_THREAD = 32
#: Read-ahead of ``scan``'s iterator (its reads are sequential; direct reads get none otherwise).
SCAN_READAHEAD_BYTES = 2 << 20

KEY_BYTES = 8
_COMPACTIONS = re.compile(r"rocksdb\.compaction\.times\.micros .*?COUNT : (\d+)")


class RocksRows:
    """Records of ``record_bytes`` bytes keyed by int64 ids, in a RocksDB database in ``folder``
    (``engine.RowStoreEngine``).  An existing database in ``folder`` is opened with its records.
    ``exact_rows=False``: ``stats()["rows"]`` is RocksDB's estimate, and puts and deletes read nothing."""

    def __init__(self, folder, record_bytes: int, *, direct_io: bool = True, read_threads: int = 8,
                 exact_rows: bool = True):
        if isinstance(record_bytes, bool) or not isinstance(record_bytes, int) or record_bytes <= 0:
            raise ValueError(f"record_bytes must be a positive int, not {record_bytes!r}")
        if isinstance(read_threads, bool) or not isinstance(read_threads, int) or read_threads <= 0:
            raise ValueError(f"read_threads must be a positive int, not {read_threads!r}")
        self.folder = pathlib.Path(folder)
        self.record_bytes = record_bytes
        self.read_threads = read_threads
        self.exact_rows = bool(exact_rows)
        self.folder.mkdir(parents=True, exist_ok=True)
        if not os.access(self.folder, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "the row store's folder is not writable", str(self.folder))
        self._options = _options(direct_io)
        try:
            self._db = rocksdict.Rdict(str(self.folder), self._options)
        except Exception as error:  # rocksdict raises a plain Exception with RocksDB's status
            if not direct_io or "Invalid argument" not in str(error):
                raise _os_error(self.folder, "open", error) from error
            # A file system without O_DIRECT (tmpfs): buffered I/O, as FBGEMM falls back.
            logger.warning("row store %s: no direct I/O on its file system, buffered I/O instead", self.folder)
            direct_io = False
            self._options = _options(direct_io)
            try:
                self._db = rocksdict.Rdict(str(self.folder), self._options)
            except Exception as error2:
                raise _os_error(self.folder, "open", error2) from error2
        self.direct_io = direct_io
        self._write_options = rocksdict.WriteOptions()
        self._write_options.disable_wal = True
        self._db.set_write_options(self._write_options)
        scan_options = rocksdict.ReadOptions()
        scan_options.set_readahead_size(SCAN_READAHEAD_BYTES)
        scan_options.fill_cache(False)
        self._scan_options = scan_options
        self._pool: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._counts = dict.fromkeys(("rows", "reads", "read_bytes", "writes", "written_bytes"), 0)
        self._closed = False
        if self.exact_rows:
            self._counts["rows"] = sum(1 for _ in self._db.keys())  # records of an earlier opening

    # The contract.

    def put(self, ids: Tensor, records: Tensor) -> None:
        keys = self._keys(ids, "put")
        _check_records(records, ids.numel(), self.record_bytes, "records")
        if len(set(keys)) != len(keys):
            raise ValueError("put's ids must be distinct")
        values = records.numpy().tobytes()
        size = self.record_bytes
        batch = rocksdict.WriteBatch(raw_mode=True)
        for row, key in enumerate(keys):
            batch.put(key, values[row * size:(row + 1) * size])
        with self._write_lock:
            replaced = self._held(keys)
            self._write(batch, "put")
            self._count(rows=len(keys) - replaced, writes=len(keys), written_bytes=len(values))

    def get(self, ids: Tensor, out: Tensor) -> Tensor:
        keys = self._keys(ids, "get")
        _check_records(out, ids.numel(), self.record_bytes, "out")
        values = self._multi_get(keys)
        found = np.fromiter((value is not None for value in values), dtype=np.bool_, count=len(values))
        held = [value for value in values if value is not None]
        if held:
            data = self._joined(held)
            out.numpy()[found] = np.frombuffer(data, dtype=np.uint8).reshape(len(held), self.record_bytes)
            self._count(reads=len(held), read_bytes=len(data))
        return torch.from_numpy(found)

    def delete(self, ids: Tensor) -> None:
        keys = self._keys(ids, "delete")
        batch = rocksdict.WriteBatch(raw_mode=True)
        for key in keys:
            batch.delete(key)
        with self._write_lock:
            held = self._held(keys)
            self._write(batch, "delete")
            self._count(rows=-held)

    def scan(self, batch: int) -> Iterator[Tuple[Tensor, Tensor]]:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ValueError(f"scan's batch must be a positive int, not {batch!r}")
        db = self._open()
        return self._scan(db, batch)

    def flush(self) -> None:
        try:
            self._open().flush(True)
        except Exception as error:
            raise _os_error(self.folder, "flush", error) from error

    def stats(self) -> Dict[str, int]:
        db = self._open()
        with self._lock:
            figures = dict(self._counts)
        if not self.exact_rows:
            figures["rows"] = max(0, db.property_int_value("rocksdb.estimate-num-keys") or 0)
        figures["disk_bytes"] = _folder_bytes(self.folder)
        found = _COMPACTIONS.search(self._options.get_statistics() or "")
        figures["compactions"] = int(found.group(1)) if found else 0
        return {name: figures[name] for name in ENGINE_STATS}

    def close(self, remove: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        try:
            self._db.close()  # (flushes the memtables first)
        except Exception as error:
            if not remove:
                raise _os_error(self.folder, "close", error) from error
            # Removing: the records unwritten (a full disk) are not wanted.
            logger.warning("row store %s: closing before its removal failed (%s); removing it", self.folder, error)
        if remove:
            shutil.rmtree(self.folder)

    # Beyond the contract.

    def memory_bytes(self) -> Dict[str, int]:
        """RocksDB's own figures of its memory: memtables, the files' indexes and filters, the block cache."""
        db = self._open()
        return {name: db.property_int_value(f"rocksdb.{prop}") or 0 for name, prop in (
            ("memtables", "cur-size-all-mem-tables"), ("indexes_and_filters", "estimate-table-readers-mem"),
            ("block_cache", "block-cache-usage"))}

    def __repr__(self) -> str:
        return f"RocksRows({str(self.folder)!r}, {self.record_bytes}, direct_io={self.direct_io})"

    # Inside.

    def _open(self) -> "rocksdict.Rdict":
        if self._closed:
            raise ValueError(f"the row store in {self.folder} is closed")
        return self._db

    def _keys(self, ids: Tensor, call: str) -> List[bytes]:
        if not isinstance(ids, Tensor) or ids.dtype != torch.int64 or ids.dim() != 1 or ids.device.type != "cpu":
            raise ValueError(f"{call}'s ids must be a 1-d int64 CPU tensor, not {_describe(ids)}")
        self._open()
        packed = ids.numpy().astype(">i8").tobytes()
        return [packed[start:start + KEY_BYTES] for start in range(0, len(packed), KEY_BYTES)]

    def _multi_get(self, keys: List[bytes]) -> list:
        db = self._db
        parts = min(self.read_threads, len(keys) // MIN_IDS_PER_READ_THREAD)
        try:
            if parts <= 1:
                return db.get(keys)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="row-store-read")
            step = -(-len(keys) // parts)
            values = []
            for part in self._pool.map(db.get, [keys[start:start + step] for start in range(0, len(keys), step)]):
                values.extend(part)
            return values
        except Exception as error:
            raise _os_error(self.folder, "get", error) from error

    def _held(self, keys: List[bytes]) -> int:
        """How many of ``keys`` are held: RocksDB's count is only an estimate (a replaced or deleted record
        counts until compaction merges it), so each put and delete asks; the Bloom filters answer for ids
        never put without a read.  None with ``exact_rows=False``."""
        if not self.exact_rows:
            return 0
        maybe = [key for key in keys if self._db.key_may_exist(key)]
        return sum(value is not None for value in self._multi_get(maybe)) if maybe else 0

    def _write(self, batch: "rocksdict.WriteBatch", call: str) -> None:
        try:
            self._db.write(batch)
        except Exception as error:
            raise _os_error(self.folder, call, error) from error

    def _scan(self, db: "rocksdict.Rdict", batch: int) -> Iterator[Tuple[Tensor, Tensor]]:
        keys: List[bytes] = []
        values: List[bytes] = []
        try:
            for key, value in db.items(read_opt=self._scan_options):
                keys.append(key)
                values.append(value)
                if len(keys) == batch:
                    yield self._batch(keys, values)
                    keys, values = [], []
        except Exception as error:
            raise _os_error(self.folder, "scan", error) from error
        if keys:
            yield self._batch(keys, values)

    def _batch(self, keys: List[bytes], values: List[bytes]) -> Tuple[Tensor, Tensor]:
        ids = torch.from_numpy(np.frombuffer(b"".join(keys), dtype=">i8").astype(np.int64))
        data = bytearray(self._joined(values))
        return ids, torch.frombuffer(data, dtype=torch.uint8).view(len(values), self.record_bytes)

    def _joined(self, values: List[bytes]) -> bytes:
        data = b"".join(values)
        if len(data) != len(values) * self.record_bytes:
            raise OSError(errno.EIO, f"a record in the row store is not of {self.record_bytes} bytes",
                          str(self.folder))
        return data

    def _count(self, **added: int) -> None:
        with self._lock:
            for name, value in added.items():
                self._counts[name] += value


def _options(direct_io: bool) -> "rocksdict.Options":
    options = rocksdict.Options(raw_mode=True)
    options.create_if_missing(True)
    options.set_compression_type(rocksdict.DBCompressionType.none())
    options.set_compaction_style(rocksdict.DBCompactionStyle.universal())
    universal = rocksdict.UniversalCompactOptions()
    universal.size_ratio = SIZE_RATIO
    universal.min_merge_width = MIN_MERGE_WIDTH
    universal.max_size_amplification_percent = MAX_SIZE_AMPLIFICATION_PERCENT
    options.set_universal_compaction_options(universal)
    options.set_level_zero_file_num_compaction_trigger(COMPACTION_TRIGGER)
    options.set_level_zero_slowdown_writes_trigger(SLOWDOWN_FILES)
    options.set_level_zero_stop_writes_trigger(STOP_FILES)
    options.set_write_buffer_size(MEMTABLE_BYTES)
    options.set_max_write_buffer_number(MEMTABLES)
    options.set_max_background_jobs(BACKGROUND_JOBS)
    options.set_max_open_files(-1)
    options.set_use_direct_reads(direct_io)
    options.set_use_direct_io_for_flush_and_compaction(direct_io)
    options.set_keep_log_file_num(2)
    options.enable_statistics()
    table = rocksdict.BlockBasedOptions()
    table.set_block_cache(rocksdict.Cache(BLOCK_CACHE_BYTES))
    table.set_bloom_filter(BLOOM_BITS_PER_KEY, False)
    table.set_data_block_index_type(rocksdict.DataBlockIndexType.binary_and_hash())
    table.set_data_block_hash_ratio(0.75)
    table.set_format_version(5)
    options.set_block_based_table_factory(table)
    return options


def _check_records(records, rows: int, record_bytes: int, name: str) -> None:
    if (not isinstance(records, Tensor) or records.dtype != torch.uint8 or records.dim() != 2
            or records.device.type != "cpu" or not records.is_contiguous()):
        raise ValueError(f"{name} must be a contiguous uint8 CPU tensor [n, {record_bytes}], not {_describe(records)}")
    if tuple(records.shape) != (rows, record_bytes):
        raise ValueError(f"{name} must have the shape [{rows}, {record_bytes}] (one record a row of ids), "
                         f"not {list(records.shape)}")


def _describe(value) -> str:
    if isinstance(value, Tensor):
        layout = "" if value.is_contiguous() else " not contiguous"
        return f"a {value.dtype} tensor of shape {list(value.shape)} on {value.device}{layout}"
    return f"a {type(value).__name__}"


def _folder_bytes(folder: pathlib.Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # a file compaction removed meanwhile
                pass
    return total


def _os_error(folder: pathlib.Path, call: str, error: Exception) -> Exception:
    """RocksDB's I/O failures (rocksdict raises them as a plain Exception) as an OSError naming the folder;
    anything else as it was."""
    message = str(error)
    if isinstance(error, OSError) or not message.startswith("IO error"):
        return error
    code = errno.ENOSPC if "No space left" in message else errno.EACCES if "ermission denied" in message \
        else errno.EIO
    return OSError(code, f"the row store's {call} failed: {message}", str(folder))
