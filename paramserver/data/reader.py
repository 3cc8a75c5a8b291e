"""``FileReader``: a worker's batches from files, read and parsed ahead in background threads, resumable.

Owns reading one worker's share of a set of files (``parts.parts_of``:
over every worker, each line or row of an epoch is read exactly once)
as ``paramserver.Batch``es: a producer thread walks the parts chunk by
chunk (text: about ``parts.CHUNK_BYTES`` of whole lines; Parquet: a row
group) and hands each to a pool of ``threads`` parsing threads (pyarrow
and numpy work without the GIL); the consumer takes parsed chunks in
order and cuts them into batches of ``batch_size`` (a batch may span
chunks and parts; the last one of the data may be shorter).  At most
``ahead`` chunks wait, so memory is bounded and a step does not wait for
data in steady state.

Position: ``state_dict()`` is where the next batch starts (epoch, part,
chunk offset, rows of that chunk already given, lines skipped so far);
``load_state_dict()`` makes the next iteration start there, as torchdata's
``StatefulDataLoader`` does, so a Trainer saves it in checkpoints and a
restored run reads on from the same sample.  Every ``iter()`` starts from
the loaded position (or the beginning), so an evaluation set is
re-iterable.

Following (``follow=True``, online training): the input (globs, directories or prefixes, local or on
an object store) is listed again every ``poll`` while reading, and files that appear are read as they
come, each exactly once, complete files only (``parts.InputFiles.ready``: final names, or a
``ready_marker``), in name order within what one listing found; the iteration never ends by itself
(it waits for files, in bounded polls, with a log line at a bounded rate) and ends on ``close()``.  A
followed input's parts (a file, or 256 MiB of it: never cut by the number of workers) go to workers by a
hash of their names (``crc32 % workers``), so that every worker decides alone and alike which new file is
whose; the parts under way of the position it starts from are its own whatever their hash, so that a group
can re-deal its members' reading (``reshare``; the rule: ``paramserver.data.shares``).  Its position names
parts by name: the parts done, the ones under way (chunk offset and rows given of each), so that after a
restore nothing is read twice and no file from its start again.  Where several readers that are not dealt
their shares together read one input (trainer groups), ``claims`` (``paramserver.train.claims``) is asked
before a part not under way is started (``take(key)``: ``True`` read it, ``False`` never, ``None`` not now:
asked again after the next listing), and told when a part's last rows were given (``finish(key)``).  What
it names stays bounded by what the
input holds: a listing's oldest file name raises ``done_below`` (every part whose key sorts below it is
done), and the parts done below it are forgotten, as are the sizes of their files, so that a stream whose old
files are deleted (a retention policy) keeps a position of the size of what is left.  A file that lands later
with a name older than that is not read (logged at a bounded rate).

Malformed input stops the reader with ``MalformedInput`` naming the file
and line (Parquet: row group and row), or, with ``skip_malformed``, is
skipped, counted (``malformed``) and logged at a bounded rate.  Every
wait is bounded and returns promptly on ``close()``.
"""

import concurrent.futures
import dataclasses
import datetime
import logging
import queue
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from ..logs import RateLimitedLog
from ..train.contract import Batch
from . import criteo, parts as parts_module, shares as sharing
from .criteo import Parsed
from .errors import MalformedInput, UnreadableFile
from .parquet import ParquetSchema, read_row_group
from .parts import InputFiles, Part
from .samples import Samples

logger = logging.getLogger(__name__)

#: How often a wait looks up (a stop request, a dead producer).
_POLL = 0.2
_STOPPED = object()
FORMATS = ("criteo", "parquet")
#: How often a followed input is listed again by default.
FOLLOW_POLL = datetime.timedelta(seconds=10)


@dataclass(frozen=True)
class Position:
    """Where reading resumes: chunk ``offset`` of part ``part`` in epoch ``epoch``, ``rows`` of it given.

    A followed input names its parts instead of numbering them: ``done`` (the keys of parts not to start:
    read whole, or under way at another member's when the shares were dealt), ``key`` (the part being read;
    ``part`` is then only this process's index of it), and ``held``: more parts under way, read after it,
    each ``(key, offset, rows)`` (a part inherited from a member that left, ``paramserver.data.shares``);
    ``done_below``: every part whose key sorts below it is done too (older than every file a listing found,
    see the module's text)."""

    epoch: int = 0
    part: int = 0
    offset: int = 0
    rows: int = 0
    malformed: int = 0
    done: Tuple[str, ...] = ()
    key: str = ""
    held: Tuple[Tuple[str, int, int], ...] = ()
    done_below: str = ""

    def under_way(self) -> List[Tuple[str, int, int]]:
        """A followed input's parts under way, in the order they are read: ``(key, offset, rows)``."""
        return ([(self.key, self.offset, self.rows)] if self.key else []) + list(self.held)


@dataclass
class _Chunk:
    part: Part
    here: Position  # where this chunk starts
    after: Position  # where the chunk after this one starts
    parsed: "concurrent.futures.Future"
    #: Text: the offset where this reading of the part began, and the lines from there to this chunk.
    began: int = 0
    lines_before: int = 0
    #: Rows of this chunk given before (the first chunk of a part resumed in its middle).
    skip: int = 0


def _place(position: "Position") -> Tuple[int, int, int]:
    return position.epoch, position.part, position.offset


class FileReader:
    """Worker ``worker`` of ``workers``'s batches from ``paths`` (paths, globs, directories; local or URLs, with
    ``storage_options``) in ``format`` ("criteo" or "parquet" with ``schema``), for ``epochs`` epochs
    (``None``: without end); an iteration ends after ``max_rows`` samples when that is given (a bounded
    evaluation set).  ``follow``: read files as they appear (see the module's text), listing again every
    ``poll``; ``ready_marker``: read a file only once its directory holds a file of that name."""

    def __init__(self, paths: Union[str, Sequence[str]], batch_size: int, *, format: str = "criteo",
                 schema: Optional[ParquetSchema] = None, worker: int = 0, workers: int = 1,
                 epochs: Optional[int] = 1, skip_malformed: bool = False, threads: int = 2, ahead: int = 4,
                 chunk_bytes: int = parts_module.CHUNK_BYTES, max_rows: Optional[int] = None,
                 follow: bool = False, poll: datetime.timedelta = FOLLOW_POLL, ready_marker: Optional[str] = None,
                 storage_options: Optional[Mapping[str, Any]] = None):
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        if format == "parquet" and schema is None:
            raise ValueError("Parquet input needs a schema (ParquetSchema: label, dense, categorical columns)")
        if batch_size < 1 or threads < 1 or ahead < 1 or (epochs is not None and epochs < 0):
            raise ValueError(f"batch_size, threads and ahead must be >= 1 and epochs >= 0 or None; got "
                             f"{batch_size}, {threads}, {ahead}, {epochs}")
        self.format, self.schema, self.batch_size = format, schema, batch_size
        self.epochs, self.skip_malformed, self.threads, self.ahead = epochs, skip_malformed, threads, ahead
        self.chunk_bytes, self.max_rows = chunk_bytes, max_rows
        if not 0 <= worker < workers:
            raise ValueError(f"worker must be in [0, {workers}), got {worker}")
        if follow and (epochs != 1 or max_rows is not None):
            raise ValueError(f"a followed input reads every file once: epochs must be 1 (got {epochs}) and "
                             f"max_rows unset (got {max_rows})")
        if poll.total_seconds() <= 0:
            raise ValueError(f"poll must be positive, got {poll}")
        self.follow, self.poll, self.worker, self.workers = follow, poll, worker, workers
        #: What ``dealt`` builds another reader of this input from.
        self._arguments = dict(paths=paths, batch_size=batch_size, format=format, schema=schema, epochs=epochs,
                               skip_malformed=skip_malformed, threads=threads, ahead=ahead, chunk_bytes=chunk_bytes,
                               max_rows=max_rows, follow=follow, poll=poll, ready_marker=ready_marker,
                               storage_options=storage_options)
        self.inputs = InputFiles(paths, storage_options, ready_marker)
        #: This reader's parts (a followed input's: ``None`` in place of one forgotten, see the module's text).
        self.parts: List[Optional[Part]] = []
        self._start = Position()  # where iterating begins (listing below keeps its parts under way)
        self._waiting_log = RateLimitedLog(logger, "listed {count} time{s} without finding a new file")
        self._too_old_log = RateLimitedLog(logger, "found {count} file{s} older than the followed input's oldest",
                                           level=logging.WARNING)
        self._too_old_logged: set = set()  # those of them logged, while they are listed
        #: A followed input read beside readers it is not dealt with (other trainer groups): ``take(key)`` and
        #: ``finish(key)``, see the module's text (``None``: every part of its share is its own).
        self.claims: Optional[Any] = None
        #: The parts ``claims`` said were read whole elsewhere (never asked again, whatever the iterations).
        self._elsewhere: set = set()
        self._elsewhere_log = RateLimitedLog(logger, "left a part to another reader {count} time{s}")
        #: A followed input: the oldest file name its last listing found ("" before one found any), and the
        #: name below which files are done (the producer's position's ``done_below``).
        self._oldest_listed = ""
        self._done_below = ""
        if follow:
            self._discover()
        else:
            files = self.inputs.list()
            every = self._parts_of_files(files)
            self.parts = parts_module.parts_of(every, worker, workers)
        if not self.parts and not follow:
            raise ValueError(f"worker {worker} of {workers} has no part of {len(files)} file(s) ({len(every)} "
                             "parts; a compressed file is one part): give more files, or uncompressed ones")
        self.tables = list(schema.tables) if format == "parquet" else list(criteo.CATEGORICAL)
        self.num_dense = len(schema.dense) if format == "parquet" else len(criteo.DENSE)
        self._position = Position()
        self._stop = threading.Event()
        #: (path, offset) -> the number of the line starting there, counted once when a message needs it.
        self._line_numbers: Dict[Tuple[str, int], int] = {}
        self._skipped_log = RateLimitedLog(logger, "skipped {count} malformed line{s}")

    @property
    def malformed(self) -> int:
        """Lines (rows) skipped as malformed so far."""
        return self._position.malformed

    def _parts_of_files(self, files: Sequence[str]) -> List[Part]:
        if self.format == "parquet":
            return parts_module.parquet_parts(files, self.inputs)
        # A followed input's parts do not depend on the number of workers (256 MiB of a file at most, each one
        # worker's): its position names them, and must name the same parts after a restore onto more workers.
        return parts_module.text_parts(files, 1 if self.follow else self.workers, self.inputs)

    @property
    def shared(self) -> bool:
        """Whether a group deals this reader's share (``reshare``): a followed input, whose parts are named."""
        return self.follow

    # The rule a group deals positions of this input by (``data.shares``), for the group's side
    # (``paramserver.train.shares``), which knows the data only by these methods.
    deal = staticmethod(sharing.deal)
    again = staticmethod(sharing.again)
    is_position = staticmethod(sharing.is_followed)

    def dealt(self, worker: int, workers: int) -> "FileReader":
        """Another reader of the same input, worker ``worker`` of ``workers``'s (not started), asking the same
        ``claims``."""
        reader = FileReader(**self._arguments, worker=worker, workers=workers)
        reader.claims = self.claims
        return reader

    def reshare(self, worker: int, workers: int, state: Dict[str, Any]) -> None:
        """A followed input: read on as worker ``worker`` of ``workers`` from ``state`` (a position dealt by
        ``paramserver.data.shares.deal``: its parts under way are this reader's whatever their hash), from the
        next iteration on; call it with no iteration under way."""
        if not self.follow:
            raise ValueError("only a followed input is dealt among workers by its parts' names")
        if not 0 <= worker < workers:
            raise ValueError(f"worker must be in [0, {workers}), got {worker}")
        self.worker, self.workers = worker, workers
        self.load_state_dict(state)

    def _discover(self) -> List[Part]:
        """A followed input: list it again; this worker's parts of files not seen before (those whose name
        hashes to it, and the parts under way of the position it starts from), in name order, appended to
        ``parts`` and returned."""
        known = {part.path for part in self.parts if part is not None}
        claimed = {key for key, _, _ in self._start.under_way()}
        listed = self.inputs.list(missing_ok=True)
        self._oldest_listed = self.inputs.oldest_found or self._oldest_listed
        new_files = [name for name in listed if name not in known
                     and (_names_part_of(name, claimed) or not self._too_old(name))]
        if self._too_old_logged:  # forget those no longer listed (usually none: no set of the listing built)
            self._too_old_logged &= set(listed)
        mine = [part for part in self._parts_of_files(new_files)
                if zlib.crc32(part.key.encode()) % self.workers == self.worker or part.key in claimed]
        mine.sort(key=lambda part: (part.path, part.start, part.row_group or 0))
        self.parts.extend(mine)
        return mine

    def _too_old(self, name: str) -> bool:
        """Whether a followed input's file ``name`` sorts below its position's ``done_below`` (logged)."""
        if name >= self._done_below:
            return False
        if name not in self._too_old_logged:
            self._too_old_logged.add(name)
            self._too_old_log.record("too old", f"{name} is older than every file of the followed input at an "
                                     f"earlier listing ({self._done_below}): taken as read, not read")
        return True

    # -- position ----------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Where the next batch starts (taken before every batch a Trainer reads ahead: O(1), the parts done of
        a followed input handed on as the immutable tuple they are, not copied)."""
        position = self._position
        state = {field.name: getattr(position, field.name) for field in dataclasses.fields(position)}
        if not self.follow:  # the fields of a followed input's position are not a fixed input's
            del state["done"], state["key"], state["held"], state["done_below"]
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        named = ("done", "key", "held", "done_below")
        fields = {key: value for key, value in state.items() if key not in named}
        position = Position(**{key: int(value) for key, value in fields.items()},
                            done=tuple(map(str, state.get("done", ()))), key=str(state.get("key", "")),
                            held=tuple((str(key), int(offset), int(rows))
                                       for key, offset, rows in state.get("held", ())),
                            done_below=str(state.get("done_below", "")))
        if self.follow != ("done" in state):
            raise ValueError(f"saved position is of {'a followed' if 'done' in state else 'a fixed'} input, "
                             f"this reader's is {'followed' if self.follow else 'fixed'}")
        if not self.follow and not 0 <= position.part <= len(self.parts):
            raise ValueError(f"saved position names part {position.part}, this reader has {len(self.parts)}")
        self._start = self._position = position
        if self.follow:  # listed again as the next iteration starts, its parts under way among this reader's
            self.parts = []
            self._done_below = position.done_below

    def close(self) -> None:
        """Stop reading (an iteration under way ends at its next batch)."""
        self._stop.set()

    # -- iteration ---------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        self._stop.clear()
        self._position = self._start
        stop = threading.Event()
        chunks: "queue.Queue" = queue.Queue(maxsize=self.ahead)
        pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="data-parse")
        producer = threading.Thread(target=self._produce, args=(self._start, chunks, pool, stop),
                                    name="data-read", daemon=True)
        producer.start()
        try:
            yield from self._batches(chunks, producer)
        finally:
            stop.set()
            producer.join(10 * _POLL)
            pool.shutdown(wait=False, cancel_futures=True)
            for log in (self._waiting_log, self._too_old_log, self._skipped_log, self._elsewhere_log):
                log.flush()  # what was counted is written now, not by a timer after the reading ended

    def _batches(self, chunks: "queue.Queue", producer: threading.Thread) -> Iterator[Batch]:
        waiting: List[Samples] = []
        waiting_rows = 0
        rows_given = 0
        malformed = self._start.malformed
        # rows a resumed position gave beyond its first chunk (cut anew from there), and where they go on
        carried, carried_to = 0, None
        while True:
            chunk = self._next_chunk(chunks, producer)
            if chunk is _STOPPED:
                return  # closed: the position stays where the last batch given left it
            if chunk is None:
                break
            parsed = self._result(chunk)
            if parsed is None:
                return
            skip = chunk.skip + (carried if carried_to == _place(chunk.here) else 0)
            if skip == 0:  # a chunk resumed in its middle had its malformed lines counted before
                malformed += self._problems(chunk, parsed)
            # on into the part's next chunk only: rows past a part's end name lines it no longer has
            same_part = (chunk.after.epoch, chunk.after.part) == (chunk.here.epoch, chunk.here.part)
            carried, carried_to = max(0, skip - len(parsed.samples)) if same_part else 0, _place(chunk.after)
            samples = parsed.samples
            if self.max_rows is not None:
                samples = samples.slice(0, max(0, min(len(samples), self.max_rows - rows_given)))
            given = min(skip, len(samples))
            while given < len(samples):
                take = min(self.batch_size - waiting_rows, len(samples) - given)
                waiting.append(samples.slice(given, given + take))
                waiting_rows += take
                given += take
                rows_given += take
                if waiting_rows == self.batch_size:
                    batch = Samples.join(waiting).batch()
                    waiting, waiting_rows = [], 0
                    self._advance(dataclasses.replace(chunk.here, rows=given, malformed=malformed)
                                  if given < len(samples) else dataclasses.replace(chunk.after, malformed=malformed))
                    yield batch
            if not waiting:
                self._advance(dataclasses.replace(chunk.after, malformed=malformed))
            if self.max_rows is not None and rows_given >= self.max_rows:
                break
        if waiting_rows:
            self._position = Position(self.epochs or 0, len(self.parts), 0, 0, malformed)
            yield Samples.join(waiting).batch()
        self._position = Position(self.epochs or 0, len(self.parts), 0, 0, malformed)

    def _advance(self, position: Position) -> None:
        """The next batch starts at ``position``; a followed input's part it left behind, done in it, is read
        whole: ``claims`` is told."""
        left = self._position.key
        self._position = position
        if self.claims is not None and left and left != position.key and left in position.done:
            self.claims.finish(left)

    def _next_chunk(self, chunks: "queue.Queue", producer: threading.Thread):
        """The next chunk; ``None`` at the end of the data; ``_STOPPED`` once ``close()`` was called."""
        while True:
            if self._stop.is_set():
                return _STOPPED
            try:
                item = chunks.get(timeout=_POLL)
            except queue.Empty:
                if not producer.is_alive() and chunks.empty() and not self._stop.is_set():
                    raise RuntimeError("the file reader's thread ended without a word") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def _result(self, chunk: _Chunk) -> Optional[Parsed]:
        """The chunk parsed (its parsing error raised); ``None`` once ``close()`` was called."""
        while True:
            if self._stop.is_set():
                return None
            try:
                return chunk.parsed.result(timeout=_POLL)
            except concurrent.futures.TimeoutError:
                continue

    def _problems(self, chunk: _Chunk, parsed: Parsed) -> int:
        """Raise for the chunk's first malformed line, or (``skip_malformed``) count and log them."""
        if not parsed.problems:
            return 0
        part = chunk.part
        for problem in parsed.problems:
            place = self._place(part, chunk, problem.line)
            if not self.skip_malformed:
                raise MalformedInput(part.path, place, problem.reason, problem.column)
            self._skipped_log.record("malformed", f"skipped malformed input: {part.path}, {place}"
                                     + (f", column {problem.column}" if problem.column else "")
                                     + f": {problem.reason}")
        return len(parsed.problems)

    def _place(self, part: Part, chunk: _Chunk, line: int) -> str:
        """Where line ``line`` of ``chunk`` is: its row group and row, or its line number in the file (the lines
        before the part's reading began are counted once per part, only when a message needs them)."""
        if part.row_group is not None:
            return f"row group {part.row_group}, row {line}"
        key = (part.path, chunk.began)
        if key not in self._line_numbers:
            self._line_numbers[key] = (parts_module.line_at(part.path, chunk.began, self.inputs) if chunk.began
                                       else 1)
        return f"line {self._line_numbers[key] + chunk.lines_before + line - 1}"

    # -- the producer thread ----------------------------------------------------
    def _produce(self, start: Position, chunks: "queue.Queue", pool, stop: threading.Event) -> None:
        try:
            if self.follow:
                self._produce_following(start, chunks, pool, stop)
                return
            epoch = start.epoch
            part_index, offset, skip = start.part, start.offset, start.rows
            while self.epochs is None or epoch < self.epochs:
                while part_index < len(self.parts):
                    following = (Position(epoch, part_index + 1, 0) if part_index + 1 < len(self.parts)
                                 else Position(epoch + 1, 0, 0))
                    for chunk in self._chunks_of(Position(epoch, part_index, offset), following, pool, skip):
                        if not self._put(chunks, chunk, stop):
                            return
                    part_index, offset, skip = part_index + 1, 0, 0
                epoch, part_index = epoch + 1, 0
            self._put(chunks, None, stop)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
            self._put(chunks, error, stop)

    def _produce_following(self, start: Position, chunks: "queue.Queue", pool, stop: threading.Event) -> None:
        """A followed input's chunks: the parts under way first (from where each was left), then every part not
        done, listing again (every ``poll``, stop-aware) when none is left; never ends by itself."""
        resume = {key: (offset, rows) for key, offset, rows in start.under_way()}  # in the order they are read
        done = tuple(key for key in start.done if key not in resume)
        finished = set(done)
        elsewhere = self._elsewhere
        busy: set = set()  # parts under way elsewhere: asked again after the next listing
        if set(resume) - self._keys() and not self._listed(stop, len(finished)):
            return
        gone = sorted(set(resume) - self._keys())
        if gone:
            logger.warning("the reading position's part(s) under way %s are gone from the input: reading on from "
                           "the other parts not read yet", ", ".join(gone))
            resume = {key: progress for key, progress in resume.items() if key not in gone}
        while not stop.is_set() and not self._stop.is_set():
            if self._oldest_listed > self._done_below:  # older files gone: forget the parts done below
                done, finished = self._forget_below(self._oldest_listed, done, set(resume))
                elsewhere.difference_update([key for key in elsewhere if key < self._done_below])
            index_of = {part.key: index for index, part in enumerate(self.parts) if part is not None}
            pending = [index_of[key] for key in resume] + [index for index, part in enumerate(self.parts)
                                                           if part is not None and part.key not in finished
                                                           and part.key not in resume and part.key not in elsewhere
                                                           and part.key not in busy]
            if not pending:
                busy.clear()
                if not self._listed(stop, len(finished), waiting=True):
                    return
                continue
            for index in pending:
                part = self.parts[index]
                answer = self.claims.take(part.key) if part.key not in resume and self.claims is not None else True
                if answer is not True:
                    (busy if answer is None else elsewhere).add(part.key)
                    self._elsewhere_log.record("under way there" if answer is None else "read whole there",
                                               f"{part.key} is read by another reader")
                    continue
                offset, rows = resume.pop(part.key, (0, 0))
                held = tuple((key, *progress) for key, progress in resume.items())
                finished.add(part.key)
                done = done + (part.key,)
                floor = self._done_below
                here = Position(0, index, offset, done=done[:-1], key=part.key, held=held, done_below=floor)
                after = Position(0, index + 1, 0, done=done, held=held, done_below=floor)
                for chunk in self._chunks_of(here, after, pool, rows):
                    if not self._put(chunks, chunk, stop):
                        return

    def _keys(self) -> set:
        return {part.key for part in self.parts if part is not None}

    def _forget_below(self, oldest: str, done: Tuple[str, ...], under_way: set) -> Tuple[Tuple[str, ...], set]:
        """A followed input whose files below ``oldest`` are gone: raise ``done_below`` to it, and forget the
        parts done below it (this reader's parts of them, and their files' sizes); the parts ``under_way``
        stay.  The parts done that are left, and the same as a set."""
        self._done_below = oldest
        done = tuple(key for key in done if key >= oldest)
        for index, part in enumerate(self.parts):
            if part is not None and part.path < oldest and part.key not in under_way:
                self.parts[index] = None
        self.inputs.forget_before(oldest)
        return done, set(done)

    def _listed(self, stop: threading.Event, read: int, waiting: bool = False) -> bool:
        """List a followed input again (``_discover``); when that fails (the store unreachable for a while:
        online training waits), or finds nothing new and ``waiting``, pause ``poll`` first and try again.  False
        once this iteration or the reader is stopped."""
        while not stop.is_set() and not self._stop.is_set():
            try:
                found = self._discover()
            except UnreadableFile as error:
                self._waiting_log.record("listing failed", f"{error}; listing again in "
                                         f"{self.poll.total_seconds():g} s")
                self._pause(stop, self.poll.total_seconds())
                continue
            if found or not waiting:
                return True
            self._waiting_log.record("no new file", f"{self.inputs.patterns[0].url}: no new file to read; "
                                     f"listing again every {self.poll.total_seconds():g} s ({read} part(s) read)")
            self._pause(stop, self.poll.total_seconds())
            return True
        return False

    def _pause(self, stop: threading.Event, seconds: float) -> None:
        """Wait ``seconds``, or less once this iteration or the reader is stopped."""
        deadline = time.monotonic() + seconds
        while not stop.is_set() and not self._stop.is_set() and time.monotonic() < deadline:
            stop.wait(min(_POLL, max(0.0, deadline - time.monotonic())))

    def _chunks_of(self, here: Position, following: Position, pool, skip: int = 0) -> Iterator[_Chunk]:
        """The chunks of part ``here.part`` from ``here.offset``, the first one's first ``skip`` rows given
        before; ``following``: where the part after it starts."""
        part = self.parts[here.part]
        if part.row_group is not None:
            yield _Chunk(part, here, following, pool.submit(read_row_group, part.path, part.row_group,
                                                            self.schema, self.inputs), skip=skip)
            return
        began, lines_before = None, 0
        for text in parts_module.text_chunks(part, here.offset or part.start, self.chunk_bytes, self.inputs):
            began = text.offset if began is None else began
            after = following if text.last else dataclasses.replace(here, offset=text.next_offset)
            yield _Chunk(part, dataclasses.replace(here, offset=text.offset), after,
                         pool.submit(criteo.parse, text.text), began, lines_before, skip)
            lines_before += text.text.count(b"\n")
            skip = 0

    def _put(self, chunks: "queue.Queue", item, stop: threading.Event) -> bool:
        while not stop.is_set() and not self._stop.is_set():
            try:
                chunks.put(item, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False


def _names_part_of(name: str, keys) -> bool:
    """Whether file ``name`` holds one of the parts ``keys`` (``Part.key``: the name, or the name and a byte
    range or row group)."""
    return any(key == name or key.startswith((f"{name}@", f"{name}#")) for key in keys)


def reader_from_config(config: Dict[str, Any], paths_key: str, batch_size: int, worker: int, workers: int,
                       epochs: Optional[int], max_rows: Optional[int] = None) -> FileReader:
    """A reader from a job's ``data`` config: ``format``, ``schema`` (Parquet), ``skip_malformed``,
    ``threads``, ``storage_options`` (for URLs), the files under ``paths_key`` ("train" or "eval"), and for
    the train files ``follow`` (read files as they land), ``poll_seconds`` and ``ready_marker``."""
    known = {"format", "train", "eval", "schema", "skip_malformed", "threads", "storage_options", "follow",
             "poll_seconds", "ready_marker"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"unknown data config keys: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    if paths_key not in config:
        raise ValueError(f"the data config names no {paths_key!r} files")
    follow = paths_key == "train" and bool(config.get("follow", False))
    poll = config.get("poll_seconds", FOLLOW_POLL.total_seconds())
    if not isinstance(poll, (int, float)) or isinstance(poll, bool) or poll <= 0:
        raise ValueError(f"data config key poll_seconds must be a positive number, got {poll!r}")
    schema = ParquetSchema.from_config(config["schema"]) if "schema" in config else None
    return FileReader(config[paths_key], batch_size, format=config.get("format", "criteo"), schema=schema,
                      worker=worker, workers=workers, epochs=1 if follow else epochs,
                      skip_malformed=bool(config.get("skip_malformed", False)), threads=int(config.get("threads", 2)),
                      max_rows=max_rows, follow=follow, poll=datetime.timedelta(seconds=poll),
                      ready_marker=config.get("ready_marker") if follow else None,
                      storage_options=config.get("storage_options"))
