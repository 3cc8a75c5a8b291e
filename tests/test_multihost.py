"""Several hosts, made of network namespaces (``tests/netns.py``): the
coordinator on one (``ps-server --shards 0``), shard servers on a second
(``ps-server --join``), a worker on each of a third and a fourth.  The
default job trains across them and learns, also through losing one of the
joined host's shard processes (SIGKILL): that host restarts it, the
coordinator takes it in once it declared the old one dead, it serves the
newest checkpoint's rows, and the job completes.  Every member advertises
its own host's address (none gave ``--host``: each took the interface
facing the coordinator); a member advertising 127.0.0.1 from another host
is refused; the cluster's shutdown ends the shard host too.  Skipped, with
the reason, where namespaces cannot be made (not root, no ``ip``)."""

import os
import re
import signal
import time

import pytest

from commands import errors, job_config, output, start_server, status, wait_for_output, wait_for_status
from netns import NamespacesUnavailable, make_hosts
from test_trainer_group_commands import SMALL

pytestmark = pytest.mark.timeout(240)

STEPS = 160


@pytest.fixture
def hosts():
    try:
        made = make_hosts(4)
    except NamespacesUnavailable as reason:
        pytest.skip(f"cannot make network namespaces: {reason}")
    yield made
    made.remove()


def test_the_default_job_trains_across_four_hosts_and_survives_a_lost_remote_shard(commands, hosts, tmp_path):
    coordinator_ns, shard_ns, *worker_ns = hosts.names
    coordinator_ip, shard_ip, *worker_ips = hosts.addresses
    checkpoints = tmp_path / "checkpoints"  # one file system for every host, as a shared volume would be
    server, address = start_server(commands, "--host", coordinator_ip, "--shards", "0", "--group-size", "2",
                                   "--heartbeat-timeout", "4", "--checkpoint-dir", str(checkpoints),
                                   "--checkpoint-every", "20", "--job-config",
                                   job_config(**dict(SMALL, steps=STEPS, hook="allreduce", eval_every=STEPS)),
                                   netns=coordinator_ns)
    assert address.startswith(f"{coordinator_ip}:")
    shard_host = commands.start("ps-server", "--join", address, "--shards", "2", netns=shard_ns)
    joined = wait_for_output(shard_host, r"ps-server joined (\S+) with 2 shards on (\S+) \(([^;]+);", 120)
    assert joined.group(1) == address and joined.group(2) == shard_ip
    shard_names = joined.group(3).split(", ")
    assert shard_names == [f"shard_{shard_ip.replace('.', '_')}_0", f"shard_{shard_ip.replace('.', '_')}_1"]

    # Advertising loopback from another host is refused, naming the address it came from.
    refused = commands.run("ps-worker", "--connect", address, "--host", "127.0.0.1", netns=worker_ns[0], timeout=60)
    assert refused.returncode == 2, refused.stdout + refused.stderr[-2000:]
    assert f"reached the coordinator from {worker_ips[0]}" in refused.stdout, refused.stdout

    lost = next(s for s in status(commands, address, netns=coordinator_ns)["shards"] if s["name"] == shard_names[1])
    workers = [commands.start("ps-worker", "--connect", address, netns=ns) for ns in worker_ns]
    # The shard goes once the first checkpoint (step 20) is committed: watched here, not through ps-ctl status,
    # whose round trips (a process each, figures a heartbeat late) let the 160 steps (about 3 s) finish first.
    deadline = time.monotonic() + 150
    while not list(checkpoints.glob("ckpt-*/MANIFEST.json")):
        assert time.monotonic() < deadline and all(w.poll() is None for w in workers), "no checkpoint in 150 s"
        time.sleep(0.05)
    os.kill(lost["pid"], signal.SIGKILL)  # pids are this machine's: namespaces share the pid space
    training = wait_for_status(commands, address, lambda s: len(s["workers"]) == 2 and s["groups"], 60,
                               netns=coordinator_ns)
    for worker in workers:
        assert worker.wait(180) == 0, errors(worker)[-4000:]
        assert "finished" in output(worker)

    final = status(commands, address, netns=coordinator_ns)
    assert {s["name"]: s["host"] for s in final["shards"]} == dict.fromkeys(shard_names, shard_ip)
    trained = [w for w in final["workers"] if w["state"] == "left"]
    assert sorted(w["host"] for w in trained) == sorted(worker_ips), final["workers"]
    # One trainer group across the two workers' hosts (as seen while they trained: once the first one
    # leaves, the coordinator publishes a view without it).
    assert training["groups"][0]["members"] == sorted(w["name"] for w in trained)
    for worker in trained:
        figures = worker["metrics"]
        assert worker["step"] == STEPS and figures["loss"] < figures["first_loss"], figures
        assert figures["shard_rebuilds"] >= 1, figures
    assert re.search(rf"restarted {shard_names[1]} \(pid \d+; restart 1 of at most 3\)", errors(shard_host))
    restarted = [s for s in final["shards"] if s["name"] == shard_names[1] and s["alive"]]
    assert restarted and restarted[0]["pid"] != lost["pid"], final["shards"]
    rank0 = next(w for w in trained if w["metrics"]["group_rank"] == 0)
    assert rank0["metrics"]["auc"] > 0.65, rank0["metrics"]

    commands.run("ps-ctl", "--connect", address, "shutdown", netns=coordinator_ns)
    assert server.wait(30) == 0, errors(server)[-3000:]
    assert shard_host.wait(30) == 0, errors(shard_host)[-3000:]
    assert "every shard of this host has left" in errors(shard_host)
