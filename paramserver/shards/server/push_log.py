"""The push log: every push a shard process applied since its checkpoint part, in the order applied, on disk.

Owns one shard's log files (``PushLog``): their record format, appending
records in batches, cutting the log when a checkpoint commits, and reading
it back after a crash (``PushLog(folder, base)`` checks every record; ``plan`` says
which records bring an optimizer's rows from a checkpoint to where the
killed process left them).  What the records mean to an optimizer (applying
them again) is ``replay``'s business; nothing here knows of optimizers,
tables or RPC.

A log is a folder of segment files, ``segment-<n>.log``, written in turn.
Each record is a 20-byte header (``PSLG``, its kind, its payload's length
and its 64-bit XXH3 checksum) and its payload:

* ``BASE``: where the log begins, the checkpoint the process started from
  (``""``: its tables' initial values);
* ``MARK``: optimizer ``tag``'s rows and state are those of checkpoint
  ``name`` here (written under its locks while its part is copied);
* ``PUSH``: one push applied by optimizer ``tag`` (pusher, step, and per
  parameter its index, rows, width and gradients' type; then every
  parameter's ids and every parameter's gradients, as they came);
* ``LOOKUP``: ids looked up at a step in a dynamic table's part ``tag``
  (its admissions, touches and evictions happen then);
* ``GAP``: optimizer ``tag`` changed in a way the log does not hold (a
  ``dist_autograd`` step, a state loaded): no replay crosses it.

Appends are taken under the caller's locks (so the log's order is the order
applied, per table) into a buffer, holding the tensors as they came; ``flush``
checksums their bytes and writes them in one ``writev``, no copy, outside
those locks, before the request that made them is answered: a process killed
after answering has its records in the kernel's page cache, which survives
it.  Nothing is synced to the device: a host that loses power or its disk
loses the log's tail, and a restart rolls back to the checkpoint there (the
trainers count those steps).  A record cut by the crash at the log's end is
dropped (the request it belonged to was never answered); a damaged record
before the end makes the whole log unusable (``fallback``), since replaying
around a hole would make rows no process ever held.
"""

import hashlib
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import xxhash
from torch import Tensor

logger = logging.getLogger(__name__)

MAGIC = b"PSLG"
HEADER = struct.Struct("<4sB3xIQ")  # magic, kind, payload length, payload checksum (XXH3, 64 bits)
BASE, MARK, PUSH, LOOKUP, GAP = 1, 2, 3, 4, 5
KINDS = {BASE: "base", MARK: "mark", PUSH: "push", LOOKUP: "lookup", GAP: "gap"}
_PUSH = struct.Struct("<QqqII")  # optimizer tag, pusher, step, parameters, gradients' type; then per parameter
#: its index, then its rows, then its width (three arrays of 32-bit numbers), its ids, its gradients
_LOOKUP = struct.Struct("<QqI")  # table tag, step, ids
_TAG = struct.Struct("<Q")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: ``writev`` takes at most this many buffers at once (Linux's IOV_MAX).
_IOV_MAX = 1024
_SEGMENT = "segment-{:08d}.log"


def tag_of(text: str) -> int:
    """A 64-bit name for ``text`` (an optimizer's or a table part's identity), the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def checkpoint_key(path: str) -> str:
    """How the log names a checkpoint: the last part of its directory's path or URL."""
    return PurePosixPath(str(path).rstrip("/")).name


class CorruptLog(ValueError):
    """A record before the log's end is damaged: the log cannot be replayed (its file and offset named)."""


def _bytes(tensor: Tensor) -> memoryview:
    """The bytes of ``tensor`` (made contiguous), without a copy."""
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def end_to_end(tensors: Sequence[Tensor]) -> List[Tensor]:
    """``tensors`` (contiguous, one type) as one tensor when they lie end to end in memory (the pieces a message
    was unpacked into), else as they are: the same bytes either way, for ``append_push``."""
    if len(tensors) < 2 or any(not tensor.is_contiguous() or tensor.dtype != tensors[0].dtype for tensor in tensors):
        return list(tensors)
    size = tensors[0].element_size()
    for before, after in zip(tensors, tensors[1:]):
        if after.data_ptr() != before.data_ptr() + before.numel() * size:
            return list(tensors)
    first = tensors[0]
    return [first.reshape(-1).as_strided((sum(tensor.numel() for tensor in tensors),), (1,))]


@dataclass(frozen=True)
class Entry:
    """Where one record of a log lies, and what an index needs of it without reading its payload."""

    segment: int
    offset: int
    kind: int
    length: int
    tag: int = 0
    name: str = ""  # a BASE's or MARK's checkpoint


@dataclass
class Push:
    """A ``PUSH`` record read back: what ``OwnerOptimizer.apply_rows`` takes again."""

    tag: int
    pusher: int
    step: int
    params: List[int]
    ids: List[Tensor]
    gradients: List[Tensor]


@dataclass
class Lookup:
    """A ``LOOKUP`` record read back."""

    tag: int
    step: int
    ids: Tensor


@dataclass
class LogFigures:
    """What a log has done, for metrics and status: records appended, their bytes, the log's size on disk, its
    writes and their seconds, the records replayed from it."""

    appends: int = 0
    appended_bytes: int = 0
    size_bytes: int = 0
    flushes: int = 0
    flush_seconds: float = 0.0
    replayed: int = 0

    def as_dict(self) -> Dict[str, float]:
        return {key: float(value) for key, value in vars(self).items()}


class PushLog:
    """One shard's push log in ``directory``, read back from what a killed process left there and appended to."""

    def __init__(self, directory: Path, base: str):
        """The log in ``directory`` (made if missing), its records checked and a cut last record dropped; a log
        with a damaged record before its end is set aside (``fallback`` says why) and a new one begins, as does
        a missing one, at ``base`` (the checkpoint the process restores, ``""`` for none)."""
        self.directory = Path(directory)
        #: Why the log found there could not be used (a damaged record), or ``None``.
        self.fallback: Optional[str] = None
        #: Why this process stopped logging (a write failed, a replay failed), or ``None``.
        self.broken: Optional[str] = None
        #: The records found at ``open``, checked, in order (what ``plan`` reads; a new log's beginning).
        self.found: List[Entry] = []
        self.figures = LogFigures()
        self._buffer_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._pending: List[Tuple[int, List]] = []  # (kind, its payload: bytes or tensors, in order)
        self._segments: List[int] = []
        self._fd = -1
        self._mark_segments: Dict[str, int] = {}  # checkpoint -> the first segment with a mark of it
        self.directory.mkdir(parents=True, exist_ok=True)
        segments = sorted(int(path.stem.split("-")[1]) for path in self.directory.glob("segment-*.log"))
        try:
            self.found = self._scan(segments)
        except CorruptLog as error:
            self.fallback = str(error)
            for number in segments:
                os.replace(self._path(number), self.directory / f"damaged-{_SEGMENT.format(number)}")
            segments, self.found = [], []
        self._segments = segments
        for entry in self.found:
            if entry.kind == MARK:
                self._mark_segments.setdefault(entry.name, entry.segment)
        if segments:
            self._open_segment(segments[-1])
        else:
            self._open_segment(0)
            self._append(BASE, [memoryview(base.encode())])
            self.flush()
            self.found = [Entry(0, 0, BASE, len(base.encode()), name=base)]
        self.figures.size_bytes = sum(self._path(number).stat().st_size for number in self._segments)

    def _path(self, number: int) -> Path:
        return self.directory / _SEGMENT.format(number)

    def _scan(self, segments: Sequence[int]) -> List[Entry]:
        """Every whole record of ``segments``, checked; the last segment cut after its last whole record."""
        entries: List[Entry] = []
        for position, number in enumerate(segments):
            path = self._path(number)
            data = path.read_bytes()
            offset = 0
            while offset < len(data):
                problem = None
                if len(data) - offset < HEADER.size:
                    problem = "a header cut short"
                else:
                    magic, kind, length, checksum = HEADER.unpack_from(data, offset)
                    start, stop = offset + HEADER.size, offset + HEADER.size + length
                    if magic != MAGIC or kind not in KINDS:
                        problem = "no record header"
                    elif stop > len(data):
                        problem = "a record cut short"
                    elif xxhash.xxh3_64_intdigest(memoryview(data)[start:stop]) != checksum:
                        problem = "a record whose checksum does not match"
                if problem is not None:
                    last = position == len(segments) - 1
                    if last and (problem.endswith("cut short") or self._nothing_whole_after(data, offset)):
                        logger.warning("push log %s: %s at its end (offset %d) dropped: the request it belonged "
                                       "to was never answered", path, problem, offset)
                        os.truncate(path, offset)
                        break
                    raise CorruptLog(f"{path} holds {problem} at offset {offset}, before its end")
                entries.append(_entry(number, offset, kind, data, start, length))
                offset = stop
        return entries

    @staticmethod
    def _nothing_whole_after(data: bytes, offset: int) -> bool:
        """Whether no whole record begins after the damaged one at ``offset`` (its tail was being written)."""
        found = data.find(MAGIC, offset + 1)
        while found >= 0:
            if len(data) - found >= HEADER.size:
                _, kind, length, checksum = HEADER.unpack_from(data, found)
                stop = found + HEADER.size + length
                if kind in KINDS and stop <= len(data) and \
                        xxhash.xxh3_64_intdigest(memoryview(data)[found + HEADER.size:stop]) == checksum:
                    return False
            found = data.find(MAGIC, found + 1)
        return True

    def _open_segment(self, number: int) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = os.open(self._path(number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if number not in self._segments:
            self._segments.append(number)

    # -- appending (under the caller's locks), writing ---------------------------
    def append_push(self, tag: int, pusher: int, step: int, params: Sequence[int], counts: Sequence[int],
                    widths: Sequence[int], ids: Sequence[Tensor], gradients: Sequence[Tensor]) -> None:
        """Optimizer ``tag`` applied a push (``OwnerOptimizer.apply_rows``'s): parameter ``params[i]``'s
        ``counts[i]`` rows of width ``widths[i]``; ``ids`` and ``gradients`` are their ids (int64) and gradients
        (one type) end to end, in one or more pieces (a message's own buffers, as they came: their bytes are
        taken as the log is written, outside the caller's locks)."""
        count = len(params)
        head = _PUSH.pack(tag, pusher, step, count, _DTYPES.index(gradients[0].dtype) if gradients else 0) + \
            struct.pack(f"<{3 * count}I", *params, *counts, *widths)
        self._append(PUSH, [memoryview(head), *ids, *gradients])

    def append_lookup(self, tag: int, ids: Tensor, step: int) -> None:
        """Dynamic table part ``tag`` admitted and touched ``ids`` at ``step``."""
        self._append(LOOKUP, [memoryview(_LOOKUP.pack(tag, step, ids.numel())), ids.to(torch.int64)])

    def append_mark(self, tag: int, checkpoint: str) -> None:
        """Optimizer ``tag``'s rows and state are those copied into checkpoint ``checkpoint`` (under its locks)."""
        self._append(MARK, [memoryview(_TAG.pack(tag)), memoryview(checkpoint.encode())])
        with self._buffer_lock:
            if self._segments:
                self._mark_segments.setdefault(checkpoint, self._segments[-1])

    def append_gap(self, tag: int) -> None:
        """Optimizer ``tag`` changed outside the log: no replay from before here reaches past it."""
        self._append(GAP, [memoryview(_TAG.pack(tag))])

    def _append(self, kind: int, pieces: List) -> None:
        if self.broken is not None:
            return
        with self._buffer_lock:
            self._pending.append((kind, pieces))

    def _stop_locked(self, reason: str) -> None:
        """The log cannot be written (``reason``): it is set aside and nothing more is logged, so a restart of this
        shard restores its checkpoint alone, rather than replaying a log with a hole (the caller holds the write
        lock)."""
        self.broken = reason
        logger.error("push log %s: %s; it is set aside and no more is logged: a restart of this shard rolls back to "
                     "its checkpoint", self.directory, reason)
        with self._buffer_lock:
            self._pending = []
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        for number in self._segments:
            os.replace(self._path(number), self.directory / f"damaged-{_SEGMENT.format(number)}")
        self._segments = []

    def flush(self) -> None:
        """Write every record appended so far, in order, in as few ``writev`` calls as it takes (a request's
        records reach the file before it is answered; several threads' records go in one write)."""
        with self._write_lock:
            with self._buffer_lock:
                pending, self._pending = self._pending, []
            if not pending:
                return
            started = time.perf_counter()
            buffers: List[memoryview] = []
            written = 0
            for kind, pieces in pending:
                views = [piece if isinstance(piece, memoryview) else _bytes(piece) for piece in pieces]
                checksum, length = xxhash.xxh3_64(), 0
                for view in views:
                    checksum.update(view)
                    length += view.nbytes
                buffers.append(memoryview(HEADER.pack(MAGIC, kind, length, checksum.intdigest())))
                buffers.extend(views)
                written += HEADER.size + length
            try:
                _write_all(self._fd, buffers)
            except OSError as error:  # a full disk, a lost device: what is logged from here would have holes
                self._stop_locked(f"writing {self._path(self._segments[-1])} failed: {error}")
                return
            figures = self.figures
            figures.appends += len(pending)
            figures.appended_bytes += written
            figures.size_bytes += written
            figures.flushes += 1
            figures.flush_seconds += time.perf_counter() - started

    # -- cutting ----------------------------------------------------------------
    def rotate(self) -> None:
        """Begin a new segment (before a checkpoint's marks: the segments before it can go when it commits)."""
        self.flush()
        with self._write_lock:
            if self.broken is None:
                self._open_segment(self._segments[-1] + 1)

    def committed(self, checkpoint: str) -> int:
        """Checkpoint ``checkpoint`` committed: the segments before the one holding its first mark are deleted
        (the log then holds one checkpoint interval).  Returns how many were."""
        with self._write_lock:
            first = self._mark_segments.get(checkpoint)
            if first is None:
                return 0
            gone = [number for number in self._segments if number < first]
            for number in gone:
                size = self._path(number).stat().st_size
                self._path(number).unlink()
                self.figures.size_bytes -= size
            self._segments = [number for number in self._segments if number >= first]
            self._mark_segments = {name: max(segment, first) for name, segment in self._mark_segments.items()}
            self.found = [entry for entry in self.found if entry.segment >= first]
        if gone:
            logger.info("push log %s cut at checkpoint %s: %d segment%s deleted, %.1f MB kept", self.directory,
                        checkpoint, len(gone), "s" if len(gone) != 1 else "", self.figures.size_bytes / 1e6)
        return len(gone)

    # -- reading back -------------------------------------------------------------
    def plan(self, checkpoint: str, tags: Set[int]) -> Optional[List[Entry]]:
        """The records found that bring everything ``tags`` name (an optimizer and its dynamic tables' parts) from
        checkpoint ``checkpoint`` (``""``: the initial values) to where the log ends, in order; ``None`` when the
        log holds no point where they were at that checkpoint (it was cut later, or began elsewhere), or a gap
        follows the last such point."""
        anchored = False
        records: List[Entry] = []
        for entry in self.found:
            if entry.kind == BASE:
                anchored, records = entry.name == checkpoint, []
            elif entry.tag not in tags:
                continue
            elif entry.kind == MARK and entry.name == checkpoint:
                anchored, records = True, []
            elif entry.kind == GAP:
                anchored, records = False, []
            elif entry.kind in (PUSH, LOOKUP) and anchored:
                records.append(entry)
        return records if anchored else None

    def read(self, entry: Entry) -> object:
        """The ``Push`` or ``Lookup`` at ``entry``."""
        return next(self.records([entry]))

    def records(self, entries: Sequence[Entry]) -> Iterator[object]:
        """The ``Push`` or ``Lookup`` at each of ``entries`` in turn, each segment opened once."""
        file, segment = None, -1
        try:
            for entry in entries:
                if entry.segment != segment:
                    if file is not None:
                        file.close()
                    file, segment = open(self._path(entry.segment), "rb"), entry.segment
                file.seek(entry.offset + HEADER.size)
                yield _record(entry.kind, bytearray(file.read(entry.length)))
        finally:
            if file is not None:
                file.close()


    def set_aside(self, reason: str) -> None:
        """Rename every segment ``damaged-segment-*`` and log no more (``reason``: a replay of it failed), so the
        process that restarts next begins a new log at its checkpoint."""
        with self._write_lock:
            self._stop_locked(reason)

    def close(self) -> None:
        self.flush()
        with self._write_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def _record(kind: int, payload: bytearray) -> object:
    """The ``Push`` or ``Lookup`` a record of ``kind`` holds (its payload read back; its tensors are views of it)."""
    if kind == LOOKUP:
        tag, step, count = _LOOKUP.unpack_from(payload, 0)
        return Lookup(tag, step, torch.frombuffer(payload, dtype=torch.int64, count=count, offset=_LOOKUP.size))
    tag, pusher, step, count, dtype = _PUSH.unpack_from(payload, 0)
    dtype, offset = _DTYPES[dtype], _PUSH.size
    numbers = struct.unpack_from(f"<{3 * count}I", payload, offset)
    params, counts, widths = list(numbers[:count]), numbers[count:2 * count], numbers[2 * count:]
    offset += 12 * count
    ids, gradients = [], []
    for rows in counts:  # every parameter's ids, then every parameter's gradients
        ids.append(torch.frombuffer(payload, dtype=torch.int64, count=rows, offset=offset) if rows else
                   torch.empty(0, dtype=torch.int64))
        offset += 8 * rows
    size = torch.empty(0, dtype=dtype).element_size()
    for rows, width in zip(counts, widths):
        values = rows * width
        gradients.append(torch.frombuffer(payload, dtype=dtype, count=values, offset=offset).view(rows, width)
                         if values else torch.empty(rows, width, dtype=dtype))
        offset += values * size
    return Push(tag, pusher, step, params, ids, gradients)


def _entry(segment: int, offset: int, kind: int, data: bytes, start: int, length: int) -> Entry:
    if kind == BASE:
        return Entry(segment, offset, kind, length, name=data[start:start + length].decode())
    if kind == MARK:
        (tag,) = _TAG.unpack_from(data, start)
        return Entry(segment, offset, kind, length, tag, data[start + _TAG.size:start + length].decode())
    if kind == LOOKUP:
        return Entry(segment, offset, kind, length, _LOOKUP.unpack_from(data, start)[0])
    return Entry(segment, offset, kind, length, _TAG.unpack_from(data, start)[0])


def _write_all(fd: int, buffers: List[memoryview]) -> None:
    """``writev`` until every byte of ``buffers`` is written (a write may take fewer)."""
    first = 0
    while first < len(buffers):
        written = os.writev(fd, buffers[first:first + _IOV_MAX])
        while first < len(buffers) and written >= buffers[first].nbytes:
            written -= buffers[first].nbytes
            first += 1
        if written:
            buffers[first] = buffers[first][written:]
