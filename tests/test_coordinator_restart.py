"""A coordinator lost and started again takes its running cluster back (``ps-server --state-dir``), through the
real commands on loopback, with a Trainer job (``tests/jobs/watch_next.py``):

1. 2 shards (a shard host, ``ps-server --join``) and 3 workers; the coordinator is SIGKILLed mid-training and
   started again 5 s later with the same flags: no worker or shard exits or restarts, every member re-attaches
   within 5 s of the new coordinator listening, ``ps-ctl status`` lists each with its step, a checkpoint asked
   after the return commits; then a shard SIGKILLed heals and a fourth worker joins, through the new store (the
   data plane's rendezvous rebuilt), and every worker finishes every step (those there from the start: each
   counted once, no --restore); the time each heal takes is printed (``benchmarks/coordinator_restart.py``
   prints it with no restart beside it);
2. a heartbeat under another member's id without its credential is refused with PERMISSION_DENIED;
3. ps-server's own shards outlive it and are taken back (SIGKILL, then SIGTERM); a worker killed during the outage
   is declared dead on the return; a shard taken back and then lost is started again and reached; a worker
   whose job fails at start is left behind by its group at once.

A coordinator that never comes back is ``tests/test_fault_bounds.py``'s.
"""

import os
import re
import signal
import socket
import time

import pytest

from commands import errors, job_config, output, pid_exists, status, wait_for_output, wait_for_status

pytestmark = pytest.mark.timeout(300)

HEARTBEAT_TIMEOUT_S = 3
GRACE_S = 40
OUTAGE_S = 5
#: Every member re-attached within this of the new coordinator listening.
REATTACH_WITHIN_S = 5
JOB = f"{os.path.dirname(__file__)}/jobs/watch_next.py:main"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _figures(line: str) -> dict:
    return {key: float(value) for key, value in re.findall(r"(\w+)=([-\d.e+]+)", line)}


def _server(commands, port, state_dir, checkpoints, steps):
    return commands.start("ps-server", "--shards", "0", "--port", str(port), "--state-dir", str(state_dir),
                          "--checkpoint-dir", str(checkpoints), "--group-size", "4", "--group-settle", "1",
                          "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--coordinator-grace", str(GRACE_S),
                          "--job", JOB, "--job-config", job_config(steps=steps, log_every=5, eval_every=100_000))


def _workers_past(status: dict, step: int, count: int) -> bool:
    workers = [w for w in status["workers"] if w["alive"]]
    return len(workers) == count and all(w["step"] > step for w in workers)


def _shard_lost_and_healed(commands, address: str, index: int, workers: int) -> float:
    """SIGKILL the process of the ``index``-th live shard (by name); seconds until it serves again (another
    process under its name) and every worker trained 10 steps past where they were."""
    state = status(commands, address)
    shard = sorted((s for s in state["shards"] if s["alive"]), key=lambda s: s["name"])[index]
    name = shard["name"]
    step = max(w["step"] for w in state["workers"])
    os.kill(shard["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for_status(commands, address, lambda s: any(
        x["name"] == name and x["alive"] and x["pid"] != shard["pid"] for x in s["shards"]) and _workers_past(
        s, step + 10, workers), 120)
    return time.monotonic() - killed_at


def _worker_joined_and_training(commands, address: str, workers: list) -> float:
    """A worker started now; seconds until it trains in the group with the others (every live worker 10 steps
    past where it was when the newcomer appeared)."""
    started_at = time.monotonic()
    workers.append(commands.start("ps-worker", "--connect", address, "--coordinator-grace", str(GRACE_S)))
    joined = wait_for_status(commands, address, lambda s: len(s["workers"]) == len(workers) and all(
        w["step"] > 0 for w in s["workers"]), 120)
    wait_for_status(commands, address, lambda s: _workers_past(s, max(w["step"] for w in joined["workers"]) + 10,
                                                               len(workers)), 120)
    return time.monotonic() - started_at


def test_a_restarted_coordinator_takes_the_running_cluster_back_with_no_step_lost(commands, tmp_path):
    """Also: after the restart, a shard's process SIGKILLed is restarted by its host and a worker joining trains
    with the others (the data plane's member list and addresses are rebuilt in the new store): the time each
    takes to heal is printed."""
    port = _free_port()
    address = f"127.0.0.1:{port}"
    state_dir, checkpoints = tmp_path / "state", tmp_path / "checkpoints"
    steps = 100_000  # more than it trains: the test ends it (ps-ctl shutdown) once every phase is done
    server = _server(commands, port, state_dir, checkpoints, steps)
    wait_for_output(server, r"ps-server ready at", 90)
    shard_host = commands.start("ps-server", "--join", address, "--shards", "2", "--coordinator-grace", str(GRACE_S))
    wait_for_output(shard_host, r"ps-server joined", 90)
    workers = [commands.start("ps-worker", "--connect", address, "--coordinator-grace", str(GRACE_S))
               for _ in range(3)]
    before = wait_for_status(commands, address, lambda s: _workers_past(s, 20, 3), 180)
    members = {m["name"]: m["pid"] for m in before["workers"] + before["shards"]}

    os.kill(server.pid, signal.SIGKILL)
    server.wait(10)
    killed_at = time.monotonic()
    time.sleep(OUTAGE_S)
    assert all(w.poll() is None for w in workers) and shard_host.poll() is None
    server = _server(commands, port, state_dir, checkpoints, steps)
    wait_for_output(server, r"ps-server ready at", 60)
    listening_at = time.monotonic()
    back = wait_for_status(commands, address, lambda s: all(
        m["alive"] and not m["reason"] and m["seconds_since_heartbeat"] < 1.5 for m in s["workers"] + s["shards"]) and all(
        w["step"] > 0 for w in s["workers"]), 30)
    reattached = time.monotonic() - listening_at
    print(f"every member re-attached {reattached:.1f} s after the new coordinator listened "
          f"({time.monotonic() - killed_at:.1f} s after the SIGKILL)")
    assert reattached < REATTACH_WITHIN_S + 1.0  # +the status poll's period
    assert {m["name"]: m["pid"] for m in back["workers"] + back["shards"]} == members, back
    assert all(m["state"] == "alive" for m in back["workers"] + back["shards"]), back
    log = errors(server)
    assert log.count("re-attached:") == 5, log[-3000:]
    assert "took back 5 members from the journal" in log, log[-3000:]

    written = commands.run("ps-ctl", "--connect", address, "checkpoint", "--timeout", "60")
    assert written.returncode == 0, written.stderr
    assert "ckpt-" in written.stdout

    # After the restart: a shard lost (it joins the data plane through the new store), then a worker joining.
    healed = {"shard, after a restart": _shard_lost_and_healed(commands, address, 0, 3),
              "worker join, after a restart": _worker_joined_and_training(commands, address, workers)}
    print("healed in: " + ", ".join(f"{what} {seconds:.1f} s" for what, seconds in healed.items()))

    commands.run("ps-ctl", "--connect", address, "shutdown")  # the whole group stops at one step, cleanly
    for number, worker in enumerate(workers):
        assert worker.wait(60) == 0, errors(worker)[-3000:]
        line = output(worker).strip().splitlines()[-1]
        figures = _figures(line)
        assert figures["steps"] > 0 and figures["sparse_steps"] > 0, line
        if number < 3:  # there from the start: each step counted once (applied, lost with a shard, or skipped)
            assert figures["sparse_steps"] + figures["sparse_steps_lost"] + figures["steps_skipped"] == \
                figures["steps"] - figures.get("start_step", 0), line
    assert all("outage lasted" in errors(worker) for worker in workers[:3])
    assert server.wait(30) == 0, errors(server)[-3000:]
    assert shard_host.wait(30) == 0, errors(shard_host)[-3000:]


def test_a_re_attach_without_the_members_credential_is_refused_and_with_it_taken_back(tmp_path, caplog):
    """Also: the RPC group's live members and their addresses come back into the new store from the journal (a
    member gone meanwhile left out); a journal without them refuses every Join at once, saying what to do."""
    import json

    import torch.distributed as dist

    from paramserver import _torch_compat as compat
    from paramserver.control import (CoordinatorClient, CoordinatorError, CoordinatorServer, CoordinatorSettings,
                                     NotPermitted, pb)

    def server(port):
        return CoordinatorServer(CoordinatorSettings(host="127.0.0.1", port=port, state_dir=str(tmp_path)),
                                 request_shutdown=lambda reason: None).start()

    first = server(0)
    client = CoordinatorClient(first.address)
    try:
        shard = client.join(pb.ROLE_SHARD, "shard0", "127.0.0.1")
        worker = client.join(pb.ROLE_WORKER, "host", "127.0.0.1")
        assert shard.credential and worker.credential and shard.credential != worker.credential
        client.call("Heartbeat", pb.HeartbeatRequest(member_id=worker.member_id, sequence=1, step=7,
                                                      credential=worker.credential))
        generation = first.membership.generation
        group = [("shard0", shard.rpc_rank, "uv://127.0.0.1:1001"), ("worker0", worker.rpc_rank, "uv://127.0.0.1:1002"),
                 ("client0", 9, "uv://127.0.0.1:1003")]  # (an RPC member the coordinator does not know: left out)
        for entry in group:  # as each member's agent writes itself when it joins the data plane
            compat.publish_rpc_member(dist.PrefixStore(compat.RPC_STORE_PREFIX, first.store.store), *entry)
        time.sleep(0.3)  # the journal is written within 0.1 s of a change
        first.stop()  # lost (its journal stays)
        second = server(first.port)
        try:
            assert second.store.rpc_group() == group[:2]
            assert second.membership.generation > generation
            assert {m.rpc_name for m in second.membership.unattached()} == {"shard0", "worker0"}
            forged = [pb.HeartbeatRequest(member_id=worker.member_id, sequence=2),  # no credential
                      pb.HeartbeatRequest(member_id=worker.member_id, sequence=2, credential=shard.credential)]
            for request in forged:
                with pytest.raises(NotPermitted, match="PERMISSION_DENIED: re-attach as worker0 refused"):
                    client.call("Heartbeat", request)
            assert {m.rpc_name for m in second.membership.unattached()} == {"shard0", "worker0"}
            answer = client.call("Heartbeat", pb.HeartbeatRequest(member_id=worker.member_id, sequence=2, step=8,
                                                                   credential=worker.credential))
            assert answer.generation == second.membership.generation
            assert {m.rpc_name for m in second.membership.unattached()} == {"shard0"}
            again = client.join(pb.ROLE_WORKER, "host", "127.0.0.1")
            assert again.rpc_name == "worker1" and again.rpc_rank == 3  # numbering continues
        finally:
            second.stop()
        journal = tmp_path / "coordinator.json"
        state = json.loads(journal.read_text())
        del state["rpc_group"]  # as an older version wrote it
        journal.write_text(json.dumps(state))
        third = server(first.port)
        try:
            with pytest.raises(CoordinatorError, match=r"FAILED_PRECONDITION: host cannot join: the journal .* holds "
                                                       r"no RPC group.*ps-ctl shutdown.*ps-server --restore"):
                client.join(pb.ROLE_WORKER, "host", "127.0.0.1")
        finally:
            third.stop()
    finally:
        client.close()


def test_a_lost_ps_server_s_shards_are_taken_back_a_worker_lost_meanwhile_is_declared_dead_and_joins_heal(
        commands, tmp_path):
    """ps-server with shards of its own is SIGKILLed, then SIGTERMed (with a journal: the coordinator alone ends),
    and started again each time:

    1. its shards serve on and are taken back each time, never started again;
    2. a worker SIGKILLed while the coordinator is out is declared dead within the heartbeat timeout of its
       return, and its group re-forms through the store that came back (reached by ``--store-name``);
    3. a shard taken back and then SIGKILLed is started again by the new coordinator, joins the data plane
       through the new store, and the worker trains on with it;
    4. a worker joining whose job fails at start: the survivor gives up waiting for it as soon as it left (not at
       the group rendezvous's timeout, 60 s), naming it, and trains on alone.
    """
    port = _free_port()
    address = f"127.0.0.1:{port}"
    flags = ["--shards", "2", "--port", str(port), "--state-dir", str(tmp_path / "state"), "--store-name", "localhost",
             "--checkpoint-dir", str(tmp_path / "checkpoints"), "--group-size", "2", "--group-settle", "1",
             "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--coordinator-grace", str(GRACE_S), "--job", JOB,
             "--job-config", job_config(steps=100_000, log_every=5, eval_every=100_000, fail_at_start_worker=2)]
    server = commands.start("ps-server", *flags)
    wait_for_output(server, r"ps-server ready at", 90)
    workers = [commands.start("ps-worker", "--connect", address, "--coordinator-grace", str(GRACE_S))
               for _ in range(2)]
    before = wait_for_status(commands, address, lambda s: len(s["workers"]) == 2 and all(
        w["step"] >= 10 for w in s["workers"]), 120)
    by_name = {w["name"]: next(p for p in workers if p.pid == w["pid"]) for w in before["workers"]}
    shards = {s["name"]: s["pid"] for s in before["shards"]}
    os.kill(server.pid, signal.SIGKILL)
    server.wait(10)
    os.kill(by_name["worker1"].pid, signal.SIGKILL)  # lost while nobody watches
    time.sleep(2)
    assert all(pid_exists(pid) for pid in shards.values()) and by_name["worker0"].poll() is None
    server = commands.start("ps-server", *flags)
    wait_for_output(server, r"ps-server ready at", 60)
    listening_at = time.monotonic()
    dead = wait_for_status(commands, address, lambda s: [w for w in s["workers"] if w["name"] == "worker1"][0][
        "state"] == "dead", HEARTBEAT_TIMEOUT_S + 3)
    print(f"worker1 declared dead {time.monotonic() - listening_at:.1f} s after the coordinator came back")
    step = [w for w in dead["workers"] if w["name"] == "worker0"][0]["step"]
    after = wait_for_status(commands, address, lambda s: s["groups"] and int(s["groups"][0]["generation"]) >= 2 and
                            [w for w in s["workers"] if w["name"] == "worker0"][0]["step"] >= step + 10 and all(
        m["alive"] and not m["reason"] and m["seconds_since_heartbeat"] < 1.5 for m in s["shards"]), 60)
    assert after["groups"][0]["members"] == ["worker0"], after["groups"]
    assert {s["name"]: s["pid"] for s in after["shards"]} == shards, after["shards"]  # the same processes, no others
    assert "took back shard0, shard1" in errors(server)

    print(f"shard0, taken back, healed {_shard_lost_and_healed(commands, address, 0, 1):.1f} s after its SIGKILL")
    shards = {s["name"]: s["pid"] for s in status(commands, address)["shards"] if s["alive"]}

    generation = int(status(commands, address)["groups"][0]["generation"])
    failing = commands.start("ps-worker", "--connect", address, "--coordinator-grace", str(GRACE_S))
    assert failing.wait(60) == 1, errors(failing)[-3000:]
    assert "fails at start" in output(failing), output(failing)
    failed_at = time.monotonic()
    alone = wait_for_status(commands, address, lambda s: int(s["groups"][0]["generation"]) >= generation + 2, 30)
    assert alone["groups"][0]["members"] == ["worker0"], alone["groups"]  # with worker2, then without it
    step = [w for w in alone["workers"] if w["name"] == "worker0"][0]["step"]
    wait_for_status(commands, address, lambda s: [w for w in s["workers"] if w["name"] == "worker0"][0][
        "step"] >= step + 10, HEARTBEAT_TIMEOUT_S + 20)  # not the rendezvous's 60 s
    print(f"worker0 trained on {time.monotonic() - failed_at:.1f} s after worker2's job failed at start")
    log = errors(by_name["worker0"])
    if re.search(r"forming trainer group 0 generation \d+ as rank 0 of 2 \(gloo\): worker0, worker2", log):
        # (else it left before worker0 came); worker0's reported step lags a heartbeat, so the line may follow
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT_S + 10
        while "without worker2 while it formed" not in log and time.monotonic() < deadline:
            time.sleep(0.2)
            log = errors(by_name["worker0"])
        assert "without worker2 while it formed" in log, log[-3000:]

    # SIGTERM (a pod moved by a node drain): with a journal, the coordinator alone ends; the cluster trains on.
    server.send_signal(signal.SIGTERM)
    assert server.wait(15) == 0, errors(server)[-3000:]
    time.sleep(1)
    assert all(pid_exists(pid) for pid in shards.values()) and by_name["worker0"].poll() is None
    server = commands.start("ps-server", *flags)
    wait_for_output(server, r"ps-server ready at", 60)
    wait_for_status(commands, address, lambda s: all(m["alive"] and not m["reason"] and m["seconds_since_heartbeat"]
                                                     < 1.5 for m in s["shards"] + [w for w in s["workers"] if
                                                                                  w["name"] == "worker0"]), 30)
    assert "took back shard0, shard1" in errors(server)
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert by_name["worker0"].wait(30) == 0, errors(by_name["worker0"])[-3000:]
    assert server.wait(30) == 0, errors(server)[-3000:]
    deadline = time.monotonic() + 10
    while any(pid_exists(pid) for pid in shards.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_exists(pid) for pid in shards.values())
