"""``ps-server``'s process: the coordinator plus its supervised shard servers.

Owns the server's life: start the coordinator, start the shards, announce
readiness (one line on stdout with the address; health SERVING) once every
shard has joined, then wait for a shutdown (SIGTERM/SIGINT or the Shutdown
RPC) and drain in order: members are asked to stop and given a few seconds
to leave, shards other hosts added are told to stop, this host's shards
are stopped, the port closes.  The whole drain is bounded
so the process is gone within 10 s, leaving no child behind.  A batch
job's server (``stop_after_workers``) shuts itself down the same way once
that many workers have left and none is running.  With a
metrics port the coordinator serves the cluster's metrics on it and each
shard serves its own (``paramserver.metrics.shard_metrics_port``).
"""

import datetime
import logging
import signal
import threading
from dataclasses import dataclass
from typing import Dict, Optional

from ..control import CoordinatorServer, CoordinatorSettings, TlsFiles, pb
from ..control.membership import LEFT, Membership
from ..control.server import format_address
from ..logs import exit_now
from ..metrics.process import coordinator_metrics
from .shard_policy import MAX_RESTARTS
from .supervisor import ShardSupervisor
from .threads import apply_threads

logger = logging.getLogger(__name__)

READY_TIMEOUT = datetime.timedelta(seconds=120)
MEMBERS_LEAVE_WITHIN = datetime.timedelta(seconds=4)
SHARDS_STOP_WITHIN = datetime.timedelta(seconds=3)
#: How often a server waiting for its workers to be done also looks at a shutdown request.
WATCH_SLICE = datetime.timedelta(seconds=1)


@dataclass(frozen=True)
class ServerOptions:
    num_shards: int
    coordinator: CoordinatorSettings
    log_level: Optional[str] = None
    ready_timeout: datetime.timedelta = READY_TIMEOUT
    shard_prefix: str = "shard"
    #: How many times one lost shard process is restarted.
    max_restarts: int = MAX_RESTARTS
    #: The coordinator's metrics port (shard i: this + 1 + i; 0: free ports); ``None``: no metrics.
    metrics_port: Optional[int] = None
    #: Shut down once this many workers have left and none is running (a batch job's end); 0: run until told.
    stop_after_workers: int = 0
    #: How long its shards serve on while the coordinator does not answer (``None``: the default).
    coordinator_grace: Optional[datetime.timedelta] = None
    #: Where its shards log their pushes (``ShardSupervisor``'s ``push_log``): ``None`` a temporary folder, "off".
    push_log: Optional[str] = None
    #: Where its shards keep the rows their memory does not hold (``row_store.RowStoreOptions``), or ``None``.
    row_store: Optional[object] = None


class _Shutdown:
    def __init__(self):
        self.event = threading.Event()
        self.reason = ""
        #: Only this process ends; the cluster rides the outage out (``step_away``).
        self.members_stay = False

    def request(self, reason: str) -> None:
        if not self.event.is_set():
            self.reason = reason
            logger.info("shutting down: %s", reason)
            self.event.set()

    def step_away(self, reason: str) -> None:
        """End this coordinator alone: its journal is kept, and its members ride the outage out until one
        started again takes them back (a pod moved by a node drain or an eviction gets SIGTERM)."""
        if not self.event.is_set():
            self.reason, self.members_stay = reason, True
            logger.info("%s: this coordinator ends; the cluster trains on for its members' grace, for a "
                        "ps-server started again with the same --state-dir to take it back (ps-ctl shutdown "
                        "stops the cluster)", reason)
            self.event.set()


def serve(options: ServerOptions, announce=print) -> int:
    """Run until shut down; returns the exit code (0 on a clean shutdown)."""
    apply_threads("coordinator", "ps-server")
    shutdown = _Shutdown()
    # With a journal, SIGTERM/SIGINT end this process alone (a pod moved elsewhere comes back to take the
    # cluster again); without one, they shut the cluster down.
    on_signal = shutdown.step_away if options.coordinator.state_dir else shutdown.request
    previous = {sig: signal.signal(sig, lambda signum, _frame: on_signal(signal.Signals(signum).name))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    coordinator = CoordinatorServer(options.coordinator, request_shutdown=shutdown.request).start()
    supervisor = metrics = None
    try:
        host = options.coordinator.host
        if options.metrics_port is not None:
            metrics = coordinator_metrics(host, options.metrics_port, coordinator.membership,
                                          coordinator.checkpoints)
        tls = options.coordinator.tls
        child_tls = TlsFiles(ca=tls.ca or tls.cert) if tls is not None else None
        # Shards listen on the server's host and dial the coordinator there.
        host = options.coordinator.host
        adopted = _adopted_shards(coordinator, options)
        if adopted:
            logger.info("took back %s, started by the ps-server before this one: they serve on and re-attach, "
                        "and are restarted like this one's own if they exit", ", ".join(adopted))
        if options.num_shards:  # none: a coordinator only, whose shards other hosts add (ps-server --join)
            supervisor = ShardSupervisor(
                options.num_shards, format_address(host, coordinator.port), host,
                on_exit=coordinator.membership.process_exited,
                token=options.coordinator.token, tls=child_tls, log_level=options.log_level,
                shard_token=coordinator.shard_credential.secret if coordinator.shard_credential else None,
                # A lost shard comes back from the newest checkpoint; with none configured it stays lost
                # (a restart would silently serve freshly initialized tables).
                restart=coordinator.checkpoints is not None, max_restarts=options.max_restarts,
                prefix=options.shard_prefix, push_log=options.push_log, row_store=options.row_store,
                metrics_port=options.metrics_port, grace=options.coordinator_grace).start(adopted)
        want = options.num_shards
        all_joined = coordinator.membership.wait_until(
            lambda m: len(m.serving_shards()) >= want or shutdown.event.is_set()
            or (supervisor is not None and not all(supervisor.alive().values())),
            options.ready_timeout)
        joined = len(coordinator.membership.serving_shards())
        if shutdown.event.is_set():
            return 0
        if not all_joined or joined < want:
            dead = [name for name, alive in (supervisor.alive() if supervisor is not None else {}).items()
                    if not alive]
            logger.error("only %d of %d shards joined%s", joined, want,
                         f"; exited: {', '.join(dead)}" if dead else
                         f" within {options.ready_timeout.total_seconds():.0f} s")
            return 1
        coordinator.mark_ready()
        announce(f"ps-server ready at {coordinator.address} ({want} shard{'' if want == 1 else 's'}, generation "
                 f"{coordinator.membership.generation})", flush=True)
        if options.stop_after_workers:
            _stop_after_workers(coordinator.membership, options.stop_after_workers, shutdown)
        shutdown.event.wait()
    finally:
        if shutdown.members_stay:
            _step_away(coordinator, supervisor, metrics)
        # Workers and drivers first (they need the shards until they are done), shards last.
        if coordinator.membership.stop_members([pb.ROLE_WORKER, pb.ROLE_CLIENT]):
            left = coordinator.membership.wait_until(
                lambda m: not [x for x in m.alive() if x.role != pb.ROLE_SHARD], MEMBERS_LEAVE_WITHIN)
            if not left:
                logger.warning("members still running after %.0f s: %s", MEMBERS_LEAVE_WITHIN.total_seconds(),
                               ", ".join(x.rpc_name for x in coordinator.membership.alive() if x.role != pb.ROLE_SHARD))
        _stop_remote_shards(coordinator.membership, set(supervisor.processes) if supervisor is not None else set())
        if supervisor is not None:
            codes = supervisor.stop(SHARDS_STOP_WITHIN)
            logger.info("shards stopped: %s", ", ".join(f"{name} exit {c}" for name, c in codes.items()))
        coordinator.stop(datetime.timedelta(seconds=0.5))
        if metrics is not None:
            metrics.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _step_away(coordinator: CoordinatorServer, supervisor: Optional[ShardSupervisor], metrics) -> None:
    """End this process alone, its journal written last, leaving every member (its own shards too) running
    for a coordinator started again to take back; never returns."""
    coordinator.stop(datetime.timedelta(seconds=0.5))
    if metrics is not None:
        metrics.close()
    if supervisor is not None:
        logger.info("leaving %s serving for the next ps-server to take back", ", ".join(supervisor.processes))
    exit_now(0)  # not the interpreter's exit, which would wait for the shard processes


def _adopted_shards(coordinator: CoordinatorServer, options: ServerOptions) -> Dict[str, int]:
    """This server's shards (``<prefix>0..``) that the journal of the server before it lists alive, name -> pid:
    their processes outlive the server that started them, and are taken back instead of started again."""
    if not coordinator.resumed or not options.num_shards:
        return {}
    own = {f"{options.shard_prefix}{index}" for index in range(options.num_shards)}
    return {m.rpc_name: m.pid for m in sorted(coordinator.membership.alive(pb.ROLE_SHARD), key=lambda m: m.rpc_name)
            if m.rpc_name in own}


def workers_done(membership: Membership, workers: int) -> bool:
    """Whether ``workers`` workers have left (finished their job, or said why not) and none is running."""
    counts = membership.counts()
    return counts.ended.get((pb.ROLE_WORKER, LEFT), 0) >= workers and not counts.alive.get(pb.ROLE_WORKER, 0)


def _stop_after_workers(membership: Membership, workers: int, shutdown: _Shutdown) -> None:
    """Wait for the end of a batch job (or a shutdown), then shut down: each wait is a slice that also
    watches ``shutdown``, so a signal is seen within one."""
    while not shutdown.event.is_set():
        if membership.wait_until(lambda m: workers_done(m, workers) or shutdown.event.is_set(), WATCH_SLICE) \
                and not shutdown.event.is_set():
            shutdown.request(f"{workers} worker{'' if workers == 1 else 's'} left and none is running")


def _stop_remote_shards(membership, local_names) -> None:
    """Shards that other hosts added (``ps-server --join``) are told to stop and given a few seconds to leave;
    their hosts' ps-servers then end too."""
    remote = [m.rpc_name for m in membership.alive() if m.role == pb.ROLE_SHARD and m.rpc_name not in local_names]
    if not remote:
        return
    membership.stop_members([pb.ROLE_SHARD])
    if not membership.wait_until(lambda m: not [x for x in m.alive() if x.rpc_name in remote], SHARDS_STOP_WITHIN):
        logger.warning("shards of other hosts still running after %.0f s: %s", SHARDS_STOP_WITHIN.total_seconds(),
                       ", ".join(x.rpc_name for x in membership.alive() if x.rpc_name in remote))
