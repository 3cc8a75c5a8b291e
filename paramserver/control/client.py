"""Talking to the coordinator: joining, heartbeats, leaving, status and commands.

Owns the client side of the control plane: the gRPC channel (plaintext or
TLS, the token attached to every call, the shard credential to a Join as a
shard, the admin credential to the calls that need it), joining with bounded exponential
backoff while the coordinator is unreachable, the heartbeat loop that
hands commands to its owner, and errors that say in one line what went
wrong.  What a member does with its assignment is the runtime's business.
"""

import datetime
import logging
import os
import socket
import threading
import time
from typing import Callable, Dict, Mapping, Optional, Set, Tuple

import grpc

from .machine import this_machine
from .protocol import MAX_MESSAGE_BYTES, pb, pb_grpc
from .security import (ADMIN_METHODS, ADMIN_TOKEN_METADATA_KEY, SHARD_TOKEN_METADATA_KEY, TlsFiles,
                       TokenClientInterceptor)
from .validation import MAX_METRICS

logger = logging.getLogger(__name__)

CALL_TIMEOUT = datetime.timedelta(seconds=10)
JOIN_RETRY_FOR = datetime.timedelta(seconds=30)
JOIN_RETRY_FOR_ENV = "PARAMSERVER_JOIN_RETRY_FOR"
#: The longest a channel waits before it tries to reach an unreachable coordinator again.
MAX_RECONNECT_BACKOFF = datetime.timedelta(seconds=1)
#: The first retry of a heartbeat the coordinator did not answer (then doubling, up to the interval).
OUTAGE_RETRY_FIRST = datetime.timedelta(seconds=0.2)


class CoordinatorError(RuntimeError):
    """A call to the coordinator failed; ``str()`` is one line saying why."""

    def __init__(self, message: str, code: Optional[grpc.StatusCode] = None):
        super().__init__(message)
        self.code = code


class CoordinatorUnavailable(CoordinatorError):
    """The coordinator could not be reached (after retrying, where the call retries)."""


class NotAuthenticated(CoordinatorError):
    """The coordinator refused the token (or its absence)."""


class NotPermitted(CoordinatorError):
    """The coordinator refused the call for the credential it lacks (``PERMISSION_DENIED``): the admin token for
    a call that changes the cluster's state, the shard token for a Join as a shard."""


def _retry_for() -> datetime.timedelta:
    value = os.environ.get(JOIN_RETRY_FOR_ENV)
    return datetime.timedelta(seconds=float(value)) if value else JOIN_RETRY_FOR


def _error_from(address: str, method: str, error: grpc.RpcError) -> CoordinatorError:
    code = error.code()
    details = error.details() or code.name
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return NotAuthenticated(f"coordinator {address} refused {method}: wrong or missing token ({details})", code)
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return NotPermitted(f"coordinator {address} refused {method}: PERMISSION_DENIED: {details}", code)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CoordinatorUnavailable(f"coordinator {address} unreachable for {method}: "
                                      f"{details.splitlines()[0][:300]}", code)
    return CoordinatorError(f"coordinator {address} refused {method}: {code.name}: {details}", code)


class CoordinatorClient:
    """One channel to the coordinator at ``address`` (``HOST:PORT``).

    ``token``: the cluster token, sent with every call; ``shard_token``: the
    shard credential, sent with a Join as a shard only; ``admin_token``: the
    admin credential, sent with the calls in ``security.ADMIN_METHODS`` only
    (Checkpoint, Shutdown).
    """

    def __init__(self, address: str, token: Optional[str] = None, tls: Optional[TlsFiles] = None,
                 call_timeout: datetime.timedelta = CALL_TIMEOUT, shard_token: Optional[str] = None,
                 admin_token: Optional[str] = None):
        self.address = address
        self.call_timeout = call_timeout
        self._shard_token = shard_token
        self._admin_token = admin_token
        self._metrics_left_out: Set[Tuple[str, ...]] = set()  # the names ``sendable`` warned about
        # Reconnect within a second of a coordinator coming back (gRPC's own backoff grows to 2 minutes):
        # members re-attach within the heartbeat timeout of its return.
        options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", int(MAX_RECONNECT_BACKOFF.total_seconds() * 1000))]
        if tls is not None:
            channel = grpc.secure_channel(address, tls.channel_credentials(), options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        self._raw_channel = channel
        if token:
            channel = grpc.intercept_channel(channel, TokenClientInterceptor(token))
        self.channel = channel
        self._stub = pb_grpc.CoordinatorStub(channel)

    def call(self, method: str, request, timeout: Optional[datetime.timedelta] = None, metadata=None):
        """``method`` (a Coordinator RPC name) once; raises ``CoordinatorError`` subclasses."""
        if self._admin_token and method in ADMIN_METHODS:
            metadata = list(metadata or []) + [(ADMIN_TOKEN_METADATA_KEY, self._admin_token)]
        try:
            return getattr(self._stub, method)(request, timeout=(timeout or self.call_timeout).total_seconds(),
                                               metadata=metadata)
        except grpc.RpcError as error:
            raise _error_from(self.address, method, error) from None

    def call_retrying(self, method: str, request, retry_for: Optional[datetime.timedelta] = None, metadata=None,
                      quiet: bool = False):
        """``call``, retried with exponential backoff (0.1 s doubling to 2 s) while the coordinator is
        unreachable (or asks to be called again), for ``retry_for`` (default ``$PARAMSERVER_JOIN_RETRY_FOR``);
        ``quiet``: each retry is logged at DEBUG, not INFO (the heartbeats already said the outage began)."""
        deadline = time.monotonic() + (retry_for or _retry_for()).total_seconds()
        delay = 0.1
        attempts = 0
        while True:
            attempts += 1
            try:
                return self.call(method, request, metadata=metadata)
            except CoordinatorUnavailable as error:
                if time.monotonic() + delay > deadline:
                    raise CoordinatorUnavailable(f"{error} (gave up after {attempts} attempts)", error.code) from None
                logger.log(logging.DEBUG if quiet else logging.INFO, "%s; retrying in %.1f s", error, delay)
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def join(self, role: int, name: str, host: str, retry_for: Optional[datetime.timedelta] = None,
             gpus: Optional[int] = None) -> pb.Assignment:
        """Join, retrying while unreachable (``call_retrying``).  ``gpus``: the GPUs this member holds for
        itself (a worker: 1 or 0); by default, every GPU of its host."""
        request = pb.JoinRequest(role=role, name=name, host=host, capabilities=local_capabilities(gpus))
        metadata = None
        if role == pb.ROLE_SHARD and self._shard_token:
            metadata = [(SHARD_TOKEN_METADATA_KEY, self._shard_token)]
        return self.call_retrying("Join", request, retry_for, metadata)

    def status(self, retry_for: Optional[datetime.timedelta] = None) -> pb.StatusResponse:
        """The cluster's status; with ``retry_for``, retried that long while the coordinator is unreachable."""
        if retry_for is None:
            return self.call("Status", pb.StatusRequest())
        return self.call_retrying("Status", pb.StatusRequest(), retry_for)

    def checkpoint(self, timeout_seconds: float = 120.0) -> pb.CheckpointResponse:
        """Ask for a checkpoint and wait (up to ``timeout_seconds``) until it is committed.

        The coordinator itself answers a checkpoint that failed or was not written in time; this call's own
        deadline (5 s later) passing means that no answer came, and the error says so: "unreachable" is for
        ``UNAVAILABLE`` alone."""
        deadline = datetime.timedelta(seconds=timeout_seconds + 5)
        try:
            return self.call("Checkpoint", pb.CheckpointRequest(timeout_seconds=timeout_seconds), timeout=deadline)
        except CoordinatorUnavailable as error:
            if error.code != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            raise CoordinatorError(f"coordinator {self.address} gave no answer to Checkpoint within "
                                   f"{deadline.total_seconds():.0f} s (DEADLINE_EXCEEDED)", error.code) from None

    def commit_checkpoint(self, request: pb.CommitCheckpointRequest) -> pb.CommitCheckpointResponse:
        return self.call("CommitCheckpoint", request)

    def shutdown(self, reason: str = "") -> None:
        self.call("Shutdown", pb.ShutdownRequest(reason=reason))

    def leave(self, member_id: str, reason: str = "", step: int = 0, metrics=None, final: bool = False) -> None:
        """``member_id`` leaves (``final``: a shard whose process will not be restarted)."""
        self.call("Leave", pb.LeaveRequest(member_id=member_id, reason=reason[:512], step=step,
                                            metrics=sendable(metrics or {}, self._metrics_left_out), final=final))

    def close(self) -> None:
        self._raw_channel.close()


def local_capabilities(gpus: Optional[int] = None) -> pb.Capabilities:
    if gpus is None:
        gpus = 0
        try:  # the control plane does not need torch; report GPUs only when it is there
            import torch
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        except ImportError:  # pragma: no cover
            pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return pb.Capabilities(cpus=os.cpu_count() or 0, gpus=gpus, memory_bytes=memory, pid=os.getpid(),
                           labels={"hostname": socket.gethostname()[:128]}, machine=this_machine())


def sendable(metrics: Mapping[str, float], told: Set[Tuple[str, ...]]) -> Dict[str, float]:
    """``metrics`` as the coordinator takes them: the finite ones, the first ``MAX_METRICS`` in the order given.
    The rest are left out, with one WARNING per set of names left out (``told``: the sets warned about)."""
    finite = {key: float(value) for key, value in metrics.items() if value == value and abs(value) != float("inf")}
    if len(finite) <= MAX_METRICS:
        return finite
    kept = dict(list(finite.items())[:MAX_METRICS])
    left_out = tuple(key for key in finite if key not in kept)
    if left_out not in told:
        told.add(left_out)
        logger.warning("%d metrics left out of what goes to the coordinator (at most %d): %s", len(left_out),
                       MAX_METRICS, ", ".join(left_out))
    return kept


class HeartbeatLoop:
    """Send a heartbeat every ``interval`` in a thread; hand each command to ``on_command``.

    ``progress()`` supplies ``(step, metrics)`` for each beat;
    ``on_response(response)`` sees every answer (live shards, the trainer
    group's view) before its commands are handled.  When the
    coordinator is unreachable for ``give_up_after`` (the member's grace for
    a coordinator outage, ``--coordinator-grace``; declared then, not at the
    next beat), or refuses the member (declared dead, unknown: at the
    first refusal, whether the loop's beat or ``beat()`` got it),
    ``on_lost(reason, refused)`` is called once and the loop ends.

    Within the grace the member rides the outage out: beats are retried
    with backoff (``OUTAGE_RETRY_FIRST`` doubling up to the interval), one
    line is logged when the outage starts and one when it ends, with its
    length (``outage``: when the current one started, or ``None``).
    ``credential``: the member's own (its Assignment's), sent with every
    beat: a coordinator started again takes the member back only with it.
    ``on_outage_end()`` runs (in the loop's thread: it must return at once)
    when the coordinator answers again after an outage.
    """

    def __init__(self, client: CoordinatorClient, member_id: str, interval: datetime.timedelta,
                 give_up_after: datetime.timedelta,
                 progress: Callable[[], tuple],
                 on_command: Callable[[pb.Command], None],
                 on_lost: Callable[[str, bool], None],
                 on_response: Optional[Callable[[pb.HeartbeatResponse], None]] = None,
                 credential: str = "", on_outage_end: Optional[Callable[[], None]] = None):
        self._client = client
        self._credential = credential
        #: When the coordinator stopped answering (``time.monotonic()``); ``None`` while it answers.
        self.outage: Optional[float] = None
        self._member_id = member_id
        self._interval = interval
        self._give_up_after = give_up_after
        self._progress = progress
        self._on_command = on_command
        self._on_lost = on_lost
        self._on_response = on_response
        self._on_outage_end = on_outage_end
        self._sequence = 0
        self._metrics_left_out: Set[Tuple[str, ...]] = set()  # the names ``sendable`` warned about
        #: Sent with every beat: this member's data plane is up.
        self.ready = False
        #: Sent with every beat: this generation of the member's trainer group broke (0: none).
        self.regroup_generation = 0
        # Beats go one at a time (the loop's and ``beat()`` called by the owner),
        # so sequence numbers reach the coordinator in order.
        self._beat_lock = threading.Lock()
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._lost_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> "HeartbeatLoop":
        self._thread.start()
        return self

    def beat(self) -> pb.HeartbeatResponse:
        """Send one heartbeat now and act on the answer (thread-safe).

        A refusal (the member is no longer in the cluster) is reported through
        ``on_lost`` before it is raised; an unreachable coordinator is only raised.
        """
        step, metrics = self._progress()
        with self._beat_lock:
            self._sequence += 1
            try:
                response = self._client.call("Heartbeat", pb.HeartbeatRequest(
                    member_id=self._member_id, sequence=self._sequence, step=step,
                    metrics=sendable(metrics, self._metrics_left_out),
                    ready=self.ready, regroup_generation=self.regroup_generation,
                    credential=self._credential),
                    timeout=self._interval * 2)
            except CoordinatorUnavailable:
                raise
            except CoordinatorError as error:
                self._declare_lost(str(error), refused=True)
                raise
        if self._on_response is not None:
            self._on_response(response)
        for command in response.commands:
            self._on_command(command)
        return response

    def _declare_lost(self, reason: str, refused: bool) -> None:
        with self._lost_lock:  # once, whichever thread hears of it first
            if self._lost.is_set():
                return
            self._lost.set()
        self._on_lost(reason, refused)

    def _run(self) -> None:
        give_up_after = self._give_up_after.total_seconds()
        interval = self._interval.total_seconds()
        last_ok = time.monotonic()
        wait = 0.0
        retry = OUTAGE_RETRY_FIRST.total_seconds()
        while not self._stop.wait(wait) and not self._lost.is_set():
            wait = interval
            try:
                self.beat()
                last_ok = time.monotonic()
                if self.outage is not None:
                    logger.warning("the coordinator answers again: the outage lasted %.1f s", last_ok - self.outage)
                    self.outage = None
                    retry = OUTAGE_RETRY_FIRST.total_seconds()
                    if self._on_outage_end is not None:
                        self._on_outage_end()
            except CoordinatorUnavailable as error:
                now = time.monotonic()
                unreachable_for = now - last_ok
                if unreachable_for >= give_up_after:
                    self._declare_lost(f"lost the coordinator: unreachable for {unreachable_for:.1f} s ({error})",
                                       refused=False)
                    return
                if self.outage is None:
                    self.outage = last_ok
                    logger.warning("%s; going on without it for up to %.0f s while it comes back", error,
                                   give_up_after)
                # Retried with backoff, and declared lost at the grace's end, not a beat later.
                wait = min(retry, interval, give_up_after - unreachable_for)
                retry *= 2
            except CoordinatorError:  # refused: declared lost by beat()
                return
            except Exception as error:  # noqa: BLE001 - a failing command handler must not end heartbeats silently
                logger.exception("heartbeat handling failed")
                self._declare_lost(f"heartbeat handling failed: {error}", refused=False)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(self._interval.total_seconds() * 3)
