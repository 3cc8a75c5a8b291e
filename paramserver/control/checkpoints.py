"""The coordinator's side of checkpoints: asking for them, committing them, and knowing the newest.

Owns when a checkpoint is taken (``ps-ctl checkpoint``, every N seconds;
every N steps is counted by the trainers themselves, who all hold the same
step), how the request reaches the trainers (a ``KIND_CHECKPOINT`` command
with the request's number: trainer group 0 agrees on a step, pauses, its
rank 0 has every shard write its part and writes the dense part), and the
commit: the coordinator checks the files its writers report and writes
the manifest *last* (``paramserver.checkpoint.CheckpointStore.commit``),
so a checkpoint without a manifest never counts, on a local disk or an
object store alike (the root is a path or an fsspec URL, with
``--storage-options`` handed to every member with the settings).  It also
answers what a (re)starting member restores from: the newest committed
checkpoint, or the one the server was started from (never pruned while
this coordinator runs).

It knows nothing of torch's distributed packages; the files are the
writers' business.
"""

import datetime
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import grpc

from ..checkpoint import MANIFEST, Checkpoint, CheckpointStore, CorruptCheckpoint, FileRecord, open_checkpoint
from ..filesystems import Location, StorageUnavailable, locate
from ..logs import one_line
from .protocol import pb
from .validation import RequestError, invalid

logger = logging.getLogger(__name__)

MAX_FILES = 4096
_NAMED = 5  # interrupted checkpoint directories named in the one line that says they were removed
MAX_INFO_CHARS = 64 * 1024


@dataclass(frozen=True)
class CheckpointOptions:
    """``ps-server``'s checkpoint flags.

    ``directory``: the root (``None``: the root of ``restore``), a path or
    fsspec URL.  ``restore``: a checkpoint directory, or a root whose
    newest valid checkpoint is used.  ``keep``: complete checkpoints kept
    (``--keep-checkpoints``).  ``storage_options``: fsspec options for
    their filesystem (``--storage-options``), handed on to every member.
    ``convert_rows``: tables whose rows ``restore`` holds in another type are
    converted (``--convert-rows``), not refused.
    """

    directory: Optional[str] = None
    every_steps: int = 0
    every_seconds: float = 0.0
    keep: int = 3
    restore: Optional[str] = None
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    convert_rows: bool = False


class CheckpointCoordinator:
    """Checkpoints of one cluster under ``store``'s root.

    ``command_workers(command)`` queues a command for every live worker
    (the membership table does it); ``every_seconds`` asks for one on a
    timer; ``restored`` is the checkpoint the cluster started from.
    """

    def __init__(self, store: CheckpointStore, command_workers: Callable[[pb.Command], int],
                 every_steps: int = 0, every_seconds: float = 0.0, restored: Optional[Checkpoint] = None,
                 convert_rows: bool = False):
        if every_steps < 0 or every_seconds < 0:
            raise ValueError("checkpoint intervals must not be negative")
        self.store = store
        self._command_workers = command_workers
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.restored = restored
        #: Members restoring convert rows held in another type than their tables' (``--convert-rows``).
        self.convert_rows = convert_rows
        self._changed = threading.Condition()
        self._requests = 0
        self._answered: Dict[int, Checkpoint] = {}  # request number -> the checkpoint that answered it
        self._failed: Dict[int, str] = {}  # request number -> why the checkpoint answering it failed
        self._answered_through = 0  # every request up to this one is answered or failed
        self._newest: Optional[Checkpoint] = restored
        #: Checkpoints committed by this coordinator (a restored one does not count).
        self.committed = 0
        self._stopped = threading.Event()
        self._timer: Optional[threading.Thread] = None

    @classmethod
    def from_options(cls, options: CheckpointOptions,
                     command_workers: Callable[[pb.Command], int]) -> "CheckpointCoordinator":
        """Open the restore point (``FileNotFoundError`` / ``CorruptCheckpoint`` / ``StorageUnavailable`` naming
        what is wrong)."""
        # Plain paths are made absolute here (locate), against the coordinator's working directory: members are
        # handed them as they are, and a worker started in another directory must find the same files.
        restored = open_checkpoint(locate(options.restore, options.storage_options)) if options.restore else None
        if restored is not None:
            logger.info("restoring from checkpoint %s (step %d)", restored.path, restored.step)
        root = locate(options.directory, options.storage_options) if options.directory else \
            restored.path.parent() if restored is not None else None
        if root is None:
            raise ValueError("checkpoints need a directory (--checkpoint-dir) or a checkpoint to restore")
        store = CheckpointStore(root, keep=options.keep)
        if restored is not None:
            store.protect(restored)  # what a member joining before the first commit reads
        return cls(store, command_workers, every_steps=options.every_steps, every_seconds=options.every_seconds,
                   restored=restored, convert_rows=options.convert_rows)

    # -- what members are told ----------------------------------------
    @property
    def newest(self) -> Optional[Checkpoint]:
        with self._changed:
            return self._newest

    def settings(self, storage_options: bool = True) -> pb.CheckpointSettings:
        """For a joining member: where checkpoints go, how often, what to restore from now, and (unless
        ``storage_options`` is false: for ``ps-ctl status``, they may hold credentials) the filesystem's
        options."""
        newest = self.newest
        settings = pb.CheckpointSettings(directory=str(self.store.root), every_steps=self.every_steps)
        if storage_options and self.store.root.storage_options:
            settings.storage_options_json = json.dumps(dict(self.store.root.storage_options))
        if newest is not None:
            settings.restore_from = str(newest.path)
            settings.restore_step = newest.step
            settings.convert_rows = self.convert_rows
        return settings

    # -- requests -----------------------------------------------------
    def request(self, reason: str) -> int:
        """Ask the trainers for a checkpoint; returns the request's number."""
        return self._ask(reason)[0]

    def _ask(self, reason: str) -> Tuple[int, int]:
        """Ask the trainers for a checkpoint: the request's number, and how many workers were told."""
        with self._changed:
            self._requests += 1
            number = self._requests
        told = self._command_workers(pb.Command(kind=pb.Command.KIND_CHECKPOINT, checkpoint_id=str(number)))
        logger.info("checkpoint %d requested (%s); told %d worker%s", number, reason, told, "" if told == 1 else "s")
        return number, told

    def checkpoint_now(self, reason: str, timeout: datetime.timedelta) -> Tuple[Checkpoint, bool]:
        """A checkpoint for whoever asks (``ps-ctl checkpoint``, an export through the cluster), and whether it
        is a new one: the one answering a request to the trainers (waited for up to ``timeout``, see
        ``wait``); or, when no worker is there to write one (the job ended, or none joined yet), the newest
        committed at once (``FAILED_PRECONDITION`` when there is none)."""
        number, told = self._ask(reason)
        if told:
            return self.wait(number, timeout), True
        newest = self.newest
        if newest is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"no trainer is training to write checkpoint request {number}, and this cluster has "
                               f"no committed checkpoint under {self.store.root} to answer with")
        logger.info("checkpoint %d: no trainer is training; answered with the newest, %s (step %d)", number,
                    newest.id, newest.step)
        return newest, False

    def wait(self, number: int, timeout: datetime.timedelta) -> Checkpoint:
        """The checkpoint that answers request ``number``; ``RequestError`` when its writing failed
        (``ABORTED``, with the writer's reason), when the coordinator stops meanwhile (``ABORTED``) or
        none comes in time (``FAILED_PRECONDITION``: the coordinator answered; ``DEADLINE_EXCEEDED`` and
        ``UNAVAILABLE`` are the client's own: no answer came)."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._changed:
            while number not in self._answered:
                if number in self._failed:
                    raise RequestError(grpc.StatusCode.ABORTED,
                                       f"checkpoint request {number} failed: {self._failed[number]}")
                if self._stopped.is_set():
                    raise RequestError(grpc.StatusCode.ABORTED, f"checkpoint request {number} abandoned: the "
                                                                "coordinator is shutting down")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RequestError(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"checkpoint request {number} was not written within {timeout.total_seconds():.0f} s: "
                        "no trainer group 0 is training (checkpoints are taken by its rank 0 at a step "
                        "boundary), or it is stuck")
                self._changed.wait(min(remaining, 0.5))
            return self._answered[number]

    # -- commits ------------------------------------------------------
    def fail(self, writer: str, request: pb.CommitCheckpointRequest) -> None:
        """``writer`` could not write the checkpoint of ``request.request``: fail the requests it was to answer
        (those not answered yet, up to it), and remove the parts written before the failure."""
        reason = f"{writer} could not write it: {one_line(request.failure)}"
        with self._changed:
            # Up to the requests made (a number beyond them is the writer's mistake, not a loop of its size).
            covered = min(request.request, self._requests)
            for number in range(self._answered_through + 1, covered + 1):
                self._failed[number] = reason
            self._answered_through = max(self._answered_through, covered)
            self._changed.notify_all()
        logger.error("checkpoint%s at step %d failed: %s", f" request {request.request}" if request.request else "",
                     request.step, reason)
        if request.directory:
            try:
                self.store.discard(self._inside_root(request.directory))
            except StorageUnavailable as error:  # removed at the next start (remove_interrupted) instead
                logger.warning("the parts of the failed checkpoint stay for now: %s", error)

    def commit(self, writer: str, request: pb.CommitCheckpointRequest) -> Checkpoint:
        """Check what ``writer`` reports, write the manifest, prune; answer the requests it covers."""
        directory = self._inside_root(request.directory)
        files = [_file_record(f) for f in request.files]
        if not files:
            raise invalid("files is empty: a checkpoint has at least the dense part")
        if len(files) > MAX_FILES:
            raise invalid(f"files has {len(files)} entries, at most {MAX_FILES} allowed")
        if len(request.info_json) > MAX_INFO_CHARS:
            raise invalid(f"info_json has {len(request.info_json)} characters, at most {MAX_INFO_CHARS} allowed")
        try:
            info = json.loads(request.info_json or "{}")
        except json.JSONDecodeError as error:
            raise invalid(f"info_json is not JSON: {error}") from None
        if not isinstance(info, dict):
            raise invalid("info_json must be a JSON object")
        info.update(writer=writer, request=request.request)
        try:
            checkpoint = self.store.commit(directory, files, request.step, info)
        except (CorruptCheckpoint, OSError) as error:
            logger.error("checkpoint in %s from %s refused: %s", directory, writer, error)
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, f"checkpoint refused: {error}") from None
        with self._changed:
            self._newest = checkpoint
            self.committed += 1
            # A request is answered by the first checkpoint committed after it (unless one failed before).
            for number in range(self._answered_through + 1, self._requests + 1):
                self._answered[number] = checkpoint
            self._answered_through = self._requests
            self._changed.notify_all()
        size = sum(f.bytes for f in files)
        logger.info("checkpoint %s committed at step %d by %s: %d files, %.1f MB", checkpoint.id, checkpoint.step,
                    writer, len(files), size / 1e6)
        return checkpoint

    def _inside_root(self, directory: str) -> Location:
        if not directory:
            raise invalid("directory is empty")
        root = self.store.root
        try:
            location = locate(directory, root.storage_options)
        except (ImportError, ValueError) as error:
            raise invalid(f"directory {directory[:300]!r}: {error}") from None
        if root.is_local and location.is_local:
            inside = os.path.dirname(os.path.realpath(location.path)) == os.path.realpath(root.path)
        else:
            inside = type(location.fs) is type(root.fs) and \
                location.path.rstrip("/").rsplit("/", 1)[0] == root.path.rstrip("/") and \
                location.name not in ("", ".", "..")
        if not inside:
            raise invalid(f"directory {directory[:300]!r} is not a checkpoint directory directly inside "
                          f"this cluster's checkpoint root {str(root)!r}")
        return location

    # -- the timer ----------------------------------------------------
    def snapshot(self) -> Dict[str, Any]:
        """For the coordinator's journal: the requests' numbering and the newest committed checkpoint."""
        with self._changed:
            return {"requests": self._requests, "newest": str(self._newest.path) if self._newest else ""}

    def resume(self, snapshot: Mapping[str, Any]) -> None:
        """Continue from the journal of the coordinator before this one: request numbers above its (workers
        keep the highest they heard of), every one of its requests settled (whoever waited for them waited on
        the coordinator before this one: the first commit here answers only requests made here), and its
        newest checkpoint as the one a restarting shard restores from (unless it no longer opens)."""
        with self._changed:
            self._requests = max(self._requests, int(snapshot.get("requests", 0)))
            self._answered_through = max(self._answered_through, self._requests)
        newest = snapshot.get("newest")
        if newest and (self._newest is None or str(self._newest.path) != newest):
            try:
                checkpoint = open_checkpoint(locate(newest, self.store.root.storage_options))
            except (OSError, CorruptCheckpoint, StorageUnavailable, ValueError) as error:
                logger.warning("the journal's newest checkpoint %s does not open: %s", newest, error)
                return
            with self._changed:
                self._newest = checkpoint

    def start(self, remove_interrupted: bool = True) -> "CheckpointCoordinator":
        """The cluster starts: remove what checkpoints interrupted before it left under the root (nothing
        writes there yet; later ones are removed by their writer's failure report, or by the pruning of a
        newer commit), and ask for checkpoints on the timer.  A coordinator taking a running cluster back
        removes nothing (``remove_interrupted`` false): a trainer may be writing a checkpoint there now, to
        commit it once the coordinator answers."""
        interrupted = self.store.remove_interrupted() if remove_interrupted else []
        if interrupted:
            names = ", ".join(d.name for d in interrupted[:_NAMED])
            logger.info("removed %d interrupted checkpoint director%s (no %s) under %s: %s%s", len(interrupted),
                        "y" if len(interrupted) == 1 else "ies", MANIFEST, self.store.root, names,
                        f" and {len(interrupted) - _NAMED} more" if len(interrupted) > _NAMED else "")
        if self.every_seconds > 0:
            self._timer = threading.Thread(target=self._every_seconds, name="checkpoint-timer", daemon=True)
            self._timer.start()
        return self

    def _every_seconds(self) -> None:
        while not self._stopped.wait(self.every_seconds):
            self.request(f"every {self.every_seconds:g} s")

    def stop(self) -> None:
        self._stopped.set()
        with self._changed:
            self._changed.notify_all()


def _file_record(message: pb.CheckpointFile) -> FileRecord:
    name = message.name
    if not name or "/" in name or "\\" in name or name in (".", "..") or len(name) > 255:
        raise invalid(f"file name {name[:300]!r} must be a plain file name inside the checkpoint's directory")
    if len(message.sha256) != 64 or any(c not in "0123456789abcdef" for c in message.sha256):
        raise invalid(f"file {name!r}: sha256 must be 64 lowercase hex digits")
    return FileRecord(name=name, bytes=message.bytes, sha256=message.sha256)
