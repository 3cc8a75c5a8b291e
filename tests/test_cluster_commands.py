"""End to end on loopback with the real commands: ps-server --shards 4, two
ps-worker processes running the shipped job, ps-ctl status/shutdown, the
standard health client, token refusals, a killed worker declared dead, a
Python driver through paramserver.connect, and SIGTERM leaving no process
behind."""

import datetime
import os
import re
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from commands import (errors, job_config, listening_addresses, output, pid_exists, self_signed_certificate,
                      start_server, status, terminate_within, wait_for_status)
from drivers import train_an_embedding_through_connect
from paramserver.logs import CPP_LOG_LEVEL_ENV
from paramserver.processes import Child, free_port, run_children

pytestmark = pytest.mark.timeout(180)


def test_cluster_forms_runs_two_workers_and_stops_on_sigterm(commands, tmp_path, monkeypatch):
    monkeypatch.setenv(CPP_LOG_LEVEL_ENV, "WARNING")  # torch's C++ warnings shown: the shutdown must cause none
    token_file = tmp_path / "token"
    token_file.write_text("cluster-token-123\n")
    (tmp_path / "wrong").write_text("not-it\n")
    auth = ("--token-file", str(token_file))
    server, address = start_server(commands, "--shards", "4", *auth, "--job", "workers.regression:main",
                                   "--job-config", job_config(steps=60))

    with grpc.insecure_channel(address) as channel:  # the standard health client needs no token
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    before = status(commands, address, *auth)
    assert [(s["name"], s["alive"]) for s in before["shards"]] == [(f"shard{i}", True) for i in range(4)]
    assert before["generation"] == 4 and before["workers"] == []
    # The coordinator, its store and the shards' data plane listen on the given host only.
    assert listening_addresses([server.pid] + [s["pid"] for s in before["shards"]]) == {"127.0.0.1"}

    checkpoint = commands.run("ps-ctl", "--connect", address, *auth, "checkpoint")
    assert checkpoint.returncode == 1 and "FAILED_PRECONDITION" in checkpoint.stderr
    assert "no checkpoint directory" in checkpoint.stderr
    refused = commands.run("ps-ctl", "--connect", address, "status")
    # A missing or wrong token ends ps-ctl and ps-worker alike: exit 2, refused (docs/cluster.md, exit codes).
    assert refused.returncode == 2 and "wrong or missing token" in refused.stderr, refused.stderr
    wrong = commands.run("ps-worker", "--connect", address, "--token-file", str(tmp_path / "wrong"))
    assert wrong.returncode == 2 and "wrong or missing token" in wrong.stdout

    workers = [commands.start("ps-worker", "--connect", address, *auth) for _ in range(2)]
    for worker in workers:
        assert worker.wait(120) == 0, errors(worker)[-3000:]
        assert "finished workers.regression:main at step 60" in output(worker)
    after = status(commands, address, *auth)
    assert sorted((w["name"], w["state"], w["step"]) for w in after["workers"]) == [
        ("worker0", "left", 60), ("worker1", "left", 60)]
    for worker in after["workers"]:
        assert worker["metrics"]["loss"] < worker["metrics"]["first_loss"] / 4, worker["metrics"]
    assert after["generation"] == 8  # 4 shards + 2 joins + 2 leaves

    shard_pids = [s["pid"] for s in after["shards"]]
    assert terminate_within(server, 10) < 10
    assert not [pid for pid in shard_pids if pid_exists(pid)]
    # The shards left the data plane together: none logged the others' closing pipes.
    assert shutdown_warnings(errors(server)) == []


#: TensorPipe's C++ warnings about a peer's pipe (torch's tensorpipe_agent.cpp), as they appear in a log.
TENSORPIPE_WARNING = re.compile(r"tensorpipe|pipe closed|EOF", re.IGNORECASE)


def shutdown_warnings(log: str) -> list:
    """TensorPipe's warnings in a ps-server's log from its shutdown on (with ``TORCH_CPP_LOG_LEVEL=WARNING``).
    Those before it are each worker's leave, which torch makes every shard log (``EOF``) while it serves on
    (docs/cluster.md: why the commands leave C++ warnings out by default)."""
    _, marker, shutdown = log.partition("shutting down:")
    assert marker, log[-3000:]
    return [line for line in shutdown.splitlines() if TENSORPIPE_WARNING.search(line)]


def test_killed_worker_is_declared_dead_and_the_cluster_goes_on(commands):
    # 3 s, not the default 5: quick, yet no false deaths with 5 busy processes on 2 cores.
    server, address = start_server(commands, "--shards", "2", "--heartbeat-timeout", "3",
                                   "--job", "workers.regression:main", "--job-config", job_config(steps=1_000_000))
    doomed = commands.start("ps-worker", "--connect", address)
    wait_for_status(commands, address, lambda s: s["workers"] and s["workers"][0]["step"] > 0, 60)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)
    dead = wait_for_status(commands, address, lambda s: s["workers"][0]["state"] == "dead", 15)
    # Declared dead once silent for the 3 s timeout (the coordinator checks every 0.2 s).
    silence = float(re.fullmatch(r"no heartbeat for ([0-9.]+) s", dead["workers"][0]["reason"]).group(1))
    assert 3.0 <= silence < 3.0 + 1.0, dead["workers"][0]
    assert dead["generation"] == 4  # 2 shards, the worker's join, its death
    # A killed member's end is still printed (the commands leave torch's C++ warnings out, not their own).
    assert re.search(r" WARNING .*lost: worker worker0 .* is dead \(no heartbeat for", errors(server)), \
        errors(server)[-3000:]

    # The data plane healed: new workers join (they would stall on the dead one otherwise) and train.
    survivors = [commands.start("ps-worker", "--connect", address) for _ in range(2)]
    wait_for_status(commands, address,
                    lambda s: len(s["workers"]) == 3 and all(w["alive"] and w["step"] > 0 for w in s["workers"][1:]),
                    60)
    # SIGTERM on a worker stops its job and it leaves cleanly; the shutdown command stops the other.
    assert terminate_within(survivors[0], 10) < 10
    shutdown = commands.run("ps-ctl", "--connect", address, "shutdown")
    assert shutdown.returncode == 0, shutdown.stderr
    assert survivors[1].wait(10) == 0, errors(survivors[1])[-3000:]
    assert server.wait(10) == 0, errors(server)[-3000:]
    for survivor in survivors:
        assert re.search(r"finished workers.regression:main at step [1-9]", output(survivor)), output(survivor)


def test_unreachable_server_is_retried_then_reported(commands):
    began = time.monotonic()
    result = commands.run("ps-worker", "--connect", f"127.0.0.1:{free_port()}", "--retry-for", "1")
    assert result.returncode == 1
    assert "unreachable" in result.stdout and "gave up after" in result.stdout
    assert len(result.stdout.strip().splitlines()) == 1
    assert time.monotonic() - began < 30


def test_python_driver_connects_places_parameters_and_trains(commands, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("driver-token\n")
    server, address = start_server(commands, "--shards", "2", "--token-file", str(token_file))
    run_children([Child("driver", train_an_embedding_through_connect, (address, "driver-token"))],
                 datetime.timedelta(seconds=90))
    clients = status(commands, address, "--token-file", str(token_file))["clients"]
    assert [(c["name"], c["state"]) for c in clients] == [("client0", "left")]
    terminate_within(server, 10)


def test_tls_server_serves_tls_clients_only(commands, tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    # The shard processes reach the coordinator over TLS too, or the server never gets ready.
    server, address = start_server(commands, "--shards", "1", "--tls-cert", str(cert), "--tls-key", str(key))
    shards = status(commands, address, "--tls-ca", str(cert))["shards"]
    assert [(s["name"], s["alive"]) for s in shards] == [("shard0", True)]
    plaintext = commands.run("ps-ctl", "--connect", address, "status")
    assert plaintext.returncode == 1 and "unreachable" in plaintext.stderr
    terminate_within(server, 10)


def test_an_exiting_shard_process_is_noticed_at_once(commands):
    server, address = start_server(commands, "--shards", "2", "--heartbeat-timeout", "30")
    shard1 = next(s for s in status(commands, address)["shards"] if s["name"] == "shard1")
    os.kill(shard1["pid"], signal.SIGKILL)
    # The supervisor sees the process end (the reason says so), not the 30 s heartbeat timeout.
    after = wait_for_status(commands, address, lambda s: not s["shards"][1]["alive"], 10)
    assert after["shards"][1]["state"] == "exited"
    assert after["shards"][1]["reason"] == "process exited with code -9"
    assert after["shards"][0]["alive"] and after["generation"] == 3
    assert "shard process shard1" in errors(server) and "exited with code -9" in errors(server)
    terminate_within(server, 10)
