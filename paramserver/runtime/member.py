"""A cluster member's session with the coordinator, and its RPC group upkeep.

Owns the part every role shares: join the coordinator under a role, keep
the assignment, send heartbeats with progress, act on commands (stop;
forget a lost RPC peer, so that this process's view of the data plane
stays whole; once the coordinator answers again after an outage, put this
process back into the RPC group's store, which may have been made anew),
and leave.  What the member does in between (serve shards,
run a job, drive) belongs to its caller.
"""

import datetime
import json
import logging
import os
import socket
import threading
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

from ..control import CoordinatorClient, CoordinatorError, CoordinatorUnavailable, HeartbeatLoop, TlsFiles, pb
from ..control.client import sendable
from ..control.protocol import COORDINATOR_GRACE, COORDINATOR_GRACE_ENV
from ..shards import peer

logger = logging.getLogger(__name__)


def coordinator_grace(given: Optional[datetime.timedelta] = None) -> datetime.timedelta:
    """``given``, else ``$PARAMSERVER_COORDINATOR_GRACE`` (seconds), else ``COORDINATOR_GRACE``."""
    if given is not None:
        return given
    value = os.environ.get(COORDINATOR_GRACE_ENV)
    return datetime.timedelta(seconds=float(value)) if value else COORDINATOR_GRACE


class MemberSession:
    """``join()``, then ``start_heartbeats(...)``, then ``leave(...)``.

    ``grace``: how long the member goes on while the coordinator does not answer (``coordinator_grace``):
    heartbeats are retried, a checkpoint's commit waits for it, and a coordinator started again on the same
    state directory takes the member back; past it the member is lost (``on_lost``).
    """

    def __init__(self, address: str, role: int, name: Optional[str] = None, host: str = "127.0.0.1",
                 token: Optional[str] = None, tls: Optional[TlsFiles] = None,
                 retry_for: Optional[datetime.timedelta] = None, shard_token: Optional[str] = None,
                 gpus: Optional[int] = None, admin_token: Optional[str] = None,
                 grace: Optional[datetime.timedelta] = None):
        self.grace = coordinator_grace(grace)
        self.client = CoordinatorClient(address, token=token, tls=tls, shard_token=shard_token,
                                        admin_token=admin_token)
        self.role = role
        self.name = name or socket.gethostname().split(".")[0][:64] or "member"
        self.host = host
        self._retry_for = retry_for
        self._gpus = gpus
        self.assignment: Optional[pb.Assignment] = None
        self._shards: List[str] = []
        self._shards_gone: Dict[str, str] = {}
        self._trainer_groups_gone: FrozenSet[int] = frozenset()
        self._host_processes = 0
        self._news_lock = threading.Lock()
        self._heartbeats: Optional[HeartbeatLoop] = None
        #: Why this member is out of the cluster (the coordinator lost, or it refused us); None while in it.
        self.lost_reason: Optional[str] = None
        #: The coordinator refused this member (declared it dead): the cluster has already moved on without it.
        self.refused = False

    def join(self) -> pb.Assignment:
        # An outage of the coordinator (started again, or still starting) is waited out within the grace.
        self.assignment = self.client.join(self.role, self.name, self.host, retry_for=self._retry_for or self.grace,
                                           gpus=self._gpus)
        self._set_news(self.assignment.shards, host_processes=self.assignment.host_processes)
        logger.info("joined %s as %s (rank %d, generation %d)", self.client.address, self.assignment.rpc_name,
                    self.assignment.rpc_rank, self.assignment.generation)
        return self.assignment

    @property
    def init_method(self) -> str:
        store = self.assignment.store
        host = f"[{store.host}]" if ":" in store.host else store.host
        return f"tcp://{host}:{store.port}"

    @property
    def shards(self) -> List[str]:
        """RPC names of the live shards, as of the last heartbeat."""
        with self._news_lock:
            return list(self._shards)

    @property
    def shards_gone(self) -> Dict[str, str]:
        """Shards that will not serve again (not restarted), as of the last heartbeat: name -> why."""
        with self._news_lock:
            return dict(self._shards_gone)

    @property
    def trainer_groups_gone(self) -> FrozenSet[int]:
        """Trainer groups of this job run left with no live worker for a while, as of the last heartbeat."""
        with self._news_lock:
            return self._trainer_groups_gone

    @property
    def host_processes(self) -> int:
        """The cluster's processes on this member's machine, as of the last heartbeat (0: unknown)."""
        with self._news_lock:
            return self._host_processes

    def _set_news(self, shards, gone=None, groups_gone=(), host_processes: int = 0) -> None:
        """What the coordinator said of the cluster: the live shards, those gone for good, the groups gone, the
        cluster's processes on this member's machine."""
        with self._news_lock:
            self._shards = list(shards)
            self._shards_gone = dict(gone or {})
            self._trainer_groups_gone = frozenset(groups_gone)
            self._host_processes = host_processes

    def start_heartbeats(self, progress: Callable[[], Tuple[int, Dict[str, float]]] = lambda: (0, {}),
                         on_stop: Callable[[], None] = lambda: None,
                         on_lost: Callable[[str, bool], None] = lambda reason, refused: None,
                         on_group: Callable[[pb.TrainerGroupView], None] = lambda view: None,
                         on_checkpoint: Optional[Callable[[int], None]] = None) -> None:
        """Heartbeat every interval from now on; ``on_group`` gets each answer's trainer-group view,
        ``on_checkpoint`` each checkpoint request's number (members without it ignore requests),
        ``on_lost(reason, refused)`` the end of this member's session, once."""
        interval = datetime.timedelta(milliseconds=self.assignment.heartbeat_interval_ms)

        def on_command(command: pb.Command) -> None:
            if command.kind == pb.Command.KIND_STOP:
                logger.info("coordinator asked %s to stop", self.assignment.rpc_name)
                on_stop()
            elif command.kind == pb.Command.KIND_FORGET_PEER:
                peer.forget(command.peer)
            elif command.kind == pb.Command.KIND_CHECKPOINT and on_checkpoint is not None:
                try:
                    on_checkpoint(int(command.checkpoint_id))
                except ValueError:
                    logger.warning("ignoring a checkpoint request numbered %r", command.checkpoint_id[:64])
            else:
                logger.warning("ignoring command %s: not supported by this member",
                               pb.Command.Kind.Name(command.kind))

        def on_response(response: pb.HeartbeatResponse) -> None:
            self._set_news(response.shards, response.shards_gone, response.trainer_groups_gone,
                           response.host_processes)
            if response.HasField("group"):
                on_group(response.group)

        def lost(reason: str, refused: bool) -> None:
            self.lost_reason, self.refused = reason, refused
            logger.error("%s: %s", self.assignment.rpc_name, reason)
            on_lost(reason, refused)

        def back_in_the_data_plane() -> None:  # its own thread: it may wait for the RPC group's token
            threading.Thread(target=peer.republish, name="rpc-republish", daemon=True).start()

        self._heartbeats = HeartbeatLoop(self.client, self.assignment.member_id, interval, give_up_after=self.grace,
                                         progress=progress, on_command=on_command, on_lost=lost,
                                         on_response=on_response, credential=self.assignment.credential,
                                         on_outage_end=back_in_the_data_plane).start()

    def beat_now(self) -> None:
        """Send a heartbeat now (to hear of a change sooner than the next beat); nothing once lost."""
        if self.lost_reason is not None:
            return
        try:
            self._heartbeats.beat()
        except CoordinatorUnavailable as error:  # the loop says so once, and declares it lost past the grace
            if self._heartbeats.outage is None:
                logger.debug("heartbeat failed: %s", error)
        except CoordinatorError:  # refused: reported once, through on_lost
            pass

    def request_regroup(self, generation: int) -> None:
        """Tell the coordinator (now) that ``generation`` of this worker's trainer group broke."""
        self._heartbeats.regroup_generation = generation
        self.beat_now()

    def commit_checkpoint(self, commit) -> str:
        """Hand a written checkpoint (a ``checkpoint.records.CheckpointCommit``) to the coordinator; returns its id."""
        request = pb.CommitCheckpointRequest(
            member_id=self.assignment.member_id, request=commit.request, directory=commit.directory,
            step=commit.step, files=[pb.CheckpointFile(**record) for record in commit.files],
            info_json=json.dumps(commit.info))
        return self._through_outage("CommitCheckpoint", request).checkpoint_id

    def _through_outage(self, method: str, request):
        """``method`` once the coordinator answers, waiting (retrying) for it through an outage within the
        grace: a checkpoint written during one is committed once the coordinator is back, never half."""
        return self.client.call_retrying(method, request, retry_for=self.grace, quiet=True)

    def fail_checkpoint(self, failure) -> None:
        """Tell the coordinator that a checkpoint (a ``checkpoint.records.CheckpointFailure``) could not be written."""
        self._through_outage("CommitCheckpoint", pb.CommitCheckpointRequest(
            member_id=self.assignment.member_id, request=failure.request, directory=failure.directory,
            step=failure.step, failure=failure.reason))

    def mark_ready(self) -> None:
        """Tell the coordinator (with the next heartbeat, sent now) that this member's data plane is up."""
        self._heartbeats.ready = True
        self.beat_now()

    def leave(self, reason: str, step: int = 0, metrics: Optional[Dict[str, float]] = None) -> None:
        """Stop heartbeats and tell the coordinator (unless it already declared us gone)."""
        if self._heartbeats is not None:
            self._heartbeats.stop()
        if self.assignment is not None and self.lost_reason is None:
            try:  # a coordinator out for a while hears it once it is back (within the grace)
                self._through_outage("Leave", pb.LeaveRequest(
                    member_id=self.assignment.member_id, reason=reason[:512], step=step,
                    metrics=sendable(metrics or {}, set())))
            except CoordinatorError as error:
                logger.warning("leaving the coordinator: %s", error)
        self.client.close()
