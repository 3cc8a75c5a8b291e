"""A worker's row traffic across steps: rows read ahead, the row cache, pushes in flight, and the staleness bound.

Owns ``RowPipeline``.  A step needs its batch's rows before its forward
pass and sends their gradients during its backward pass.  Sent one after
the other, a step waits for a lookup, then for its push, and each shard
handles two messages per worker per step.  The pipeline lets one message
do both (ps-lite's push-pull): a message carries pushes and the lookups
of later steps, and each shard reads those rows right after applying the
pushes.  Two numbers shape it: the staleness ``k`` and the row cache's
window ``L`` (``cache_steps``, 1 to ``k + 1``; 1 without a cache).  A
message leaves every ``L`` steps, carrying the pushes of those ``L``
steps and the rows of the next ``L`` steps from ``d = k + 1 - L`` steps
on; the ``L`` steps of a window share one read (``row_cache.RowWindow``):
a row several of them need crosses the wire once.

* ``staleness = 0`` (the default, ``L = 1``): the push of step ``t``
  carries step ``t + 1``'s lookups, and step ``t`` ends once it is applied.
  Step ``t + 1``'s rows are read after step ``t``'s update, as an unpipelined
  step reads them (its lookup leaves after the push is applied), so the
  results are bit-identical to it.  Each shard handles one message per
  worker per step instead of two.
* ``staleness = k >= 1``: pushes are applied in the background.  The
  message sent after step ``r`` is waited for before step ``r + d + 1``
  (with ``L = 1``: after step ``t`` the worker waits for the push of step
  ``t - k``).  Rows read by it serve steps up to ``r + d + L``, so they miss
  at most the updates of the ``k`` steps before the one they serve, and a
  worker never runs more than ``k`` steps ahead of its oldest unapplied
  push (a held one included: pushes wait at most ``L - 1`` steps for their
  message).  Other workers' rows are bound by the same rule one step later:
  the group's all-reduce keeps every member within a step of the others.
  The dense part stays synchronous (DDP).  Fewer messages are what the
  cache buys: each shard handles one per worker every ``L`` steps.  The
  Trainer's default ``L`` follows the host (``default_window``): ``k``
  where it has more cores than the cluster's processes on it (a message
  then overlaps a step instead of being waited for at once), else
  ``k + 1`` (CPU is short: the fewest messages win).

A read that no message carried (the first steps, after an agreement that
reads do not cross, after ``drop_reads``) is sent when its step starts:
for up to ``k + 1`` steps when no push is outstanding, else for that step
alone (its rows then miss only the outstanding pushes, within the bound).
Reads never go past the last step.  Before what takes the model as of a
step (a checkpoint, a live export, an evaluation, the end: the Trainer
says when) every push is sent and applied (``drain``), so a checkpoint
holds every update up to its step; otherwise pushes in flight cross the
group's agreements.  A read changes nothing on a fixed table, so reads of
fixed tables cross agreements.  A dynamic table's read admits and touches
ids (once per window, at its first step), so with one among the tables reads
stop at the next agreement, and a checkpoint holds no read of a later
step.  A step's batch is read ahead only when its checks pass: a bad batch
is refused in its turn, by the step it belongs to.  When the step is
redone, the group re-forms, or the sparse part is rebuilt, the reads ahead
are dropped (``drop_reads``).  Their steps look their rows up again.

A push that fails against a lost shard is kept, restricted to the shards
it failed against, and its step is counted neither applied nor lost yet:
once the Trainer has rebuilt the sparse part (every shard serves again),
``rebuilt`` sends the kept pushes again, in step order, through the new
collection, and waits for them (a shard that replayed one from its push
log skips it: pushes are idempotent per pusher and step).  It first asks
every shard served by a new process for its ledger (``AckedSteps``): the
steps that process lost of what the old one had acknowledged are counted
lost.  A push refused by a shard is lost, and the Trainer raises the
refusal.

The cache's memory is bounded (``cache_rows``, ``cache_bytes``, and per
table a ``Table``'s ``cache_rows``): the windows alive at once (those read
ahead: a window goes when its last step takes its rows) hold at most that
many rows and bytes of rows, each window being cut short to fit its share,
except that a step's own rows are read even when they alone exceed it.
Its figures (``cache``): rows read, hits (rows a step needed that its
window had read already), bytes those saved, evictions (rows dropped when
their window ends) and rows held.
"""

import collections
import datetime
import logging
import math
import time
from typing import Callable, Deque, Dict, List, Mapping, Optional, Protocol, Sequence, Set, Tuple

from torch import Tensor

from ..logs import RateLimitedLog
from ..shards.client.collection import (CollectionLookup, EmbeddingCollection, PendingPush, PushOnGradients,
                                        ShardRequestFailed, StepPush)
from ..shards.client.row_cache import RowWindow
from .acked import AckedSteps, describe_steps
from .contract import Batch, Table

logger = logging.getLogger(__name__)

#: A wait for an old push longer than this is logged (at a bounded rate): a shard applies slowly.
SLOW_PUSH = datetime.timedelta(seconds=1)


class RowCacheRecorder(Protocol):
    """What the pipeline records of its row cache (``paramserver.metrics.data_plane.DataPlaneMetrics`` has
    it): rows read, hits, bytes the hits saved and evictions since the last call, and rows held now."""

    def row_cache(self, rows_read: int, hits: int, bytes_saved: int, evictions: int, rows_held: int) -> None: ...


class RowCacheFigures:
    """The row cache's counters (``RowPipeline.cache``): rows read, hits, bytes saved, evictions, rows held."""

    def __init__(self):
        self.rows_read = self.hits = self.bytes_saved = self.evictions = self.rows_held = 0
        self.windows = 0

    def figures(self) -> Dict[str, float]:
        """The job's figures (``row_cache.*``)."""
        needed = self.rows_read + self.hits
        figures = {"hit_rate": self.hits / needed if needed else 0.0, "rows_read": self.rows_read,
                   "hits": self.hits, "bytes_saved": self.bytes_saved, "evictions": self.evictions,
                   "rows_held": self.rows_held, "windows": self.windows}
        return {f"row_cache.{name}": value for name, value in figures.items()}


def default_window(staleness: int, cores_to_spare: bool) -> int:
    """The row cache's window ``L`` when the Trainer is not given one: 1 at ``staleness = 0``; else ``k`` steps on
    a host with more cores than the cluster's processes on it, so that each message has a step to cross in
    (``d = 1``), and ``k + 1`` on a host without, where each message costs CPU that the steps need and the
    fewest messages win (``d = 0``: a message is waited for before the next step)."""
    return max(1, staleness) if cores_to_spare else staleness + 1


class RowPipeline:
    """The reads ahead, row cache and pushes in flight of one worker's steps (see the module's docstring).

    ``upcoming(offset)``: the batch ``offset`` steps after the current
    one, or ``None`` when the data ends first.  ``tables``: the Trainer's
    tables, which a batch is checked against before it is read ahead.
    ``read_ahead``: False looks every step's rows up when the step
    starts and waits for its push (the unpipelined step, kept for
    comparison).  ``next_agreement()`` (the step of the group's next
    agreement) and ``last_step`` bound the reads ahead (agreements only
    when a table is dynamic).  ``cache_steps``
    (``L``, 1 to ``staleness + 1``): steps per window and per message;
    ``cache_rows``: the most rows the windows alive at once hold, and
    ``cache_bytes`` the most bytes of rows (``None``: no bound);
    ``recorder``: where the cache's figures go (``None``: nowhere).
    ``applied``/``lost`` count the steps whose pushes were applied, and
    those lost: refused by a shard, still kept when the worker ended
    (``abandon``), or rolled back on a shard that came back without them
    (moved from ``applied``: each step is counted once, in one of the two).
    ``replayed``: this worker's pushes that shard processes replayed from
    their push logs.  The Trainer checks its arguments.
    """

    def __init__(self, staleness: int, upcoming: Callable[[int], Optional[Batch]], tables: Mapping[str, Table],
                 next_agreement: Callable[[], int], last_step: int, read_ahead: bool = True, cache_steps: int = 1,
                 cache_rows: Optional[int] = None, recorder: Optional[RowCacheRecorder] = None,
                 cache_bytes: Optional[int] = None):
        self.staleness, self.read_ahead = staleness, read_ahead
        self.window, self._depth = cache_steps, staleness + 1 - cache_steps
        # The windows alive at once: those read ahead, up to k + 1 steps on (a window goes when its last step
        # takes its rows, before the next is read); each gets its share of the bounds.
        alive = math.ceil((staleness + 1) / cache_steps)
        self._window_rows = None if cache_rows is None else max(1, cache_rows // alive)
        self._window_bytes = None if cache_bytes is None else max(1, cache_bytes // alive)
        self._window_table_rows = {name: max(1, table.cache_rows // alive) for name, table in tables.items()
                                   if table.cache_rows is not None}
        self._upcoming, self._tables = upcoming, tables
        self._next_agreement, self._last_step = next_agreement, last_step
        self._reads_cross_agreements = not any(table.dynamic for table in tables.values())
        self._reads: Dict[int, RowWindow] = {}
        self._held: List[StepPush] = []
        self._planned: Optional[RowWindow] = None  # the window the push being made carries (``push``/``pushed``)
        self._pushes: Deque[Tuple[int, PendingPush]] = collections.deque()
        self.applied = self.lost = 0
        #: Pushes that failed against lost shards, each restricted to those shards, sent again after the
        #: sparse part is rebuilt (``rebuilt``); their steps are counted neither applied nor lost meanwhile.
        self._kept: List[StepPush] = []
        self._doomed: Set[int] = set()  # kept steps rolled back on another shard: lost once settled
        self._acked = AckedSteps()
        self._incarnations: Optional[Dict[str, int]] = None  # the shard processes whose ledgers were read
        #: Pushes of this worker that the shard processes it pushes to replayed from their push logs.
        self.replayed = 0
        self.cache = RowCacheFigures()
        self._recorder = recorder
        self._slow = RateLimitedLog(logger, "waited for {count} slow push{s} of earlier steps", level=logging.WARNING)

    def describe(self) -> str:
        """One line for the log: the staleness, and the window that pushes and reads leave in."""
        if not self.read_ahead:
            return "rows looked up as each step starts"
        bound = "exact" if self.staleness == 0 else f"staleness {self.staleness}"
        return f"{bound}, a message per shard every {self.window} step{'s' if self.window != 1 else ''}"

    def _horizon(self, step: int) -> int:
        """The first step whose rows must not be read during ``step``: the end, or the next agreement when a
        table is dynamic (after ``step``: a step's own rows are always read)."""
        if self._reads_cross_agreements:
            return self._last_step
        return min(self._last_step, max(step + 1, self._next_agreement()))

    def _window(self, collection: EmbeddingCollection, step: int, first: int, last: int,
                batch: Optional[Batch] = None) -> Optional[RowWindow]:
        """Steps ``first`` to ``last`` (planned during ``step``; ``batch`` is ``step``'s own) as one window, cut
        where a batch is missing or refused (the step it belongs to raises that in its turn) or at the row
        bound; ``None`` when not even ``first`` is there."""
        steps, distinct = [], {}
        for later in range(first, last + 1):
            ahead = batch if later == step else self._upcoming(later - step)
            if ahead is None:
                break
            if later != step:
                try:
                    ahead.check(self._tables)
                except (ValueError, TypeError, IndexError):  # what Batch.check refuses
                    break
            steps.append((later, ahead.sparse))
            distinct[later] = ahead.distinct
        if not steps:
            return None

        def window_of(run: List[Tuple[int, Mapping[str, Tensor]]]) -> RowWindow:
            return RowWindow(collection, run, max_rows=self._window_rows, distinct=distinct,
                             max_bytes=self._window_bytes, max_table_rows=self._window_table_rows)

        try:
            return window_of(steps)
        except (ValueError, TypeError, IndexError):  # a table's route refuses a later batch's ids: not read ahead
            if steps[0][0] == step:  # the step's own refusal raises
                return window_of(steps[:1])
            return None

    def rows(self, collection: EmbeddingCollection, step: int, batch: Batch) -> CollectionLookup:
        """Step ``step``'s lookup: from its window, read ahead, or sent now (for the following steps too, up to
        the staleness, when no push is outstanding)."""
        window = self._reads.pop(step, None)
        if window is None or window.collection is not collection:
            quiet = not self._pushes and not self._held and not self._kept
            last = min(step + self.staleness, self._horizon(step) - 1) if self.read_ahead and quiet else step
            window = self._window(collection, step, step, last, batch)
            window.read(collection.lookup_planned(window.plan))
            self._count_read(window)
            for later in window.steps[1:]:
                self._reads[later] = window
        lookup = window.lookup(step)
        if window.steps[-1] == step:  # its last step: its rows go
            self._evict(window)
        return lookup

    def push(self, lookup: CollectionLookup, step: int) -> PushOnGradients:
        """Step ``step``'s push, made during its backward pass: held for a later message (a window's steps but
        its last), or sent with the pushes held so far, carrying the next window's reads."""
        collection = lookup.collection
        horizon = self._horizon(step)
        if self.read_ahead and len(self._held) + 1 < self.window and step + 1 in self._reads and \
                step + 1 < horizon:
            return lookup.push_during_backward(step, hold=True)
        then = None
        if self.read_ahead:
            first = step + 1
            while first in self._reads:
                first += 1
            last = min(step + self._depth + self.window, horizon - 1)
            if first <= last:
                window = self._window(collection, step, first, last)
                if window is not None:
                    self._planned = window
                    then = window.plan
        return lookup.push_during_backward(step, then=then, earlier=list(self._held))

    def pushed(self, step: int, push: PushOnGradients) -> List[Tuple[int, BaseException]]:
        """Step ``step``'s push was made (during its backward pass): held, or in flight with the pushes held
        before it; then wait for the messages beyond the staleness.  Returns the steps whose pushes failed,
        with why."""
        planned, self._planned = self._planned, None
        try:
            pending = push.sent()
        except Exception as error:  # noqa: BLE001 - sending it failed: kept to send again, or lost
            steps = [held.step for held in self._held] + [step]
            self._held.clear()
            return self._failed(steps, push.unsent, error, sent=False) + self.drain()
        if push.holding:
            if push.held is not None:
                self._held.append(push.held)
            else:  # the backward pass never reached the rows: nothing to apply, the step's update is done
                self.applied += 1
        else:
            self._held.clear()
            if pending.then is not None and planned is not None:
                window = planned.read(pending.then)
                self._count_read(window)
                for later in window.steps:
                    self._reads[later] = window
            if pending.steps:
                self._pushes.append((step, pending))
        return self._settle(lambda sent_after: sent_after <= step - self._depth)

    def drain(self) -> List[Tuple[int, BaseException]]:
        """Send the held pushes and wait until every push in flight is applied (or failed): before an
        agreement, an evaluation, a rebuild, the end."""
        failures = []
        if self._held:
            held, self._held = self._held, []
            try:
                self._pushes.append((held[-1].step, held[0].collection.send(held)))
            except Exception as error:  # noqa: BLE001 - sending them failed: kept to send again, or lost
                failures.extend(self._failed([push.step for push in held], held, error))
        return failures + self._settle(lambda _sent_after: True)

    def kept(self, step: int) -> bool:
        """Whether the push of ``step`` failed against lost shards and is kept to be sent again (``rebuilt``)."""
        return any(push.step == step for push in self._kept)

    def rebuilt(self, before: EmbeddingCollection, collection: EmbeddingCollection) -> List[Tuple[int, BaseException]]:
        """The sparse part was rebuilt (``before`` -> ``collection``; every push in flight settled first).

        Each shard served by another process now tells its ledger
        (``EmbeddingCollection.push_ledgers``): the pushes it replayed
        from its push log are counted (``replayed``), and the steps it had
        acknowledged but holds no more (rolled back: no log, a corrupt log,
        a lost disk) are counted lost, each step once however many shards
        lost it, with one warning line per shard.  Then the kept pushes go
        again, in step order, through ``collection``, to the shards they
        failed against, and are waited for: a shard skips a step it
        applied already (pushes are idempotent per pusher and step).
        Returns the steps whose pushes failed again, with why (kept again,
        or lost when refused).  A shard that does not tell its ledger
        raises its ``ShardRequestFailed`` (the kept pushes stay kept).
        """
        if self._incarnations is None:
            self._incarnations = before.incarnations()
        now = collection.incarnations()
        replaced = [shard for shard, incarnation in now.items() if self._incarnations.get(shard) != incarnation]
        ledgers = collection.push_ledgers(replaced) if replaced else {}
        self._incarnations = now
        self._reconcile({shard: ledgers[shard] for shard in replaced})
        if not self._kept:
            return []
        kept, self._kept = sorted(self._kept, key=lambda push: push.step), []
        try:
            self._pushes.append((kept[-1].step, collection.send(kept)))
        except Exception as error:  # noqa: BLE001 - sending them failed: kept again, or lost
            return self._failed([push.step for push in kept], kept, error)
        return self._settle(lambda _sent_after: True)

    def abandon(self) -> None:
        """The worker ends, or gives up on the shards: the kept pushes are lost."""
        for push in self._kept:
            self._count(push.step, applied=False)
        self._kept.clear()

    def _reconcile(self, ledgers: Mapping[str, Tuple[int, int]]) -> None:
        """Shards served by new processes told their ledgers (shard -> the newest step of this worker's they
        hold, pushes they replayed): the steps each had acknowledged after that one move from applied to lost,
        each step once however many shards lost it."""
        rolled_back: Set[int] = set()
        for shard, (applied, replayed) in ledgers.items():
            self.replayed += replayed
            rolled = self._acked.rolled_back(shard, applied)
            if rolled:
                plural = "s" if len(rolled) > 1 else ""
                logger.warning("shard %s came back without the pushes of %d step%s it had applied (step%s %s; it "
                               "holds this worker's up to step %d): counted lost", shard, len(rolled), plural, plural,
                               describe_steps(rolled), applied)
                rolled_back.update(rolled)
        self._acked.forget(sorted(rolled_back))  # counted lost now, whichever other shard loses them later
        kept = {push.step for push in self._kept}
        for step in rolled_back:
            if step in kept:
                self._doomed.add(step)
            else:
                self.applied -= 1
                self.lost += 1

    def _count(self, step: int, applied: bool) -> None:
        """The push of ``step`` settled: applied (unless rolled back meanwhile on a shard) or lost."""
        if step in self._doomed:
            self._doomed.discard(step)
            applied = False
        if applied:
            self.applied += 1
        else:
            self.lost += 1

    def _acknowledged(self, push: StepPush, failed: Sequence[str] = ()) -> None:
        for shard in push.by_shard:
            if shard not in failed:
                self._acked.add(shard, push.step)

    def _failed(self, steps: Sequence[int], pushes: Sequence[StepPush], error: BaseException,
                sent: bool = True) -> List[Tuple[int, BaseException]]:
        """The message carrying the pushes of ``steps`` (``pushes``: those that have rows) failed with ``error``:
        a step whose push failed against lost shards is kept, restricted to them; refused (``ShardRefused``
        carried), or failed otherwise, it is lost; a step with nothing on those shards is applied, and so is
        a step without a push in a message that left (its rows got no gradient; ``sent``: False when making or
        sending the message failed, where such a step's push may never have been made: lost).  Returns the
        steps kept or lost, with why."""
        failed: Optional[Set[str]] = None  # None: which shards is not known (sending failed): every shard
        keep = isinstance(error, (RuntimeError, TimeoutError))
        if isinstance(error, ShardRequestFailed):
            failed = {shard for shard, _ in error.failures}
            keep = error.refusal() is None
        if not keep:
            for step in steps:
                self._count(step, applied=False)
            return [(step, error) for step in steps]
        by_step = {push.step: push for push in pushes}
        failures = []
        for step in steps:
            push = by_step.get(step)
            if push is None:  # its rows got no gradient (or, not sent, its push was never made)
                self._count(step, applied=sent)
                if not sent:
                    failures.append((step, error))
                continue
            on_failed = [shard for shard in push.by_shard if failed is None or shard in failed]
            self._acknowledged(push, on_failed)
            if not on_failed:
                self._count(step, applied=True)
            elif step < 0:  # not idempotent: never sent again
                self._count(step, applied=False)
                failures.append((step, error))
            else:
                self._kept.append(StepPush(push.collection, step, {shard: push.by_shard[shard]
                                                                   for shard in on_failed}))
                failures.append((step, error))
        return failures

    def drop_reads(self) -> None:
        """Forget the rows read ahead: their steps look them up again."""
        for window in set(self._reads.values()):
            self._evict(window)
        self._reads.clear()

    def _count_read(self, window: RowWindow) -> None:
        cache = self.cache
        cache.windows += 1
        cache.rows_read += window.rows_held
        cache.hits += window.row_hits
        cache.bytes_saved += window.bytes_saved
        cache.rows_held += window.rows_held
        if self._recorder is not None:
            self._recorder.row_cache(window.rows_held, window.row_hits, window.bytes_saved, 0, cache.rows_held)

    def _evict(self, window: RowWindow) -> None:
        cache = self.cache
        cache.evictions += window.rows_held
        cache.rows_held -= window.rows_held
        if self._recorder is not None:
            self._recorder.row_cache(0, 0, 0, window.rows_held, cache.rows_held)

    def _settle(self, due: Callable[[int], bool]) -> List[Tuple[int, BaseException]]:
        """Wait for the messages in flight, oldest first, while ``due(the step they were sent after)``."""
        failures = []
        while self._pushes and due(self._pushes[0][0]):
            sent_after, pending = self._pushes.popleft()
            started = time.perf_counter()
            try:
                pending.wait()
            except (RuntimeError, TimeoutError) as error:
                failures.extend(self._failed(pending.steps, pending.pushes, error))
            else:
                for push in pending.pushes:
                    self._acknowledged(push)
                for step in pending.steps:
                    self._count(step, applied=True)
            waited = time.perf_counter() - started
            if waited > SLOW_PUSH.total_seconds():
                steps = ", ".join(map(str, pending.steps))
                plural = "s" if len(pending.steps) > 1 else ""
                self._slow.record("slow", f"waited {waited:.1f} s for the push of step{plural} {steps} "
                                          f"(staleness {self.staleness})")
        return failures

    def close(self) -> None:
        self._slow.flush()
