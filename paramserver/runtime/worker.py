"""``ps-worker``'s process: join the cluster, run the shipped job, leave.

Owns a worker's life: join the coordinator (retrying while it is
unreachable), unpack the job it hands out, join the data plane under the
assigned RPC name, heartbeat the job's progress while it runs, and leave
both planes when it returns.  A stop command, SIGTERM/SIGINT, or losing
the coordinator asks the job to stop; a job that ignores the request is
ended after a grace period.  With a metrics port the worker serves its
metrics there from before it joins until it exits (its RPCs to the shards,
its training, the job's reported figures): the job's context carries the
metric sets (``JobContext.recorders``) for the job to hand to what records
into them.  Losing the cluster ends the
worker within a bound: refused by the coordinator (declared dead while it
hung), it exits at once; the coordinator unreachable for the heartbeat
timeout, the job is asked to stop and the process ends within
``LOST_CLUSTER_GRACE`` whether or not the job returned.  Exit codes: 0
done, 1 the job or the cluster failed (or the metrics port cannot be
bound), 2 refused (wrong token, bad job).  Every outcome is one line.
"""

import datetime
import gc
import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import grpc

from .._torch_compat import forsake_rref_owners
from ..control import CoordinatorError, CoordinatorUnavailable, NotAuthenticated, TlsFiles, pb
from ..metrics.process import ProcessMetrics, worker_metrics
from ..logs import exit_now, one_line
from ..shards import peer
from .context import JobContext, Recorders
from .devices import claim_gpu
from .exit_codes import EXIT_FAILED, EXIT_OK, EXIT_REFUSED
from .threads import HostThreads
from .job import JobError, check_config, unpack_job
from .member import MemberSession

logger = logging.getLogger(__name__)

STOP_GRACE = datetime.timedelta(seconds=10)
#: How long a worker that lost the coordinator gives its job to return before it exits.
LOST_CLUSTER_GRACE = datetime.timedelta(seconds=1.5)
#: How long leaving the data plane may take after the job ended (RPC calls in flight, RRef releases).
DATA_PLANE_LEAVE_WITHIN = datetime.timedelta(seconds=20)


@dataclass(frozen=True)
class WorkerOptions:
    address: str
    host: str = "127.0.0.1"
    token: Optional[str] = None
    tls: Optional[TlsFiles] = None
    retry_for: Optional[datetime.timedelta] = None
    stop_grace: datetime.timedelta = STOP_GRACE
    #: Job arguments set by this worker's flags, over the job spec's (``--comm-hook``...).
    config_overrides: Dict[str, Any] = field(default_factory=dict)
    #: Serve Prometheus metrics on this port of ``host`` (0: a free one); ``None``: no metrics.
    metrics_port: Optional[int] = None
    #: How long the job goes on while the coordinator does not answer (``None``: ``member.coordinator_grace()``).
    coordinator_grace: Optional[datetime.timedelta] = None


def run_worker(options: WorkerOptions, say=print) -> int:
    """Run one worker to completion; ``say`` prints the one-line outcome.  Returns the exit code."""
    metrics = None
    if options.metrics_port is not None:
        try:
            metrics = worker_metrics(options.host, options.metrics_port)
        except OSError as error:
            say(f"ps-worker: {error}")
            return EXIT_FAILED
    try:
        return _run(options, say, metrics)
    finally:
        if metrics is not None:
            metrics.close()


def _run(options: WorkerOptions, say, metrics: Optional[ProcessMetrics]) -> int:
    gpu = claim_gpu(name="ps-worker")  # held until the process ends
    session = MemberSession(options.address, pb.ROLE_WORKER, host=options.host, token=options.token,
                            tls=options.tls, retry_for=options.retry_for, gpus=int(gpu.index is not None),
                            grace=options.coordinator_grace)
    try:
        assignment = session.join()
    except NotAuthenticated as error:
        say(f"ps-worker: {error}")
        return EXIT_REFUSED
    except CoordinatorUnavailable as error:
        say(f"ps-worker: {error}")
        return EXIT_FAILED
    except CoordinatorError as error:
        say(f"ps-worker: could not join: {error}")
        # A join refused for what it said (a loopback --host from another host...) is this worker's to fix.
        return EXIT_REFUSED if error.code == grpc.StatusCode.INVALID_ARGUMENT else EXIT_FAILED
    # Sized to the cluster's processes on this host, as the coordinator counts them; followed as they change.
    threads = HostThreads("worker", "ps-worker")
    threads.apply(assignment.host_processes)
    recorders = Recorders() if metrics is None else Recorders(data_plane=metrics.data_plane,
                                                              training=metrics.training)
    context = JobContext.from_assignment(assignment, session, gpu.index, recorders, threads=threads)
    if metrics is not None:
        metrics.watch_job(context)
    watchdog = _StopWatchdog(context, options.stop_grace, say, assignment.rpc_name)
    # Heartbeats from the moment we joined: unpacking the job and joining the
    # data plane can take seconds on a loaded machine.
    session.start_heartbeats(progress=context.progress, on_stop=watchdog.stop_requested,
                             on_lost=watchdog.cluster_lost, on_group=context.inbox.set_group_view,
                             on_checkpoint=context.inbox.request_checkpoint)
    if not assignment.job.code:
        session.leave("no job")
        say(f"ps-worker: the cluster at {options.address} has no job to run")
        return EXIT_REFUSED
    try:
        job, config = unpack_job(assignment.job)
        config.update(_accepted(job, assignment.job.name, options.config_overrides))
    except JobError as error:
        session.leave(f"bad job: {error}")
        say(f"ps-worker: {error}")
        return EXIT_REFUSED

    try:
        peer.join(assignment.rpc_name, assignment.rpc_rank, None, session.init_method, bind_host=options.host)
    except Exception as error:  # noqa: BLE001 - say why in one line and leave the cluster
        session.leave(f"could not join the data plane: {error}")
        say(f"ps-worker: could not join the data plane at {session.init_method}: {error}")
        return EXIT_FAILED
    # SIGTERM/SIGINT (a scheduler, Ctrl-C) ask the job to stop, as the coordinator's STOP does.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: (logger.info("got %s", signal.Signals(signum).name),
                                                   watchdog.stop_requested()))
    session.mark_ready()
    logger.info("running job %s as %s with %s", assignment.job.name, assignment.rpc_name, config or "no config")
    try:
        result = job(context, **config)
    except Exception as error:  # noqa: BLE001 - report the job's failure in one line, then leave
        logger.error("job %s failed:\n%s", assignment.job.name, traceback.format_exc())
        if session.lost_reason is not None:  # failed because the cluster went away: say that
            watchdog.exit_lost()
        watchdog.done()
        peer.leave(graceful=False)
        session.leave(f"job failed: {one_line(error)}", *context.progress())
        say(f"ps-worker: job {assignment.job.name} failed: {one_line(error)}")
        return EXIT_FAILED
    if session.lost_reason is not None:
        watchdog.exit_lost(result)
    watchdog.done()
    step, progress = context.progress()
    metrics = _figures(result)  # the job's own figures first: they go to the coordinator whatever else is cut
    metrics.update((key, value) for key, value in progress.items() if key not in metrics)
    _drop_retired_handles(context)
    left_data_plane = _leave_data_plane(graceful=True)
    if not left_data_plane:
        session.leave("finished; left the data plane without waiting", step, metrics)
        say(f"ps-worker: {assignment.rpc_name} finished {assignment.job.name} at step {step}, but leaving the "
            f"data plane did not finish within {DATA_PLANE_LEAVE_WITHIN.total_seconds():.0f} s")
        exit_now(EXIT_OK)  # torch's teardown would wait on the same peers
    session.leave("job finished", step, metrics)
    say(f"ps-worker: {assignment.rpc_name} finished {assignment.job.name} at step {step}{_summary(metrics)}")
    return EXIT_OK


def _figures(result) -> Dict[str, float]:
    """The numbers among what a job returned."""
    if not isinstance(result, dict):
        return {}
    return {key: float(value) for key, value in result.items() if isinstance(value, (int, float))}


def _summary(metrics: Dict[str, float]) -> str:
    summary = ", ".join(f"{key}={value:.4g}" for key, value in sorted(metrics.items()))
    return f" ({summary})" if summary else ""


def _drop_retired_handles(context: JobContext) -> None:
    """Drop the handles the job retired (RRefs of a shard process that died) without telling their owner, which
    no longer exists: told, torch logs an error with a C++ stack trace for each one.  Right before leaving."""
    retired = context.take_retired_handles()
    if retired:
        forsake_rref_owners()
        logger.info("dropped %d handles to objects of lost shard processes", len(retired))
        del retired
        # Now, not at some later collection: what of them sits in reference cycles (a failed build's error and
        # the frames of its traceback) is released while no owner is told.
        gc.collect()


def _leave_data_plane(graceful: bool) -> bool:
    """Leave torch RPC; False when that did not finish within ``DATA_PLANE_LEAVE_WITHIN``.

    A graceful leave of an open group waits for this process's calls in
    flight and RRef releases; a peer lost just before (a shard restarted
    moments ago) can leave it waiting far longer than any step.
    """
    finished = threading.Event()

    def leave():
        try:
            peer.leave(graceful=graceful)
        except Exception as error:  # noqa: BLE001 - leaving is best effort; the cluster drops us anyway
            logger.warning("leaving the data plane: %s: %s", type(error).__name__, error)
        finished.set()

    threading.Thread(target=leave, name="leave-data-plane", daemon=True).start()
    if finished.wait(DATA_PLANE_LEAVE_WITHIN.total_seconds()):
        return True
    logger.error("leaving the data plane did not finish within %.0f s; exiting without it",
                 DATA_PLANE_LEAVE_WITHIN.total_seconds())
    return False


def _accepted(job, name: str, overrides: Dict[str, Any]) -> Dict[str, Any]:
    """``overrides``, once the job is known to take each of them, of its annotated types."""
    check_config(job, overrides, name, "this worker's flags (--comm-hook...)", partial=True)
    return overrides


class _StopWatchdog:
    """Pass a stop request to the job; end the process if the job ignores it for ``grace``.

    Losing the cluster is stricter (``cluster_lost``): refused by the
    coordinator, the process exits at once; the coordinator unreachable, the
    job gets ``LOST_CLUSTER_GRACE`` to return, then the process exits either
    way.  Either exit says in one line that the cluster was lost, with the
    figures the job last reported.
    """

    def __init__(self, context: JobContext, grace: datetime.timedelta, say, name: str):
        self._context = context
        self._grace = grace
        self._say = say
        self._name = name
        self._finished = threading.Event()
        self._exiting = threading.Lock()
        self._lost_reason = ""

    def stop_requested(self) -> None:
        if self._context.should_stop():
            return
        self._context.inbox.request_stop()
        threading.Thread(target=self._enforce, name="stop-watchdog", daemon=True).start()

    def _enforce(self) -> None:
        if not self._finished.wait(self._grace.total_seconds()):
            logger.error("the job did not stop within %.0f s of being asked; exiting", self._grace.total_seconds())
            os._exit(EXIT_FAILED)

    def cluster_lost(self, reason: str, refused: bool) -> None:
        """The member's session ended (``MemberSession.start_heartbeats``' ``on_lost``)."""
        self._lost_reason = reason
        if refused:  # the cluster moved on without us: nothing this process holds is wanted any more
            self.exit_lost()
        self._context.inbox.request_stop()
        threading.Thread(target=self._exit_after_grace, name="lost-cluster-watchdog", daemon=True).start()

    def _exit_after_grace(self) -> None:
        time.sleep(LOST_CLUSTER_GRACE.total_seconds())
        logger.error("the job did not return within %.1f s of losing the cluster", LOST_CLUSTER_GRACE.total_seconds())
        self.exit_lost()

    def exit_lost(self, result=None) -> None:
        """Say that the cluster was lost (with the job's figures), then end the process at once: exit 1."""
        with self._exiting:  # one line, whichever thread gets here first; the others wait for the exit
            step, metrics = self._context.progress()
            metrics.update(_figures(result))
            self._say(f"ps-worker: {self._name} lost the cluster at step {step}{_summary(metrics)}: "
                      f"{one_line(self._lost_reason)}")
            exit_now(EXIT_FAILED)

    def done(self) -> None:
        self._finished.set()
