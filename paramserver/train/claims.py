"""``PartClaims``: which trainer group reads each part of a followed input, for a job of several groups.

Owns the claims, kept in the coordinator's store (``TrainerGroup.job_store``), where every group of the job
reaches them.  Within a group the members deal a followed input's parts among themselves by their names
(``paramserver.train.shares``); across groups nothing is dealt ahead, since groups neither pause nor
re-form together.  A reader about to start a part it has not under way asks for it for its group
(``take``: an atomic compare-and-set of the part's key, so the first group to ask gets it and every later
asker learns whose it is) and leaves it when another group has it.  Groups pull the parts as they have room
for them, and each part is read by one group.  A group dealing a checkpoint's positions (its first
formation) asks the same for each part those positions had under way, so that two groups starting together
do not both read it on.  A part whose last rows a reader has given is marked done (``finish``): for the
other groups, which never take it over; the group's own members may still read it on, where a position
they are dealt holds it under way (the batches of a lost member that the group had not trained).

A part under way at a lost group is taken over by the next group that asks for it, from its start: a group
lost whole (every member gone) leaves its parts under way read again, at least once, and the parts it
finished done.  A group is lost when the coordinator says it is gone (``gone``: no live worker for its
``group_gone_after``, a minute by default, and none rejoined it; where a restarted worker rejoins sooner,
the group's parts stay its own), or when it has not said it is alive for ``lost_after`` (10 minutes: longer
than a group's longest pause, a checkpoint written to an object store or a lost shard's rebuild): a group
whose workers still heartbeat but no longer train (hung).  A group says it is alive at its
formation and at every agreement (``alive``: every ``agree_every`` steps, and every 2 s while it waits for
data).

The claims live in the coordinator's store, which a coordinator started again brings back empty: each
member publishes again the claims it knew of (its group's parts, under way or done) as soon as its connection
finds the store gone (``JobStore.on_reconnect``), and for ``REPUBLISH_WINDOW`` after that asks for no part
it did not know of, so that the other groups' claims are back before it does.

Claims belong to a run of the job (``JobContext.job_run``: one more each time a worker joins while none is
alive).  A run starts from the newest checkpoint, whose positions say what was read; what an earlier run's
groups claimed after that checkpoint must be free to be read again.  Group times are the hosts' wall
clocks: on several hosts they must agree to well within ``lost_after`` (NTP does).
"""

import datetime
import logging
import time
from typing import AbstractSet, Any, Callable, Dict, Optional

logger = logging.getLogger(__name__)

#: The name of the claims' space in the coordinator's store, one per run (``TrainerGroup.job_store``).
STORE_NAME = "followed_parts"
#: How long a group may go without saying it is alive before its parts under way are taken over.
GROUP_LOST_AFTER = datetime.timedelta(minutes=10)
_DONE = "/done"
#: After the store came back empty with a coordinator started again, how long a member asks for no part it did
#: not know of (``take`` answers "ask again later"): every live group publishes its claims again at its next
#: agreement, well within it.
REPUBLISH_WINDOW = datetime.timedelta(seconds=10)


class PartClaims:
    """The claims of trainer group ``group_index`` in ``store`` (a ``torch.distributed.Store``, one run's);
    ``gone``: the groups of the run the coordinator says are gone, as of its last word; ``clock``: the wall
    clock groups' liveness is told in."""

    @classmethod
    def of_job(cls, group, run: int, group_index: int,
               gone: Callable[[], AbstractSet[int]] = frozenset) -> "PartClaims":
        """Those of run ``run`` of the job ``group`` (a ``TrainerGroup``) belongs to, through a connection of
        their own (a reader's thread asks while the group may wait in the store)."""
        return cls(group.job_store(f"{STORE_NAME}/run{run}", own_connection=True), group_index, gone=gone)

    def __init__(self, store: Any, group_index: int, lost_after: datetime.timedelta = GROUP_LOST_AFTER,
                 clock: Callable[[], float] = time.time, gone: Callable[[], AbstractSet[int]] = frozenset):
        self.store = store
        self.group = str(group_index)
        self.lost_after = lost_after
        self.clock = clock
        self.gone = gone
        #: The parts this member took for its group, part -> the value it last knew there (the group, or done).
        self._taken: Dict[str, str] = {}
        #: When the store last came back empty (``time.monotonic()``), or ``None``.
        self._came_back_at: Optional[float] = None
        if hasattr(store, "on_reconnect"):  # a store that comes back (empty) with a coordinator started again
            store.on_reconnect(self._publish_again)

    def _publish_again(self) -> None:
        """The store came back empty with a coordinator started again: put back what this member knew of its
        group's parts (before the operation that found the store gone is tried again), and that it is alive."""
        self._came_back_at = time.monotonic()
        for key, value in self._taken.items():
            self.store.compare_set(key, "", value)
        logger.info("trainer group %s: %d part claim%s published again in the store started again", self.group,
                    len(self._taken), "" if len(self._taken) == 1 else "s")

    def alive(self) -> None:
        """This group is alive now (at its formation and every agreement)."""
        self.store.set(f"alive/{self.group}", repr(self.clock()))

    def take(self, key: str) -> Optional[bool]:
        """Whether this group reads part ``key``: ``True`` (claimed for it now or before, read whole or not: a
        member's position, a re-deal's or a checkpoint's, may still hold it under way; or taken over from a
        lost group), ``False`` (another group read it whole: never), ``None`` (another group has it under way:
        ask again later, that group may be lost by then)."""
        if key not in self._taken:
            self.store.check([key])  # (finds a store that came back, and publishes this member's claims again)
            if self._came_back_at is not None and \
                    time.monotonic() - self._came_back_at < REPUBLISH_WINDOW.total_seconds():
                return None  # other groups may not have published theirs again yet: ask again later
        value = self.store.compare_set(key, "", self.group).decode()
        if value in (self.group, self.group + _DONE):  # this group's: its members' positions say where it stands
            self._taken[key] = value
            return True
        if value.endswith(_DONE):
            return False
        why = self._lost(value)
        if why is None:
            return None
        if self.store.compare_set(key, value, self.group).decode() != self.group:
            return None  # another group took it over first, or its own group finished it meanwhile
        logger.warning("trainer group %s takes over %s from trainer group %s, %s: read again from its start",
                       self.group, key, value, why)
        self._taken[key] = self.group
        return True

    def finish(self, key: str) -> None:
        """Part ``key``, this group's, is read whole (the last of its rows given to the group's training)."""
        self.store.compare_set(key, self.group, self.group + _DONE)
        self._taken[key] = self.group + _DONE

    def _lost(self, group: str) -> Optional[str]:
        """Why ``group`` is lost, ``None`` when it is not: the coordinator says it is gone, or it has not said it
        is alive for ``lost_after`` (a group that never said so has not formed: not lost)."""
        if int(group) in self.gone():
            return "gone (no live worker, says the coordinator)"
        said = f"alive/{group}"
        if not self.store.check([said]):
            return None
        silent = self.clock() - float(self.store.get(said).decode())
        return f"silent for {silent:.0f} s" if silent > self.lost_after.total_seconds() else None
