"""A worker's row traffic across steps: rows read ahead, pushes in flight, and the staleness bound between them.

Owns ``RowPipeline``.  A step needs its batch's rows before its forward
pass and sends their gradients during its backward pass.  Sent one after
the other, a step waits for a lookup, then for its push, and each shard
handles two messages per worker per step.  The pipeline lets one message
do both (ps-lite's push-pull): the push of step ``t`` carries the lookups
of step ``t + 1 + staleness``, and each shard reads those rows right after
applying the push.

* ``staleness = 0`` (the default): the push of step ``t`` carries step
  ``t + 1``'s lookups, and step ``t`` ends once it is applied.  Step
  ``t + 1``'s rows are read after step ``t``'s update, as an unpipelined
  step reads them (its lookup leaves after the push is applied), so the
  results are bit-identical to it.  Each shard handles one message per
  worker per step instead of two.
* ``staleness = k >= 1``: pushes are applied in the background.  After
  step ``t`` the worker waits only for the push of step ``t - k``, which
  carried step ``t + 1``'s rows.  So it never runs more than ``k`` steps
  ahead of its oldest unapplied push, and rows it reads miss at most its
  own updates of the last ``k`` steps.  Other workers' rows are bound by
  the same rule one step later: the group's all-reduce keeps every member
  within a step of the others, so the bound for them is ``k + 1``.  The
  dense part stays synchronous (DDP).

Reads never go past the last step.  Before an agreement of the group
(every ``agree_every`` steps, where checkpoints are written) every push
is applied (``drain``), so a checkpoint holds every update up to its step.
A read changes nothing on a fixed table, so reads of fixed tables cross
agreements.  A dynamic table's read admits and touches ids, so with one
among the tables reads stop at the next agreement, and a checkpoint holds
no read of a later step.  After such an agreement the next steps' rows
are looked up on their own, all at once, until pushes carry them again.  A step's batch is read ahead only when its
checks pass: a bad batch is refused in its turn, by the step it belongs
to.  When the step is redone, the group re-forms, or the sparse part is
rebuilt, the reads ahead are dropped (``drop_reads``).  Their steps look
their rows up again.
"""

import collections
import datetime
import logging
import time
from typing import Callable, Deque, Dict, List, Mapping, Optional, Tuple

from ..logs import RateLimitedLog
from ..shards.client.collection import CollectionLookup, EmbeddingCollection, LookupPlan, PendingPush, PushOnGradients
from .contract import Batch, Table

logger = logging.getLogger(__name__)

#: A wait for an old push longer than this is logged (at a bounded rate): a shard applies slowly.
SLOW_PUSH = datetime.timedelta(seconds=1)


class RowPipeline:
    """The reads ahead and pushes in flight of one worker's steps (see the module's docstring).

    ``upcoming(offset)``: the batch ``offset`` steps after the current
    one, or ``None`` when the data ends first.  ``tables``: the Trainer's
    tables, which a batch is checked against before it is read ahead.
    ``read_ahead``: False looks every step's rows up when the step
    starts and waits for its push (the unpipelined step, kept for
    comparison).  ``agree_every`` and ``last_step`` bound the reads
    ahead (agreements only when a table is dynamic).  ``applied``/``lost``
    count the pushes that were applied, and those that failed against a
    shard.  The Trainer checks ``staleness`` and ``read_ahead``.
    """

    def __init__(self, staleness: int, upcoming: Callable[[int], Optional[Batch]], tables: Mapping[str, Table],
                 agree_every: int, last_step: int, read_ahead: bool = True):
        self.staleness, self.read_ahead = staleness, read_ahead
        self._upcoming, self._tables = upcoming, tables
        self._agree_every, self._last_step = agree_every, last_step
        self._reads_cross_agreements = not any(table.dynamic for table in tables.values())
        self._reads: Dict[int, CollectionLookup] = {}
        self._pushes: Deque[Tuple[int, PendingPush]] = collections.deque()
        self.applied = self.lost = 0
        self._slow = RateLimitedLog(logger, "waited for {count} slow push{s} of earlier steps", level=logging.WARNING)

    def _horizon(self, step: int) -> int:
        """The first step whose rows must not be read during ``step``: the end, or the next agreement when a
        table is dynamic."""
        if self._reads_cross_agreements:
            return self._last_step
        return min(self._last_step, (step // self._agree_every + 1) * self._agree_every)

    def _plan(self, collection: EmbeddingCollection, step: int, later: int) -> Optional[LookupPlan]:
        """Step ``later``'s lookups, planned during ``step``; ``None`` when its batch is not there or is refused
        (the step it belongs to raises that in its turn)."""
        batch = self._upcoming(later - step)
        if batch is None:
            return None
        try:
            batch.check(self._tables)
            return collection.plan_lookup(batch.sparse, later)
        except (ValueError, TypeError, IndexError):  # what Batch.check and a table's route refuse
            return None

    def rows(self, collection: EmbeddingCollection, step: int, batch: Batch) -> CollectionLookup:
        """Step ``step``'s lookup: read ahead, or sent now (with the following steps' up to the staleness,
        none of whose rows a push carries)."""
        lookup = self._reads.pop(step, None)
        if lookup is not None and lookup.collection is collection:
            return lookup
        lookup = collection.lookup(batch.sparse, step)
        if self.read_ahead:
            for later in range(step + 1, min(step + self.staleness, self._horizon(step) - 1) + 1):
                if later not in self._reads:
                    plan = self._plan(collection, step, later)
                    if plan is None:
                        break
                    self._reads[later] = collection.lookup_planned(plan)
        return lookup

    def carried(self, collection: EmbeddingCollection, step: int) -> Optional[LookupPlan]:
        """The lookups step ``step``'s push carries: step ``step + staleness + 1``'s, unless that is at or past
        the next agreement or the end, or its rows are read already."""
        later = step + self.staleness + 1
        if not self.read_ahead or later >= self._horizon(step) or later in self._reads:
            return None
        return self._plan(collection, step, later)

    def pushed(self, step: int, push: PushOnGradients) -> List[Tuple[int, BaseException]]:
        """Step ``step``'s push left (during its backward pass): keep it in flight, then wait for the pushes
        beyond the staleness.  Returns the steps whose pushes failed, with why."""
        try:
            pending = push.sent()
        except Exception as error:  # noqa: BLE001 - sending it failed: that step's update is lost
            self.lost += 1
            return [(step, error)] + self.drain()
        if pending.then is not None:
            self._reads[pending.then.step] = pending.then
        self._pushes.append((step, pending))
        return self._settle(keep=self.staleness)

    def drain(self) -> List[Tuple[int, BaseException]]:
        """Wait until every push in flight is applied (or failed): before an agreement, an evaluation, a
        rebuild, the end."""
        return self._settle(keep=0)

    def drop_reads(self) -> None:
        """Forget the rows read ahead: their steps look them up again."""
        self._reads.clear()

    def _settle(self, keep: int) -> List[Tuple[int, BaseException]]:
        failures = []
        while len(self._pushes) > keep:
            step, pending = self._pushes.popleft()
            started = time.perf_counter()
            try:
                pending.wait()
                self.applied += 1
            except (RuntimeError, TimeoutError) as error:
                self.lost += 1
                failures.append((step, error))
            waited = time.perf_counter() - started
            if waited > SLOW_PUSH.total_seconds():
                self._slow.record("slow", f"waited {waited:.1f} s for the push of step {step} "
                                          f"(staleness {self.staleness})")
        return failures

    def close(self) -> None:
        self._slow.flush()
