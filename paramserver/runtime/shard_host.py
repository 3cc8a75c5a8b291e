"""``ps-server --join``'s process: shard servers on this host for a coordinator on another.

Owns the life of a shard host: start N supervised shard processes that
join the remote coordinator under this host's names (``<prefix>0..``),
report at once to the coordinator a shard process that exits (it leaves
on the process's behalf, as the coordinator's own supervisor reports its
host's), restart one that fails when the cluster keeps checkpoints (it then serves
its tables from the newest one; without checkpoints a restart would serve
fresh tables, so a lost shard stays lost), announce readiness once the
coordinator counts every one of them serving, and end when told to
(SIGTERM/SIGINT: stop the shards) or once every shard has left for good
(the coordinator stopped them at its shutdown, or was lost).  Shards the
coordinator refuses for good (a missing or wrong ``--shard-token-file``)
end it at once with exit code 2, their log saying why.  The
coordinator itself, the job and checkpoints are the coordinator host's
business (``server``).
"""

import datetime
import logging
import signal
import threading
import time
from dataclasses import dataclass
from typing import List, Optional

from ..control import TlsFiles
from ..control.client import JOIN_RETRY_FOR, CoordinatorClient, CoordinatorError
from .server import READY_TIMEOUT, SHARDS_STOP_WITHIN
from .exit_codes import EXIT_REFUSED
from .shard_policy import MAX_RESTARTS
from .supervisor import ShardSupervisor
from .member import coordinator_grace

logger = logging.getLogger(__name__)

_POLL = datetime.timedelta(seconds=0.25)


@dataclass(frozen=True)
class ShardHostOptions:
    coordinator: str                 # HOST:PORT of the cluster's ps-server
    num_shards: int
    host: str                        # this host's address on the cluster's network (the shards bind it)
    prefix: str                      # shard names: <prefix>0, <prefix>1, ...
    token: Optional[str] = None
    #: The shard credential (``--shard-token-file``) each shard's Join carries.
    shard_token: Optional[str] = None
    tls: Optional[TlsFiles] = None
    log_level: Optional[str] = None
    retry_for: Optional[datetime.timedelta] = None
    ready_timeout: datetime.timedelta = READY_TIMEOUT
    #: Shard i serves metrics on this + 1 + i, as on the coordinator's host (0: free ports); ``None``: none.
    metrics_port: Optional[int] = None
    #: How many times one lost shard process is restarted.
    max_restarts: int = MAX_RESTARTS
    #: How long its shards serve on while the coordinator does not answer (``None``: the default).
    coordinator_grace: Optional[datetime.timedelta] = None
    #: Where its shards log their pushes (``ShardSupervisor``'s ``push_log``): ``None`` a temporary folder, "off".
    push_log: Optional[str] = None
    #: Where its shards keep the rows their memory does not hold (``row_store.RowStoreOptions``), or ``None``.
    row_store: Optional[object] = None


def serve_shard_host(options: ShardHostOptions, announce=print) -> int:
    """Run until shut down or until every shard left; returns the exit code (0: a clean end)."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, _frame: _stop(stop, signal.Signals(signum).name))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    client = CoordinatorClient(options.coordinator, token=options.token, tls=options.tls)
    supervisor = None
    try:
        # The coordinator may still be starting: retried while unreachable.
        status = client.status(retry_for=options.retry_for or max(JOIN_RETRY_FOR, coordinator_grace(
            options.coordinator_grace)))
        keeps_checkpoints = bool(status.checkpoint.directory)
        supervisor = ShardSupervisor(
            options.num_shards, options.coordinator, options.host,
            on_exit=lambda name, code, not_restarted: _report_exit(client, supervisor, name, code, options.host,
                                                                   not_restarted),
            token=options.token, shard_token=options.shard_token, tls=options.tls, log_level=options.log_level,
            restart=keeps_checkpoints, max_restarts=options.max_restarts, prefix=options.prefix,
            push_log=options.push_log, row_store=options.row_store, metrics_port=options.metrics_port,
            grace=options.coordinator_grace).start()
        names = list(supervisor.processes)
        if not _wait_until_serving(client, names, supervisor, stop, options.ready_timeout):
            if stop.is_set():
                return 0
            refused = any(process.exitcode == EXIT_REFUSED for process in supervisor.processes.values())
            return EXIT_REFUSED if refused else 1
        announce(f"ps-server joined {options.coordinator} with {len(names)} shard{'s' if len(names) > 1 else ''} "
                 f"on {options.host} ({', '.join(names)}; lost shards "
                 f"{'restart from the newest checkpoint' if keeps_checkpoints else 'are not restarted: no checkpoints'})",
                 flush=True)
        while not stop.is_set():
            if supervisor.wait_all_exited(_POLL):
                logger.info("every shard of this host has left; exiting")
                break
        return 0
    except CoordinatorError as error:
        logger.error("%s", error)
        return 1
    finally:
        if supervisor is not None:
            codes = supervisor.stop(SHARDS_STOP_WITHIN)
            logger.info("shards stopped: %s", ", ".join(f"{name} exit {code}" for name, code in codes.items()))
        client.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _report_exit(client: CoordinatorClient, supervisor: Optional[ShardSupervisor], name: str, code: int,
                 host: str, not_restarted: Optional[str]) -> None:
    """Tell the coordinator at once that shard ``name``'s process exited (it leaves on the process's behalf),
    and whether for good (``not_restarted``: why it is not started again).

    Without this the coordinator would learn it from the missing heartbeats,
    a timeout later, and meanwhile list the lost shard as live: workers
    would keep sending it requests, and a restarted process could not join
    under its name.  A shard that left on its own (exit 0) has said so.
    """
    member_id = supervisor.member_id(name) if supervisor is not None else ""
    if code == 0 or not member_id:
        return
    try:
        client.leave(member_id, reason=f"process exited with code {code} (reported by ps-server --join on {host})"
                     + (f"; not restarted: {not_restarted}" if not_restarted else ""), final=bool(not_restarted))
    except CoordinatorError as error:  # already declared dead, or the coordinator is gone: nothing to report
        logger.info("could not report %s's exit: %s", name, error)


def _stop(event: threading.Event, reason: str) -> None:
    if not event.is_set():
        logger.info("shutting down: %s", reason)
        event.set()


def _wait_until_serving(client: CoordinatorClient, names: List[str], supervisor: ShardSupervisor,
                        stop: threading.Event, timeout: datetime.timedelta) -> bool:
    """Until the coordinator lists every one of ``names`` as a serving shard; False if stopped, a shard
    process exited, or the time ran out (logged)."""
    deadline = time.monotonic() + timeout.total_seconds()
    while not stop.is_set():
        serving = {s.name for s in client.status().shards if s.alive and s.ready}
        if set(names) <= serving:
            return True
        dead = [name for name, alive in supervisor.alive().items() if not alive]
        if dead:
            logger.error("shard processes exited before serving: %s", ", ".join(dead))
            return False
        if time.monotonic() > deadline:
            logger.error("only %d of %d shards of this host serve after %.0f s: %s", len(set(names) & serving),
                         len(names), timeout.total_seconds(), ", ".join(sorted(set(names) - serving)) + " missing")
            return False
        stop.wait(_POLL.total_seconds())
    return False
