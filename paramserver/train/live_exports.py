"""A training job's live exports: every few steps, a delta (or a base) that serving follows.

Owns when and how trainer group 0's rank 0 writes an export of the chain under ``root``
(``paramserver.checkpoint.live_export``: local or any fsspec URL): at a step boundary every ``every``
steps, after every push up to it was applied, it has every shard write its part at once (one RPC each,
``service.write_export_part``: the rows changed since the last export, or all of them), writes the dense
part and commits the manifest last.  The first export of a process is a base, so is every ``base_every``-th,
and so is the one after an export failed (a shard that wrote its part of an uncommitted export gave its
changes to it).  A failed export is logged in one line; training goes on.  Whether one is due is told at
the group's agreement (``due``), so a boundary without one costs nothing; where one is, the members drain
their pushes and pass a barrier, rank 0 writes, and the others wait for its outcome in the group's store
(``at_boundary``), not in a collective.  With ``keep`` (``Trainer(keep_exports=N)``, ``ps-server
--keep-exports N``), each export committed is followed by pruning the root to the newest ``keep`` bases
with their deltas (``live_export.prune``: a chain superseded less than ``grace`` ago stays for the readers
loading it), and the folders of its own failed exports.
"""

import datetime
import logging
import os
import secrets
import time
from typing import Any, Dict, List, Mapping, Optional

import torch.distributed.rpc as rpc

from ..checkpoint.live_export import DENSE_FILE, READ_GRACE, commit, export_name, prune, write_tensors
from ..checkpoint.storage import FileRecord
from ..filesystems import locate
from ..logs import one_line
from ..shards.server import service
from .checkpoints import every_part

logger = logging.getLogger(__name__)

#: How long a shard may take to write its part of an export.
PART_TIMEOUT = datetime.timedelta(minutes=10)
#: How long the group's other members wait for rank 0 to have written and committed one.
WRITTEN_WITHIN = PART_TIMEOUT + datetime.timedelta(minutes=5)
#: Seconds a chain superseded stays for its readers where exports are pruned (``live_export.READ_GRACE`` unless
#: set).
READ_GRACE_ENV = "PARAMSERVER_EXPORT_READ_GRACE"


def read_grace() -> datetime.timedelta:
    """The grace a superseded chain keeps for its readers: ``READ_GRACE_ENV`` seconds, else ``READ_GRACE``."""
    value = os.environ.get(READ_GRACE_ENV)
    if not value:
        return READ_GRACE
    seconds = float(value)
    if seconds < 0:
        raise ValueError(f"{READ_GRACE_ENV} must not be negative, got {value}")
    return datetime.timedelta(seconds=seconds)


class LiveExports:
    """Exports of ``replica``'s model into ``root`` every ``every`` steps (see the module's text); ``model`` is
    the model's description (``checkpoint.model.describe_model``), ``shards`` the shard names; ``keep``: the
    bases kept with their deltas (0: every export stays), ``grace``: how long a superseded chain stays
    (``None``: ``read_grace()``)."""

    def __init__(self, root: str, every: int, base_every: int, replica, shards: List[str], model: Dict[str, Any],
                 storage_options: Optional[Mapping[str, Any]] = None, keep: int = 0,
                 grace: Optional[datetime.timedelta] = None):
        if every < 1 or base_every < 1:
            raise ValueError(f"export_every and export_base_every must be at least 1, got {every} and {base_every}")
        if keep < 0:
            raise ValueError(f"keep_exports must not be negative, got {keep}")
        self.keep = keep
        self.grace = read_grace() if grace is None else grace
        #: Its exports that failed before their commit, removed at the next pruning.
        self._failed: List[str] = []
        self.root = locate(root, storage_options)
        self.every, self.base_every = every, base_every
        self.replica, self.shards, self.model = replica, list(shards), model
        self._previous: Optional[str] = None
        self._base: Optional[str] = None
        self._since_base = 0
        self._last_step = replica.step
        #: Names this process's exports apart from those of an earlier run of the job at the same steps.
        self.writer = secrets.token_hex(4)
        self.written: List[str] = []

    def due(self) -> bool:
        """Whether ``every`` steps passed since the last export this member took part in (or since it began):
        what it says at the group's agreement.  The members' answers agree once they took part in one export
        (a member that joined since then began counting later, so it never asks for one before the others do)."""
        return self.replica.step - self._last_step >= self.every

    def at_boundary(self, final: bool = False) -> None:
        """Every member of the group, at the boundary where the group agreed on an export (``due``), once it
        applied every push of its own up to it; or ``final``: after the last step, every push applied.  Rank 0
        writes the export (at the end only if any step passed since the last).  Except at the end the members
        first pass a barrier, so that rank 0 writes once every member's pushes are applied, and the others
        then wait for it in the group's store (``TrainerGroup.hand_out``), not in their next step's all-reduce,
        whose timeout (a minute) a base export of a large table would outlast; at the end no collective
        follows, and they return at once."""
        group, step = self.replica.group, self.replica.step
        if final:
            if group.rank == 0 and step > self._last_step:
                self._last_step = step
                self.write()
            return
        group.barrier()
        group.hand_out(self.write() if group.rank == 0 else None, 0, WRITTEN_WITHIN)
        self._last_step = step  # (not before: where rank 0 is lost meanwhile, the group re-formed exports again)

    def write(self) -> Optional[str]:
        """Write and commit an export of the model as of now; its name, or ``None`` when it failed."""
        step = self.replica.step
        whole = self._previous is None or self._since_base + 1 >= self.base_every
        name = export_name(step, self.writer)
        directory = self.root.join(name)
        started = time.monotonic()
        try:
            futures = [rpc.rpc_async(shard, service.write_export_part,
                                     args=(directory.url, dict(self.root.storage_options), whole),
                                     timeout=PART_TIMEOUT.total_seconds()) for shard in self.shards]
            files = [FileRecord.from_json(part) for part in every_part(futures, self.shards, "export parts")]
            files.append(write_tensors(directory.join(DENSE_FILE), self.replica.module.state_dict()))
            commit(directory, kind="base" if whole else "delta", step=step,
                   previous=None if whole else self._previous, base=name if whole else self._base,
                   model=self.model, files=files)
        except Exception as error:  # noqa: BLE001 - a failed export must not end the training
            logger.error("live export at step %d to %s failed, not committed (the next one is a base): %s", step,
                         directory, one_line(error))
            self._previous = None
            self._failed.append(name)
            return None
        if whole:
            self._base, self._since_base = name, 0
        else:
            self._since_base += 1
        self._previous = name
        self.written.append(name)
        logger.info("live export %s (%s) written at step %d in %.2f s: %.1f MB", directory, "base" if whole else
                    "delta", step, time.monotonic() - started, sum(record.bytes for record in files) / 1e6)
        if self.keep:
            self._prune()
        return name

    def _prune(self) -> None:
        try:
            prune(self.root, self.keep, self.grace, uncommitted=self._failed)
        except Exception as error:  # noqa: BLE001 - a failed removal must not end the training
            logger.error("pruning the live exports under %s failed (tried again after the next export): %s",
                         self.root, one_line(error))
            return
        self._failed = []
