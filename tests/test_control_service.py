"""The Coordinator service's handlers under fuzzing, a Join as a shard and its credential, refusals logged
at a bounded rate, and the rendezvous store's upkeep.

Every request, however malformed, is either answered or refused with
INVALID_ARGUMENT / FAILED_PRECONDITION, and a legitimate member keeps
being served afterwards.  With a shard credential, a Join as a shard
without it is refused with PERMISSION_DENIED saying which flag is missing;
workers and clients need none."""

import datetime
import logging
import re
import threading

import grpc
import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramserver.control import CoordinatorSettings
from paramserver.control.groups import TrainerGroups
from paramserver.control.membership import Membership
from paramserver.control.protocol import pb
from paramserver.control.security import SHARD_TOKEN_METADATA_KEY, ShardCredential
from paramserver.logs import RateLimitedLog
from paramserver._torch_compat import RPC_STORE_PREFIX
from paramserver.control.rendezvous import RendezvousStore
from paramserver.control.service import CoordinatorService, ServiceSettings
from paramserver.control.validation import RequestError

METHODS = ["Join", "Heartbeat", "Leave", "Status", "Checkpoint", "Shutdown"]
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


def make_service(shard_credential=None, membership=None):
    shutdowns = []
    service = CoordinatorService(
        membership or Membership(datetime.timedelta(seconds=5)),
        ServiceSettings(store=pb.StoreAddress(host="127.0.0.1", port=1), job=pb.JobSpec(name="j", code=b"x"),
                        heartbeat_interval=datetime.timedelta(seconds=1),
                        heartbeat_timeout=datetime.timedelta(seconds=5)),
        request_shutdown=shutdowns.append, shard_credential=shard_credential)
    return service, shutdowns


SERVICE, SHUTDOWNS = make_service()
LEGIT = SERVICE.handle("Join", pb.JoinRequest(role=pb.ROLE_WORKER, name="legit", host="127.0.0.1").SerializeToString())
SEQUENCE = [0]


def legit_member_still_served():
    SEQUENCE[0] += 1
    answer = SERVICE.handle("Heartbeat", pb.HeartbeatRequest(member_id=LEGIT.member_id, sequence=SEQUENCE[0])
                            .SerializeToString())
    assert isinstance(answer, pb.HeartbeatResponse)
    assert any(w.name == LEGIT.rpc_name and w.alive for w in SERVICE.handle("Status", b"").workers)


def answer_or_refusal(method, raw):
    try:
        return SERVICE.handle(method, raw)
    except RequestError as error:
        assert error.code in REFUSALS, (method, error.code, error.message)
        assert error.message
        return error


fuzz = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fuzz
@given(method=st.sampled_from([m for m in METHODS if m != "Shutdown"]), raw=st.binary(max_size=300))
def test_random_bytes_are_answered_or_refused(method, raw):
    answer_or_refusal(method, raw)
    legit_member_still_served()


texts = st.text(max_size=80) | st.sampled_from(["", "w", "a" * 65, "127.0.0.1", "::1", "host.example"])
finite_or_not = st.floats(allow_nan=True, allow_infinity=True)


@fuzz
@given(role=st.integers(-3, 6), name=texts, host=texts,
       labels=st.dictionaries(texts, texts, max_size=20))
def test_random_joins_are_answered_or_refused(role, name, host, labels):
    request = pb.JoinRequest(name=name, host=host, capabilities=pb.Capabilities(labels=labels))
    request.role = role  # open enums keep unknown numbers
    result = answer_or_refusal("Join", request.SerializeToString())
    if isinstance(result, pb.Assignment):
        assert result.rpc_rank > 0 and result.member_id
        SERVICE.handle("Leave", pb.LeaveRequest(member_id=result.member_id).SerializeToString())
    legit_member_still_served()


@fuzz
@given(member_id=texts | st.just("LEGIT"), sequence=st.integers(0, 2**64 - 1),
       metrics=st.dictionaries(texts, finite_or_not, max_size=40), reason=texts,
       method=st.sampled_from(["Heartbeat", "Leave"]))
def test_random_heartbeats_and_leaves_are_answered_or_refused(member_id, sequence, metrics, reason, method):
    if member_id == "LEGIT":
        # The legit member's own id with a random sequence: out of order or fine, never a crash.
        # (Never a Leave: the member must stay for the other examples.)
        member_id, method = LEGIT.member_id, "Heartbeat"
        sequence = min(sequence, SEQUENCE[0] + 1)
        SEQUENCE[0] = max(SEQUENCE[0], sequence)
    if method == "Heartbeat":
        request = pb.HeartbeatRequest(member_id=member_id, sequence=sequence, metrics=metrics)
    else:
        request = pb.LeaveRequest(member_id=member_id, reason=reason, metrics=metrics)
    answer_or_refusal(method, request.SerializeToString())
    legit_member_still_served()


def test_refusals_name_what_was_wrong():
    with pytest.raises(RequestError, match="not a valid paramserver.control.v1.JoinRequest"):
        SERVICE.handle("Join", b"\xff\xff\xff")
    with pytest.raises(RequestError, match="no checkpoint directory"):
        SERVICE.handle("Checkpoint", b"")


# --- a Join as a shard and its credential ---------------------------------------------------------------------

TOKEN = "cluster-token-1"
SHARD_TOKEN = "shard-token-2"


def join(service, role, name, shard_token=None):
    metadata = [(SHARD_TOKEN_METADATA_KEY, shard_token)] if shard_token is not None else []
    request = pb.JoinRequest(role=role, name=name, host="127.0.0.1")
    return service.handle("Join", request.SerializeToString(), "ipv4:127.0.0.1:5000", metadata)


def refusal(service, role, name, shard_token=None) -> RequestError:
    with pytest.raises(RequestError) as error:
        join(service, role, name, shard_token)
    assert error.value.code == grpc.StatusCode.PERMISSION_DENIED
    return error.value


def test_a_shard_join_needs_the_shard_credential_and_says_which_flag_is_missing():
    service, _ = make_service(ShardCredential(SHARD_TOKEN))
    assert re.search("shard s1: .*lacks.*--shard-token-file", refusal(service, pb.ROLE_SHARD, "s1").message)
    assert "not the cluster's" in refusal(service, pb.ROLE_SHARD, "s1", shard_token="guess").message
    # The cluster token is no shard credential; workers and clients need none.
    refusal(service, pb.ROLE_SHARD, "s1", shard_token=TOKEN)
    worker = join(service, pb.ROLE_WORKER, "w")
    assert (worker.rpc_name, worker.job_run) == ("worker0", 1)  # the first worker: the job's first run
    assert join(service, pb.ROLE_CLIENT, "c").rpc_name == "client0"
    assert join(service, pb.ROLE_SHARD, "s1", shard_token=SHARD_TOKEN).rpc_name == "s1"
    # Refused joins left no trace: one shard, one worker, one client.
    status = service.handle("Status", b"")
    assert [len(status.shards), len(status.workers), len(status.clients)] == [1, 1, 1]


def test_heartbeats_tell_workers_which_trainer_groups_are_gone():
    groups = TrainerGroups(1, gone_after=datetime.timedelta(0))
    service, _ = make_service(membership=Membership(datetime.timedelta(seconds=5), groups=groups))
    first, second = join(service, pb.ROLE_WORKER, "w"), join(service, pb.ROLE_WORKER, "w")
    assert (first.trainer_group, second.trainer_group) == (0, 1)
    beat = lambda sequence: service.handle(  # noqa: E731
        "Heartbeat", pb.HeartbeatRequest(member_id=first.member_id, sequence=sequence).SerializeToString())
    assert list(beat(1).trainer_groups_gone) == []
    service.handle("Leave", pb.LeaveRequest(member_id=second.member_id, reason="killed").SerializeToString())
    assert list(beat(2).trainer_groups_gone) == [1]


def test_a_credential_made_for_this_run_admits_only_the_servers_own_shards():
    made = ShardCredential.for_this_run()
    assert made.made_for_this_run and len(made.secret) >= 32 and made.secret not in repr(made)
    service, _ = make_service(made)
    for token in (None, SHARD_TOKEN):
        message = refusal(service, pb.ROLE_SHARD, "remote0", shard_token=token).message
        assert "admits only the shards it started itself" in message and "--shard-token-file" in message
    assert join(service, pb.ROLE_SHARD, "shard0", shard_token=made.secret).rpc_name == "shard0"


def test_an_open_cluster_admits_shards_without_credentials():
    assert join(make_service()[0], pb.ROLE_SHARD, "shard0").rpc_name == "shard0"


def test_the_shard_credential_must_differ_from_the_cluster_token():
    with pytest.raises(ValueError, match="the shard token is the cluster token"):
        CoordinatorSettings(token=TOKEN, shard_credential=ShardCredential(TOKEN))
    with pytest.raises(ValueError, match="empty"):
        ShardCredential("")


# --- refusals at a bounded rate ---------------------------------------------------------------------------------

class FakeTimers:
    """``start_timer`` for ``RateLimitedLog``: timers fire when the test says so."""

    def __init__(self):
        self.pending = []

    def __call__(self, seconds, callback):
        timer = FakeTimer(seconds, callback)
        self.pending.append(timer)
        return timer

    def fire(self):
        due, self.pending = self.pending, []
        for timer in due:
            if not timer.cancelled:
                timer.callback()


class FakeTimer:
    def __init__(self, seconds, callback):
        self.seconds, self.callback, self.cancelled = seconds, callback, False

    def cancel(self):
        self.cancelled = True


def test_a_repeated_event_is_logged_at_once_then_counted_once_per_interval(caplog):
    now, timers = [100.0], FakeTimers()
    log = RateLimitedLog(logging.getLogger("test.refusals"), "refused {count} call{s}",
                         interval=datetime.timedelta(seconds=10), clock=lambda: now[0], start_timer=timers)
    caplog.set_level(logging.INFO, logger="test.refusals")

    def lines():
        return [r.getMessage() for r in caplog.records]

    log.record("INVALID_ARGUMENT", "refused Join from a: INVALID_ARGUMENT: name is empty")
    assert lines() == ["refused Join from a: INVALID_ARGUMENT: name is empty"]  # the first one at once
    for i in range(5800):
        log.record("INVALID_ARGUMENT", f"refused Join from b: INVALID_ARGUMENT: call {i}")
    for _ in range(64):
        log.record("UNAUTHENTICATED", "refused Status from c: UNAUTHENTICATED: called without a token")
    assert len(lines()) == 1 and [t.seconds for t in timers.pending] == [10]
    now[0] += 10
    timers.fire()
    assert lines()[1] == ("refused 5,864 calls in the last 10 s: INVALID_ARGUMENT 5,800, UNAUTHENTICATED 64; "
                          "latest: refused Status from c: UNAUTHENTICATED: called without a token")
    # The flood goes on: one line per interval; a quiet interval ends the spell, then the next is logged at once.
    log.record("NOT_FOUND", "x" * 1000)
    now[0] += 10
    timers.fire()
    assert re.fullmatch(r"refused 1 call in the last 10 s: NOT_FOUND 1; latest: x{300}\.\.\.", lines()[2])
    timers.fire()
    assert len(lines()) == 3 and not timers.pending
    log.record("INVALID_ARGUMENT", "again")
    log.record("INVALID_ARGUMENT", "and again")
    assert lines()[3:] == ["again"]
    log.flush()  # a stopping server writes what is counted; the timer then does nothing
    timers.fire()
    assert lines()[4:] == ["refused 1 call in the last 0 s: INVALID_ARGUMENT 1; latest: and again"]


def test_a_bad_summary_template_is_refused_at_once():
    with pytest.raises(KeyError):
        RateLimitedLog(logging.getLogger("test"), "refused {n} calls")
    with pytest.raises(ValueError, match="interval must be positive"):
        RateLimitedLog(logging.getLogger("test"), "x", interval=datetime.timedelta(0))


def test_rendezvous_store_removes_a_lost_member_and_frees_its_token():
    store = RendezvousStore("127.0.0.1")
    try:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=5))
        rpc_store = dist.PrefixStore(RPC_STORE_PREFIX, client)
        names = dist.PrefixStore("names", rpc_store)
        # (A TCPStore client's set is not answered: each is read back on the same connection before the store's
        # own connection acts on it, or a loaded machine may let the removal run first.)
        names.set("_ALL_WORKER_INFOS", "shard0-1,worker0-2,worker1-3,")
        assert names.get("_ALL_WORKER_INFOS") == b"shard0-1,worker0-2,worker1-3,"
        # worker0 died while joining, holding the group's token.
        rpc_store.set("RpcGroupManagementToken", "Token_for_worker0_join")
        assert rpc_store.get("RpcGroupManagementToken") == b"Token_for_worker0_join"
        assert store.remove_rpc_peer("worker0", 2, takeover_after=datetime.timedelta(seconds=0.3))
        assert names.get("_ALL_WORKER_INFOS") == b"shard0-1,worker1-3,"
        assert rpc_store.get("RpcGroupManagementToken") == b""
        assert rpc_store.get("Token_for_worker0_join") == b"Done"  # whoever waited on it goes on
        assert not store.remove_rpc_peer("worker0", 2)

        # Another member is joining: its token is waited for, never taken.
        # (Ordered by events, not by elapsed time: a loaded machine may
        # stall this thread past the release.)
        rpc_store.set("RpcGroupManagementToken", "Token_for_worker2_join")
        assert rpc_store.get("RpcGroupManagementToken") == b"Token_for_worker2_join"
        released = threading.Event()

        def release_the_token():
            released.set()
            rpc_store.set("RpcGroupManagementToken", "")

        release = threading.Timer(0.5, release_the_token)
        release.start()
        assert store.remove_rpc_peer("worker1", 3, takeover_after=datetime.timedelta(seconds=0.1))
        assert released.is_set(), "the removal took a joining member's token instead of waiting for it"
        assert not rpc_store.check(["Token_for_worker2_join"])  # never marked done by the removal
        assert names.get("_ALL_WORKER_INFOS") == b"shard0-1,"
        release.join()
    finally:
        store.close()
