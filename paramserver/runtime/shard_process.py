"""A shard server process of ``ps-server``: coordinator member and data-plane owner.

Owns the life of one supervised shard process: join the coordinator as a
shard (its RPC name, rank, the store and the checkpoint to restore from
come back), heartbeat (with its dynamic tables' figures,
``paramserver.shards.server.figures``),
serve parameters over torch RPC (``paramserver.shards.run_shard_server``)
until told to stop (a STOP command, SIGTERM/SIGINT, or losing the
coordinator), then leave.  With a metrics port it serves its data-plane and
dynamic table metrics there from before it joins (a port it cannot bind
ends it with exit code 1).
Exit code 0 on a clean stop, at once: the process skips the
interpreter's teardown, which has nothing left to save.  A Join the
coordinator refuses ends it with one line saying why: exit code 2
(``EXIT_REFUSED``) when it was refused for its credentials or for what it
said, which no restart would change; 1 otherwise.  A shard that is to
restore its tables verifies the checkpoint first and falls back to the
newest one that verifies; when none does it says so, naming the files,
and exits with ``EXIT_NO_CHECKPOINT`` (a restart would find the same files).
It heartbeats while it verifies (a big checkpoint takes longer than the
heartbeat timeout to hash) and is not ready meanwhile; a stop asked then
ends it before it serves.  A step that fails inside its kernels (out of memory, an
internal error: ``ShardState.fault``) ends it at once with exit code 1, to be
restarted from the newest checkpoint.  With a push log (``ps-server
--push-log``) a restarted process replays what the killed one applied since
that checkpoint, so it loses nothing.
"""

import datetime
import faulthandler
import logging
import os
import pathlib
import signal
import sys
import threading
from typing import Optional

import grpc

from ..control import CoordinatorError, TlsFiles, pb
from ..checkpoint.records import CheckpointSettings
from ..checkpoint.shard_part import CheckpointSource
from ..checkpoint.storage import CorruptCheckpoint, StorageUnavailable
from ..logs import configure_logging, exit_now, one_line
from ..metrics.process import shard_metrics
from ..shards import PeerOptions, ShardServerOptions, run_shard_server
from ..shards.server import ShardState
from ..shards.server.figures import LogRate, dynamic_figures, dynamic_parts
from ..shards.server.push_log import PushLog
from ..shards.server.row_store.stores import RowStoreOptions, RowStores
from .exit_codes import EXIT_DISK_FULL, EXIT_FAILED, EXIT_NO_CHECKPOINT, EXIT_REFUSED
from .member import MemberSession
from .threads import apply_threads

logger = logging.getLogger(__name__)

_REFUSED_FOR_GOOD = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                     grpc.StatusCode.INVALID_ARGUMENT)


def run_shard_member(address: str, name: str, host: str, token: Optional[str] = None,
                     tls: Optional[TlsFiles] = None, log_level: Optional[str] = None, metrics_port=None,
                     member_id=None, shard_token: Optional[str] = None,
                     grace: Optional[datetime.timedelta] = None, push_log: Optional[str] = None,
                     row_store: Optional[RowStoreOptions] = None) -> None:
    """Process target: one shard server named ``name`` that joins the coordinator at ``address``.

    ``token``: the cluster token; ``shard_token``: the shard credential its Join carries (the coordinator's
    own, or ``--shard-token-file``'s).  ``grace``: how long it serves on while the coordinator does not
    answer (``--coordinator-grace``).  ``push_log``: the folder of its push log (``None``: none), which a
    restarted process replays on top of the checkpoint it restores.  ``row_store``: where its dynamic
    tables keep the rows their memory does not hold (``--row-store``; ``None``: they drop them).

    ``metrics_port``: ``None`` (no metrics), or a shared integer
    (``multiprocessing.Value``) holding the port to serve metrics on (0: a
    free one), where this process writes the port it serves on.
    ``member_id``: ``None``, or a shared byte string (``multiprocessing.Array``)
    where this process writes the member id the coordinator gave it, so
    that its supervisor can report its exit (``ShardSupervisor.member_id``).
    """
    configure_logging(name, log_level)
    state = ShardState()  # what this process serves: its tables are asked for once it serves
    state.on_fault = lambda reason: _end_for_a_fault(name)
    state.on_store_failure = lambda reason: _end_for_a_full_disk(name, reason)
    metrics = None  # serves until the process exits
    if metrics_port is not None:
        try:
            metrics = shard_metrics(host, metrics_port.value, name, dynamic_tables=lambda: dynamic_parts(state),
                                    push_log=lambda: state.push_log.figures.as_dict() if state.push_log else None)
            metrics_port.value = metrics.port
        except OSError as error:
            logger.error("shard %s: %s", name, error)
            sys.exit(1)
        state.recorder = metrics.data_plane
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # kill -USR1: every thread's stack
    stops = _StopRequests(state)
    # SIGTERM means "stop" for the whole life of the process, not only while serving.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda _signum, _frame: stops.request())
    session = MemberSession(address, pb.ROLE_SHARD, name=name, host=host, token=token, tls=tls,
                            shard_token=shard_token, grace=grace)
    try:
        assignment = session.join()
    except CoordinatorError as error:
        logger.error("shard %s could not join: %s", name, error)
        exit_now(EXIT_REFUSED if error.code in _REFUSED_FOR_GOOD else 1)
    if member_id is not None:
        member_id.value = assignment.member_id.encode()
    # Heartbeats from now on: verifying a big checkpoint may take longer than the heartbeat timeout.
    # Its dynamic tables' rows, admissions, evictions and bytes, and its push log's size and appends per second,
    # go with every beat (ps-ctl status shows them).
    # A STOP (the coordinator's shutdown) stops every shard: they leave the data plane together.  A lost
    # coordinator leaves at once: the group's store it hosts is gone.
    log_rate = LogRate()
    session.start_heartbeats(progress=lambda: (0, {**dynamic_figures(state), **log_rate.figures(state)}),
                             on_stop=stops.request,
                             on_lost=lambda reason, refused: stops.request(together=False))
    restore_source = None
    if assignment.checkpoint.restore_from:
        # Tables that trainers ask for come from the checkpoint (rows cut to this shard's ranges).
        checkpoint = CheckpointSettings.from_message(assignment.checkpoint)
        try:
            restore_source = CheckpointSource.newest_verified(checkpoint.locate(checkpoint.restore_from),
                                                              checkpoint.restore_step, assignment.rpc_name,
                                                              convert_rows=checkpoint.convert_rows)
        except (CorruptCheckpoint, StorageUnavailable) as error:
            logger.error("%s", error)
            session.leave(one_line(error))
            # Unreachable storage may come back: a restart tries again (ps-server's --shard-restarts bound it).
            exit_now(1 if isinstance(error, StorageUnavailable) else EXIT_NO_CHECKPOINT)
        logger.info("shard %s restores its tables from %s (step %d)", assignment.rpc_name,
                    restore_source.checkpoint.path, restore_source.checkpoint.step)
    if row_store is not None:  # before the push log's replay, whose lookups may evict into it
        state.row_stores = RowStores(row_store, assignment.rpc_name)
        logger.info("shard %s keeps rows its memory does not hold in %s (%s engine%s)", assignment.rpc_name,
                    state.row_stores.folder, row_store.engine,
                    f", {row_store.memory / 2 ** 20:.0f} MiB of rows in memory" if row_store.memory else "")
    if push_log is not None:
        _open_push_log(state, pathlib.Path(push_log), assignment.rpc_name, restore_source)
    if stops.asked:  # while it verified: it never served
        logger.info("shard %s stops before it serves", assignment.rpc_name)
        session.leave("stopped")
        exit_now(0)

    def serving() -> None:
        if not stops.asked:  # the coordinator hands this shard to workers once it says it is ready
            session.mark_ready()
    try:
        # Sized to the cluster's processes on this host as the coordinator counts them now (workers join later:
        # a shard's intra-op count does not depend on it, and its inter-op pool cannot be resized).
        apply_threads("shard", assignment.rpc_name, assignment.host_processes)  # so the data plane leaves PyTorch's threads as they are
        run_shard_server(assignment.rpc_name, assignment.rpc_rank, None, session.init_method,
                         ShardServerOptions(peer=PeerOptions(intra_op_threads=None)), bind_host=host,
                         on_serving=serving, restore_source=restore_source, state=state)
    finally:
        session.leave("stopped")
    if state.push_log is not None:
        figures = state.push_log.figures
        logger.info("shard %s: push log: %d records, %.1f MB appended in %d writes (%.2f s); %d replayed",
                    assignment.rpc_name, figures.appends, figures.appended_bytes / 1e6, figures.flushes,
                    figures.flush_seconds, figures.replayed)
    if state.row_stores is not None:
        state.row_stores.close()  # its files go with it: the checkpoint and the push log are what is durable
    logger.info("shard %s (pid %d) exits", assignment.rpc_name, os.getpid())
    # Both planes are left: nothing of the interpreter's teardown is needed, and after
    # a long run torch's destructors took over 3 s of it (past ps-server's stop
    # deadline, so the shards were killed).
    exit_now(0)


def _open_push_log(state: ShardState, folder: pathlib.Path, name: str, restore_source) -> None:
    """The shard's push log, read back (what a killed process of it applied since its checkpoint, replayed as
    trainers ask for their optimizers again: ``paramserver.shards.server.replay``)."""
    since = restore_source.key if restore_source is not None else ""
    log = PushLog(folder, since)
    state.push_log = log
    where = f"checkpoint {since}" if since else "the initial values"
    if log.fallback is not None:
        logger.error("shard %s: its push log is damaged (%s): its tables stay at %s, and the pushes applied "
                     "since are lost", name, log.fallback, where)
    elif len(log.found) > 1:
        logger.info("shard %s: push log %s holds %d records (%.1f MB) to replay on %s", name, folder,
                    len(log.found), log.figures.size_bytes / 1e6, where)


def _end_for_a_fault(name: str) -> None:
    """A step failed inside its kernels (``ShardState.fault``): the rows may be half-applied, so the process ends
    at once (exit 1), without a checkpoint; its supervisor restarts it from the newest checkpoint, and workers
    take it as a lost shard."""
    logger.error("shard %s exits to be restarted from its newest checkpoint", name)
    exit_now(EXIT_FAILED)


def _end_for_a_full_disk(name: str, reason: str) -> None:
    """Its row store could not write (``ShardState.store_failed``): the process ends at once, every row it held
    kept until then, and is not restarted (``EXIT_DISK_FULL``): the disk would fill again."""
    logger.error("shard %s stops: %s", name, reason)
    exit_now(EXIT_DISK_FULL)


class _StopRequests:
    """Stops asked of this shard process (SIGTERM, the coordinator's STOP, losing the coordinator) from its
    start on, passed to the state it serves (a stop asked before it serves ends it before it serves)."""

    def __init__(self, state: ShardState):
        self._state = state
        self._asked = threading.Event()

    def request(self, together: bool = True) -> None:
        """``together``: with the other shards that stop now (SIGTERM, STOP: the cluster's shutdown)."""
        self._asked.set()
        self._state.request_stop(graceful=False, together=together)

    @property
    def asked(self) -> bool:
        return self._asked.is_set()
