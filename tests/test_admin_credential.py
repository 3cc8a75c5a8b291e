"""Who may make which call: every credential against every call, on one coordinator on a real gRPC port (in
this process, no shards).  The cluster token admits Join as a worker, heartbeats and Status; a Join as a shard
also needs the shard token; Checkpoint, Shutdown and Export through the cluster also need the admin token
(``PERMISSION_DENIED`` otherwise, one log line naming the peer and the call, and nothing changes).  Without
an admin token configured, the cluster token suffices, as before, and the start warns."""

import argparse
import collections
import datetime
import logging
import re

import grpc
import pytest

from paramserver.cli import ctl
from paramserver.control import CoordinatorClient, CoordinatorServer, CoordinatorSettings
from paramserver.control.protocol import pb
from paramserver.control.security import ShardCredential

TOKEN, SHARD_TOKEN, ADMIN_TOKEN = "cluster-token-1", "shard-token-2", "admin-token-3"

#: Each credential as the client carries it.
CREDENTIALS = {
    "none": {},
    "worker": dict(token=TOKEN),
    "shard": dict(token=TOKEN, shard_token=SHARD_TOKEN),
    "admin": dict(token=TOKEN, admin_token=ADMIN_TOKEN),
    "admin alone": dict(admin_token=ADMIN_TOKEN),  # the admin token replaces no cluster token
    "wrong admin": dict(token=TOKEN, admin_token="not-the-admin-token"),
}
OK, UNAUTHENTICATED, DENIED = "OK", grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
#: FAILED_PRECONDITION: past every credential check, refused because this coordinator keeps no checkpoints.
NO_CHECKPOINTS = grpc.StatusCode.FAILED_PRECONDITION
CALLS = ["Join as worker", "Join as shard", "Heartbeat", "Status", "Checkpoint", "Export", "Shutdown"]
EXPECTED = {
    "none": [UNAUTHENTICATED] * 7,
    "worker": [OK, DENIED, OK, OK, DENIED, DENIED, DENIED],
    "shard": [OK, OK, OK, OK, DENIED, DENIED, DENIED],
    "admin": [OK, DENIED, OK, OK, NO_CHECKPOINTS, NO_CHECKPOINTS, OK],
    "admin alone": [UNAUTHENTICATED] * 7,
    "wrong admin": [OK, DENIED, OK, OK, DENIED, DENIED, DENIED],
}


@pytest.fixture(scope="module")
def coordinator():
    shutdowns = []
    server = CoordinatorServer(CoordinatorSettings(port=0, token=TOKEN, shard_credential=ShardCredential(SHARD_TOKEN),
                                                   admin_token=ADMIN_TOKEN),
                               request_shutdown=shutdowns.append).start()
    yield server, shutdowns
    server.stop(datetime.timedelta(seconds=0))


def outcome(call):
    try:
        call()
    except grpc.RpcError as error:  # never: the client turns them into CoordinatorError
        raise AssertionError(error)
    except Exception as error:  # noqa: BLE001 - CoordinatorError, with the status code
        code = getattr(error, "code", None)
        assert code is not None, repr(error)
        return code
    return OK


def export_through(client):
    """What ``ps-ctl export DIR`` does through the cluster, with ``client``'s credentials (never reaching DIR)."""
    from paramserver.checkpoint.export import export_from_cluster
    return export_from_cluster(client, "/nonexistent/export", datetime.timedelta(seconds=5))


def calls(client, name):
    """Each call of ``CALLS`` made by ``client``, as a thunk."""
    joined = {}

    def join_worker():
        joined["worker"] = client.join(pb.ROLE_WORKER, name, "127.0.0.1", retry_for=datetime.timedelta(seconds=1))

    def heartbeat():
        member_id = joined["worker"].member_id if "worker" in joined else "0" * 16
        client.call("Heartbeat", pb.HeartbeatRequest(member_id=member_id, sequence=1))

    return [join_worker,
            lambda: client.join(pb.ROLE_SHARD, f"{name}s", "127.0.0.1", retry_for=datetime.timedelta(seconds=1)),
            heartbeat, client.status, lambda: client.checkpoint(5), lambda: export_through(client),
            lambda: client.shutdown("a test")]


@pytest.mark.timeout(60)
def test_every_call_with_every_credential(coordinator, caplog):
    server, shutdowns = coordinator
    caplog.set_level(logging.INFO, logger="paramserver.control")
    seen = {}
    for number, (credential, carried) in enumerate(CREDENTIALS.items()):
        before = len(shutdowns)
        client = CoordinatorClient(server.address, **carried)
        try:
            seen[credential] = [outcome(call) for call in calls(client, f"m{number}")]
        finally:
            client.close()
        assert len(shutdowns) == before + (credential == "admin"), credential
    assert seen == EXPECTED
    assert shutdowns == ["a test"]  # the admin's, alone
    server.refusals.flush()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused")]
    # The first refusal in full, then a line per 10 s interval counting them by code and naming the latest.
    assert lines[0].startswith("refused Join from ipv4:127.0.0.1:") and "UNAUTHENTICATED" in lines[0], lines
    assert len(lines) <= 4, lines
    counted = collections.Counter()
    for line in lines[1:]:
        summary = re.match(r"refused [\d,]+ calls in the last [\d.e+-]+ s: (.*?); latest: ", line)
        assert summary, line
        counted.update({kind: int(count) for kind, count in re.findall(r"([A-Z_]+) (\d+)", summary.group(1))})
    assert counted == {"UNAUTHENTICATED": 13, "PERMISSION_DENIED": 12, "FAILED_PRECONDITION": 2}, lines
    assert re.search(r"latest: refused Shutdown from ipv4:127\.0\.0\.1:\d+: PERMISSION_DENIED: Shutdown carries an "
                     r"admin token that is not this cluster's", lines[-1]), lines


@pytest.mark.timeout(60)
def test_ps_ctl_exits_2_without_the_admin_token_and_0_with_it(coordinator, tmp_path, capsys, monkeypatch):
    server, shutdowns = coordinator
    monkeypatch.setattr(ctl, "setup_logging", lambda *_: None)  # the process's logging is pytest's, not ps-ctl's
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "admin").write_text(ADMIN_TOKEN + "\n")
    base = ["--connect", server.address, "--token-file", str(tmp_path / "token")]
    before = len(shutdowns)
    assert ctl.main(base + ["shutdown"]) == 2
    assert "PERMISSION_DENIED: Shutdown changes the cluster's state" in capsys.readouterr().err
    assert ctl.main(base + ["checkpoint", "--timeout", "5"]) == 2
    assert ctl.main(base + ["export", str(tmp_path / "out")]) == 2
    assert ctl.main(base + ["status"]) == 0
    assert len(shutdowns) == before
    assert ctl.main(["--connect", server.address, "shutdown"]) == 2  # no token at all: refused the same way
    assert "wrong or missing token" in capsys.readouterr().err
    assert ctl.main(base + ["--admin-token-file", str(tmp_path / "admin"), "shutdown"]) == 0
    assert len(shutdowns) == before + 1


def test_without_an_admin_token_the_cluster_token_may_stop_the_cluster_and_the_start_warns(caplog):
    caplog.set_level(logging.WARNING, logger="paramserver.control")
    shutdowns = []
    server = CoordinatorServer(CoordinatorSettings(port=0, token=TOKEN), request_shutdown=shutdowns.append).start()
    try:
        assert any("has a token but no admin token" in r.getMessage() for r in caplog.records)
        client = CoordinatorClient(server.address, token=TOKEN)
        client.shutdown("as before")
        client.close()
        assert shutdowns == ["as before"]
    finally:
        server.stop(datetime.timedelta(seconds=0))


@pytest.mark.parametrize("settings, message", [
    (dict(token=TOKEN, admin_token=TOKEN), "the admin token is the cluster token"),
    (dict(shard_credential=ShardCredential(SHARD_TOKEN), admin_token=SHARD_TOKEN), "the admin token is the shard"),
])
def test_the_admin_token_is_a_secret_of_its_own(settings, message):
    with pytest.raises(ValueError, match=message):
        CoordinatorSettings(**settings)


def test_ps_server_reads_the_admin_token_file_and_refuses_it_with_join(tmp_path):
    from paramserver.cli import server as server_command
    from paramserver.cli.common import UsageError
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "admin").write_text(ADMIN_TOKEN)
    parser = argparse.ArgumentParser()
    server_command.add_arguments(parser)
    options = server_command.options_from(parser.parse_args(
        ["--shards", "0", "--token-file", str(tmp_path / "token"), "--admin-token-file", str(tmp_path / "admin")]))
    assert options.coordinator.admin_token == ADMIN_TOKEN
    assert ADMIN_TOKEN not in repr(options.coordinator)
    with pytest.raises(UsageError, match="--admin-token-file holds the same token as --token-file"):
        server_command.options_from(parser.parse_args(
            ["--token-file", str(tmp_path / "token"), "--admin-token-file", str(tmp_path / "token")]))
    with pytest.raises(UsageError, match="--join runs no coordinator: --admin-token-file belongs"):
        server_command.shard_host_options_from(parser.parse_args(
            ["--join", "127.0.0.1:1", "--admin-token-file", str(tmp_path / "admin")]))
