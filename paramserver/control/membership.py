"""Who is in the cluster: the membership table, generations and failure detection.

Owns the coordinator's state about members, pure and in memory: joining
(assigning RPC names and ranks, never reused), heartbeats (sequence checks,
step and metrics), leaving, declaring members dead when heartbeats stop or
when their process exits, the generation number (one more on every change),
the commands waiting for each member, the status snapshot, and how many
members joined and ended, by role and by how (``counts()``, which metrics
read).  Which workers train together is ``groups.TrainerGroups``' policy,
kept here in step with the members.  It knows
nothing of gRPC transport or of torch; a ``RequestError`` tells the service
which status code to answer with.
"""

import datetime
import hashlib
import hmac
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import grpc

from ..logs import one_line
from .groups import TrainerGroups
from .protocol import ROLE_NAMES, pb
from .validation import RequestError

logger = logging.getLogger(__name__)

ALIVE, LEFT, DEAD, EXITED = "alive", "left", "dead", "exited"
#: What status says of a live member taken from the journal that has not re-attached yet.
NOT_REATTACHED = "not re-attached yet"
#: Members no longer alive that status keeps showing (oldest are dropped first).
MAX_FORMER_MEMBERS = 256


@dataclass(frozen=True)
class MembershipCounts:
    """A consistent snapshot: the generation, live members by role, joins by role, ends by (role, state)."""

    generation: int
    alive: Dict[int, int]
    joined: Dict[int, int]
    ended: Dict[Tuple[int, str], int]


@dataclass
class Member:
    member_id: str
    role: int
    name: str
    host: str
    rpc_name: str
    rpc_rank: int
    index: int
    pid: int
    joined_generation: int
    trainer_group: int
    last_heartbeat: float
    #: Workers: the job's run it joined (``Membership.join``); 0 for shards.
    job_run: int = 0
    state: str = ALIVE
    ready: bool = False
    sequence: int = 0
    step: int = 0
    metrics: Dict[str, float] = field(default_factory=dict)
    commands: List[pb.Command] = field(default_factory=list)
    end_reason: str = ""
    #: The secret its Join was answered with (kept in memory for the answer; never journaled).
    credential: str = field(default="", repr=False)
    #: sha256 of ``credential``, hex: what a re-attach is checked against (journaled).
    credential_digest: str = ""
    #: False for a member taken from the journal of the coordinator before this one, until it re-attaches.
    attached: bool = True
    #: The machine it runs on, as it said (``control.machine``; empty: not said).
    machine: str = ""

    @property
    def role_name(self) -> str:
        return ROLE_NAMES[self.role]

    def describe(self) -> str:
        return f"{self.role_name} {self.rpc_name} ({self.name}@{self.host}, pid {self.pid})"


def _precondition(message: str) -> RequestError:
    return RequestError(grpc.StatusCode.FAILED_PRECONDITION, message)


class Membership:
    """The membership table.  Thread-safe; ``clock`` is injectable for tests.

    ``on_gone(member)`` runs (outside the lock) for each member that ends,
    however it ends (left, declared dead, process exited), after the
    survivors were told to forget it: one that left cleanly has already
    left the RPC group, and forgetting it again does nothing, but one that
    left after a failure may not have.
    """

    def __init__(self, heartbeat_timeout: datetime.timedelta,
                 on_gone: Optional[Callable[[Member], None]] = None,
                 clock: Callable[[], float] = time.monotonic,
                 groups: Optional[TrainerGroups] = None, machine: str = ""):
        if heartbeat_timeout.total_seconds() <= 0:
            raise ValueError(f"heartbeat_timeout must be positive, got {heartbeat_timeout}")
        self.heartbeat_timeout = heartbeat_timeout
        self._on_gone = on_gone
        self._clock = clock
        self._changed = threading.Condition()
        self._members: Dict[str, Member] = {}
        self._generation = 0
        self._next_rank = 1  # rank 0 is the store's host, the coordinator
        self._role_joins = {role: 0 for role in ROLE_NAMES}
        self._ends: Dict[Tuple[int, str], int] = {}  # (role, LEFT/DEAD/EXITED) -> how many ended that way
        self._stopping = False
        self._groups = groups or TrainerGroups()
        #: The job's runs: one more each time a worker joins while no worker is alive.
        self._job_runs = 0
        #: Shards whose process exited and is not restarted: RPC name -> why (a shard joining under it clears it).
        self._shards_gone: Dict[str, str] = {}
        #: The coordinator's own machine (``control.machine``): one more of the cluster's processes there.
        self._machine = machine

    # -- reading -------------------------------------------------------
    @property
    def generation(self) -> int:
        with self._changed:
            return self._generation

    @property
    def stopping(self) -> bool:
        with self._changed:
            return self._stopping

    def alive(self, role: Optional[int] = None) -> List[Member]:
        with self._changed:
            return self._alive(role)

    def _alive(self, role: Optional[int] = None) -> List[Member]:
        return [m for m in self._members.values() if m.state == ALIVE and (role is None or m.role == role)]

    def live_shard_names(self) -> List[str]:
        with self._changed:
            return self._live_shard_names()

    def _live_shard_names(self) -> List[str]:
        return sorted((m.rpc_name for m in self._serving_shards()), key=_natural_key)

    def host_processes(self, member_id: str) -> int:
        """How many of the cluster's processes run on the machine of live member ``member_id``: the live members
        that said the same machine, and the coordinator if it runs there; 0 where the member said none."""
        with self._changed:
            member = self._members.get(member_id)
            if member is None or not member.machine:
                return 0
            return (int(member.machine == self._machine)
                    + sum(1 for m in self._alive() if m.machine == member.machine))

    def serving_shards(self) -> List[Member]:
        """Live shards whose heartbeats say their data plane is up."""
        with self._changed:
            return self._serving_shards()

    def _serving_shards(self) -> List[Member]:
        return [m for m in self._alive(pb.ROLE_SHARD) if m.ready]

    def counts(self) -> MembershipCounts:
        with self._changed:
            alive: Dict[int, int] = {}
            for member in self._alive():
                alive[member.role] = alive.get(member.role, 0) + 1
            return MembershipCounts(self._generation, alive, dict(self._role_joins), dict(self._ends))

    def wait_until(self, predicate: Callable[["Membership"], bool], timeout: datetime.timedelta) -> bool:
        """Block until ``predicate(self)`` holds (checked on every change) or ``timeout`` passes."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._changed:
            while True:
                if predicate(self):
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(min(remaining, 0.5))

    # -- changes -------------------------------------------------------
    def join(self, request: pb.JoinRequest) -> Member:
        with self._changed:
            if self._stopping:
                raise _precondition("the cluster is shutting down and takes no new members")
            index = self._role_joins[request.role]
            rpc_name = self._rpc_name_for(request, index)
            self._role_joins[request.role] += 1
            self._generation += 1
            is_worker = request.role == pb.ROLE_WORKER
            new_run = is_worker and not self._alive(pb.ROLE_WORKER)
            if new_run:
                self._job_runs += 1  # the job starts, or starts again from its checkpoint
                self._groups.new_run()
            credential = secrets.token_urlsafe(24)
            member = Member(
                member_id=secrets.token_hex(8), role=request.role, name=request.name, host=request.host,
                rpc_name=rpc_name, rpc_rank=self._next_rank, index=index, pid=request.capabilities.pid,
                joined_generation=self._generation,
                trainer_group=self._groups.assign() if is_worker else 0,
                last_heartbeat=self._clock(), job_run=self._job_runs if is_worker else 0,
                credential=credential, credential_digest=_digest(credential), machine=request.capabilities.machine)
            self._next_rank += 1
            if is_worker:
                self._groups.add(member.trainer_group, rpc_name, request.capabilities.gpus, self._clock())
            self._members[member.member_id] = member
            self._shards_gone.pop(rpc_name, None)
            self._forget_oldest_former_members()
            self._changed.notify_all()
        logger.info("joined: %s, rank %d, generation %d", member.describe(), member.rpc_rank, member.joined_generation)
        if new_run:
            logger.info("job run %d starts: %s joined with no worker alive", member.job_run, member.rpc_name)
        return member

    def _rpc_name_for(self, request: pb.JoinRequest, index: int) -> str:
        if request.role == pb.ROLE_SHARD:
            # Shards keep the name they were started with, so a restarted shard is found again.
            same_name = next((m for m in self._alive() if m.rpc_name == request.name), None)
            if same_name is not None:
                if same_name.host == request.host and same_name.pid != request.capabilities.pid:
                    # Most likely its restarted process, on a host whose supervisor cannot report the old one's
                    # exit here: it joins once the old one is declared dead.  The joiner retries meanwhile.
                    raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                       f"a live member on {request.host} is already named {request.name!r} (pid "
                                       f"{same_name.pid}); join again once it is gone")
                raise _precondition(f"a live member is already named {request.name!r}")
            # ... once every survivor has dropped the lost one from its RPC group (a peer that still
            # knows the old one would never learn the new one): the joiner retries meanwhile.
            if any(c.kind == pb.Command.KIND_FORGET_PEER and c.peer == request.name
                   for m in self._alive() for c in m.commands):
                raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                   f"members are still dropping the previous {request.name}; join again shortly")
            return request.name
        # Workers and clients get a fresh name per join: a rejoining process is a new member.
        return f"{ROLE_NAMES[request.role]}{index}"

    def _known(self, member_id: str) -> Member:
        member = self._members.get(member_id)
        if member is None:
            raise _precondition(f"unknown member_id {member_id[:64]!r}: join first")
        if member.state != ALIVE:
            raise _precondition(f"{member.describe()} is {member.state} ({member.end_reason}); join again")
        return member

    def heartbeat(self, request: pb.HeartbeatRequest
                  ) -> Tuple[int, List[pb.Command], List[str], Optional[pb.TrainerGroupView]]:
        """Record a heartbeat; returns the generation, the member's commands, the live shards
        and, for a worker, its trainer group's newest view."""
        with self._changed:
            member = self._known(request.member_id)
            if not member.attached:
                self._reattach(member, request)
            if request.sequence <= member.sequence:
                raise _precondition(f"heartbeat out of order from {member.rpc_name}: sequence "
                                    f"{request.sequence} after {member.sequence}")
            member.sequence = request.sequence
            if request.ready and not member.ready:
                member.ready = True
                self._changed.notify_all()
            member.last_heartbeat = self._clock()
            member.step = request.step
            member.metrics = dict(request.metrics)
            commands, member.commands = member.commands, []
            if member.role == pb.ROLE_WORKER and request.regroup_generation:
                self._groups.regroup(member.trainer_group, request.regroup_generation, member.last_heartbeat)
            view = self._groups.view(member.trainer_group, member.last_heartbeat) \
                if member.role == pb.ROLE_WORKER else None
            return self._generation, commands, self._live_shard_names(), view

    def _reattach(self, member: Member, request: pb.HeartbeatRequest) -> None:
        """A member the coordinator before this one knew heartbeats: take it back if it proves it is the one
        that joined (its credential), else refuse it (``PERMISSION_DENIED``), changing nothing."""
        if not member.credential_digest or not hmac.compare_digest(_digest(request.credential),
                                                                   member.credential_digest):
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED,
                               f"re-attach as {member.rpc_name} refused: the heartbeat does not carry the "
                               "credential this member joined with")
        member.attached = True
        member.last_heartbeat = self._clock()
        self._changed.notify_all()
        logger.info("re-attached: %s at step %d, trainer group %d", member.describe(), request.step,
                    member.trainer_group)

    def unattached(self) -> List[Member]:
        """Live members taken from the journal that have not re-attached yet."""
        with self._changed:
            return [m for m in self._alive() if not m.attached]

    # -- the journal ----------------------------------------------------
    def snapshot(self) -> Dict[str, Any]:
        """What a coordinator started again needs to take the cluster back (``restore``), as plain JSON types:
        the counters (generation, ranks, indices, job runs), the live members with their credentials'
        digests, the trainer groups and the shards gone.  Steps and figures are not in it: heartbeats bring
        them again."""
        with self._changed:
            return {
                "generation": self._generation, "next_rank": self._next_rank,
                "role_joins": {str(role): count for role, count in self._role_joins.items()},
                "job_runs": self._job_runs, "shards_gone": dict(self._shards_gone),
                "members": [{key: getattr(m, key) for key in (*_JOURNALED, "machine")} for m in self._alive()],
                "groups": self._groups.snapshot(),
            }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back what ``snapshot`` wrote: its live members are alive here, unattached until they
        re-attach (a heartbeat with their credential) and declared dead after the heartbeat timeout if they
        do not; the generation continues above the journaled one."""
        with self._changed:
            now = self._clock()
            self._generation = int(state["generation"]) + 1
            self._next_rank = max(self._next_rank, int(state["next_rank"]))
            for role, count in state["role_joins"].items():
                self._role_joins[int(role)] = max(self._role_joins.get(int(role), 0), int(count))
            self._job_runs = int(state["job_runs"])
            self._shards_gone = dict(state.get("shards_gone", {}))
            for fields in state["members"]:
                member = Member(**{key: fields[key] for key in _JOURNALED}, machine=fields.get("machine", ""),
                                last_heartbeat=now, attached=False)
                self._members[member.member_id] = member
            self._groups.restore(state.get("groups", {}), now)
            self._changed.notify_all()
        logger.info("took the journal back: generation %d, %d member%s to re-attach", self._generation,
                    len(state["members"]), "" if len(state["members"]) == 1 else "s")

    def trainer_groups_gone(self) -> List[int]:
        """Trainer groups of this job run left with no live worker for their ``gone_after``, by number."""
        with self._changed:
            return self._groups.gone(self._clock())

    def shards_gone(self) -> Dict[str, str]:
        """Shards that will not serve again (their process is not restarted): name -> why."""
        with self._changed:
            return dict(self._shards_gone)

    def _shard_gone(self, member: Member, why: str) -> None:
        if member.role == pb.ROLE_SHARD:
            self._shards_gone[member.rpc_name] = one_line(f"{member.end_reason}; {why}")

    def leave(self, request: pb.LeaveRequest) -> int:
        with self._changed:
            member = self._known(request.member_id)
            member.step = request.step or member.step
            member.metrics.update(request.metrics)
            self._end(member, LEFT, request.reason or "left")
            if request.final:
                self._shard_gone(member, "not restarted")
            generation = self._generation
        logger.info("left: %s at step %d, generation %d (%s)", member.describe(), member.step, generation,
                    member.end_reason)
        self._report_gone([member])
        return generation

    def sweep(self) -> List[Member]:
        """Declare dead every member silent for longer than the heartbeat timeout, and say which trainer
        groups have become gone (``TrainerGroups.newly_gone``)."""
        limit = self.heartbeat_timeout.total_seconds()
        with self._changed:
            now = self._clock()
            lost = [m for m in self._alive() if now - m.last_heartbeat > limit]
            for member in lost:
                self._end(member, DEAD, f"no heartbeat for {now - member.last_heartbeat:.1f} s")
            newly_gone = self._groups.newly_gone(now)
        self._report_gone(lost)
        for group, empty_for in newly_gone:
            logger.warning("trainer group %d is gone: no live worker for %.0f s; other groups may take over "
                           "what it had under way", group, empty_for)
        return lost

    def process_exited(self, rpc_name: str, exit_code: Optional[int], not_restarted: str = "") -> Optional[Member]:
        """The supervisor saw the process of ``rpc_name`` exit: it is gone now, and for good when
        ``not_restarted`` says why it will not be started again."""
        with self._changed:
            member = next((m for m in self._alive() if m.rpc_name == rpc_name), None)
            if member is not None:
                self._end(member, EXITED, f"process exited with code {exit_code}")
                if not_restarted:
                    self._shard_gone(member, f"not restarted: {not_restarted}")
        if member is not None:
            self._report_gone([member])
        return member

    def _end(self, member: Member, state: str, reason: str) -> None:
        member.state = state
        member.end_reason = one_line(reason)  # a member's text: never a second line in a status table or log
        self._ends[(member.role, state)] = self._ends.get((member.role, state), 0) + 1
        member.commands = []
        self._generation += 1
        if member.role == pb.ROLE_WORKER:
            self._groups.remove(member.trainer_group, member.rpc_name, self._clock())
        # Its RPC peers must drop it, or the group waits on it forever (a no-op
        # for a member that left the RPC group properly).
        for survivor in self._alive():
            survivor.commands.append(pb.Command(kind=pb.Command.KIND_FORGET_PEER, peer=member.rpc_name))
        self._changed.notify_all()

    def _report_gone(self, gone: List[Member]) -> None:
        for member in gone:
            if member.state != LEFT:
                logger.warning("lost: %s is %s (%s); generation %d", member.describe(), member.state,
                               member.end_reason, self.generation)
            if self._on_gone is not None:
                self._on_gone(member)

    def stop_members(self, roles) -> List[Member]:
        """Ask the live members of ``roles`` to stop; no one joins from now on.  Returns who was asked.

        Shutdown asks workers and clients first and shards last: a shard
        leaving under a running worker would fail its steps.
        """
        with self._changed:
            self._stopping = True
            members = [m for m in self._alive() if m.role in roles]
            for member in members:
                member.commands.append(pb.Command(kind=pb.Command.KIND_STOP))
            self._changed.notify_all()
        return members

    def command(self, role: int, command: pb.Command) -> int:
        """Queue ``command`` for every live member of ``role`` (sent with their next heartbeat answer)."""
        with self._changed:
            members = self._alive(role)
            for member in members:
                member.commands.append(command)
        return len(members)

    def live_member(self, member_id: str) -> Member:
        """The live member ``member_id`` (``RequestError`` for an unknown or former one)."""
        with self._changed:
            return self._known(member_id)

    def _forget_oldest_former_members(self) -> None:
        former = [key for key, m in self._members.items() if m.state != ALIVE]
        for key in former[:max(0, len(former) - MAX_FORMER_MEMBERS)]:
            del self._members[key]

    # -- status --------------------------------------------------------
    def status(self) -> pb.StatusResponse:
        with self._changed:
            now = self._clock()
            response = pb.StatusResponse(generation=self._generation, stopping=self._stopping)
            lists = {pb.ROLE_SHARD: response.shards, pb.ROLE_WORKER: response.workers,
                     pb.ROLE_CLIENT: response.clients}
            for member in sorted(self._members.values(), key=lambda m: _natural_key(m.rpc_name)):
                lists[member.role].add(
                    member_id=member.member_id, role=member.role, name=member.rpc_name, joined_as=member.name,
                    host=member.host, alive=member.state == ALIVE, state=member.state, step=member.step,
                    metrics=member.metrics, seconds_since_heartbeat=round(now - member.last_heartbeat, 3),
                    joined_generation=member.joined_generation, trainer_group=member.trainer_group,
                    pid=member.pid, reason=member.end_reason or ("" if member.attached else NOT_REATTACHED),
                    ready=member.ready)
            response.groups.extend(self._groups.views(now))
            response.trainer_groups_gone.extend(self._groups.gone(now))
            return response


#: A member's fields in the journal.
_JOURNALED = ("member_id", "role", "name", "host", "rpc_name", "rpc_rank", "index", "pid", "joined_generation",
              "trainer_group", "job_run", "ready", "credential_digest")


def _digest(credential: str) -> str:
    return hashlib.sha256(credential.encode()).hexdigest()


def _natural_key(name: str):
    """``shard2`` before ``shard10``."""
    head = name.rstrip("0123456789")
    tail = name[len(head):]
    return (head, int(tail) if tail else -1)
