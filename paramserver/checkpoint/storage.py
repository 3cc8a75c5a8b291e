"""Sharded checkpoints committed by their manifest: the files, the manifest, and finding the newest whole one.

Owns the storage side of checkpoints, for every role that writes or reads
one (shards, trainers, the coordinator), on any filesystem a path or URL
names (``paramserver.filesystems``: a local path, ``file://``, ``s3://``,
``gs://``...): writing a file whole or not at all (locally: to a temporary
name in the same directory, counted and hashed on the way, flushed,
fsynced, renamed, the directory fsynced; on an object store, where there
is no rename: one object, counted and hashed on the way, uploaded in parts
while it is written (``object_upload``), abandoned on failure), loading it
after checking its size and sha256 (a local file memory-mapped if asked; a
remote one read into memory once, checked and loaded from there), the
manifest (``MANIFEST.json``, written last: it is the commit, and a
checkpoint directory without one is an interrupted checkpoint that never
counts and is removed), removing a directory (``remove_tree``: on an object
store, the objects under its prefix), keeping the newest ``keep`` checkpoints (never one
the store was told to protect: what a restore reads), and refusing a
corrupt or truncated one with a message naming the file, in favour of the
previous one. A remote filesystem's failure (unreachable, credentials
refused) is a ``StorageUnavailable`` naming the URL. Also the pure tensor
logic of resharding: naming row ranges (``table[start:stop]``) and cutting
any row range out of the ranges a checkpoint holds.

It knows nothing of processes, ``torch.distributed`` or gRPC, nor of who
wrote what: ``shard_part`` and ``dense_part`` beside it say what goes in
the files.
"""

import contextlib
import copy
import hashlib
import io
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import BinaryIO, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

import torch
from torch import Tensor

from ..filesystems import Location, PathOrUrl, StorageUnavailable, failures_named, locate  # noqa: F401 - re-exported
from ..logs import one_line
from .object_upload import open_for_upload

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
CHECKPOINT_PREFIX = "ckpt-"
FORMAT = 1
_HASH_CHUNK = 1 << 20
#: A local path, a URL, or a ``Location`` (a URL with its storage options).
PathLike = PathOrUrl
T = TypeVar("T")



@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as its writer measured it."""

    name: str
    bytes: int
    sha256: str

    def to_json(self) -> Dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Dict) -> "FileRecord":
        return cls(name=str(data["name"]), bytes=int(data["bytes"]), sha256=str(data["sha256"]))


class CorruptCheckpoint(ValueError):
    """A checkpoint file that is missing, truncated, altered or unreadable; the message names it."""


class _HashingWriter:
    """A write-only, unseekable stream that counts and hashes what goes through it (enough for ``torch.save``)."""

    def __init__(self, file: BinaryIO):
        self._file = file
        self.sha256 = hashlib.sha256()
        self.bytes = 0
        #: The file system's refusal of a write (torch.save's writer reports it as its own RuntimeError).
        self.failure: Optional[BaseException] = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.sha256.update(view)
        self.bytes += len(view)
        try:
            self._file.write(view)
        except Exception as error:  # an OSError, or a remote filesystem client's own error
            self.failure = error
            raise
        return len(view)

    def tell(self) -> int:
        return self.bytes

    def flush(self) -> None:
        self._file.flush()


def _fresh(location: Location) -> Location:
    """``location``, with what its filesystem remembers of listings forgotten (other processes write there)."""
    if not location.is_local:
        location.fs.invalidate_cache()
    return location


def atomic_write(path: PathLike, write: Callable[[BinaryIO], None]) -> FileRecord:
    """Write ``path`` through ``write(file)`` so that it appears whole or not at all; returns its record.

    Locally: written aside, fsynced and renamed; on any error the temporary file is removed and whatever was at
    ``path`` before is left as it was.  On an object store: one object, abandoned (never completed) on error.
    """
    location = locate(path)
    if not location.is_local:
        return _write_object(location, write)
    path = location.path
    directory, name = os.path.split(path)
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name}.tmp-")
    writer = None
    try:
        with os.fdopen(descriptor, "wb") as file:
            writer = _HashingWriter(file)
            write(writer)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        refusal = error if isinstance(error, OSError) else writer.failure if writer is not None else None
        if isinstance(refusal, OSError) and refusal.errno is not None:  # "No space left on device", with the file
            raise OSError(refusal.errno, f"{os.strerror(refusal.errno)}: writing {path}") from error
        raise
    descriptor = os.open(directory, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    return FileRecord(name=name, bytes=writer.bytes, sha256=writer.sha256.hexdigest())


def _write_object(location: Location, write: Callable[[BinaryIO], None]) -> FileRecord:
    """``atomic_write`` on an object store: an object appears when its upload completes, whole; a failed one is
    abandoned (its multipart upload aborted), never completed."""
    with failures_named(location, "write", absent_is_failure=True):  # absent: no such bucket
        file = open_for_upload(location)
        writer = _HashingWriter(file)
        try:
            write(writer)
        except BaseException as error:
            with contextlib.suppress(Exception):
                file.discard()  # nothing of it is completed...
                file.closed = True  # ...nor by a close when the object is collected
            if writer.failure is not None and error is not writer.failure:
                raise writer.failure from error  # torch.save's RuntimeError hides the filesystem's own
            raise
        file.close()
    return FileRecord(name=location.name, bytes=writer.bytes, sha256=writer.sha256.hexdigest())


def save_tensors(path: PathLike, obj) -> FileRecord:
    """``torch.save(obj)`` to ``path``, atomically, every tensor in it on the CPU: a file written by a worker
    training on a GPU loads on a host without one (and its state is copied off the device once, here)."""
    on_cpu = tensors_on_cpu(obj)
    return atomic_write(path, lambda file: torch.save(on_cpu, file))


def tensors_on_cpu(value):
    """``value`` with every tensor in it (through dicts, lists and tuples) on the CPU (``cpu()`` keeps a CPU
    tensor as it is).  A dict is copied with ``copy.copy``, which keeps its type and attributes: a
    ``state_dict``'s ``_metadata`` (versions ``load_state_dict`` reads) goes with it."""
    if isinstance(value, Tensor):
        return value.cpu()
    if isinstance(value, dict):
        moved = copy.copy(value)
        for key, item in value.items():
            moved[key] = tensors_on_cpu(item)
        return moved
    if isinstance(value, list):
        return [tensors_on_cpu(item) for item in value]
    if isinstance(value, tuple):  # a plain tuple, a named tuple, or one holding no tensor (torch.Size) as it is
        items = [tensors_on_cpu(item) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return tuple(items) if type(value) is tuple else type(value)(*items)
    return value


def _check_size(location: Location, size: int, record: FileRecord) -> None:
    if size != record.bytes:
        raise CorruptCheckpoint(f"{location}: size {size} bytes, expected {record.bytes} (truncated or replaced)")


def _check_sha256(location: Location, digest: "hashlib._Hash", record: FileRecord) -> None:
    if digest.hexdigest() != record.sha256:
        raise CorruptCheckpoint(f"{location}: sha256 mismatch: {digest.hexdigest()[:16]}..., expected "
                                f"{record.sha256[:16]}... (the file was altered)")


def verify_file(path: PathLike, record: FileRecord, check_sha256: bool = True) -> None:
    """``CorruptCheckpoint`` unless ``path`` has the recorded size (and sha256)."""
    location = locate(path)
    with failures_named(location, "read"):
        try:
            size = os.stat(location.path).st_size if location.is_local else int(location.fs.info(location.path)["size"])
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{location}: missing") from None
        _check_size(location, size, record)
        if not check_sha256:
            return
        digest = hashlib.sha256()
        with location.open("rb") as file:
            for chunk in iter(lambda: file.read(_HASH_CHUNK), b""):
                digest.update(chunk)
    _check_sha256(location, digest, record)


def load_tensors(path: PathLike, record: Optional[FileRecord] = None, mmap: bool = False):
    """What ``save_tensors`` wrote (tensors and plain data only), checked against ``record`` first.

    ``mmap``: a local file is memory-mapped; a remote one is read into memory once (checked there, then loaded).
    """
    location = locate(path)
    if location.is_local:
        if record is not None:
            verify_file(location, record)
        source = location.path
    else:
        with failures_named(location, "read"):
            try:
                data = location.fs.cat_file(location.path)
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{location}: missing") from None
        if record is not None:
            _check_size(location, len(data), record)
            _check_sha256(location, hashlib.sha256(data), record)
        source, mmap = io.BytesIO(data), False
    try:
        return torch.load(source, weights_only=True, mmap=mmap, map_location="cpu")  # files of older writers too
    except Exception as error:  # noqa: BLE001 - any unreadable file is a corrupt checkpoint
        raise CorruptCheckpoint(f"{location}: not loadable: {type(error).__name__}: {error}") from error


@dataclass
class Checkpoint:
    """A committed checkpoint: its directory (a ``Location``) and its manifest."""

    path: Location
    manifest: Dict

    @property
    def id(self) -> str:
        return self.path.name

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def files(self) -> List[FileRecord]:
        return [FileRecord.from_json(entry) for entry in self.manifest["files"]]

    def file(self, name: str) -> Location:
        return self.path.join(name)

    def verify(self) -> None:
        """``CorruptCheckpoint`` naming the first file that is missing or differs from the manifest."""
        for record in self.files:
            verify_file(self.file(record.name), record)


def read_manifest(directory: PathLike) -> Checkpoint:
    """The checkpoint in ``directory`` as its manifest says (files not checked).

    ``FileNotFoundError`` when there is no manifest (an interrupted checkpoint),
    ``CorruptCheckpoint`` when it is not JSON or lacks a field.
    """
    directory = locate(directory)
    path = directory.join(MANIFEST)
    try:
        with failures_named(path, "read"):
            text = path.fs.cat_file(path.path)
        checkpoint = Checkpoint(directory, json.loads(text))
        _ = (checkpoint.step, checkpoint.files, float(checkpoint.manifest.get("created_unix", 0.0)))
    except (FileNotFoundError, StorageUnavailable):
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptCheckpoint(f"{path}: not a valid manifest: {type(error).__name__}: {error}") from None
    return checkpoint


def _step_from_name(name: str) -> int:
    match = re.match(rf"{CHECKPOINT_PREFIX}(\d+)", name)
    return int(match.group(1)) if match else -1


def _age(directory: Location, parsed: Union[Checkpoint, CorruptCheckpoint]) -> Tuple[int, float, str]:
    """Orders checkpoints oldest to newest: (step, created_unix, name); an unreadable manifest by its name's step."""
    if isinstance(parsed, Checkpoint):
        return (parsed.step, float(parsed.manifest.get("created_unix", 0.0)), directory.name)
    return (_step_from_name(directory.name), 0.0, directory.name)


def remove_tree(directory: Location, first: Optional[str] = None) -> None:
    """Remove ``directory`` and all in it (a prefix's objects on an object store); ``first``: the name of a file
    in it removed before the rest (a manifest: a reader meanwhile finds the directory uncommitted, never a
    committed one with files missing)."""
    if first is not None:
        with failures_named(directory, "remove"), contextlib.suppress(FileNotFoundError):
            directory.fs.rm_file(directory.join(first).path)
    if directory.is_local:
        shutil.rmtree(directory.path, ignore_errors=True)
        return
    with failures_named(directory, "remove"), contextlib.suppress(FileNotFoundError):
        directory.fs.rm(directory.path, recursive=True)


class CheckpointStore:
    """Checkpoints under ``root`` (a path or URL), one directory each (``ckpt-<step>``); the newest ``keep`` are
    kept, and any the store is told to ``protect``."""

    def __init__(self, root: PathLike, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = locate(root)
        self.keep = keep
        self._protected: set = set()

    def protect(self, checkpoint: Checkpoint) -> None:
        """Never prune ``checkpoint`` (one a restore reads: the checkpoint a cluster started from)."""
        self._protected.add(checkpoint.path)

    def new_directory(self, step: int) -> Location:
        """A new, empty directory for the checkpoint of ``step`` (never one used before)."""
        root = _fresh(self.root)
        base = f"{CHECKPOINT_PREFIX}{step:010d}"
        with failures_named(root, "write a checkpoint"):
            if root.is_local:
                os.makedirs(root.path, exist_ok=True)
            for attempt in range(10_000):
                directory = root.join(base if attempt == 0 else f"{base}-{attempt}")
                if root.is_local:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(directory.path)
                        return directory
                elif not directory.exists():  # an object store has no directories: a prefix nothing is under
                    return directory
        raise FileExistsError(f"no free checkpoint directory name for step {step} under {self.root}")

    def discard(self, directory: PathLike) -> None:
        """Remove the directory of a checkpoint that failed before it was committed (one with a manifest stays)."""
        directory = _fresh(locate(directory))
        with failures_named(directory, "remove a failed checkpoint"):
            if directory.fs.isdir(directory.path) and not directory.join(MANIFEST).exists():
                remove_tree(directory)
                logger.info("removed %s: its checkpoint failed before it was committed", directory)

    def commit(self, directory: PathLike, files: Sequence[FileRecord], step: int, info: Dict) -> Checkpoint:
        """Check the files are there with their sizes, then write the manifest (last: the commit), then prune
        (a pruning that fails is logged: the checkpoint is committed)."""
        directory = _fresh(locate(directory))
        for record in files:
            verify_file(directory.join(record.name), record, check_sha256=False)
        manifest = {"format": FORMAT, "id": directory.name, "step": step, "created_unix": time.time(),
                    "files": [record.to_json() for record in files], "info": info}
        atomic_write(directory.join(MANIFEST), lambda file: file.write(json.dumps(manifest, indent=1).encode()))
        try:
            self.prune()
        except StorageUnavailable as error:
            logger.warning("checkpoint %s committed; older ones not pruned: %s", directory, error)
        return Checkpoint(directory, manifest)

    def _directories(self) -> List[Location]:
        root = _fresh(self.root)
        with failures_named(root, "list checkpoints"):
            try:
                entries = root.fs.ls(root.path, detail=True)
            except (FileNotFoundError, NotADirectoryError):
                return []
        names = [entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in entries if entry["type"] == "directory"]
        return [root.join(name) for name in sorted(names) if name.startswith(CHECKPOINT_PREFIX)]

    def _with_manifest(self) -> List[Tuple[Location, Union[Checkpoint, CorruptCheckpoint]]]:
        """Every directory with a manifest, newest first, with its checkpoint or why the manifest is bad."""
        entries = []
        for directory in self._directories():
            try:
                entries.append((directory, read_manifest(directory)))
            except FileNotFoundError:
                logger.debug("skipping %s: no %s (an interrupted checkpoint)", directory, MANIFEST)
            except CorruptCheckpoint as error:
                entries.append((directory, error))
        return sorted(entries, key=lambda entry: _age(*entry), reverse=True)

    def complete(self) -> List[Checkpoint]:
        """Checkpoints with a readable manifest, newest first (their files not checked)."""
        return [checkpoint for _, checkpoint in self._with_manifest() if isinstance(checkpoint, Checkpoint)]

    def newest_valid(self, log: Callable[[str], None] = logger.warning) -> Optional[Checkpoint]:
        """The newest checkpoint whose files all check out; each one refused is logged, naming the file."""
        for directory, checkpoint in self._with_manifest():
            try:
                if isinstance(checkpoint, CorruptCheckpoint):
                    raise checkpoint
                checkpoint.verify()
                return checkpoint
            except CorruptCheckpoint as error:
                log(f"refusing checkpoint {directory}: {error}; trying the previous one")
        return None

    def _interrupted(self) -> List[Location]:
        return [d for d in self._directories() if not d.join(MANIFEST).exists()]

    def remove_interrupted(self) -> List[Location]:
        """Remove every checkpoint directory without a manifest (checkpoints that failed or were interrupted
        before their commit); returns them.  Only while nothing writes under the root: a cluster starting."""
        interrupted = self._interrupted()
        for directory in interrupted:
            remove_tree(directory)
        return sorted(interrupted, key=lambda d: d.url)

    def prune(self) -> None:
        """Keep the newest ``keep`` complete checkpoints (and the protected ones); delete older ones, and any
        other directory (no manifest, or an unreadable one) older than the newest complete checkpoint."""
        complete = self.complete()
        if not complete:
            return
        complete_paths = {c.path for c in complete}
        doomed = [c.path for c in complete[self.keep:]]
        doomed += [d for d in self._directories()
                   if d not in complete_paths and _step_from_name(d.name) < complete[0].step]
        for directory in doomed:
            if directory in self._protected:
                continue
            remove_tree(directory)
            logger.info("deleted old checkpoint directory %s", directory)


def first_usable(preferred: PathLike, step: int, use: Callable[[Checkpoint], T], who: str) -> Tuple[Checkpoint, T]:
    """``use(checkpoint)`` (which checks what it reads) on the committed checkpoint ``preferred``, of ``step``,
    else on the newest committed one beside it (in its root) that is not newer and on which ``use`` succeeds:
    a member restarted mid-job restores from what it checked, not from a file damaged after its commit.

    Each checkpoint refused is logged once, naming the file, and falling back in one line naming the
    checkpoint used; ``CorruptCheckpoint`` naming ``who`` and every file refused when none will do.
    """
    preferred = locate(preferred)
    older = [c.path for c in CheckpointStore(preferred.parent()).complete() if c.path != preferred and c.step <= step]
    refused = []
    for path in [preferred] + older:
        try:
            checkpoint = read_manifest(path)
            result = use(checkpoint)
        except (CorruptCheckpoint, FileNotFoundError) as error:
            refused.append(one_line(str(error)))
            logger.error("%s: not restoring from %s: %s", who, path, refused[-1])
            continue
        if refused:
            logger.warning("%s falls back to checkpoint %s (step %d): the one it was told, of step %d, does not "
                           "verify", who, checkpoint.id, checkpoint.step, step)
        return checkpoint, result
    raise CorruptCheckpoint(f"{who}: no checkpoint to restore from verifies: {'; '.join(refused)}")


def open_checkpoint(path: PathLike, log: Callable[[str], None] = logger.warning) -> Checkpoint:
    """The checkpoint directory ``path`` (checked), or the newest valid checkpoint under the root ``path``."""
    path = _fresh(locate(path))
    with failures_named(path, "read checkpoints"):
        if not path.fs.isdir(path.path):
            raise FileNotFoundError(f"no checkpoint at {path}: no such directory")
        has_manifest = path.join(MANIFEST).exists()
    if has_manifest:
        checkpoint = read_manifest(path)
        checkpoint.verify()
        return checkpoint
    if path.name.startswith(CHECKPOINT_PREFIX):
        raise FileNotFoundError(f"checkpoint {path} is incomplete: it has no {MANIFEST}")
    checkpoint = CheckpointStore(path).newest_valid(log)
    if checkpoint is None:
        raise FileNotFoundError(f"no valid checkpoint under {path} (a checkpoint directory has a {MANIFEST})")
    return checkpoint


# -- resharding: row ranges -------------------------------------------------------
_RANGE = re.compile(r"^(.+)\[(\d+):(\d+)\]$")


def range_name(table: str, start: int, stop: int) -> str:
    """How the rows ``start:stop`` of ``table`` are named in a checkpoint: ``"table[start:stop]"``."""
    return f"{table}[{start}:{stop}]"


def parse_range_name(name: str) -> Optional[Tuple[str, int, int]]:
    """``"t[0:5]"`` -> ``("t", 0, 5)``; ``None`` for a name that is no row range."""
    match = _RANGE.match(name)
    if not match:
        return None
    start, stop = int(match.group(2)), int(match.group(3))
    return (match.group(1), start, stop) if start < stop else None


def assemble_rows(pieces: Sequence[Tuple[int, int, Tensor]], start: int, stop: int, what: str) -> Tensor:
    """A new tensor of rows ``start:stop`` copied out of ``pieces`` (``(piece_start, piece_stop, rows)``,
    in any order; rows are the first dimension).  ``ValueError`` naming ``what`` and the first rows missing."""
    if start >= stop:
        raise ValueError(f"{what}: empty row range {start}:{stop}")
    for a, b, rows in pieces:
        if rows.dim() == 0 or rows.shape[0] != b - a:
            raise ValueError(f"{what}: piece {a}:{b} holds a tensor of shape {tuple(rows.shape)}, not {b - a} rows")
    covering = sorted(((a, b, rows) for a, b, rows in pieces if a < stop and b > start), key=lambda p: p[0])
    if not covering:
        raise ValueError(f"{what}: the checkpoint holds none of rows {start}:{stop}")
    first = covering[0][2]
    out = torch.empty((stop - start,) + tuple(first.shape[1:]), dtype=first.dtype)
    reached = start
    for a, b, rows in covering:
        if a > reached:
            break
        if b > reached:
            high = min(b, stop)
            out[reached - start:high - start] = rows[reached - a:high - a]
            reached = high
    if reached < stop:
        gap_end = next((a for a, _, _ in covering if a > reached), stop)
        raise ValueError(f"{what}: the checkpoint lacks rows {reached}:{gap_end}")
    return out
