"""A worker's position in its data: the batches of the steps ahead, and where to resume after a restore.

Owns ``BatchStream``, the Trainer's reader over any iterable of ``Batch``.
A batch belongs to a step until that step is finished (``finished``): a
step done again after a failure gets the same batch, and a step the group
took from another member instead of training it drops its batch
(``skip``).  Before an agreement the Trainer asks for the batches up to
the next one (``ensure``), so that a worker whose data ends asks its
group to stop there, where every member stops together, instead of
leaving the others waiting in a collective.  A batch read ahead has its
distinct ids found in the reader's thread (``Batch.find_distinct_ids``),
off the training thread's path (its routes start from them).

Its position (``position()``) goes into checkpoints: the number of
batches used, and, for data with ``state_dict()``/``load_state_dict()``
(the convention of torchdata's ``StatefulDataLoader``), the data's own
state as it was before the first batch not yet used (known without
waiting for that batch: the state after each batch is taken as it is
read).  A restore loads that state, or, for other data, skips that many
batches.  ``restart`` reads on from wherever the data is put meanwhile
(a trainer group re-dealt the shares of its input), dropping the batches
read ahead.
"""

import collections
import datetime
import logging
import queue
import threading
import time
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, Optional, Tuple

from .contract import Batch

logger = logging.getLogger(__name__)

#: How often a wait for the background reader looks up (the reader's stop, its death).
_READER_POLL = 0.5
#: How long ``restart`` waits for the background reader to end its pull.
STOP_WITHIN = datetime.timedelta(seconds=30)


def is_stateful(data) -> bool:
    return callable(getattr(data, "state_dict", None)) and callable(getattr(data, "load_state_dict", None))


class DataExhausted(RuntimeError):
    """The data ended between two agreements of the group (it cannot stop the group there)."""


class BatchStream:
    """Batches of ``data`` for the steps ahead, from ``position`` (a ``position()`` of an earlier run).

    ``prefetch``: batches read ahead in a background thread (0: read when
    asked), so that a step's batch is ready when the step starts; the
    data's errors are raised in their turn, as if read then.  ``close()``
    stops that thread.
    """

    def __init__(self, data: Iterable[Batch], position: Optional[Dict[str, Any]] = None, prefetch: int = 0,
                 started: bool = True):
        """``started=False``: nothing is read until ``restart`` (the data's start is not known yet)."""
        self._data = data
        self._stateful = is_stateful(data)
        self._prefetch = prefetch
        restored = position or {}
        self.used = int(restored.get("used", 0))
        loads_state = self._stateful and restored.get("state") is not None
        if loads_state:
            data.load_state_dict(restored["state"])
            logger.info("data position restored after %d batches (the data's own state)", self.used)
        # (batch, the data's state before it was pulled, its state after)
        self._ahead: Deque[Tuple[Batch, Any, Any]] = collections.deque()
        self._reader: Optional[_Reader] = None
        self._iterator: Optional[Iterator[Batch]] = None
        #: The data's state after the last batch taken (before the next one), and after the last one pulled.
        self._next_state = self._pulled_state = data.state_dict() if self._stateful else None
        if not started:
            return
        self._begin()
        if restored and not loads_state:
            for _ in range(self.used):
                if self._pull() is None:
                    break
            self._next_state = self._pulled_state
            logger.info("data position restored by skipping %d batches", self.used)
        self._start_reading()

    def _start_reading(self) -> None:
        if self._prefetch > 0:  # from here on only the reader's thread touches the data
            self._reader = _Reader(self._pull_ahead, self._prefetch)

    def _pull_ahead(self) -> Optional[Tuple[Batch, Any, Any]]:
        """``_pull_now`` in the reader's thread, which also finds the batch's distinct ids, off the step's path
        (not for batches pulled to be skipped, nor when nothing is read ahead: a route finds them then)."""
        pulled = self._pull_now()
        if pulled is not None and isinstance(pulled[0], Batch):  # (what is not is refused when its step checks it)
            pulled[0].find_distinct_ids()
        return pulled

    def restart(self, configure: Callable[[], None]) -> None:
        """Read on from wherever ``configure()``, called while nothing reads the data, puts it (the data must
        have ``close()``, which ends an iteration under way, when batches are read ahead in the background);
        the batches read ahead are dropped."""
        if self._reader is not None:
            self._reader.close(self._data.close)
            self._reader = None
        if self._iterator is not None and callable(getattr(self._iterator, "close", None)):
            self._iterator.close()
        configure()
        self._ahead.clear()
        self._begin()
        self._start_reading()

    def _begin(self) -> None:
        """Iterate the data afresh, from its state now."""
        self._iterator = iter(self._data)
        self._next_state = self._pulled_state = self._data.state_dict() if self._stateful else None

    def _pull_now(self) -> Optional[Tuple[Batch, Any, Any]]:
        """The next batch, with the data's state before it (after the one pulled before) and after it: one
        ``state_dict()`` a batch, by the one thread that pulls."""
        try:
            batch = next(self._iterator)
        except StopIteration:
            return None
        before, self._pulled_state = self._pulled_state, self._data.state_dict() if self._stateful else None
        return batch, before, self._pulled_state

    def _take(self, pulled: Tuple[Batch, Any, Any]) -> None:
        self._ahead.append(pulled)
        self._next_state = pulled[2]

    def _pull(self) -> Optional[Tuple[Batch, Any, Any]]:
        return self._reader.next() if self._reader is not None else self._pull_now()

    def close(self) -> None:
        """Stop reading ahead in the background."""
        if self._reader is not None:
            self._reader.close()

    def ready(self, count: int, patience: float, lull: Optional[float] = None) -> Optional[bool]:
        """Whether ``count`` batches can be had, waiting at most ``patience`` seconds for them: True, False
        when the data ends first, ``None`` when they have not come yet (data that follows files as they land,
        or a slow store); those that came stay read ahead.  ``lull``: with some batch in hand, stop waiting
        once no batch came for that long (the reader waits for more data to land: take what is there)."""
        deadline = time.monotonic() + patience
        while len(self._ahead) < count:
            if self._reader is None:
                return self.ensure(count)
            now = time.monotonic()
            wait = deadline - now if lull is None or not self._ahead else min(deadline - now, lull)
            pulled = self._reader.next(max(0.0, wait))
            if pulled is _Reader.NOT_YET:
                return None
            if pulled is None:
                return False
            self._take(pulled)
        return True

    def ensure(self, count: int) -> bool:
        """Read ahead until ``count`` batches are waiting; False when the data ends first."""
        while len(self._ahead) < count:
            pulled = self._pull()
            if pulled is None:
                return False
            self._take(pulled)
        return True

    def __len__(self) -> int:
        """Batches read ahead, not used yet."""
        return len(self._ahead)

    def current(self) -> Batch:
        """The batch of the step at hand (the same one until ``finished`` or ``skip``)."""
        if not self.ensure(1):
            raise DataExhausted(f"the data ended after {self.used} batches, between two agreements of the group")
        return self._ahead[0][0]

    def ahead(self, offset: int) -> Optional[Batch]:
        """The batch ``offset`` steps after the step at hand (0: its own), read ahead; ``None`` when the data
        ends first."""
        return self._ahead[offset][0] if self.ensure(offset + 1) else None

    def ahead_now(self, offset: int) -> Optional[Batch]:
        """``ahead(offset)`` if that batch can be had without waiting (read ahead already, or waiting in the
        background reader's queue); ``None`` otherwise, or when the data ended first."""
        return self._ahead[offset][0] if self.ready(offset + 1, 0.0) else None

    def finished(self) -> None:
        """The step at hand is done: its batch is used."""
        self._ahead.popleft()
        self.used += 1

    def skip(self, steps: int) -> None:
        """The group moved ``steps`` steps ahead of this member: their batches are dropped unused."""
        for _ in range(steps):
            if not self._ahead and not self.ensure(1):
                return
            self.finished()

    def current_states(self) -> Tuple[Any, Any]:
        """The data's state before the batch of the step at hand and after it (``None`` when that batch is not
        read yet)."""
        return (self._ahead[0][1], self._ahead[0][2]) if self._ahead else (self._next_state, None)

    def position(self) -> Dict[str, Any]:
        """Where a restored run resumes: batches used, and the data's state before the next one."""
        if not self._stateful:
            return {"used": self.used, "state": None}
        return {"used": self.used, "state": self._ahead[0][1] if self._ahead else self._next_state}


class _Reader:
    """Reads ahead in a background thread: up to ``depth`` pulls waiting, in order; the data's end and its
    errors reach the consumer in their turn (an error is raised by ``next`` as it was raised by the data)."""

    _END = object()
    #: What ``next(within)`` returns when nothing came within that time.
    NOT_YET = object()

    def __init__(self, pull: Callable[[], Optional[Tuple[Batch, Any, Any]]], depth: int):
        self._pull = pull
        self._queue: "queue.Queue" = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._run, name="batch-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._pull()
            except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
                self._put(error)
                return
            self._put(self._END if item is None else item)
            if item is None:
                return

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_READER_POLL)
                return
            except queue.Full:
                continue

    def next(self, within: Optional[float] = None) -> Optional[Tuple[Batch, Any, Any]]:
        """The next batch and state; ``None`` at the data's end; ``NOT_YET`` when ``within`` seconds (None: no
        bound) passed first."""
        if self._ended:
            return None
        deadline = None if within is None else time.monotonic() + within
        while True:
            wait = _READER_POLL if deadline is None else min(_READER_POLL, max(0.0, deadline - time.monotonic()))
            try:
                item = self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait()
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the batch reader thread ended without a word") from None
                if deadline is not None and time.monotonic() >= deadline:
                    return self.NOT_YET
        if item is self._END:
            self._ended = True
            self._thread.join(_READER_POLL)
            return None
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        return item

    def close(self, interrupt: Optional[Callable[[], None]] = None) -> None:
        """Stop reading; with ``interrupt`` (which ends a pull under way: the data's ``close``), wait until the
        thread ended (``RuntimeError`` if it did not within ``STOP_WITHIN``), so that nothing reads the data
        any more."""
        self._stop.set()
        if interrupt is None:
            self._thread.join(2 * _READER_POLL)
            return
        interrupt()
        self._thread.join(STOP_WITHIN.total_seconds())
        if self._thread.is_alive():
            raise RuntimeError(f"the batch reader thread did not stop within {STOP_WITHIN.total_seconds():g} s")
