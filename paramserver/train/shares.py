"""``GroupShares``: the members of a trainer group read one followed input together, each its share by its
place in the group's current membership, re-dealt whenever the group re-forms.

Owns the group's side of sharing a followed input (``FileReader(follow=True)``: its parts are named, and a
reader can be re-dealt, ``reshare``): what the members tell each other and when, and who computes the new
deal.  The rule itself (merging positions, who takes which part) is the data's (a ``FileReader``'s ``deal``,
``again`` and ``is_position``: ``paramserver.data.shares``), so this module imports nothing of the data; the
step, the agreement and re-forming are the Trainer's and ``DenseReplica``'s, which call:

* ``agreed(group, step)`` at every agreement that goes on: every member's position (before the batch of
  ``step``) is gathered, with the step from which it has no batch in the window (``until``: a group taking
  uneven steps goes on without it there), and kept with that step (a *snapshot*);
* ``formed(group, step)`` each time the group (re-)formed, once the state is shared and the members that
  were behind skipped the batches of the steps they took from another (every member at ``step``).  Every
  member tells its position now and the step of its snapshot; the member with the newest snapshot deals:
  the members' positions, and the positions of the members of its snapshot that are gone, replayed: a
  temporary reader of the same input, as that member's deal was, reads on from its snapshot position for
  ``min(step, until) - snapshot step`` batches (the steps the group completed since, up to those it sat
  out: that member read each of their batches), which is where it stood before the batch of ``step``.
  Its parts under way and its parts not started go to the members by name (``deal``); a member that
  joined brings nothing and gets its share.
  Every member then reads on from the position dealt to it, its batches read ahead dropped: a member's
  position is before the batch of ``step``, with the parts that batch began kept as its own
  (``shares.again``), so that a step redone trains the lines it tried.  At the group's
  first formation nobody has a snapshot: rank 0 deals the positions of the checkpoint the job starts from,
  whatever workers wrote them (``restored``), or the input from its start.

Where the job has several trainer groups, the data's ``claims`` (``paramserver.train.claims``) say which
parts each group reads: a deal takes on the parts under way in ``restored`` or in a gone member's
position only where ``claims`` grant them to this group, and the readers ask before each part they start.

Each deal is named by the generation of the group that made it, and every member tells the deal it
follows: a member that missed the last deal the dealer knows of (that formation failed before its
broadcast reached it, and no step was completed since) is dealt from the dealer's snapshot of it, as a
member that is gone is, not from the position it tells.

The replay reads the same batches as the lost member did only if its reader met the files in name order:
a reader reads the files one listing found in name order, and the replay lists them all at once, so files
that landed out of name order (an earlier name landing later, between two listings that member made) may
be replayed in another order, and a few lines read twice or skipped.  The batch of the step the lost
member had under way when it died is read again by the member its part goes to: its dense part was not
applied (the group did not complete that step), its sparse push may have been (at most that one batch
twice; with ``staleness`` k, the pushes of up to k steps before it may be lost instead).
"""

import dataclasses
import datetime
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..logs import one_line
from .data import BatchStream

logger = logging.getLogger(__name__)

#: How long replaying a lost member's reader may take before the group goes on with what it replayed (the
#: other members wait for the deal in a collective: well within its timeout, ``ddp.group.COLLECTIVE_TIMEOUT``).
REPLAY_WITHIN = datetime.timedelta(seconds=20)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Every member's position before the batch of ``step``: ``entries[name] = {"state", "worker",
    "workers", "deal"}`` (its reader's position, its share, and the generation that dealt it)."""

    step: int
    entries: Dict[str, Dict[str, Any]]


class GroupShares:
    """``data`` (a reader with ``shared`` true: ``reshare``, ``dealt``, ``deal``, ``again``, ``is_position``,
    ``state_dict``...), read through
    ``batches`` (started by the first ``formed``), shared by this worker's trainer group.  ``restored``: the
    data positions of the checkpoint the job starts from (``{worker index: BatchStream.position()}``)."""

    def __init__(self, data, batches: BatchStream, restored: Optional[Dict[Any, Any]] = None,
                 until: Callable[[], int] = lambda: 1 << 62):
        self.data, self.batches = data, batches
        #: The first step of the window this member has no batch for (its group takes uneven steps: it reads
        #: no batch from there to the next agreement).
        self.until = until
        saved = [position.get("state") for position in (restored or {}).values() if isinstance(position, dict)]
        self.restored: List[Dict[str, Any]] = [state for state in saved if data.is_position(state)]
        self.snapshot: Optional[Snapshot] = None
        #: The generation of the group that dealt this member's share (``None``: not dealt yet).
        self.deal: Optional[int] = None

    def _mine(self, group) -> Dict[str, Any]:
        return {"name": group.members[group.rank], "state": self.batches.position()["state"],
                "worker": self.data.worker, "workers": self.data.workers, "deal": self.deal}

    def agreed(self, group, step: int) -> None:
        """At an agreement: every member's position, kept as the snapshot of ``step``."""
        mine = dict(self._mine(group), until=self.until())
        self.snapshot = Snapshot(step, {entry["name"]: entry for entry in group.gather_objects(mine)})

    def formed(self, group, step: int) -> None:
        """The group (re-)formed at ``step``: deal the input to its members and read on from this member's
        share (see the module's text)."""
        mine = dict(self._mine(group), snapshot=None if self.snapshot is None else self.snapshot.step)
        before, after = self.batches.current_states()
        if self.snapshot is None:
            mine["state"] = None  # nothing read yet as a member: it brings nothing
        elif after is not None:  # the batch at hand (a step redone) is read again as it was
            mine["state"] = self.data.again(before, after)
        told = group.gather_objects(mine)
        holders = [rank for rank, entry in enumerate(told) if entry["snapshot"] is not None]
        dealer = max(holders, key=lambda rank: (told[rank]["snapshot"], -rank)) if holders else 0
        states = group.broadcast_object(self._deal(told, group, step) if group.rank == dealer else None, dealer)
        self.batches.restart(lambda: self.data.reshare(group.rank, group.world_size, states[group.rank]))
        self.deal = group.generation
        self.snapshot = Snapshot(step, {name: {"state": states[rank], "worker": rank, "workers": group.world_size,
                                               "deal": self.deal} for rank, name in enumerate(group.members)})
        logger.info("%s reads share %d of %d of the followed input from step %d (%d part(s) under way, %d done)",
                    group.members[group.rank], group.rank, group.world_size, step,
                    1 + len(states[group.rank]["held"]) if states[group.rank]["key"] else 0,
                    len(states[group.rank]["done"]))

    def _deal(self, told: Sequence[Dict[str, Any]], group, step: int) -> List[Dict[str, Any]]:
        members = [entry["state"] for entry in told]
        claims = getattr(self.data, "claims", None)  # several groups read the input: what is under way elsewhere
        take = (lambda key: claims.take(key) is True) if claims is not None else None
        if self.snapshot is None:  # the group's first formation: the checkpoint's positions, if any
            return self.data.deal(members, self.restored, group.world_size, take)
        known = self.snapshot.entries
        # a member that missed a deal the dealer knows of tells a position of the deal before: not used
        members = [None if entry["name"] in known and entry["deal"] != known[entry["name"]].get("deal") else state
                   for entry, state in zip(told, members)]
        telling = {entry["name"] for entry, state in zip(told, members) if state is not None}
        gone = [name for name in known if name not in telling]
        # A member read one batch a step since the snapshot, up to the steps it had no batch for.
        others = [self._replayed(f"{name} {'missed the last deal' if name in group.members else 'left the group'}",
                                 known[name], min(step, known[name].get("until", step)) - self.snapshot.step)
                  for name in gone]
        return self.data.deal(members, others, group.world_size, take)

    def _replayed(self, who: str, entry: Dict[str, Any], batches: int) -> Dict[str, Any]:
        """Where a reader (``who``: its member's name, and why it is replayed) stood ``batches`` batches after
        its snapshot position ``entry`` (see the module's text), read again by a temporary reader, within
        ``REPLAY_WITHIN``."""
        if batches <= 0:
            logger.info("%s: its reading position is the one it told at step %d", who, self.snapshot.step)
            return entry["state"]
        try:
            reader = self.data.dealt(entry["worker"], entry["workers"])
        except (OSError, ValueError) as error:  # the input cannot be listed now (``UnreadableFile``)
            logger.warning("%s; its reading position could not be replayed (%s): the %d batch(es) it read "
                           "since step %d may be read again", who, one_line(error), batches,
                           self.snapshot.step)
            return entry["state"]
        reader.load_state_dict(entry["state"])
        deadline = threading.Timer(REPLAY_WITHIN.total_seconds(), reader.close)
        deadline.daemon = True
        deadline.start()
        iterator = iter(reader)
        read = 0
        try:
            for _ in range(batches):
                if next(iterator, None) is None:
                    break
                read += 1
            state = reader.state_dict()
        finally:
            deadline.cancel()
            iterator.close()
            reader.close()
        if read < batches:
            logger.warning("%s: replayed only %d of the %d batches it read after its last agreement (within %.0f "
                           "s): the rest of them may be read again", who, read, batches, REPLAY_WITHIN.total_seconds())
        logger.info("%s: its reading position replayed over the %d batch(es) it read since its group's last "
                    "agreement", who, read)
        return state
