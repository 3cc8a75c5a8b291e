"""Joining and leaving the torch RPC data plane.

Owns how a process (shard server, trainer, driver) becomes a torch RPC peer:
the TensorPipe backend options (worker threads, default RPC timeout), the
intra-op thread count, the network interface it listens on, the orderly
way out, and waiting for a fan-out of RPCs to settle.  Groups come in two kinds: static (a fixed world size, everyone
joins at once: local clusters, tests) and open (no world size: members join
and leave at any time, meeting in a store the coordinator hosts, through a
connection that connects again when the coordinator comes back; a member
that died is dropped with ``forget``; one that re-attached to a coordinator
started again puts itself back into the store with ``republish``).  It knows nothing of what peers host
or compute.
"""

import datetime
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple
from urllib.parse import urlparse

import torch
import torch.distributed.rpc as rpc

from .._torch_compat import (RPC_TOKEN_DONE, RPC_TOKEN_KEY, current_rpc_agent, forget_dead_peers_when_joining,
                             forget_rpc_peer, is_open_rpc_group, mark_leaving, publish_rpc_member, release_rrefs,
                             reset_rpc_init_counter, rpc_member_address, rpc_token, tensorpipe_options)
from ..logs import one_line
from .group_store import open_group_url, store_of

logger = logging.getLogger(__name__)

#: Environment overrides for the defaults below.
RPC_TIMEOUT_ENV = "PARAMSERVER_RPC_TIMEOUT"
RPC_THREADS_ENV = "PARAMSERVER_RPC_THREADS"
RPC_TRANSPORTS_ENV = "PARAMSERVER_RPC_TRANSPORTS"

CREATE_TIMEOUT_ENV = "PARAMSERVER_CREATE_TIMEOUT"

DEFAULT_RPC_TIMEOUT = datetime.timedelta(seconds=60)
#: How long creating something on an owner may take (tables drawn there, an optimizer compiled with
#: TorchScript: about 3 s for the first compile on a fresh machine); a step's RPCs keep the short timeout.
DEFAULT_CREATE_TIMEOUT = datetime.timedelta(seconds=300)
DEFAULT_RPC_THREADS = 16
#: Transports of an open group (the cluster that ps-server, ps-worker and
#: paramserver.connect form) unless PARAMSERVER_RPC_TRANSPORTS says otherwise.
OPEN_GROUP_TRANSPORTS = ("uv",)


def _env_timeout() -> datetime.timedelta:
    value = os.environ.get(RPC_TIMEOUT_ENV)
    return datetime.timedelta(seconds=float(value)) if value else DEFAULT_RPC_TIMEOUT


def creation_timeout() -> float:
    """Seconds an RPC that creates tables or optimizers on an owner may take (``PARAMSERVER_CREATE_TIMEOUT``
    overrides), independent of the step RPCs' timeout."""
    value = os.environ.get(CREATE_TIMEOUT_ENV)
    seconds = float(value) if value else DEFAULT_CREATE_TIMEOUT.total_seconds()
    if not seconds > 0:
        raise ValueError(f"{CREATE_TIMEOUT_ENV} must be a positive number of seconds, got {value!r}")
    return seconds


def settle(futures: Mapping[str, Any]) -> Tuple[Dict[str, Any], List[Tuple[str, BaseException]]]:
    """Wait for every RPC future (by peer name): the results of those that answered, and ``(peer, error)`` for
    each that failed, so that one failure never hides another."""
    results, failures = {}, []
    for name, future in futures.items():
        try:
            results[name] = future.wait()
        except Exception as error:  # noqa: BLE001 - every peer's outcome is collected first
            failures.append((name, error))
    return results, failures


def _env_transports() -> Optional[Tuple[str, ...]]:
    value = os.environ.get(RPC_TRANSPORTS_ENV)
    return tuple(part.strip() for part in value.split(",") if part.strip()) if value else None


def _env_threads() -> int:
    value = os.environ.get(RPC_THREADS_ENV)
    return int(value) if value else DEFAULT_RPC_THREADS


@dataclass(frozen=True)
class PeerOptions:
    """How a process takes part in the data plane.

    ``intra_op_threads``: threads each PyTorch op may use (``None`` keeps
    PyTorch's default).  Shard servers default to 1: they get their
    parallelism from concurrent RPC threads, from running several shards
    and from their inter-op pool, and a per-op thread pool would only fight
    them for cores.  ``inter_op_threads``: PyTorch's inter-op pool (``None``
    keeps its default: the cores), on which a shard applies a large push in
    parts (``shards/server/optimizers.py``).

    ``transports``: TensorPipe transports to offer, in order (``None``: its
    default, which on one host prefers shared memory, ``shm``, in a static
    group, and ``OPEN_GROUP_TRANSPORTS`` (``uv``) in an open one).  The
    ``shm`` transport polls: every idle peer keeps most of a core busy
    (measured: about 40-65% each on a 2-core machine).  ``("uv",)`` (TCP)
    idles at zero CPU for a little more latency per message.  A cluster
    runs more processes than one host has cores (the default job on 2
    cores: 4 shards, 2 workers): there uv trains about 4x faster.
    """

    rpc_timeout: datetime.timedelta = field(default_factory=_env_timeout)
    num_worker_threads: int = field(default_factory=_env_threads)
    intra_op_threads: Optional[int] = None
    inter_op_threads: Optional[int] = None
    transports: Optional[Tuple[str, ...]] = field(default_factory=_env_transports)

    def __post_init__(self):
        if self.rpc_timeout.total_seconds() <= 0:
            raise ValueError(f"rpc_timeout must be positive, got {self.rpc_timeout}")
        if self.num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be at least 1, got {self.num_worker_threads}")
        for threads in ("intra_op_threads", "inter_op_threads"):
            if getattr(self, threads) is not None and getattr(self, threads) < 1:
                raise ValueError(f"{threads} must be at least 1, got {getattr(self, threads)}")


#: TensorPipe's own variable naming the network interface to listen on.
TENSORPIPE_INTERFACE_ENV = "TP_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915


def interface_for(host: str) -> Optional[str]:
    """The name of this machine's network interface holding IPv4 address ``host`` (or its
    resolution), or ``None`` when none does."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    if ipaddress.ip_address(address).is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _index, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def join(name: str, rank: int, world_size: Optional[int], init_method: str,
         options: Optional[PeerOptions] = None, bind_host: Optional[str] = None) -> None:
    """Become RPC peer ``name`` with ``rank``, meeting the others at ``init_method`` (``tcp://HOST:PORT``).

    ``world_size``: the fixed size of a static group (rank 0 then hosts the
    rendezvous), or ``None`` to join an open group whose store someone else
    hosts (ranks must be unique and above 0).  ``bind_host``: listen only on
    the interface holding this address (unless ``TP_SOCKET_IFNAME`` is set).
    """
    options = options or PeerOptions()
    if options.intra_op_threads is not None:
        torch.set_num_threads(options.intra_op_threads)
    if options.inter_op_threads is not None and options.inter_op_threads != torch.get_num_interop_threads():
        torch.set_num_interop_threads(options.inter_op_threads)  # RuntimeError once the pool has started
    if bind_host and TENSORPIPE_INTERFACE_ENV not in os.environ:
        interface = interface_for(bind_host)
        if interface is None:
            raise ValueError(f"no network interface of this machine has address {bind_host!r}")
        os.environ[TENSORPIPE_INTERFACE_ENV] = interface
    if world_size is None:
        if rank < 1:
            raise ValueError(f"rank {rank}: in an open group rank 0 is the store's host; use 1 or more")
        # torch prefixes a process's store keys by how many times it called
        # init_rpc; members of an open group must all use the first prefix,
        # the one the coordinator's store upkeep knows.
        reset_rpc_init_counter()
        forget_dead_peers_when_joining()  # a member that died a moment ago would hang torch's join
        parsed = urlparse(init_method)
        if parsed.scheme == "tcp":  # through a store connection that outlives a coordinator's restart
            init_method = open_group_url(parsed.hostname, parsed.port)
    transports = options.transports or (OPEN_GROUP_TRANSPORTS if world_size is None else None)
    backend_options = tensorpipe_options(init_method, options.num_worker_threads, options.rpc_timeout, transports)
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=backend_options)
    if world_size is None:
        agent = current_rpc_agent()
        store = store_of(agent)
        if store is not None:  # kept for ``republish``: nothing else can tell it later
            store.own_address = rpc_member_address(agent.store, name)


def republish(within: datetime.timedelta = datetime.timedelta(seconds=10)) -> Optional[bool]:
    """Put this member back into its open group's store, connected to again: for a member that re-attached to
    a coordinator started again, whose new store may lack it (the journal it was rebuilt from missed a
    member that had joined just before).  Under the group's membership token, as torch's join.  Returns
    whether the member list lacked this member, or None when there was nothing to do (no open group, or
    not joined through ``join``) or it could not be done (said in the log)."""
    agent = current_rpc_agent()
    store = store_of(agent) if agent is not None and is_open_rpc_group(agent) else None
    if store is None or store.own_address is None:
        return None
    me = agent.get_worker_info()
    try:
        store.reconnect()
    except torch.distributed.DistError as error:
        logger.warning("%s could not connect again to the RPC group's store: %s", me.name, one_line(error))
        return None
    not_taken = _take_membership_token(agent, "join", within)
    if not_taken is not None:
        logger.warning("%s: %s could not put itself back into the RPC group's store", not_taken, me.name)
        return None
    try:
        added = publish_rpc_member(agent.store, me.name, me.id, store.own_address)
    finally:
        _release_membership_token_if_held(agent, "join")
    if added:
        logger.info("%s put itself back into the RPC group's member list", me.name)
    return added


def is_open_group() -> bool:
    agent = current_rpc_agent()
    return agent is not None and is_open_rpc_group(agent)


def forget(peer: str) -> bool:
    """Drop ``peer`` (known to be dead) from this process's view of an open group.

    Without this, leaving would wait on the dead peer.  Returns whether it was known.
    """
    agent = current_rpc_agent()
    if agent is None:
        return False
    try:
        info = agent.get_worker_info(peer)
    except RuntimeError:
        return False
    forget_rpc_peer(agent, info)
    logger.info("forgot lost RPC peer %s", peer)
    return True


#: How long leaving an open group waits for this process's RRefs to be released by their owners.
RELEASE_RREFS_WITHIN = datetime.timedelta(seconds=5)


#: How often a member tries to take the open group's membership token while another member holds it.
_TOKEN_POLL = datetime.timedelta(seconds=0.02)


def _take_membership_token(agent, purpose: str, within: datetime.timedelta) -> Optional[str]:
    """Take the open group's membership token under the name torch's own join and leave use (so that torch's
    graceful shutdown, called next, finds it taken already and goes on); None once taken, else why not (it
    stayed taken ``within``, or the group's store is gone: its host left or died).

    Polled, never waited for in the store: a ``Store.wait`` holds this process's one connection to the store
    until the key appears, and a member that joins meanwhile (holding the token) asks every member, this
    one included, to read its address from the store through that same connection.  Each would wait for the
    other until the store's timeout (60 s): torch's own graceful leave does exactly that when a member joins
    while it waits for the token (reproduced).  Between polls the connection is free.
    """
    store, token = agent.store, rpc_token(agent.get_worker_info().name, purpose)
    deadline = time.monotonic() + within.total_seconds()
    try:
        while store.compare_set(RPC_TOKEN_KEY, "", token).decode() != token:
            if time.monotonic() > deadline:
                return f"the RPC group's membership token stayed taken for {within.total_seconds():.1f} s"
            time.sleep(_TOKEN_POLL.total_seconds())
    except torch.distributed.DistError as error:  # its connection broke, and connecting again failed
        return f"the RPC group's store is gone ({one_line(error)})"
    return None


def leave(graceful: bool = True, timeout: Optional[datetime.timedelta] = None) -> None:
    """Stop being a peer.  Graceful: in a static group, wait until every peer
    leaves and all outstanding work is done (bounded by ``timeout`` when
    given); in an open group, release the RRefs this process holds, take the
    group's membership token (bounded by ``timeout``, else the RPC timeout;
    when it stays taken, or the group's store is gone, leave without telling
    the others: the coordinator takes a member that is gone off the group's
    list) and tell the others it left.  Not graceful: just stop.  A graceful leave whose group store
    closes during its last step (the peer hosting the store left first) has
    left all the same."""
    if graceful and is_open_group():
        try:
            # Bounded: RRefs whose owner died (a lost shard) are never confirmed, and torch's default
            # wait for them is 100 s.
            release_rrefs(RELEASE_RREFS_WITHIN)
        except RuntimeError as error:  # an owner may be gone; its RRefs are moot
            logger.warning("releasing RRefs before leaving: %s", error)
        agent = current_rpc_agent()
        within = timeout or datetime.timedelta(seconds=rpc.get_rpc_timeout())
        not_taken = _take_membership_token(agent, "leave", within)
        if not_taken is None:
            try:
                _shut_down(True, timeout)
            finally:
                _release_membership_token_if_held(agent, "leave")
            return
        logger.warning("%s: %s leaves without telling the other members", not_taken, agent.get_worker_info().name)
        graceful = False
    _shut_down(graceful, timeout)


def _release_membership_token_if_held(agent, purpose: str) -> None:
    """Give back the token ``_take_membership_token`` took, as torch does (whoever waits on it goes on), if this
    process still holds it: torch releases it after a graceful leave, but keeps it when that fails midway (a
    member it tells is gone), and every later join and leave of the group would wait for it."""
    token = rpc_token(agent.get_worker_info().name, purpose)
    try:
        if agent.store.compare_set(RPC_TOKEN_KEY, token, "").decode() == "":
            agent.store.set(token, RPC_TOKEN_DONE)
    except torch.distributed.DistError as error:  # the store's host is gone: so is the group
        logger.info("could not check the RPC group's membership token after leaving: %s", one_line(error))


def _shut_down(graceful: bool, timeout: Optional[datetime.timedelta]) -> None:
    try:
        if timeout is None:
            rpc.shutdown(graceful=graceful)
        else:
            rpc.shutdown(graceful=graceful, timeout=timeout.total_seconds())
    except torch.distributed.DistNetworkError as error:
        # The last step of a graceful leave reads the group's store, which the peer hosting it may have closed
        # by leaving first, once every peer had reached that step: this process has left all the same (torch
        # finishes the local shutdown whatever the barrier's end).
        if not graceful:
            raise
        logger.info("left the RPC group; its store closed during the last step (%s)", one_line(error))


#: Under the open group's store: the key a member sets once it counts as leaving (``leave_together``).
LEAVING_KEY = "paramserver/leaving/{name}-{rank}"


def leave_together(within: datetime.timedelta) -> bool:
    """Leave an open group together with the other members that leave now (a cluster's shards at its
    shutdown), so that no one logs TensorPipe's ``pipe closed`` or ``EOF`` warnings; False (nothing done,
    call ``leave``) when this is no open group, this process has RPCs of its own in flight, or the group's
    membership token stays taken for ``within``.

    TensorPipe takes a pipe that breaks as expected only at a member that
    counts as shutting down; a plain leave closes its pipes at once (it
    logs ``pipe closed`` for its own), and torch's graceful leave of an open
    group connects to every member and closes that pipe while they still serve
    (each logs ``EOF``).  So: count as leaving first (``mark_leaving``, under
    the membership token; the member list loses this process), say so in the
    group's store, wait up to ``within`` until every member this process still
    knows has said so too, then close.  A member that stays (it was not asked
    to stop) is left behind once ``within`` ran out: it logs ``EOF`` for this
    process's pipes, as it would for any member that leaves.
    """
    agent = current_rpc_agent()
    if agent is None or not is_open_rpc_group(agent):
        return False
    deadline = time.monotonic() + within.total_seconds()
    me = agent.get_worker_info()
    store = agent.store
    while int(agent.get_metrics().get("agent.client_active_calls", "0")) > 0:
        if time.monotonic() > deadline:
            logger.info("RPCs of %s still in flight after %.1f s: leaving at once", me.name, within.total_seconds())
            return False
        time.sleep(_TOKEN_POLL.total_seconds())
    left = datetime.timedelta(seconds=max(0.0, deadline - time.monotonic()))
    not_taken = _take_membership_token(agent, "leave", left)
    if not_taken is not None:
        logger.info("%s: %s leaves at once", not_taken, me.name)
        return False
    try:
        mark_leaving(agent)
    finally:
        _release_membership_token_if_held(agent, "leave")
    store.set(LEAVING_KEY.format(name=me.name, rank=me.id), "1")
    others = [LEAVING_KEY.format(name=peer.name, rank=peer.id) for peer in agent.get_worker_infos()
              if peer.name != me.name]
    # Polled, not waited for in the store (``_take_membership_token`` says why).
    while others and not store.check(others):
        if time.monotonic() > deadline:  # those members stay
            logger.info("%s leaves while other RPC peers still serve", me.name)
            break
        time.sleep(_TOKEN_POLL.total_seconds())
    rpc.shutdown(graceful=False)  # every pipe closes; this process and those that left with it expect that
    return True
