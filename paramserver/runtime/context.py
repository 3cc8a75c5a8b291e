"""The job contract: what a running job sees of the cluster, in plain Python types.

Owns ``JobContext`` (a job's first argument), ``GroupView`` (a plain
type it hands out), ``Recorders`` (the worker's metric sets, for a job to
hand to what it builds: a ``Trainer`` does) and ``GroupChannel``, the
narrow interface a trainer group forms through; the checkpoint records it
hands out and takes (``CheckpointSettings``, ``CheckpointCommit``,
``CheckpointFailure``) are ``paramserver.checkpoint.records``'s,
importable from here too.  A context is built in one call:
``JobContext.from_assignment`` for a
``ps-worker`` (the coordinator's answer and the worker's session), or
``JobContext.local`` for one process with no cluster (a job or a Trainer
under test: the process is its own shard and a trainer group of one).

The runtime feeds a context through its ``inbox`` (views of the trainer
group, stop and checkpoint requests, as the coordinator sends them); the
job only reads.  No protobuf message crosses into a job; this module
converts them at the boundary and never talks to the coordinator itself.
"""

import datetime
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AbstractSet, Any, Callable, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    from ..metrics.data_plane import DataPlaneMetrics
    from ..metrics.training import TrainingMetrics

from ..checkpoint.records import CheckpointCommit, CheckpointFailure, CheckpointSettings, LiveExportSettings
from .threads import HostThreads, choose_threads

#: How long a job waits for its trainer group to form before giving up.
GROUP_WAIT = datetime.timedelta(seconds=120)
_GROUP_POLL = datetime.timedelta(seconds=0.25)


@dataclass(frozen=True)
class GroupView:
    """One generation of a trainer group as the coordinator published it: members in rank order."""

    group: int
    generation: int
    members: Tuple[str, ...]
    backend: str = "gloo"

    @classmethod
    def from_message(cls, view) -> "GroupView":
        return cls(group=int(view.group), generation=int(view.generation), members=tuple(view.members),
                   backend=view.backend)

    def describe(self) -> str:
        return f"generation {self.generation} of {', '.join(self.members) or 'nobody'}"


@dataclass(frozen=True)
class Recorders:
    """Where a worker's job records what it does, when the worker serves metrics (``ps-worker --metrics-port``);
    ``None`` each when it does not.

    ``data_plane``: the RPCs it sends the shards (hand it to an
    ``EmbeddingCollection``, a ``ShardedEmbeddingBag`` looked up outside
    one, a ``DistributedOptimizer``); ``training``: its trainer group,
    dense replica and comm hook.  A ``Trainer`` hands both on itself.
    """

    data_plane: Optional["DataPlaneMetrics"] = None
    training: Optional["TrainingMetrics"] = None


class Inbox:
    """What the coordinator told this worker, newest first; written by the runtime, read by the job."""

    def __init__(self):
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._view: Optional[GroupView] = None
        self._checkpoint_request = 0

    def request_stop(self) -> None:
        self._stop.set()
        with self._changed:
            self._changed.notify_all()

    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def set_group_view(self, view) -> None:
        """A view of this worker's trainer group arrived (a ``GroupView`` or its message); kept when newer."""
        view = view if isinstance(view, GroupView) else GroupView.from_message(view)
        with self._changed:
            if self._view is None or view.generation > self._view.generation:
                self._view = view
                self._changed.notify_all()

    def group_view(self) -> Optional[GroupView]:
        with self._changed:
            return self._view

    def wait_for_change(self, seconds: float) -> None:
        with self._changed:
            self._changed.wait(seconds)

    def request_checkpoint(self, number: int) -> None:
        with self._changed:
            self._checkpoint_request = max(self._checkpoint_request, int(number))

    def checkpoint_request(self) -> int:
        with self._changed:
            return self._checkpoint_request


class GroupChannel:
    """What a trainer group needs of the cluster, and nothing else (``paramserver.ddp.TrainerGroup``).

    ``rpc_name`` and ``worker_index`` name this member; ``store_host``/
    ``store_port`` are the c10d store its generations rendezvous in;
    ``gpu`` is the GPU this worker holds for itself (``paramserver.runtime.devices``), or ``None``.
    """

    def __init__(self, rpc_name: str, worker_index: int, trainer_group: int, store_host: str, store_port: int,
                 inbox: Inbox, refresh: Callable[[], None] = lambda: None,
                 request_regroup: Callable[[int], None] = lambda generation: None, gpu: Optional[int] = None):
        self.rpc_name = rpc_name
        self.gpu = gpu
        self.worker_index = worker_index
        self.trainer_group = trainer_group
        self.store_host = store_host
        self.store_port = store_port
        self._inbox = inbox
        self._refresh = refresh
        self._request_regroup = request_regroup

    def group_view(self) -> Optional[GroupView]:
        """The newest view of this worker's trainer group heard of (``None`` before it formed)."""
        return self._inbox.group_view()

    def should_stop(self) -> bool:
        return self._inbox.stop_requested()

    def request_regroup(self, generation: int) -> None:
        """Tell the coordinator that ``generation`` of this group broke (a new one is due)."""
        self._request_regroup(generation)

    def wait_for_group_view(self, newer_than: int = 0,
                            timeout: datetime.timedelta = GROUP_WAIT) -> Optional[GroupView]:
        """Block until a view newer than generation ``newer_than`` that includes this worker arrives.

        Returns ``None`` as soon as the worker is asked to stop; raises
        ``TimeoutError`` after ``timeout``.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.should_stop():
            view = self.group_view()
            if view is not None and view.generation > newer_than and self.rpc_name in view.members:
                return view
            self._inbox.wait_for_change(_GROUP_POLL.total_seconds())
            if time.monotonic() > deadline:
                newest = self.group_view()
                raise TimeoutError(f"{self.rpc_name}: trainer group {self.trainer_group} did not form within "
                                   f"{timeout.total_seconds():.0f} s (newest view: "
                                   f"{newest.describe() if newest else 'none yet'})")
            self._refresh()
        return None


@dataclass
class JobContext:
    """What a running job knows of the cluster; passed as the job's first argument.

    A job is ``def main(ctx: JobContext, **config) -> dict``.  It reports
    progress with ``report`` (heartbeats carry the latest figures to the
    coordinator) and returns soon after ``should_stop()`` turns true; a
    ``paramserver.Trainer`` does both for it.
    """

    rpc_name: str
    worker_index: int
    trainer_group: int
    #: RPC names of the shards serving when this worker joined.
    shards: List[str]
    group: GroupChannel
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    #: Where trainer group 0 writes live exports (``ps-server --export-dir``; directory empty: none).
    exports: LiveExportSettings = field(default_factory=LiveExportSettings)
    #: The member id the coordinator knows this worker by.
    member_id: str = ""
    #: The job's run this worker joined: one more each time a worker joins while none is alive; the workers of
    #: one run share it (a followed input's parts are taken per run: ``paramserver.train.claims``).
    job_run: int = 0
    inbox: Inbox = field(default_factory=Inbox, repr=False)
    #: The worker's metric sets to record into (each ``None``: this worker serves no metrics).
    recorders: Recorders = field(default_factory=Recorders, repr=False)
    #: Whether this worker's host has more cores than the cluster's processes on it (``runtime.threads``); the
    #: Trainer's row cache chooses its default window by it.
    cores_to_spare: bool = True
    #: The shards serving now, as of the last word from the coordinator.
    _live_shards: Optional[Callable[[], List[str]]] = field(default=None, repr=False)
    #: The shards that will not serve again (name -> why), as of the last word from the coordinator.
    _shards_gone: Callable[[], Dict[str, str]] = field(default=dict, repr=False)
    #: The trainer groups of this job run gone (no live worker for a while), as of the last word from the coordinator.
    _trainer_groups_gone: Callable[[], AbstractSet[int]] = field(default=frozenset, repr=False)
    #: Handles holding RRefs of a shard process that died, kept until the runtime leaves the data plane.
    _retired: List[Any] = field(default_factory=list, repr=False)
    #: Asks the coordinator for news now.
    _refresh: Callable[[], None] = field(default=lambda: None, repr=False)
    #: Commits a written checkpoint at the coordinator; returns its id.
    _commit_checkpoint: Optional[Callable[[CheckpointCommit], str]] = field(default=None, repr=False)
    #: Tells the coordinator a checkpoint could not be written.
    _fail_checkpoint: Callable[[CheckpointFailure], None] = field(default=lambda failure: None, repr=False)
    _close: Callable[[], None] = field(default=lambda: None, repr=False)
    #: Sets this worker's threads for the cluster's processes on its host now (``runtime.threads``), on the
    #: job's thread; ``report`` calls it.
    _follow_threads: Callable[[], None] = field(default=lambda: None, repr=False)
    _progress_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _step: int = field(default=0, repr=False)
    _figures: Dict[str, float] = field(default_factory=dict, repr=False)

    # -- building ------------------------------------------------------
    @classmethod
    def from_assignment(cls, assignment, session, gpu: Optional[int] = None,
                        recorders: Optional[Recorders] = None,
                        threads: Optional[HostThreads] = None) -> "JobContext":
        """A worker's context: the coordinator's ``Assignment``, the worker's ``MemberSession``, the GPU it
        holds (``None``: none), the metric sets it serves (``None``: none) and its threads, applied (whether
        its host has cores to spare is theirs; they follow the cluster's processes on the host from the job's
        thread; ``None``: as PyTorch has them, and cores to spare)."""
        inbox = Inbox()
        group = GroupChannel(assignment.rpc_name, assignment.index, assignment.trainer_group,
                             assignment.store.host, assignment.store.port, inbox, refresh=session.beat_now,
                             request_regroup=session.request_regroup, gpu=gpu)

        return cls(rpc_name=assignment.rpc_name, worker_index=assignment.index,
                   trainer_group=assignment.trainer_group, shards=list(assignment.shards), group=group,
                   checkpoint=CheckpointSettings.from_message(assignment.checkpoint),
                   exports=LiveExportSettings.from_message(assignment.job.exports),
                   member_id=assignment.member_id, job_run=assignment.job_run, inbox=inbox,
                   recorders=recorders or Recorders(),
                   cores_to_spare=threads.choice.cores_to_spare if threads is not None else True,
                   _follow_threads=(lambda: threads.follow(session.host_processes)) if threads is not None
                   else (lambda: None),
                   _live_shards=lambda: session.shards,
                   _shards_gone=lambda: session.shards_gone,
                   _trainer_groups_gone=lambda: session.trainer_groups_gone,
                   _refresh=session.beat_now, _commit_checkpoint=session.commit_checkpoint,
                   _fail_checkpoint=session.fail_checkpoint)

    @classmethod
    def local(cls, name: str = "worker0", worker_index: int = 0,
              recorders: Optional[Recorders] = None) -> "JobContext":
        """A context for one process and no cluster: it joins torch RPC as its own only peer (so it is the
        shard of every table) and forms a trainer group of one over gloo.  ``close()`` leaves both.
        ``recorders``: metric sets for the job to record into (``None``: none)."""
        import torch.distributed as dist

        from ..processes import free_port
        from ..shards import peer

        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        inbox = Inbox()
        inbox.set_group_view(GroupView(group=0, generation=1, members=(name,), backend="gloo"))
        peer.join(name, 0, 1, f"tcp://127.0.0.1:{free_port()}")

        def close(kept_until_closed=store) -> None:  # the store lives as long as the group may use it
            peer.leave(graceful=True)

        group = GroupChannel(name, worker_index, 0, "127.0.0.1", store.port, inbox)
        return cls(rpc_name=name, worker_index=worker_index, trainer_group=0, shards=[name], group=group,
                   inbox=inbox, recorders=recorders or Recorders(),
                   cores_to_spare=choose_threads("worker").cores_to_spare, _close=close)

    def close(self) -> None:
        """Leave what ``local`` joined (nothing for a worker's context: its runtime leaves)."""
        self._close()

    def __enter__(self) -> "JobContext":
        return self

    def __exit__(self, *exc_info) -> None:
        """``with JobContext.local() as ctx:`` leaves what it joined on the way out, error or not."""
        self.close()

    # -- what a job reads ----------------------------------------------
    def should_stop(self) -> bool:
        """True once the coordinator asked this worker to stop (or was lost)."""
        return self.inbox.stop_requested()

    def live_shards(self) -> List[str]:
        """The shards serving now, as of the last word from the coordinator."""
        return list(self._live_shards()) if self._live_shards is not None else list(self.shards)

    def shards_gone(self) -> Dict[str, str]:
        """Shards that will not serve again (their process is not restarted): name -> why."""
        return dict(self._shards_gone())

    def trainer_groups_gone(self) -> AbstractSet[int]:
        """The trainer groups of this job run left with no live worker for the coordinator's ``group_gone_after``
        (what they had under way may be taken over)."""
        return frozenset(self._trainer_groups_gone())

    def retire_handles(self, handles: Any) -> None:
        """Keep ``handles`` (objects holding RRefs to objects of a shard process that died, or the error of a
        build that failed, whose traceback holds what it built) until this process leaves the data plane, where
        the runtime drops them without telling their owner.

        Dropped earlier, torch would tell the owner that no longer exists, and
        log an error with a C++ stack trace for each RRef.
        """
        self._retired.append(handles)

    def take_retired_handles(self) -> List[Any]:
        """For the runtime, as it leaves the data plane: the retired handles, which the context forgets."""
        retired, self._retired = self._retired, []
        return retired

    def refresh(self) -> None:
        """Ask the coordinator for news now (a heartbeat), rather than at the next beat."""
        self._refresh()

    def checkpoint_request(self) -> int:
        """The newest checkpoint request heard of (0: none)."""
        return self.inbox.checkpoint_request()

    def commit_checkpoint(self, commit: CheckpointCommit) -> str:
        """Commit a written checkpoint at the coordinator; returns its id."""
        if self._commit_checkpoint is None:
            raise RuntimeError(f"{self.rpc_name} has no coordinator to commit checkpoints to")
        return self._commit_checkpoint(commit)

    def fail_checkpoint(self, failure: CheckpointFailure) -> None:
        """Tell the coordinator that a checkpoint could not be written (nothing without a coordinator)."""
        self._fail_checkpoint(failure)

    # -- what a job reports --------------------------------------------
    def report(self, step: int, **figures: float) -> None:
        """Record progress: the step reached and a few figures (loss, samples/s...).  Called from the job's
        thread, it also sets that thread's intra-op threads for the cluster's processes on the host now."""
        self._follow_threads()
        with self._progress_lock:
            self._step = int(step)
            self._figures = {key: float(value) for key, value in figures.items()}

    def progress(self) -> Tuple[int, Dict[str, float]]:
        with self._progress_lock:
            return self._step, dict(self._figures)
