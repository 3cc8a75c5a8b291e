"""The default job through the real commands: ``ps-demo`` end to end with few
steps on Criteo-format files (the workers share them; it learns, prints its
JSON summary, leaves no process), ``ps-demo`` stopped by SIGTERM (its whole
cluster stops with it), a worker that
joins a running trainer group through the coordinator, and workers that
disagree on the comm hook.  A small planted problem keeps each run short."""

import json
import os
import re
import signal
import time

import pytest

from paramserver import serving
from paramserver.checkpoint import live_export
from paramserver.filesystems import locate

from commands import errors, job_config, output, pid_exists, start_server, status, wait_for_status

pytestmark = pytest.mark.timeout(300)

SMALL = dict(spec={"vocab_sizes": [2000, 500, 200, 50], "bag_sizes": [1, 2, 1, 1], "num_dense": 4},
             batch_size=256, holdout_size=4096, log_every=10, eval_every=20, row_wise_min_rows=1000,
             sparse_lr=64.0)


def test_demo_trains_the_main_job_on_criteo_format_files_and_prints_its_summary(commands, tmp_path):
    from paramserver.jobs.ctr_files import PlantedFiles
    files = PlantedFiles(seed=5)
    for day in range(2):  # gzip: one part per file, one file per worker
        files.write_criteo(str(tmp_path / f"day_{day}.gz"), day, 8_000)
    oracle = files.write_criteo(str(tmp_path / "eval.txt"), 99, 4_096)
    data = {"format": "criteo", "train": str(tmp_path / "day_*.gz"), "eval": str(tmp_path / "eval.txt")}
    logs, exports = tmp_path / "demo-logs", tmp_path / "exports"
    # Live exports in a group of two: agreed on, then rank 0 writes them while the other member waits in the store.
    demo = commands.run("ps-demo", "--shards", "2", "--workers", "2", "--hook", "powersgd", "--steps", "60",
                        "--job-config", job_config(batch_size=256, log_every=10, eval_every=20, sparse_lr=64.0,
                                                   data=data, export_to=str(exports), export_every=20),
                        "--log-dir", str(logs), timeout=280)
    assert demo.returncode == 0, demo.stderr[-3000:]
    summary = json.loads(demo.stdout.strip().splitlines()[-1])
    assert {"steps", "samples_per_s", "auc", "hook", "bytes_per_step", "allreduce_ms"} <= set(summary)
    assert summary["steps"] == 60 and summary["hook"] == "powersgd" and summary["samples_per_s"] > 0
    assert summary["loss"] < summary["first_loss"], summary
    assert 0.5 + 0.5 * (oracle - 0.5) < summary["auc"] <= oracle + 0.02, (oracle, summary)
    assert 0 < summary["bytes_per_step"], summary
    # Not on a terminal: tqdm's meter as plain lines, no carriage returns.
    assert re.search(r"^ps-demo: +\d+%\|[# ]*\| 60/60 ", demo.stderr, re.MULTILINE) and "\r" not in demo.stderr
    worker_logs = "".join(path.read_text() for path in logs.glob("ps-worker*"))
    assert re.search(r"reads criteo: 1 part\(s\) of share 0 of 2", worker_logs), worker_logs[-3000:]
    assert re.search(r"reads criteo: 1 part\(s\) of share 1 of 2", worker_logs), worker_logs[-3000:]
    # Due every 20 steps, agreed by the group (the other member took part in each: no hand-out otherwise), and
    # the last one the model as training left it.
    assert [export.step for export in live_export.chain(locate(str(exports)))] == [20, 40, 60]
    assert serving.load(str(exports)).step == 60
    pids = json.loads((logs / "pids.json").read_text())
    assert sorted(pids) == ["ps-server", "ps-worker0", "ps-worker1"]
    assert not [name for name, pid in pids.items() if pid_exists(pid)]


def _session_members(session: int) -> list:
    """The pids of the processes in session ``session`` (its leader's pid): ps-server, its fork server, shards."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
        if int(fields[3]) == session:
            members.append(int(entry))
    return members


def test_a_stopped_demo_stops_its_whole_cluster(commands, tmp_path):
    """ps-demo's children run in sessions of their own: SIGTERM (a launcher's or ``timeout``'s stop) must end
    them too, not only ps-demo."""
    stop = signal.SIGTERM
    logs = tmp_path / "demo-logs"
    demo = commands.start("ps-demo", "--shards", "2", "--workers", "2", "--hook", "allreduce",
                          "--job-config", job_config(**dict(SMALL, steps=1_000_000)), "--log-dir", str(logs))
    pids = {}
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 3 and demo.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            try:
                pids = json.loads((logs / "pids.json").read_text())
            except (OSError, ValueError):
                pass  # not written yet, or being written
        assert sorted(pids) == ["ps-server", "ps-worker0", "ps-worker1"], errors(demo)[-3000:]
        assert _session_members(pids["ps-server"]), "ps-server's session is empty before the stop"
        demo.send_signal(stop)
        assert demo.wait(60) == 128 + stop, errors(demo)[-3000:]
        assert f"ps-demo: stopped by {signal.Signals(stop).name}; stopping the cluster" in errors(demo)
        assert not [name for name, pid in pids.items() if pid_exists(pid)]
        # Its fork server and shards too: killed with ps-server's session, then reaped by init.
        deadline = time.monotonic() + 10
        while _session_members(pids["ps-server"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _session_members(pids["ps-server"])
    finally:
        for pid in pids.values():  # whatever ps-demo left: each child leads a session of its own
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_worker_joining_later_is_taken_into_the_running_group(commands):
    server, address = start_server(commands, "--shards", "2", "--group-settle", "1", "--job-config",
                                   job_config(**dict(SMALL, steps=1_000_000, eval_every=1_000_000)))
    first = commands.start("ps-worker", "--connect", address, "--comm-hook", "allreduce")
    wait_for_status(commands, address, lambda s: s["workers"] and s["workers"][0]["step"] >= 20, 120)
    late = commands.start("ps-worker", "--connect", address, "--comm-hook", "allreduce")
    both = wait_for_status(commands, address, lambda s: len(s["workers"]) == 2 and all(
        w["alive"] and w["step"] > 0 for w in s["workers"]) and s["groups"][0]["generation"] == "2", 120)
    assert both["groups"][0]["members"] == ["worker0", "worker1"]
    # SIGTERM on one member stops the group: both leave at the same step.
    late.terminate()
    for worker in (first, late):
        assert worker.wait(60) == 0, errors(worker)[-3000:]
    workers = status(commands, address)["workers"]
    assert [(w["name"], w["state"]) for w in workers] == [("worker0", "left"), ("worker1", "left")]
    assert workers[0]["step"] == workers[1]["step"] > 20
    metrics = [w["metrics"] for w in workers]
    assert (metrics[0]["reformations"], metrics[1]["reformations"]) == (1, 0)
    assert metrics[0]["replica_checksum"] == metrics[1]["replica_checksum"]  # one replica, twice
    assert "trainer group 0: generation 2 formed by worker0, worker1" in errors(server)
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert server.wait(30) == 0, errors(server)[-3000:]


def test_workers_with_different_comm_hooks_are_refused(commands):
    server, address = start_server(commands, "--shards", "1", "--group-size", "2",
                                   "--job-config", job_config(**SMALL))
    workers = [commands.start("ps-worker", "--connect", address, "--comm-hook", hook) for hook in ("allreduce", "bf16")]
    for worker in workers:
        assert worker.wait(120) == 1, errors(worker)[-3000:]
        assert re.search(r"HookMismatch: trainer group members use different comm hooks: "
                         r"worker0: (allreduce|bf16); worker1: (allreduce|bf16)", output(worker)), output(worker)
    groups = status(commands, address)["groups"]
    assert groups[0]["members"] == ["worker0", "worker1"]
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert server.wait(30) == 0
