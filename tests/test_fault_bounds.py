"""Faults with a bound, on one cluster running a Trainer job (``tests/jobs/watch_next.py``), in order:

1. a worker hangs (SIGSTOP): declared dead after the heartbeat timeout, and the survivor, blocked in the
   group's collective with it, abandons that collective on the view without it and trains again within
   seconds, not the 60 s collective timeout;
2. the hung worker resumes (SIGCONT): its first heartbeat is refused and it exits 1 at once, one line;
3. the coordinator is SIGKILLed: the survivor exits 1 within the heartbeat timeout + 2 s, saying the
   cluster was lost, with the figures it last reported.

and on a second cluster, whose shards may not be restarted (``--shard-restarts 0``):

4. a shard is killed: the worker learns at once that it is gone for good and exits 1 naming it, rather
   than waiting for it to serve again.

Each bound is measured from the fault and printed; docs/faults.md lists them.
"""

import os
import signal
import time

import pytest

from commands import errors, job_config, output, pid_exists, start_server, status, wait_for_status

pytestmark = pytest.mark.timeout(240)

HEARTBEAT_TIMEOUT_S = 3
#: The survivor trains again within this of a hung member's SIGSTOP (timeout, view, abandon, re-form).
HUNG_MEMBER_CUT_OUT_S = HEARTBEAT_TIMEOUT_S + 10
#: A refused worker exits within this of resuming.
REFUSED_EXIT_S = 5
#: Losing the coordinator ends a worker within the heartbeat timeout + 2 s (+1 s for a loaded machine's exit).
CLUSTER_LOST_EXIT_S = HEARTBEAT_TIMEOUT_S + 2 + 1
#: A worker fails within this of a shard that is not restarted exiting (a heartbeat brings the news).
SHARD_GONE_EXIT_S = 5
JOB = f"{os.path.dirname(__file__)}/jobs/watch_next.py:main"


def _worker(state, name):
    return next(w for w in state["workers"] if w["name"] == name)


def _wait_for_exit(process, seconds):
    began = time.monotonic()
    try:
        code = process.wait(seconds)
    except Exception:  # noqa: BLE001 - reported below with the process's output
        raise AssertionError(f"still running {seconds} s later:\n{errors(process)[-3000:]}") from None
    return code, time.monotonic() - began


def test_a_hung_worker_is_cut_out_then_refused_and_a_lost_coordinator_ends_the_survivor(commands):
    server, address = start_server(commands, "--shards", "2", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
                                   "--job", JOB, "--job-config", job_config(steps=100_000, log_every=2,
                                                                            eval_every=100_000))
    started = [commands.start("ps-worker", "--connect", address) for _ in range(2)]
    state = wait_for_status(commands, address, lambda s: len(s["workers"]) == 2 and all(
        w["step"] >= 10 for w in s["workers"]), 120)
    workers = {w["name"]: next(p for p in started if p.pid == w["pid"]) for w in state["workers"]}
    shard_pids = [s["pid"] for s in state["shards"]]
    hung, survivor = workers["worker1"], workers["worker0"]
    try:
        # 1: hung, not dead.
        os.kill(hung.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        blocked = wait_for_status(commands, address, lambda s: _worker(s, "worker1")["state"] == "dead",
                                  HUNG_MEMBER_CUT_OUT_S)
        blocked_at = _worker(blocked, "worker0")["step"]  # where it waits for the hung member (or a step later)
        wait_for_status(commands, address, lambda s: _worker(s, "worker0")["step"] >= blocked_at + 10,
                        HUNG_MEMBER_CUT_OUT_S - (time.monotonic() - stopped_at))
        print(f"survivor trained 10 steps more {time.monotonic() - stopped_at:.1f} s after the SIGSTOP")
        assert "abandoning its" in errors(survivor)

        # 2: resumed, refused.
        os.kill(hung.pid, signal.SIGCONT)
        code, took = _wait_for_exit(hung, REFUSED_EXIT_S)
        print(f"the resumed worker exited {code} {took:.1f} s after SIGCONT")
        lines = output(hung).strip().splitlines()
        assert code == 1 and len(lines) == 1 and "lost the cluster" in lines[0] and "dead" in lines[0], lines

        # 3: the coordinator lost.
        state = wait_for_status(commands, address, lambda s: _worker(s, "worker0")["step"] >= blocked_at + 20, 60)
        os.kill(server.pid, signal.SIGKILL)
        code, took = _wait_for_exit(survivor, CLUSTER_LOST_EXIT_S)
        print(f"the survivor exited {code} {took:.1f} s after the coordinator was SIGKILLed")
        lines = output(survivor).strip().splitlines()
        assert code == 1 and len(lines) == 1, lines
        assert "lost the cluster at step" in lines[0] and "lost the coordinator" in lines[0], lines
        assert "did not stop within" not in errors(survivor)
    finally:
        for process in (hung, survivor):
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        for pid in shard_pids:  # orphaned by the SIGKILL: they leave on their own, after the heartbeat timeout
            deadline = time.monotonic() + 2 * HEARTBEAT_TIMEOUT_S + 5
            while pid_exists(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_shard_past_its_restart_budget_fails_the_worker_at_once_naming_it(commands, tmp_path):
    server, address = start_server(commands, "--shards", "2", "--shard-restarts", "0", "--checkpoint-dir",
                                   str(tmp_path / "checkpoints"), "--checkpoint-every", "20", "--job", JOB,
                                   "--job-config", job_config(steps=100_000, log_every=2, eval_every=100_000))
    worker = commands.start("ps-worker", "--connect", address)
    state = wait_for_status(commands, address, lambda s: s["workers"] and s["workers"][0]["step"] >= 30, 120)
    shard = next(s for s in state["shards"] if s["name"] == "shard1")
    os.kill(shard["pid"], signal.SIGKILL)
    code, took = _wait_for_exit(worker, SHARD_GONE_EXIT_S)
    print(f"the worker exited {code} {took:.1f} s after shard1 was killed")
    lines = output(worker).strip().splitlines()
    assert code == 1 and len(lines) == 1, lines
    assert "ShardLost: shard shard1 will not serve again: process exited with code -9; not restarted: it exited " \
           "1 time (at most 0 restarts)" in lines[0], lines
    gone = next(s for s in status(commands, address)["shards"] if s["name"] == "shard1")
    assert gone["state"] == "exited" and not gone["alive"], gone
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert server.wait(30) == 0, errors(server)[-3000:]
