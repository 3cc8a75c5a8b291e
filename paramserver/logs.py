"""Log set-up for paramserver's processes: one readable line per event, to stderr.

Owns the log format and level of ps-server, ps-worker, ps-ctl and every
shard server (``--log-level``, defaulting to ``PARAMSERVER_LOG_LEVEL``,
else INFO), how an error or a reason is written on one line (``one_line``:
a reason ends up in a status table and in a worker's last line),
logging a repeated event at a bounded rate (``RateLimitedLog``: the first
occurrence at once, then one line per interval with a count), ending a
process at once with its log written (``exit_now``), and the level of
PyTorch's C++ log lines in the commands' processes (``quiet_cpp_warnings``).
"""

import collections
import datetime
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional, Union

LOG_LEVEL_ENV = "PARAMSERVER_LOG_LEVEL"

#: How often ``RateLimitedLog`` sums up an event that keeps recurring.
REPEAT_SUMMARY_EVERY = datetime.timedelta(seconds=10)
#: The example occurrence a summary line quotes is cut to this many characters.
MAX_EXAMPLE_CHARS = 300
#: How long a one-line reason may be.
MAX_REASON_CHARS = 300


#: PyTorch's C++ log level (c10's logging: TensorPipe's and gloo's lines), read once when torch is imported.
CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"


def quiet_cpp_warnings(environ=None) -> None:
    """Leave PyTorch's C++ WARNING lines out of this process and the processes it starts (ERROR and FATAL ones
    still print), unless ``TORCH_CPP_LOG_LEVEL`` says otherwise; call it before torch is imported.

    TensorPipe logs a WARNING at a member for every pipe that a peer which left had opened to it (``RPC agent
    for shard0 encountered error when reading incoming request from worker1: EOF``): the side that accepted a
    pipe always has a read pending, and takes its end as expected only while it shuts down itself
    (tensorpipe_agent.cpp, ``respond``).  So a worker that finishes its job while the shards serve on makes
    each shard print one, whatever the order of leaving, and torch has no switch for one pipe or one peer: the
    level is the only way.  What such a line would tell of a member that died, the commands say in their own
    lines (the coordinator's ``declared dead`` or ``exited``, a worker's failed step).  Set
    ``TORCH_CPP_LOG_LEVEL=WARNING`` (or ``INFO``) to see them.
    """
    environ = os.environ if environ is None else environ
    environ.setdefault(CPP_LOG_LEVEL_ENV, "ERROR")


def default_log_level() -> str:
    return os.environ.get(LOG_LEVEL_ENV, "INFO").upper()


def configure_logging(process: str, level: Optional[str] = None, replace: bool = True) -> None:
    """Log lines look like ``2026-11-21 13:05:01,123 shard0 INFO paramserver.x: message``.

    ``replace=False`` leaves a process that set up logging itself alone.
    """
    if not replace and logging.getLogger().handlers:
        return
    logging.basicConfig(level=(level or default_log_level()).upper(), stream=sys.stderr, force=True,
                        format=f"%(asctime)s {process} %(levelname)s %(name)s: %(message)s")


def one_line(what: Union[BaseException, str], limit: int = MAX_REASON_CHARS) -> str:
    """An error as ``Type: first line of its message``, or a text with its line breaks and runs of spaces
    collapsed; at most ``limit`` characters.  An error's later lines are tracebacks (a remote one, a C++
    one): its first line says what happened."""
    if isinstance(what, BaseException):
        lines = [line for line in str(what).strip().splitlines() if line.strip()]
        text = f"{type(what).__name__}: {lines[0].strip() if lines else ''}".rstrip(": ")
    else:
        text = " ".join(str(what).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def exit_now(code: int) -> None:
    """Write out the log and the standard streams, then end the process without the interpreter's teardown
    (torch's destructors can take seconds, or wait on peers that are gone)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start_daemon_timer(seconds: float, callback: Callable[[], None]):
    timer = threading.Timer(seconds, callback)
    timer.daemon = True  # a pending summary never holds up a process's exit
    timer.start()
    return timer


class RateLimitedLog:
    """A repeated event, logged at a bounded rate: the first occurrence in full at once, then one line per
    ``interval`` that counts the occurrences by kind.

    ``summary`` names the count, with ``{count}`` (``5,864``) and ``{s}`` (a plural "s")::

        refusals = RateLimitedLog(logger, "refused {count} call{s}")
        refusals.record("INVALID_ARGUMENT", "refused Join from ipv4:10.0.0.3:51234: INVALID_ARGUMENT: name is empty")

    While occurrences keep coming, each interval ends with one line such as
    ``refused 5,864 calls in the last 10 s: INVALID_ARGUMENT 5,800, UNAUTHENTICATED 64; latest: ...``;
    an interval without any ends the spell, and the next occurrence is logged in full at once again.
    So a flood costs one line per interval, and a lone event still shows as it happens.  ``flush()``
    writes what is counted so far (a server calls it when it stops).  Thread-safe; ``clock`` and
    ``start_timer(seconds, callback)`` (returning something with ``cancel()``) are injectable for tests.
    """

    def __init__(self, logger: logging.Logger, summary: str,
                 interval: datetime.timedelta = REPEAT_SUMMARY_EVERY, level: int = logging.INFO,
                 clock: Callable[[], float] = time.monotonic,
                 start_timer: Callable[[float, Callable[[], None]], object] = _start_daemon_timer):
        if interval.total_seconds() <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        summary.format(count="2", s="s")  # a template with other fields fails here, not in a timer thread
        self._logger = logger
        self._summary = summary
        self._seconds = interval.total_seconds()
        self._level = level
        self._clock = clock
        self._start_timer = start_timer
        self._lock = threading.Lock()
        self._counts: collections.Counter = collections.Counter()
        self._latest = ""
        self._since: Optional[float] = None  # when the current interval began; None: quiet, nothing counted
        self._timer = None
        self._intervals = 0  # numbers the intervals, so that a stale timer (flushed meanwhile) does nothing

    def record(self, kind: str, message: str) -> None:
        """One occurrence of kind ``kind`` (a short word, counted); ``message`` is its own one-line account."""
        with self._lock:
            if self._since is not None:
                self._counts[kind] += 1
                self._latest = message
                return
            self._begin_interval()
        self._logger.log(self._level, "%s", message)

    def _begin_interval(self) -> None:
        self._intervals += 1
        number = self._intervals
        self._since = self._clock()
        self._timer = self._start_timer(self._seconds, lambda: self._end_interval(number))

    def _end_interval(self, number: int) -> None:
        with self._lock:
            if number != self._intervals:
                return
            line = self._take_summary()
            if line is None:  # a quiet interval ends the spell
                self._since = self._timer = None
            else:
                self._begin_interval()
        if line is not None:
            self._logger.log(self._level, "%s", line)

    def _take_summary(self) -> Optional[str]:
        """The line for what was counted this interval (None when nothing was); resets the counts."""
        total = sum(self._counts.values())
        if not total:
            return None
        seconds = self._clock() - self._since
        kinds = ", ".join(f"{kind} {count:,}" for kind, count in self._counts.most_common())
        latest = self._latest if len(self._latest) <= MAX_EXAMPLE_CHARS else self._latest[:MAX_EXAMPLE_CHARS] + "..."
        self._counts.clear()
        self._latest = ""
        return (f"{self._summary.format(count=f'{total:,}', s='' if total == 1 else 's')} in the last "
                f"{seconds:.3g} s: {kinds}; latest: {latest}")

    def flush(self) -> None:
        """Write what is counted so far and end the spell: the next occurrence is logged in full at once."""
        with self._lock:
            line = self._take_summary() if self._since is not None else None
            if self._timer is not None:
                self._timer.cancel()
            self._intervals += 1
            self._since = self._timer = None
        if line is not None:
            self._logger.log(self._level, "%s", line)
