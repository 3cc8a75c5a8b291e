"""How long a cluster takes to heal, with no coordinator restart and after one.

What it measures
    One cluster on this machine through the real commands, as ``tests/test_coordinator_restart.py`` starts
    it: ``ps-server --shards 0 --state-dir`` (the coordinator, with a journal), a shard host
    (``ps-server --join --shards 2``) and 2 ``ps-worker`` in one trainer group, training the job of
    ``tests/jobs/watch_next.py``.  Twice, once before and once after the coordinator is SIGKILLed and started
    again ``--outage`` seconds later with the same flags:

    * shard lost: a shard's process SIGKILLed; seconds until another process serves under its name and every
      worker trained 10 steps past where they were;
    * worker join: a worker started; seconds until it trains in the group with the others (every worker 10
      steps past where they were when it appeared).

    After the restart both go through the new coordinator's store (the data plane's rendezvous rebuilt from
    the journal).  The test asserts the heals after a restart; this prints both, side by side.

How to run
    ``.venv/bin/python benchmarks/coordinator_restart.py [--outage 5]``; progress on stderr, a markdown table on
    stdout.
"""

import argparse
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict

from paramserver.cli.ctl import status_as_dict
from paramserver.cli.demo import LocalProcesses, wait_for_ready
from paramserver.control import CoordinatorClient

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
JOB = f"{REPO_ROOT / 'tests' / 'jobs' / 'watch_next.py'}:main"
GRACE_S = 40
#: How long each phase may take before the benchmark gives up.
PHASE_WITHIN = 180.0
HOST_PROCESSES = 6  # the coordinator, the shard host, its 2 shards, 2 workers (a third joins)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cluster_status(address: str) -> dict:
    client = CoordinatorClient(address)
    try:
        return status_as_dict(client.status())
    finally:
        client.close()


def until(address: str, condition: Callable[[dict], bool], what: str) -> dict:
    """The cluster's status once ``condition`` holds (polled twice a second, at most ``PHASE_WITHIN``)."""
    deadline = time.monotonic() + PHASE_WITHIN
    while True:
        state = cluster_status(address)
        if condition(state):
            return state
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {PHASE_WITHIN:.0f} s; status {state}")
        time.sleep(0.5)


def trained_past(state: dict, step: int, workers: int) -> bool:
    live = [w for w in state["workers"] if w["alive"]]
    return len(live) == workers and all(w["step"] > step for w in live)


def shard_heal(address: str, workers: int) -> float:
    state = cluster_status(address)
    shard = min((s for s in state["shards"] if s["alive"]), key=lambda s: s["name"])
    step = max(w["step"] for w in state["workers"])
    os.kill(shard["pid"], signal.SIGKILL)
    lost_at = time.monotonic()
    until(address, lambda s: trained_past(s, step + 10, workers) and any(
        x["name"] == shard["name"] and x["alive"] and x["pid"] != shard["pid"] for x in s["shards"]), "shard heal")
    return time.monotonic() - lost_at


def worker_join(processes: LocalProcesses, address: str, workers: int) -> float:
    began = time.monotonic()
    processes.start(f"ps-worker{workers}", "paramserver.cli.worker", "--connect", address,
                    "--coordinator-grace", str(GRACE_S), host_processes=HOST_PROCESSES)
    seen = until(address, lambda s: len(s["workers"]) == workers + 1 and all(w["step"] > 0 for w in s["workers"]),
                 "worker join")
    until(address, lambda s: trained_past(s, max(w["step"] for w in seen["workers"]) + 10, workers + 1),
          "worker join")
    return time.monotonic() - began


def run(args) -> Dict[str, Dict[str, float]]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    address = f"127.0.0.1:{port}"
    healed: Dict[str, Dict[str, float]] = {"shard lost": {}, "worker join": {}}
    with tempfile.TemporaryDirectory(prefix="coordinator_restart-") as scratch:
        folder = pathlib.Path(scratch)
        (folder / "logs").mkdir()
        processes = LocalProcesses(folder / "logs")
        coordinator = ["paramserver.cli.server", "--shards", "0", "--port", str(port), "--state-dir",
                       str(folder / "state"), "--checkpoint-dir", str(folder / "checkpoints"), "--group-size", "4",
                       "--group-settle", "1", "--heartbeat-timeout", "3", "--coordinator-grace", str(GRACE_S),
                       "--job", JOB, "--job-config", '{"steps": 1000000000, "log_every": 5, "eval_every": 1000000000}']
        try:
            server = processes.start("ps-server", *coordinator, host_processes=HOST_PROCESSES)
            wait_for_ready(processes, server)
            processes.start("shard-host", "paramserver.cli.server", "--join", address, "--shards", "2",
                            "--coordinator-grace", str(GRACE_S), host_processes=HOST_PROCESSES)
            until(address, lambda s: sum(x["alive"] and x["ready"] for x in s["shards"]) == 2, "the shards")
            for index in range(2):
                processes.start(f"ps-worker{index}", "paramserver.cli.worker", "--connect", address,
                                "--coordinator-grace", str(GRACE_S), host_processes=HOST_PROCESSES)
            until(address, lambda s: trained_past(s, 20, 2), "the cluster's first steps")
            for when in ("no restart", "after a restart"):
                if when == "after a restart":
                    progress(f"SIGKILL the coordinator; started again {args.outage:g} s later")
                    os.kill(server.pid, signal.SIGKILL)
                    server.wait(10)
                    time.sleep(args.outage)
                    server = processes.start("ps-server", *coordinator, host_processes=HOST_PROCESSES)
                    wait_for_ready(processes, server)
                    until(address, lambda s: all(m["alive"] and not m["reason"] for m in s["workers"] + s["shards"])
                          and all(w["step"] > 0 for w in s["workers"]), "re-attach")
                workers = len([w for w in cluster_status(address)["workers"] if w["alive"]])
                written = subprocess.run([sys.executable, "-m", "paramserver.cli.ctl", "--connect", address,
                                          "checkpoint", "--timeout", "60"], capture_output=True, text=True, timeout=90)
                if written.returncode != 0:
                    raise RuntimeError(f"ps-ctl checkpoint failed: {written.stderr}")
                healed["shard lost"][when] = shard_heal(address, workers)
                healed["worker join"][when] = worker_join(processes, address, workers)
                progress(f"{when}: " + ", ".join(f"{what} {took[when]:.1f} s" for what, took in healed.items()))
        finally:
            processes.shut_down(address)
    return healed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outage", type=float, default=5.0, help="seconds the coordinator stays down (default 5)")
    healed = run(parser.parse_args())
    print("| heal | no restart (s) | after a restart (s) |")
    print("|---|---:|---:|")
    for what, took in healed.items():
        print(f"| {what} | {took['no restart']:.1f} | {took['after a restart']:.1f} |")


if __name__ == "__main__":
    main()
