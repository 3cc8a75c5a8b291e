"""The coordinator on a real gRPC port (in this process, no shards): the standard
health client, reflection, token auth, the shard credential, a flood of refused
calls logged as a count, TLS, bad bytes on the wire, failure detection."""

import datetime
import logging
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from commands import self_signed_certificate
from paramserver.control import CoordinatorClient, CoordinatorServer, CoordinatorSettings, NotAuthenticated, TlsFiles
from paramserver.control.client import CoordinatorError, CoordinatorUnavailable
from paramserver.control.protocol import SERVICE_NAME, pb

TOKEN = "s3cret-token"


@pytest.fixture
def start():
    servers = []

    def start_server(**settings):
        settings.setdefault("port", 0)
        server = CoordinatorServer(CoordinatorSettings(**settings), request_shutdown=lambda reason: None).start()
        servers.append(server)
        return server

    yield start_server
    for server in servers:
        server.stop(datetime.timedelta(seconds=0))


def health_of(channel, service=""):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_answers_serving_once_ready_and_reflection_lists_services(start):
    server = start()
    with grpc.insecure_channel(server.address) as channel:
        assert health_of(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        server.mark_ready()
        assert health_of(channel) == health_pb2.HealthCheckResponse.SERVING
        assert health_of(channel, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
        responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_token_is_required_except_for_health(start):
    server = start(token=TOKEN)
    server.mark_ready()
    for token in (None, "wrong"):
        with pytest.raises(NotAuthenticated, match="wrong or missing token"):
            CoordinatorClient(server.address, token=token).status()
    with grpc.insecure_channel(server.address) as channel:
        assert health_of(channel) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as error:
            list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    client = CoordinatorClient(server.address, token=TOKEN)
    assert client.status().generation == 0


def test_a_token_holder_cannot_join_as_a_shard_but_the_servers_own_shards_can(start):
    server = start(token=TOKEN)  # no shard credential given: one is made for this run
    assert server.shard_credential is not None and server.shard_credential.made_for_this_run
    client = CoordinatorClient(server.address, token=TOKEN)
    with pytest.raises(CoordinatorError) as refused:
        client.join(pb.ROLE_SHARD, "shard9", "127.0.0.1")
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "refused Join: PERMISSION_DENIED: shard shard9: this coordinator admits only" in str(refused.value)
    assert client.join(pb.ROLE_WORKER, "w", "127.0.0.1").rpc_name == "worker0"
    own = CoordinatorClient(server.address, token=TOKEN, shard_token=server.shard_credential.secret)
    assert own.join(pb.ROLE_SHARD, "shard0", "127.0.0.1").rpc_name == "shard0"
    # The shard credential goes with a Join as a shard only, and replaces no cluster token.
    with pytest.raises(NotAuthenticated):
        CoordinatorClient(server.address, shard_token=server.shard_credential.secret).status()
    assert [s.name for s in client.status().shards] == ["shard0"]


def test_a_flood_of_refused_calls_is_logged_as_a_count_not_a_line_each(start, caplog):
    server = start(token=TOKEN)
    caplog.set_level(logging.INFO, logger="paramserver.control")
    with grpc.insecure_channel(server.address) as channel:
        no_token = channel.unary_unary(f"/{SERVICE_NAME}/Status")
        garbage = channel.unary_unary(f"/{SERVICE_NAME}/Join")
        for _ in range(50):
            with pytest.raises(grpc.RpcError):
                no_token(b"", timeout=5)
        for _ in range(300):
            with pytest.raises(grpc.RpcError):
                garbage(b"\xff\xfe", timeout=5, metadata=[("authorization", "Bearer " + TOKEN)])
    server.refusals.flush()  # what stop() does; the 10 s interval has not ended yet
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    assert lines[0].startswith("refused Status from ipv4:127.0.0.1:") and "called without a token" in lines[0]
    summaries = [re.match(r"refused ([\d,]+) calls in the last [\d.e+-]+ s: (.*); latest: ", line)
                 for line in lines[1:]]
    assert all(summaries), lines
    # One line per 10 s interval (a loaded machine may have crossed one), and every refusal counted.
    assert len(lines) <= 3, lines
    counted = {}
    for summary in summaries:
        for kind, count in re.findall(r"([A-Z_]+) ([\d,]+)", summary.group(2)):
            counted[kind] = counted.get(kind, 0) + int(count.replace(",", ""))
    assert counted == {"UNAUTHENTICATED": 49, "INVALID_ARGUMENT": 300}, lines


def test_garbage_on_the_wire_gets_invalid_argument_and_others_are_still_served(start):
    server = start()
    client = CoordinatorClient(server.address)
    member = client.join(pb.ROLE_WORKER, "w", "127.0.0.1")
    with grpc.insecure_channel(server.address) as channel:
        for method, raw in (("Join", b"\xff\xfe\xfd"), ("Heartbeat", b"\x0a\x05ab"),
                            ("Join", pb.JoinRequest(role=pb.ROLE_WORKER, name="a b", host="h").SerializeToString()),
                            ("Heartbeat", b"\x12" + b"\x01" * 64)):
            call = channel.unary_unary(f"/{SERVICE_NAME}/{method}")
            with pytest.raises(grpc.RpcError) as error:
                call(raw, timeout=5)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, error.value.details())
            assert error.value.details()
        # A message far above any field limit (but under the transport's).
        big = pb.HeartbeatRequest(member_id=member.member_id, sequence=1, metrics={f"m{i}": 1.0 for i in range(5000)})
        with pytest.raises(grpc.RpcError) as error:
            channel.unary_unary(f"/{SERVICE_NAME}/Heartbeat")(big.SerializeToString(), timeout=5)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "5000 entries" in error.value.details()
    response = client.call("Heartbeat", pb.HeartbeatRequest(member_id=member.member_id, sequence=1, step=3))
    assert response.generation == 1
    with pytest.raises(CoordinatorError, match="FAILED_PRECONDITION.*out of order"):
        client.call("Heartbeat", pb.HeartbeatRequest(member_id=member.member_id, sequence=1))
    assert client.status().workers[0].step == 3


def test_silent_member_is_marked_dead_within_the_timeout(start):
    server = start(heartbeat_timeout=datetime.timedelta(seconds=1.5))
    client = CoordinatorClient(server.address)
    member = client.join(pb.ROLE_WORKER, "w", "127.0.0.1")
    joined = time.monotonic()
    while client.status().workers[0].alive:
        assert time.monotonic() - joined < 6.0, "not declared dead within the timeout (+ slack for a loaded machine)"
        time.sleep(0.05)
    assert time.monotonic() - joined >= 1.5
    status = client.status()
    assert status.workers[0].state == "dead" and status.generation == 2
    with pytest.raises(CoordinatorError, match="is dead"):
        client.call("Heartbeat", pb.HeartbeatRequest(member_id=member.member_id, sequence=1))
    assert client.join(pb.ROLE_WORKER, "w", "127.0.0.1").generation == 3  # rejoining: a new generation


def test_a_member_with_more_metrics_than_a_call_carries_sends_the_first_ones_and_says_which_were_left_out(
        start, caplog):
    server = start()
    client = CoordinatorClient(server.address)
    member = client.join(pb.ROLE_WORKER, "w", "127.0.0.1")
    metrics = {"auc": 0.84, "nan": float("nan"), **{f"figure{i:02d}": float(i) for i in range(70)}}
    with caplog.at_level(logging.WARNING, logger="paramserver.control.client"):
        client.leave(member.member_id, "job finished", 100, metrics)
        with pytest.raises(CoordinatorError, match="is left"):  # refused (it left), and told once all the same
            client.leave(member.member_id, "job finished", 100, metrics)
    assert client.status().workers[0].metrics == {"auc": 0.84, **{f"figure{i:02d}": float(i) for i in range(63)}}
    told = [record.getMessage() for record in caplog.records if "left out" in record.getMessage()]
    assert told == ["7 metrics left out of what goes to the coordinator (at most 64): " +
                    ", ".join(f"figure{i}" for i in range(63, 70))]


def test_unreachable_coordinator_is_retried_then_reported(start):
    from paramserver.processes import free_port
    client = CoordinatorClient(f"127.0.0.1:{free_port()}")
    began = time.monotonic()
    with pytest.raises(CoordinatorUnavailable, match="unreachable.*gave up after"):
        client.join(pb.ROLE_WORKER, "w", "127.0.0.1", retry_for=datetime.timedelta(seconds=1))
    assert time.monotonic() - began < 5


def test_workers_wait_for_a_starting_cluster_while_its_shards_join(start):
    """A server that starts shards holds workers back until it is ready, so that no worker places its tables
    on the shards that happen to serve already (a launcher starts server and workers at once)."""
    import threading
    server = start(hold_workers_until_ready=True)
    client = CoordinatorClient(server.address)
    with pytest.raises(CoordinatorUnavailable, match="its shards do not all serve yet; join again shortly"):
        client.join(pb.ROLE_WORKER, "w", "127.0.0.1", retry_for=datetime.timedelta(seconds=0.3))
    client.join(pb.ROLE_SHARD, "shard0", "127.0.0.1")  # shards are never held
    assert not client.status().workers
    ready = threading.Timer(0.5, server.mark_ready)
    ready.start()
    try:
        assignment = client.join(pb.ROLE_WORKER, "w", "127.0.0.1", retry_for=datetime.timedelta(seconds=10))
    finally:
        ready.join()
    assert assignment.rpc_name == "worker0"


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory):
    cert, key = self_signed_certificate(tmp_path_factory.mktemp("tls"))
    return TlsFiles(cert=str(cert), key=str(key), ca=str(cert))


def test_tls_client_works_and_plaintext_is_refused(start, self_signed):
    server = start(tls=self_signed, token=TOKEN)
    server.mark_ready()
    client = CoordinatorClient(server.address, token=TOKEN, tls=TlsFiles(ca=self_signed.ca))
    assert client.join(pb.ROLE_WORKER, "w", "127.0.0.1").rpc_name == "worker0"
    with grpc.secure_channel(server.address, TlsFiles(ca=self_signed.ca).channel_credentials()) as channel:
        assert health_of(channel) == health_pb2.HealthCheckResponse.SERVING
    plaintext = CoordinatorClient(server.address, token=TOKEN, call_timeout=datetime.timedelta(seconds=3))
    with pytest.raises(CoordinatorUnavailable):
        plaintext.status()
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as error:
            health_of(channel)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
