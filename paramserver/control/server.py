"""The coordinator's gRPC server: the service, health, reflection, auth, TLS, failure detection.

Owns putting the control plane on a port: the Coordinator service, the
standard ``grpc.health.v1`` health service (NOT_SERVING until the cluster
is ready, then SERVING), server reflection, the token interceptor, the shard
credential (given, or made for this cluster when it has a token and none
was given: kept in the journal, so a server started again keeps it), the
admin credential (given, or none: then any holder of the cluster token may
stop the cluster, and the start says so), TLS, the rendezvous store (taking a
cluster back: its RPC group from the journal), one bounded-rate log of refused
calls, and the thread that declares silent members dead.
What the cluster runs (shard processes, the job) is the runtime's business.
"""

import concurrent.futures
import datetime
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from .checkpoints import CheckpointCoordinator, CheckpointOptions
from .journal import Journal
from .groups import GROUP_GONE_AFTER, GROUP_SETTLE, TrainerGroups
from .membership import Member, Membership
from .machine import this_machine
from .protocol import (DEFAULT_PORT, HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_ENV,
                       MAX_MESSAGE_BYTES, SERVICE_NAME, pb)
from ..logs import RateLimitedLog
from .rendezvous import RendezvousStore
from .security import AdminCredential, ShardCredential, TlsFiles, TokenAuthInterceptor
from .service import CoordinatorService, ServiceSettings, generic_handler

logger = logging.getLogger(__name__)

_SWEEP_EVERY = datetime.timedelta(seconds=0.2)


def _env_heartbeat_timeout() -> datetime.timedelta:
    value = os.environ.get(HEARTBEAT_TIMEOUT_ENV)
    return datetime.timedelta(seconds=float(value)) if value else HEARTBEAT_TIMEOUT


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class CoordinatorSettings:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    token: Optional[str] = None
    #: What a Join as a shard must carry.  ``None``: with a ``token``, the server makes one for this run (its
    #: own shards get it, shards of other hosts cannot join); without one, shards join like anyone.
    shard_credential: Optional[ShardCredential] = None
    #: What Checkpoint and Shutdown must carry (``security.ADMIN_METHODS``).  ``None``: whoever holds the
    #: cluster token (everyone, on a cluster without one) may make them.
    admin_token: Optional[str] = field(default=None, repr=False)
    tls: Optional[TlsFiles] = None
    job: Optional[pb.JobSpec] = None
    heartbeat_interval: datetime.timedelta = HEARTBEAT_INTERVAL
    heartbeat_timeout: datetime.timedelta = field(default_factory=_env_heartbeat_timeout)
    max_workers: int = 32
    #: How long a trainer group's membership must stay unchanged before it forms (when not full).
    group_settle: datetime.timedelta = GROUP_SETTLE
    #: How long a trainer group may have no live worker before other groups may take over what it had under way.
    group_gone_after: datetime.timedelta = GROUP_GONE_AFTER
    #: Where and how often to checkpoint, and what to restore from (``None``: no checkpoints).
    checkpoints: Optional[CheckpointOptions] = None
    #: Refuse workers' joins (UNAVAILABLE, so they retry) until ``mark_ready()``: for a server that starts its
    #: shards, whose workers must not place their tables before every shard serves.
    hold_workers_until_ready: bool = False
    #: Where the coordinator's journal lives (``ps-server --state-dir``): a server started again with the same
    #: directory takes the running cluster back.  ``None``: no journal (a restarted server starts a new cluster).
    state_dir: Optional[str] = None
    #: The name members reach the rendezvous store by (``None``: ``host``): a stable DNS name where the
    #: coordinator may come back on another address (a Kubernetes pod's), so members find the store again.
    store_name: Optional[str] = None

    def __post_init__(self):
        if self.shard_credential is not None and self.shard_credential.same_as(self.token):
            raise ValueError("the shard token is the cluster token: give shards a secret of their own, or every "
                             "holder of the cluster token could join as a shard")
        if self.admin_token is not None:
            admin = AdminCredential(self.admin_token)
            if admin.same_as(self.token):
                raise ValueError("the admin token is the cluster token: give operators a secret of their own, or "
                                 "every worker could stop the cluster")
            if self.shard_credential is not None and admin.same_as(self.shard_credential.secret):
                raise ValueError("the admin token is the shard token: give operators a secret of their own")
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(f"heartbeat timeout ({self.heartbeat_timeout.total_seconds()} s) must exceed the "
                             f"heartbeat interval ({self.heartbeat_interval.total_seconds()} s)")


class CoordinatorServer:
    """Start with ``start()``; ``mark_ready()`` flips health to SERVING; ``stop()`` ends it."""

    def __init__(self, settings: CoordinatorSettings, request_shutdown: Callable[[str], None]):
        self.settings = settings
        #: Every refused call, whether the interceptor or the service refused it.
        self.refusals = RateLimitedLog(logger, "refused {count} call{s}")
        self.journal = Journal(settings.state_dir) if settings.state_dir else None
        journaled = self.journal.read() if self.journal is not None else None
        #: This server took a running cluster back from the journal of the one before it.
        self.resumed = journaled is not None
        #: What this server's own shard processes must carry when they join (``None``: nothing).
        self.shard_credential = settings.shard_credential or (self._made_shard_credential(journaled)
                                                               if settings.token else None)
        self.store = self._store(settings.host, journaled)
        groups = TrainerGroups(settings.job.group_size if settings.job is not None else 0, settings.group_settle,
                               settings.group_gone_after)
        self.membership = Membership(settings.heartbeat_timeout, on_gone=self._remove_from_rpc_group,
                                     groups=groups, machine=this_machine())
        self.checkpoints = None
        if settings.checkpoints is not None:
            self.checkpoints = CheckpointCoordinator.from_options(
                settings.checkpoints, lambda command: self.membership.command(pb.ROLE_WORKER, command))
        #: Why members joining the data plane from now on could not reach those there before (the RPC group's
        #: store was lost with the coordinator before this one and cannot be rebuilt), or None.
        self.data_plane_lost: Optional[str] = None
        #: The RPC group's members and addresses as last read for the journal.
        self._rpc_group: list = []
        if journaled is not None:
            self.membership.restore(journaled["membership"])
            if self.checkpoints is not None:
                self.checkpoints.resume(journaled.get("checkpoints") or {})
            self.data_plane_lost = self._restore_rpc_group(journaled)
        self.service = CoordinatorService(
            self.membership,
            ServiceSettings(store=pb.StoreAddress(host=settings.store_name or self.store.host, port=self.store.port),
                            job=settings.job,
                            heartbeat_interval=settings.heartbeat_interval,
                            heartbeat_timeout=settings.heartbeat_timeout),
            request_shutdown, self.checkpoints, shard_credential=self.shard_credential, refusals=self.refusals,
            admin_credential=AdminCredential(settings.admin_token) if settings.admin_token else None,
            data_plane_lost=self.data_plane_lost)
        if settings.hold_workers_until_ready:
            self.service.hold_workers("the cluster is starting: its shards do not all serve yet")
        interceptors = [TokenAuthInterceptor(settings.token, refusals=self.refusals)] if settings.token else []
        self._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(settings.max_workers, thread_name_prefix="coordinator"),
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                     ("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers((generic_handler(self.service),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        address = format_address(settings.host, settings.port)
        try:
            if settings.tls is not None:
                self.port = self._server.add_secure_port(address, settings.tls.server_credentials())
            else:
                self.port = self._server.add_insecure_port(address)
        except RuntimeError:  # grpc's "Failed to bind"
            self.port = 0
        if self.port == 0:
            self.store.close()
            raise OSError(f"cannot listen on {address}: the port is in use, or the host is not an address "
                          "of this machine")
        self.address = format_address(settings.host, self.port)
        self._stopped = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="failure-detector", daemon=True)

    @staticmethod
    def _store(host: str, journaled) -> RendezvousStore:
        """The rendezvous store, on the port of the one before this server when it took the cluster back
        (members dial the port they were given), or a free one."""
        port = int(journaled.get("store_port", 0)) if journaled is not None else 0
        try:
            return RendezvousStore(host, port)
        except OSError as error:
            if not port:
                raise
            logger.warning("the rendezvous store cannot listen on its port %d again (%s); members that need it "
                           "to form a group will not reach it", port, error)
            return RendezvousStore(host)

    @staticmethod
    def _made_shard_credential(journaled) -> ShardCredential:
        """The shard credential of a server given none: the one the server before it made, from its journal
        (the shards it started, which outlive it, carry that one when they join again), else a new one."""
        secret = (journaled or {}).get("shard_secret")
        if secret:
            return ShardCredential(str(secret), made_for_this_run=True)
        return ShardCredential.for_this_run()

    def _restore_rpc_group(self, journaled) -> Optional[str]:
        """Write the RPC group's live members, as journaled, into the new store; why it could not be, or None."""
        journaled_port = int(journaled.get("store_port", 0))
        if journaled_port and journaled_port != self.store.port:
            return (f"the RPC group's store could not listen on its port {journaled_port} again, so the members "
                    "there before cannot reach it")
        alive = {member.rpc_name for member in self.membership.alive()}
        group = journaled.get("rpc_group")
        if group is None:
            if alive:
                return "the journal of the coordinator before this one holds no RPC group (an older version's)"
            return None
        self.store.restore_rpc_group([tuple(entry) for entry in group if entry[0] in alive])
        return None

    def journal_state(self) -> dict:
        """What the journal holds: the membership, the checkpoints' numbering, the store's port, the RPC group's
        members and their addresses, and the shard credential this server made (none given: a server started
        again hands its shards the same one)."""
        group = self.store.rpc_group()
        if group is not None:  # else a member is joining or leaving: the group as read last
            self._rpc_group = [list(entry) for entry in group]
        state = {"membership": self.membership.snapshot(), "store_port": self.store.port,
                 "rpc_group": self._rpc_group,
                 "checkpoints": self.checkpoints.snapshot() if self.checkpoints is not None else {}}
        if self.shard_credential is not None and self.shard_credential.made_for_this_run:
            state["shard_secret"] = self.shard_credential.secret
        return state

    def start(self) -> "CoordinatorServer":
        if self.journal is not None:
            self.journal.write(self.journal_state())
            self.journal.keep_writing(self.journal_state)
        self._server.start()
        self._sweeper.start()
        if self.checkpoints is not None:
            self.checkpoints.start(remove_interrupted=not self.resumed)
        logger.info("coordinator listening on %s (%s%s%s%s), store on %s:%d, heartbeat timeout %.1f s",
                    self.address, "TLS" if self.settings.tls else "plaintext",
                    ", token required" if self.settings.token else "", self._shard_admission(),
                    ", admin token required for Checkpoint and Shutdown" if self.settings.admin_token else "",
                    self.store.host, self.store.port, self.settings.heartbeat_timeout.total_seconds())
        if self.settings.token and not self.settings.admin_token:
            logger.warning("this cluster has a token but no admin token: every holder of the cluster token "
                           "(every worker and job author) may stop the cluster or force a checkpoint; give "
                           "ps-server --admin-token-file to keep those calls to operators")
        return self

    def _shard_admission(self) -> str:
        if self.shard_credential is None:  # an open cluster: no token either
            return ""
        if self.shard_credential.made_for_this_run:
            return ", shard token made for this run: only this server's shards may join"
        return ", shard token required"

    def mark_ready(self) -> None:
        """Health SERVING, and workers admitted (see ``CoordinatorSettings.hold_workers_until_ready``)."""
        self.service.admit_workers()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def _set_health(self, status) -> None:
        self.health.set("", status)
        self.health.set(SERVICE_NAME, status)

    def _sweep(self) -> None:
        while not self._stopped.wait(_SWEEP_EVERY.total_seconds()):
            self.membership.sweep()

    def _remove_from_rpc_group(self, member: Member) -> None:
        # In a daemon thread: it may wait for the group's token, and must never hold up an exit.
        if not self._stopped.is_set():
            threading.Thread(target=self._remove_quietly, args=(member,), name="rpc-group-upkeep",
                             daemon=True).start()

    def _remove_quietly(self, member: Member) -> None:
        try:
            self.store.remove_rpc_peer(member.rpc_name, member.rpc_rank)
        except Exception:  # noqa: BLE001 - upkeep must not kill the coordinator
            logger.exception("could not remove %s from the RPC group's list", member.rpc_name)

    def stop(self, grace: datetime.timedelta = datetime.timedelta(seconds=1)) -> None:
        self._stopped.set()
        if self.journal is not None:
            self.journal.stop()
        if self.checkpoints is not None:
            self.checkpoints.stop()
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server.stop(grace.total_seconds()).wait()
        self.refusals.flush()
        self.store.close()
        logger.info("coordinator stopped")
