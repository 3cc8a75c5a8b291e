"""A trainer group's side of checkpoints: when trainer group 0 writes one, writing it, starting from one.

Owns the trainers' checkpoint protocol: trainer group 0
checkpoints every ``every_steps`` steps (every member holds the same step,
so all decide alike without a message) and when the coordinator asks
(``KIND_CHECKPOINT``: members agree on it in the group's agreement, the
one all-reduce every ``agree_every`` steps, so all act at the same step).
A checkpoint is written at a step boundary (``at_boundary``), with no
step in flight: every member hands rank 0 its data position and comm-hook
state (a collective in the trainer group) and pauses there while rank 0
has every shard write its part (one RPC to each,
``service.write_checkpoint_part``, allowed ``PART_TIMEOUT``), writes the
dense part and commits the checkpoint at the coordinator, which writes the
manifest, then tells every shard it committed (``service.checkpoint_committed``:
their push logs keep only what came after it); the others wait for the outcome in the group's store
(``TrainerGroup.hand_out``), not in a collective, whose timeout a large
checkpoint would outlast, and leave that wait at once if the group is
abandoned (rank 0 lost).  The root may be
any path or fsspec URL (``s3://...``); shards are handed it with the
storage options of the settings.  A checkpoint that fails (a shard lost
while writing, a full disk, unreachable storage) is logged in one
line and reported to the coordinator, which answers a request waiting for
it and removes its parts; training goes on.

``restore_point(ctx)`` is the dense part of the checkpoint the cluster
starts from, for ``DenseReplica(..., initial=...)``, with every member's
data position: the one the coordinator names, or when its dense part does
not verify (damaged after its commit), the newest older one whose does.

The files themselves (their layout, writing and verifying them) are
``paramserver.checkpoint``'s: ``dense_part`` for the dense part,
``storage`` for directories and manifests, ``records`` for what is
handed to the coordinator.
"""

import datetime
import logging
import pickle
import time
from typing import Any, Callable, Dict, List, Optional

import torch.distributed.rpc as rpc

from .._torch_compat import remote_error_cause
from ..checkpoint.dense_part import read_dense_part, write_dense_part
from ..checkpoint.records import CheckpointCommit, CheckpointFailure
from ..checkpoint.storage import CheckpointStore, first_usable
from ..logs import RateLimitedLog, one_line
from ..shards.server import service
from .positions import PublishedPositions

logger = logging.getLogger(__name__)

#: How long a shard may take to write its part of a checkpoint (its RPC's timeout, not the RPC default).
PART_TIMEOUT = datetime.timedelta(minutes=30)
#: How long rank 0 waits for a shard to cut its push log at a committed checkpoint (a few file deletions).
CUT_WITHIN = datetime.timedelta(seconds=30)
#: How long the other members of group 0 wait for rank 0 to have a checkpoint written and committed: not a
#: collective, whose timeout (a minute) a large checkpoint on an object store would outlast.
WRITTEN_WITHIN = PART_TIMEOUT + datetime.timedelta(minutes=5)


def restore_point(ctx) -> Optional[Dict[str, Any]]:
    """The dense part of the checkpoint the cluster starts from (``None``: a fresh model).

    ``{"step", "module", "optimizer", "hook", "hook_states", "data_positions", "model", ...}``;
    ``hook_states`` are pickled per rank of the group that wrote it.
    """
    path = ctx.checkpoint.restore_from
    if not path:
        return None
    # A worker joining mid-job: the newest checkpoint may have been damaged since its commit.
    checkpoint, part = first_usable(ctx.checkpoint.locate(path), ctx.checkpoint.restore_step, read_dense_part,
                                    ctx.rpc_name)
    logger.info("%s starts from checkpoint %s at step %d", ctx.rpc_name, checkpoint.id, part["step"])
    return part


class TrainerCheckpoints:
    """Checkpoints of ``replica``'s trainer group, for the job running in ``ctx``.

    Call ``at_boundary(agreed)`` at every step boundary after the group's
    sync point, on every member (it is a collective when a checkpoint is
    due); pass ``pending()`` to the sync point.  ``data_position()`` is
    this member's data position (``paramserver.train.data``).
    ``every_steps`` overrides the cluster's ``--checkpoint-every``.
    ``model``: the model's description (``model.describe_model``), written
    into every dense part so that the checkpoint can be exported.
    ``positions``: where the members of the other trainer groups publish
    their data positions (``paramserver.train.positions``; ``None``: this
    job has one group, or keeps no checkpoints); call ``at_agreement()`` at
    every agreement of the group: in a group other than 0 it publishes this
    member's, group 0's rank 0 reads them when it writes.  ``restored``: the
    data positions of the checkpoint this run started from.
    """

    def __init__(self, ctx, replica, data_position: Callable[[], Any], every_steps: Optional[int] = None,
                 model: Optional[Dict[str, Any]] = None, positions: Optional[PublishedPositions] = None,
                 restored: Optional[Dict[Any, Any]] = None):
        self.ctx = ctx
        self.model = model
        self.replica = replica
        self.data_position = data_position
        self.enabled = bool(ctx.checkpoint.directory) and ctx.trainer_group == 0
        self.positions = positions
        self._restored_positions = dict(restored or {})
        self._unpublished = RateLimitedLog(logger, "{count} data position{s} not published", level=logging.WARNING)
        self.every_steps = ctx.checkpoint.every_steps if every_steps is None else every_steps
        self._done_request = 0
        self._last_step = replica.step  # a restored run does not write its starting point again
        self.written: List[str] = []

    def pending(self) -> int:
        """The checkpoint request this member heard of and the group has not served yet (0: none)."""
        if not self.enabled:
            return 0
        heard = self.ctx.checkpoint_request()
        return heard if heard > self._done_request else 0

    def due(self, agreed_request: int = 0) -> bool:
        """Whether ``at_boundary(agreed_request)`` writes a checkpoint now (the same answer on every member)."""
        if not self.enabled:
            return False
        by_steps = self.every_steps > 0 and self.replica.step % self.every_steps == 0
        return bool(by_steps or agreed_request) and self.replica.step != self._last_step

    def at_boundary(self, agreed_request: int = 0) -> None:
        """Write a checkpoint now if one is due: by steps, or ``agreed_request`` (the group's agreement)."""
        if not self.enabled:
            return
        # A member that had not heard of the request yet counts it served too.
        self._done_request = max(self._done_request, agreed_request)
        if self.due(agreed_request):
            self._last_step = self.replica.step
            self.write(agreed_request)

    def at_agreement(self) -> None:
        """In a trainer group other than 0, at each of its agreements: publish this member's data position (best
        effort: where the coordinator's store cannot be reached, training goes on, and a restore reads this
        worker's data from an older position)."""
        if self.positions is None or self.ctx.trainer_group == 0:
            return
        try:
            self.positions.publish(self.ctx.worker_index, self.ctx.rpc_name, self.replica.step, self.data_position())
        except (RuntimeError, OSError) as error:  # (torch's DistStoreError is a RuntimeError)
            self._unpublished.record(type(error).__name__, f"{self.ctx.rpc_name}: its data position at step "
                                                           f"{self.replica.step} was not published: {one_line(error)}")

    def write(self, request: int = 0) -> Optional[str]:
        """Every member: pause here while rank 0 writes and commits; returns the checkpoint's id on rank 0."""
        group = self.replica.group
        mine = {"rpc_name": self.ctx.rpc_name, "worker_index": self.ctx.worker_index,
                "position": self.data_position(), "hook_state": pickle.dumps(self.replica.hook_state)}
        members = group.gather_objects(mine)
        outcome = self._write_on_rank0(members, request) if group.rank == 0 else None
        outcome = group.hand_out(outcome, 0, WRITTEN_WITHIN)  # everyone waits for the shards' parts
        if outcome is not None:
            self.written.append(outcome)
        return outcome

    def _write_on_rank0(self, members: List[Dict], request: int) -> Optional[str]:
        step = self.replica.step
        started = time.monotonic()
        directory = None
        try:
            settings = self.ctx.checkpoint
            directory = CheckpointStore(settings.locate(settings.directory)).new_directory(step)
            shards = list(self.ctx.shards)
            # The other groups' positions, read before the shards write: their lines are all in the parts.
            positions = {} if self.positions is None else self.positions.read(
                (m["worker_index"] for m in members), self._restored_positions)
            positions.update({m["worker_index"]: m["position"] for m in members})
            futures = [rpc.rpc_async(shard, service.write_checkpoint_part,
                                     args=(directory.url, dict(settings.storage_options)),
                                     timeout=PART_TIMEOUT.total_seconds()) for shard in shards]
            files = every_part(futures, shards)
            dense = write_dense_part(
                directory, step=step, module=self.replica.module.state_dict(),
                optimizer=self.replica.optimizer.state_dict(), hook=self.replica.hook,
                hook_options=self.replica.hook_options, hook_states=[m["hook_state"] for m in members],
                data_positions=positions,
                members=[m["rpc_name"] for m in members], model=self.model)
            files.append(dense.to_json())
            info = {"shards": shards, "group_members": [m["rpc_name"] for m in members],
                    "data_used": {str(index): position["used"] for index, position in sorted(positions.items())
                                  if isinstance(position, dict)},
                    "hook": self.replica.hook}
            checkpoint_id = self.ctx.commit_checkpoint(CheckpointCommit(
                request=request, directory=str(directory), step=step, files=tuple(files), info=info))
        except Exception as error:  # noqa: BLE001 - a failed checkpoint must not end the training
            reason = one_line(error)
            logger.error("%s: checkpoint at step %d failed, not committed: %s", self.ctx.rpc_name, step, reason)
            self._report_failure(CheckpointFailure(request, str(directory or ""), step, reason))
            return None
        logger.info("%s: checkpoint %s written at step %d in %.2f s (%d shards)", self.ctx.rpc_name, checkpoint_id,
                    step, time.monotonic() - started, len(shards))
        _cut_push_logs(shards, directory.url)
        return checkpoint_id

    def _report_failure(self, failure: CheckpointFailure) -> None:
        """Tell the coordinator (which answers a waiting ps-ctl and removes the parts); best effort."""
        try:
            self.ctx.fail_checkpoint(failure)
        except Exception as error:  # noqa: BLE001 - the coordinator's own problem; training goes on
            logger.warning("%s: could not report the failed checkpoint: %s", self.ctx.rpc_name, one_line(error))


def _cut_push_logs(shards: List[str], directory: str) -> None:
    """Tell the shards that the checkpoint at ``directory`` committed, so that their push logs keep only what came
    after it.  Best effort, bounded: a shard that misses it keeps a longer log until the next one."""
    futures = [rpc.rpc_async(shard, service.checkpoint_committed, args=(directory,),
                             timeout=CUT_WITHIN.total_seconds()) for shard in shards]
    for shard, future in zip(shards, futures):
        try:
            future.wait()
        except RuntimeError as error:  # (a shard lost meanwhile: its restart reads the log as it is)
            logger.warning("shard %s did not cut its push log at the checkpoint: %s", shard, one_line(error))


def every_part(futures, shards: List[str], what: str = "shard parts") -> List[Dict]:
    """Every shard's part record (as JSON), once every shard is done (none still writes into the directory when
    a failed checkpoint's parts are removed); else the first failure, naming its shard."""
    parts, failures = [], []
    for shard, future in zip(shards, futures):
        try:
            parts.append(future.wait())
        except Exception as error:  # noqa: BLE001 - named below; a shard's error arrives as text: its cause
            failures.append(f"shard {shard}: {remote_error_cause(error)}")
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(shards)} {what} not written: {failures[0]}")
    return parts
