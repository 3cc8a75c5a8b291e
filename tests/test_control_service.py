"""The Coordinator service's handlers under fuzzing, and the rendezvous store's upkeep.

Every request, however malformed, is either answered or refused with
INVALID_ARGUMENT / FAILED_PRECONDITION, and a legitimate member keeps
being served afterwards."""

import datetime
import threading
import time

import grpc
import pytest
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paramserver.control.membership import Membership
from paramserver.control.protocol import pb
from paramserver._torch_compat import RPC_STORE_PREFIX
from paramserver.control.rendezvous import RendezvousStore
from paramserver.control.service import CoordinatorService, ServiceSettings
from paramserver.control.validation import RequestError

METHODS = ["Join", "Heartbeat", "Leave", "Status", "Checkpoint", "Shutdown"]
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}


def make_service():
    shutdowns = []
    service = CoordinatorService(
        Membership(datetime.timedelta(seconds=5)),
        ServiceSettings(store=pb.StoreAddress(host="127.0.0.1", port=1), job=pb.JobSpec(name="j", code=b"x"),
                        heartbeat_interval=datetime.timedelta(seconds=1),
                        heartbeat_timeout=datetime.timedelta(seconds=5)),
        request_shutdown=shutdowns.append)
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


def test_rendezvous_store_removes_a_lost_member_and_frees_its_token():
    store = RendezvousStore("127.0.0.1")
    try:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=5))
        rpc_store = dist.PrefixStore(RPC_STORE_PREFIX, client)
        names = dist.PrefixStore("names", rpc_store)
        names.set("_ALL_WORKER_INFOS", "shard0-1,worker0-2,worker1-3,")
        # worker0 died while joining, holding the group's token.
        rpc_store.set("RpcGroupManagementToken", "Token_for_worker0_join")
        assert store.remove_rpc_peer("worker0", 2, takeover_after=datetime.timedelta(seconds=0.3))
        assert names.get("_ALL_WORKER_INFOS") == b"shard0-1,worker1-3,"
        assert rpc_store.get("RpcGroupManagementToken") == b""
        assert rpc_store.get("Token_for_worker0_join") == b"Done"  # whoever waited on it goes on
        assert not store.remove_rpc_peer("worker0", 2)

        # Another member is joining: its token is waited for, never taken.
        rpc_store.set("RpcGroupManagementToken", "Token_for_worker2_join")
        release = threading.Timer(0.5, lambda: rpc_store.set("RpcGroupManagementToken", ""))
        release.start()
        began = time.monotonic()
        assert store.remove_rpc_peer("worker1", 3, takeover_after=datetime.timedelta(seconds=0.1))
        assert time.monotonic() - began >= 0.4
        assert names.get("_ALL_WORKER_INFOS") == b"shard0-1,"
        release.join()
    finally:
        store.close()
