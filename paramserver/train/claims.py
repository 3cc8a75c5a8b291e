"""``PartClaims``: which trainer group reads each part of a followed input, for a job of several groups.

Owns the claims, kept in the coordinator's store (``TrainerGroup.job_store``), where every group of the job
reaches them.  Within a group the members deal a followed input's parts among themselves by their names
(``paramserver.train.shares``); across groups nothing is dealt ahead, since groups neither pause nor
re-form together.  A reader about to start a part it has not under way asks for it for its group
(``take``: an atomic compare-and-set of the part's key, so the first group to ask gets it and every later
asker learns whose it is) and skips it when another group has it.  Groups pull the parts as they have room
for them, and each part is read by one group.  A group dealing a checkpoint's positions (its first
formation) asks the same for each part those positions had under way, so that two groups starting together
do not both read it on.

Claims belong to a run of the job (``JobContext.job_run``: one more each time a worker joins while none is
alive).  A run starts from the newest checkpoint, whose positions say what was read; what an earlier run's
groups claimed after that checkpoint must be free to be read again.

A group keeps its claims while it is lost whole: the next worker that joins it (new workers fill the
lowest-numbered group with room) deals the newest checkpoint's positions at its first formation and reads the
group's parts on from there, or from their start where that checkpoint does not name them: what the group
read since the checkpoint is read again (at least once), and until a worker joins it, nobody reads its parts.
"""

from typing import Any

#: The name of the claims' space in the coordinator's store, one per run (``TrainerGroup.job_store``).
STORE_NAME = "followed_parts"


class PartClaims:
    """The claims of trainer group ``group_index`` in ``store`` (a ``torch.distributed.Store``, one run's)."""

    @classmethod
    def of_job(cls, group, run: int, group_index: int) -> "PartClaims":
        """Those of run ``run`` of the job ``group`` (a ``TrainerGroup``) belongs to, through a connection of
        their own (a reader's thread asks while the group may wait in the store)."""
        return cls(group.job_store(f"{STORE_NAME}/run{run}", own_connection=True), group_index)

    def __init__(self, store: Any, group_index: int):
        self.store = store
        self.group = str(group_index)

    def take(self, key: str) -> bool:
        """Whether this group reads part ``key``: claimed for it now, or before; ``False``: another group has it."""
        return self.store.compare_set(key, "", self.group).decode() == self.group
