"""The Coordinator gRPC service: requests in, membership changes and answers out.

Owns decoding each request (raw bytes, so that bytes that are no valid
message get ``INVALID_ARGUMENT`` instead of a transport error), validating
it, dispatching it to the membership table, and turning refusals into gRPC
status codes, logged at a bounded rate (a flood of bad calls costs a line per
interval, not a line each).  One bad request never disturbs anyone else's:
every failure is answered on that call alone.  A Join as a shard must carry
the shard credential when the cluster has one, and a call that changes the
cluster's state (``security.ADMIN_METHODS``: Checkpoint, Shutdown) the admin
credential when the cluster has one (``PERMISSION_DENIED`` otherwise, saying
why, before the request is even decoded: nothing changes); the cluster token
itself is checked before, by the server's interceptor.
"""

import datetime
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Tuple

import grpc
from google.protobuf.message import DecodeError

from ..logs import RateLimitedLog, one_line
from .addresses import loopback_from_afar
from .membership import Membership
from .protocol import CHECKPOINT_WAIT, SERVICE_NAME, pb
from .security import AdminCredential, ShardCredential
from .validation import (RequestError, check_member_id, invalid, validate_heartbeat, validate_join, validate_leave,
                         validate_shutdown)

if TYPE_CHECKING:  # the checkpoint side loads torch; it is only imported by a server that keeps checkpoints
    from .checkpoints import CheckpointCoordinator

logger = logging.getLogger(__name__)

#: How long the Checkpoint call waits for the checkpoint unless told (as ``checkpoints.DEFAULT_WAIT``).

_DESCRIPTOR = pb.DESCRIPTOR.services_by_name["Coordinator"]


@dataclass(frozen=True)
class ServiceSettings:
    """What the service hands out besides membership: the store, the job, heartbeat timing."""

    store: pb.StoreAddress
    job: Optional[pb.JobSpec]
    heartbeat_interval: datetime.timedelta
    heartbeat_timeout: datetime.timedelta


class CoordinatorService:
    """The handlers, callable without gRPC: ``handle(method, raw_bytes)``.

    ``request_shutdown(reason)`` is called by the Shutdown RPC and must
    return at once (the caller drains the cluster elsewhere);
    ``checkpoints`` takes Checkpoint and CommitCheckpoint (``None``:
    checkpoints are not configured, and both are refused).
    ``shard_credential``: what a Join as a shard must carry (``None``: shards
    join like anyone, as on an open development cluster).  ``admin_credential``:
    what Checkpoint and Shutdown must carry (``None``: whoever passed the
    interceptor may make them, as on a cluster without one).  ``refusals``:
    where refused calls are logged (by default one of its own, at INFO,
    summed up every ``logs.REPEAT_SUMMARY_EVERY``).
    """

    def __init__(self, membership: Membership, settings: ServiceSettings,
                 request_shutdown: Callable[[str], None],
                 checkpoints: Optional["CheckpointCoordinator"] = None,
                 shard_credential: Optional[ShardCredential] = None,
                 refusals: Optional[RateLimitedLog] = None,
                 admin_credential: Optional[AdminCredential] = None, data_plane_lost: Optional[str] = None):
        self.membership = membership
        #: Why a member joining now could not reach the data plane's members (``CoordinatorServer``), or None.
        self.data_plane_lost = data_plane_lost
        self.settings = settings
        self._request_shutdown = request_shutdown
        self.checkpoints = checkpoints
        self.shard_credential = shard_credential
        self.admin_credential = admin_credential
        self.refusals = refusals or RateLimitedLog(logger, "refused {count} call{s}")
        self._workers_held_because: Optional[str] = None
        self._handlers = {
            "Join": (pb.JoinRequest, self.join),
            "Heartbeat": (pb.HeartbeatRequest, self.heartbeat),
            "Leave": (pb.LeaveRequest, self.leave),
            "Status": (pb.StatusRequest, self.status),
            "Checkpoint": (pb.CheckpointRequest, self.checkpoint),
            "CommitCheckpoint": (pb.CommitCheckpointRequest, self.commit_checkpoint),
            "Shutdown": (pb.ShutdownRequest, self.shutdown),
        }
        missing = {m.name for m in _DESCRIPTOR.methods} - set(self._handlers)
        assert not missing, f"no handler for {missing}"

    def handle(self, method: str, raw: bytes, peer: str = "", metadata: Sequence[Tuple[str, str]] = ()):
        """Decode, validate and answer one request; raises ``RequestError`` to refuse it.

        ``peer``: where the call came from, as gRPC names it (``ipv4:10.0.0.3:51234``);
        ``metadata``: the call's metadata (where a shard's or an admin's credential is).
        """
        request_cls, handler = self._handlers[method]
        if self.admin_credential is not None:
            refusal = self.admin_credential.refusal(method, metadata)
            if refusal is not None:
                raise RequestError(grpc.StatusCode.PERMISSION_DENIED, refusal)
        try:
            request = request_cls.FromString(raw)
        except DecodeError as error:
            raise invalid(f"{method}: the request is not a valid {request_cls.DESCRIPTOR.full_name} "
                          f"message ({error})") from None
        if method == "Join":
            return self.join(request, peer, metadata)
        return handler(request)

    def hold_workers(self, because: str) -> None:
        """Answer a worker's Join with UNAVAILABLE (it retries) until ``admit_workers()``: a worker that joined
        before the cluster's shards serve would place its tables on those that happen to serve already."""
        self._workers_held_because = because

    def admit_workers(self) -> None:
        self._workers_held_because = None

    # -- handlers ------------------------------------------------------
    def join(self, request: pb.JoinRequest, peer: str = "", metadata: Sequence[Tuple[str, str]] = ()
             ) -> pb.Assignment:
        validate_join(request)
        if request.role == pb.ROLE_SHARD and self.shard_credential is not None:
            refusal = self.shard_credential.refusal(metadata)
            if refusal is not None:
                raise RequestError(grpc.StatusCode.PERMISSION_DENIED, f"shard {request.name}: {refusal}")
        if self.data_plane_lost is not None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"{request.name} cannot join: {self.data_plane_lost}; a member joining now would "
                               "not reach the members there before.  Stop the cluster (ps-ctl shutdown) and start "
                               "it again from its newest checkpoint (ps-server --restore)")
        held_because = self._workers_held_because
        if request.role == pb.ROLE_WORKER and held_because is not None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"{held_because}; join again shortly")
        unreachable = loopback_from_afar(request.host, peer)
        if unreachable:
            raise invalid(unreachable)
        member = self.membership.join(request)
        assignment = pb.Assignment(
            member_id=member.member_id, rpc_name=member.rpc_name, rpc_rank=member.rpc_rank, index=member.index,
            store=self.settings.store, generation=member.joined_generation,
            trainer_group=member.trainer_group, job_run=member.job_run, credential=member.credential,
            heartbeat_interval_ms=_ms(self.settings.heartbeat_interval),
            heartbeat_timeout_ms=_ms(self.settings.heartbeat_timeout),
            shards=self.membership.live_shard_names(),
            host_processes=self.membership.host_processes(member.member_id))
        if self.checkpoints is not None:
            assignment.checkpoint.CopyFrom(self.checkpoints.settings())
        if request.role == pb.ROLE_WORKER and self.settings.job is not None:
            assignment.job.CopyFrom(self.settings.job)
        return assignment

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        validate_heartbeat(request)
        generation, commands, shards, view = self.membership.heartbeat(request)
        return pb.HeartbeatResponse(generation=generation, commands=commands, shards=shards, group=view,
                                    shards_gone=self.membership.shards_gone(),
                                    trainer_groups_gone=self.membership.trainer_groups_gone(),
                                    host_processes=self.membership.host_processes(request.member_id))

    def leave(self, request: pb.LeaveRequest) -> pb.LeaveResponse:
        validate_leave(request)
        return pb.LeaveResponse(generation=self.membership.leave(request))

    def status(self, _request: pb.StatusRequest) -> pb.StatusResponse:
        response = self.membership.status()
        response.store.CopyFrom(self.settings.store)
        response.job = self.settings.job.name if self.settings.job is not None else ""
        if self.checkpoints is not None:
            response.checkpoint.CopyFrom(self.checkpoints.settings(storage_options=False))
        return response

    def checkpoint(self, request: pb.CheckpointRequest) -> pb.CheckpointResponse:
        """Ask trainer group 0 for a checkpoint and answer once it is committed; with no trainer training,
        answer at once with the newest committed one."""
        checkpoints = self._checkpoints()
        if not (0 <= request.timeout_seconds <= 3600):  # NaN fails this too
            raise invalid(f"timeout_seconds must be 0-3600, got {request.timeout_seconds}")
        timeout = (datetime.timedelta(seconds=request.timeout_seconds) if request.timeout_seconds
                   else CHECKPOINT_WAIT)
        checkpoint, new = checkpoints.checkpoint_now("ps-ctl checkpoint", timeout)
        return pb.CheckpointResponse(checkpoint_id=checkpoint.id, step=checkpoint.step,
                                     directory=str(checkpoint.path), no_group_training=not new)

    def commit_checkpoint(self, request: pb.CommitCheckpointRequest) -> pb.CommitCheckpointResponse:
        checkpoints = self._checkpoints()
        check_member_id(request.member_id)
        writer = self.membership.live_member(request.member_id)
        if writer.role != pb.ROLE_WORKER:
            raise invalid(f"{writer.describe()} is no trainer: only a trainer commits checkpoints")
        if request.failure:
            checkpoints.fail(writer.rpc_name, request)
            return pb.CommitCheckpointResponse()
        return pb.CommitCheckpointResponse(checkpoint_id=checkpoints.commit(writer.rpc_name, request).id)

    def _checkpoints(self) -> "CheckpointCoordinator":
        if self.checkpoints is None:
            raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                               "this cluster has no checkpoint directory configured (ps-server "
                               "--checkpoint-dir), so there is nowhere to write a checkpoint")
        return self.checkpoints

    def shutdown(self, request: pb.ShutdownRequest) -> pb.ShutdownResponse:
        validate_shutdown(request)
        reason = one_line(request.reason)
        logger.info("shutdown requested over gRPC%s", f": {reason}" if reason else "")
        self._request_shutdown(reason or "ps-ctl shutdown")  # only flags it: the drain runs elsewhere
        return pb.ShutdownResponse()


def _ms(delta: datetime.timedelta) -> int:
    return int(delta.total_seconds() * 1000)


def generic_handler(service: CoordinatorService) -> grpc.GenericRpcHandler:
    """The service as gRPC method handlers that take the request's raw bytes."""
    handlers = {}
    for method in _DESCRIPTOR.methods:
        response_cls = getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            _answer(service, method.name), request_deserializer=None,
            response_serializer=response_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def _answer(service: CoordinatorService, method: str):
    def answer(raw: bytes, context: grpc.ServicerContext):
        try:
            return service.handle(method, raw, context.peer(), context.invocation_metadata())
        except RequestError as error:
            service.refusals.record(error.code.name, f"refused {method} from {context.peer()}: {error.code.name}: "
                                                     f"{error.message}")
            context.abort(error.code, error.message)
        except Exception as error:  # noqa: BLE001 - one bad call must not take the server down
            logger.exception("%s failed", method)
            context.abort(grpc.StatusCode.INTERNAL, f"{method} failed on the coordinator: {error}")
    return answer
