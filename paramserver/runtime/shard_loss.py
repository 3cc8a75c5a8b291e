"""Surviving a lost shard, on the trainer's side: waiting for it to come back and rebuilding what pointed at it.

Owns the trainer's handles on the shards (tables, ``DistributedOptimizer``)
across a shard's restart.  Those handles are RRefs bound to the process that
owned them: when a shard process dies, ``ps-server`` starts a new one under
the same name, which restores its tables from the newest checkpoint (see
``paramserver.shards.snapshot``), and every handle built against the old
process is stale.  ``SparsePart`` keeps whatever ``build(shards)`` returns
and, after a step failed against a shard, builds it again once every shard
it uses is serving, a bounded number of times within a bounded time.  The
new handles are built before the old ones are dropped, so that what the
surviving shards hold for several trainers (a shared optimizer and its
state) is never released in between.

Which steps are redone is the training loop's decision (see
``workers.ctr``): a step that failed before any collective of its trainer
group is redone; one that failed later is not.
"""

import datetime
import logging
import time
from typing import Callable, Generic, List, Optional, Sequence, TypeVar

logger = logging.getLogger(__name__)

Built = TypeVar("Built")

#: How long a trainer waits for lost shards to serve again before it gives up.
SHARD_RETURN_TIMEOUT = datetime.timedelta(seconds=120)
#: Rebuilds in a row (without a good step between them) before the trainer gives up.
MAX_CONSECUTIVE_REBUILDS = 3


class ShardLost(RuntimeError):
    """A shard did not come back in time, or steps kept failing after it did."""


class SparsePart(Generic[Built]):
    """``build(shards)``'s result (``.built``), rebuilt by ``rebuild(cause)`` after a shard was lost.

    ``live_shards()`` lists the shards serving now (the coordinator's view,
    refreshed by ``refresh()``).  Call ``step_succeeded()`` after each good
    step: it resets the count of rebuilds in a row.
    """

    def __init__(self, build: Callable[[Sequence[str]], Built], shards: Sequence[str],
                 live_shards: Callable[[], List[str]], refresh: Callable[[], None] = lambda: None,
                 timeout: datetime.timedelta = SHARD_RETURN_TIMEOUT,
                 max_consecutive: int = MAX_CONSECUTIVE_REBUILDS):
        self._build = build
        self.shards = list(shards)
        self._live_shards = live_shards
        self._refresh = refresh
        self._timeout = timeout
        self._max_consecutive = max_consecutive
        self._in_a_row = 0
        self.rebuilds = 0
        self.built: Built = build(self.shards)

    def step_succeeded(self) -> None:
        self._in_a_row = 0

    def rebuild(self, cause: BaseException) -> None:
        """Wait until every shard serves again, then build anew; ``ShardLost`` when that cannot be done."""
        self._in_a_row += 1
        if self._in_a_row > self._max_consecutive:
            raise ShardLost(f"{self._in_a_row - 1} rebuilds in a row did not make a step succeed; "
                            f"last failure: {_one_line(cause)}") from cause
        logger.warning("a step failed against the shards (%s); rebuilding the sparse part once %s serve",
                       _one_line(cause), ", ".join(self.shards))
        started = time.monotonic()
        deadline = started + self._timeout.total_seconds()
        last_error: Optional[BaseException] = None
        while True:
            self._refresh()
            missing = sorted(set(self.shards) - set(self._live_shards()))
            if not missing:
                try:
                    built = self._build(self.shards)
                except Exception as error:  # noqa: BLE001 - e.g. the restarted shard not reachable yet
                    last_error = error
                else:
                    self.built = built  # the old handles go only now: see the module's docstring
                    self.rebuilds += 1
                    logger.warning("sparse part rebuilt after %.1f s (rebuild %d)", time.monotonic() - started,
                                   self.rebuilds)
                    return
            if time.monotonic() > deadline:
                raise ShardLost(f"shards {', '.join(missing) or ', '.join(self.shards)} did not serve again within "
                                f"{self._timeout.total_seconds():.0f} s"
                                + (f"; last error: {_one_line(last_error)}" if last_error else "")) from cause
            time.sleep(0.5)


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"
