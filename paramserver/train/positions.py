"""``PublishedPositions``: the data positions of the trainer groups that do not write checkpoints, kept where
trainer group 0 reads them when it writes one.

Trainer group 0 writes every checkpoint; the other groups train on meanwhile, at steps of their own (groups do
not pause together).  So that a restore does not send their workers back to the start of their data, every
member of another group publishes its data position at each of its group's agreements (every
``agree_every`` steps) in the coordinator's store (``TrainerGroup.job_store``), under its worker index; rank 0
of group 0 reads the newest of them as it writes a checkpoint, beside its own group's positions, which it
gathers exactly at the checkpoint's step.

The published position is one whose lines all reached the shards before it was published: a member at
agreement A with ``staleness`` k may have the pushes of steps A-k to A-1 in flight, so it publishes the
position of its newest agreement at step A-k or earlier (with k = 0: A's own).  The shards write their parts
later than that, so a restore reads again what such a worker trained between its last published agreement and
the checkpoint: at most ``agree_every + k`` steps' batches per worker, trained twice (at least once, not exactly
once, as group 0's own lines are).

Entries of another run of the job than the reader's (``JobContext.job_run``: one more each time a worker joins
while none is alive) are not used: a previous run's workers were all gone before this one started from its
checkpoint (the coordinator and its store outlive them).  For a worker that published once but has no entry
of this run now, the position of the checkpoint the reader's run started from is kept, if it held one.  Only
workers that published count: with one trainer group (a followed input, too) nothing is read here.
"""

import collections
import logging
import pickle
from typing import Any, Deque, Dict, Iterable, Optional, Set, Tuple

logger = logging.getLogger(__name__)

#: The name of the keys' space in the coordinator's store (``TrainerGroup.job_store``).
STORE_NAME = "data_positions"
#: The key listing the worker indices that published (comma-separated, appended once per publisher).
INDICES_KEY = "indices"


class PublishedPositions:
    """Data positions of trainer groups other than 0 in ``store`` (a ``torch.distributed.Store``).

    ``staleness``: the job's ``staleness`` (how many steps' pushes may still be in flight at an agreement);
    ``run``: the run of the job this worker is in (``JobContext.job_run``).
    """

    @classmethod
    def of_job(cls, group, staleness: int = 0, run: int = 0) -> "PublishedPositions":
        """Those of the job ``group`` (a ``TrainerGroup``) belongs to, in the coordinator's store."""
        return cls(group.job_store(STORE_NAME), staleness, run)

    def __init__(self, store, staleness: int = 0, run: int = 0):
        self.store = store
        self.staleness = staleness
        self.run = run
        #: This member's positions at its recent agreements, oldest first: ``(step, position)``.
        self._agreed: Deque[Tuple[int, Dict[str, Any]]] = collections.deque()
        self._listed: Optional[int] = None  # the store connection it is listed in (JobStore.reconnections)
        #: Worker indices whose previous run's entry was logged as not used (once each).
        self._told_stale: Set[int] = set()

    def publish(self, worker_index: int, rpc_name: str, step: int, position: Dict[str, Any]) -> None:
        """At an agreement at ``step`` (``position``: the data's before the batch of ``step``), publish the newest
        position all of whose lines have reached the shards."""
        self._agreed.append((step, position))
        while len(self._agreed) > 1 and self._agreed[1][0] <= step - self.staleness:
            self._agreed.popleft()
        settled_step, settled = self._agreed[0]
        if settled_step > step - self.staleness:
            return  # not one yet: the run's first agreements, within k steps of its start
        self.store.set(str(worker_index), pickle.dumps({"step": settled_step, "position": settled,
                                                        "member": rpc_name, "run": self.run}))
        listed_in = getattr(self.store, "reconnections", 0)  # a store started again with its coordinator
        if self._listed != listed_in:  # is empty: listed again there
            self.store.append(INDICES_KEY, f"{worker_index},")
            self._listed = listed_in

    def read(self, skip: Iterable[int], kept: Optional[Dict[Any, Any]] = None) -> Dict[int, Dict[str, Any]]:
        """The newest published position of every worker index that published one in this run and is not in
        ``skip`` (group 0's own members); for one without such an entry, its position in ``kept`` (the checkpoint
        the reader's run started from), if it has one."""
        if not self.store.check([INDICES_KEY]):
            return {}
        indices = {int(part) for part in self.store.get(INDICES_KEY).decode().split(",") if part}
        kept = {int(index): position for index, position in (kept or {}).items()}
        found: Dict[int, Dict[str, Any]] = {}
        for index in sorted(indices - set(skip)):
            entry = pickle.loads(self.store.get(str(index))) if self.store.check([str(index)]) else None
            if entry is not None and entry.get("run") == self.run:
                found[index] = entry["position"]
                continue
            if entry is not None and index not in self._told_stale:
                self._told_stale.add(index)
                logger.info("the data position worker %d (%s) published at step %d is a previous run's: not used",
                            index, entry["member"], entry["step"])
            if index in kept:
                found[index] = kept[index]
        return found
