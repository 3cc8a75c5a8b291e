"""Faults with a bound, on one cluster running a Trainer job (``tests/jobs/watch_next.py``), in order:

1. a worker hangs (SIGSTOP): declared dead after the heartbeat timeout, and the survivor, blocked in the
   group's collective with it, abandons that collective on the view without it and trains again within
   seconds, not the 60 s collective timeout;
2. the hung worker resumes (SIGCONT): its first heartbeat is refused and it exits 1 at once, one line;
3. the coordinator is SIGKILLed and never comes back: the survivor exits 1 within its grace for the
   coordinator (``--coordinator-grace``) + 2 s, saying the cluster was lost, with the figures it last reported
   (having warned that it goes on without the coordinator for up to its grace); ps-server's shards, orphaned,
   end within the same bound.

and on a second cluster, whose shards are restarted once (``--shard-restarts 1``):

4. the newest checkpoint is damaged after it was committed, then a shard is killed: the restarted shard
   refuses it (one line naming the file) and restores from the previous one; the worker trains on;
5. the shard is killed again, past its restart budget: the worker learns at once that it is gone for
   good and exits 1 naming it, rather than waiting for it to serve again.

and, where the test may mount a tiny tmpfs (root), on a third whose checkpoint disk is full:

6. ``ps-ctl checkpoint`` hears at once that the checkpoint failed, why (the disk is full, naming the file),
   and the parts written before the failure are removed; the training goes on.

Each bound is measured from the fault and printed; docs/faults.md lists them.
"""

import os
import pathlib
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
#: How long members wait for a coordinator that does not answer, here.
COORDINATOR_GRACE_S = 3
#: Losing the coordinator for good ends a worker within its grace + 2 s (+1 s for a loaded machine's exit).
CLUSTER_LOST_EXIT_S = COORDINATOR_GRACE_S + 2 + 1
#: A worker fails within this of a shard that is not restarted exiting (a heartbeat brings the news).
SHARD_GONE_EXIT_S = 5
#: ps-ctl checkpoint hears of a checkpoint that failed within this (its agreement, the writing, a heartbeat).
CHECKPOINT_FAILED_WITHIN_S = 10
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
    server, address = start_server(commands, "--shards", "2", "--group-size", "2", "--group-settle", "1",
                                   "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
                                   "--coordinator-grace", str(COORDINATOR_GRACE_S), "--job", JOB,
                                   "--job-config", job_config(steps=100_000, log_every=2, eval_every=100_000))
    started = [commands.start("ps-worker", "--connect", address, "--coordinator-grace", str(COORDINATOR_GRACE_S))
               for _ in range(2)]
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
        killed_at = time.monotonic()
        code, took = _wait_for_exit(survivor, CLUSTER_LOST_EXIT_S)
        print(f"the survivor exited {code} {took:.1f} s after the coordinator was SIGKILLed")
        lines = output(survivor).strip().splitlines()
        assert code == 1 and len(lines) == 1, lines
        assert "lost the cluster at step" in lines[0] and "lost the coordinator: unreachable for" in lines[0], lines
        assert f"going on without it for up to {COORDINATOR_GRACE_S} s" in errors(survivor)
        assert "did not stop within" not in errors(survivor)
        while any(pid_exists(pid) for pid in shard_pids) and time.monotonic() < killed_at + CLUSTER_LOST_EXIT_S:
            time.sleep(0.1)
        assert not any(pid_exists(pid) for pid in shard_pids), "a shard outlived its grace"
    finally:
        for process in (hung, survivor):
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        for pid in shard_pids:  # orphaned by the SIGKILL: they leave on their own, after their grace
            deadline = time.monotonic() + 2 * COORDINATOR_GRACE_S + 5
            while pid_exists(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def _shard(state, name):
    """The newest process of shard ``name`` (status lists the ones before it too)."""
    return [s for s in state["shards"] if s["name"] == name][-1]


def test_a_restarted_shard_skips_a_damaged_checkpoint_and_one_past_its_budget_fails_the_worker_at_once(
        commands, tmp_path):
    root = tmp_path / "checkpoints"
    server, address = start_server(commands, "--shards", "2", "--group-size", "1", "--shard-restarts", "1",
                                   "--checkpoint-dir", str(root),
                                   "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--job", JOB,
                                   "--job-config", job_config(steps=100_000, log_every=2, eval_every=100_000))
    worker = commands.start("ps-worker", "--connect", address)
    wait_for_status(commands, address, lambda s: s["workers"] and s["workers"][0]["step"] >= 20, 120)
    written = [commands.run("ps-ctl", "--connect", address, "checkpoint", "--timeout", "60") for _ in range(2)]
    assert all(r.returncode == 0 for r in written), [r.stderr for r in written]
    older, newest = (pathlib.Path(r.stdout.split(": ")[-1].strip()) for r in written)
    part = newest / "shard-shard1.pt"
    part.write_bytes(part.read_bytes()[:-10])  # damaged after it was committed

    # 5: the restarted shard restores from the newest checkpoint that verifies.
    state = status(commands, address)
    os.kill(_shard(state, "shard1")["pid"], signal.SIGKILL)
    killed_at = state["workers"][0]["step"]
    state = wait_for_status(commands, address, lambda s: s["workers"][0]["step"] >= killed_at + 20 and
                            s["workers"][0]["metrics"].get("shard_rebuilds", 0) >= 1, 60)
    log = errors(server)
    assert log.count(f"shard1: not restoring from {newest}: {part}: size") == 1, log[-3000:]
    assert f"shard shard1 falls back to checkpoint {older.name}" in log, log[-3000:]

    # 4: killed again, past its budget: not restarted, and the worker hears it at once.
    os.kill(_shard(state, "shard1")["pid"], signal.SIGKILL)
    code, took = _wait_for_exit(worker, SHARD_GONE_EXIT_S)
    print(f"the worker exited {code} {took:.1f} s after shard1 was killed past its restart budget")
    lines = output(worker).strip().splitlines()
    assert code == 1 and len(lines) == 1, lines
    assert "ShardLost: shard shard1 will not serve again: process exited with code -9; not restarted: it exited " \
           "2 times (at most 1 restarts)" in lines[0], lines
    gone = _shard(status(commands, address), "shard1")
    assert gone["state"] == "exited" and not gone["alive"], gone
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert server.wait(30) == 0, errors(server)[-3000:]


def test_a_checkpoint_that_fills_the_disk_fails_ps_ctl_at_once_naming_it_and_leaves_no_parts(commands, tiny_disk):
    server, address = start_server(commands, "--shards", "2", "--group-size", "1", "--checkpoint-dir", str(tiny_disk),
                                   "--job", JOB,
                                   "--job-config", job_config(steps=100_000, log_every=2, eval_every=100_000))
    worker = commands.start("ps-worker", "--connect", address)
    wait_for_status(commands, address, lambda s: s["workers"] and s["workers"][0]["step"] >= 10, 120)
    free = os.statvfs(tiny_disk)
    (tiny_disk / "ballast").write_bytes(b"\0" * (free.f_bavail * free.f_frsize - 8192))  # a checkpoint needs more
    began = time.monotonic()
    result = commands.run("ps-ctl", "--connect", address, "checkpoint", "--timeout", "60")
    took = time.monotonic() - began
    print(f"ps-ctl checkpoint failed {took:.1f} s after it asked: {result.stderr.strip()}")
    assert result.returncode == 1 and took < CHECKPOINT_FAILED_WITHIN_S, (took, result.stderr)
    assert "checkpoint request 1 failed: worker0 could not write it:" in result.stderr, result.stderr
    assert "No space left on device: writing" in result.stderr and "unreachable" not in result.stderr
    assert [p.name for p in tiny_disk.iterdir()] == ["ballast"]  # the failed checkpoint's parts are gone
    assert worker.poll() is None  # a failed checkpoint does not end the training
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert worker.wait(30) == 0 and server.wait(30) == 0, errors(worker)[-3000:]
