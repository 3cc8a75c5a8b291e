"""Checkpoints through the real commands: the default job writes them every N
steps and on ``ps-ctl checkpoint``, and ``ps-ctl export`` has the live
cluster write one and exports it; with two trainer groups a checkpoint
holds the other group's data position too, and a run restored from it
reads each worker's data on from its own; a restored run of a Trainer job (the
second job, ``tests/jobs/watch_next.py``, whose data has no saved position:
the Trainer skips to it) continues the same trajectory as an undisturbed
one, also on another number of shards (2 -> 3 and 3 -> 2: rows and their
optimizer state re-placed, a dynamic table's ids routed again by their
hash); the undisturbed run's newest checkpoint, exported (a table split
by rows over both shards reassembled whole), scores the held-out batches
as that run's last evaluation did; a damaged newest checkpoint is
refused, naming the file, and the previous one is used; a shard that
takes long to verify the checkpoint it restores keeps its heartbeats
meanwhile and still obeys a stop."""

import datetime
import json
import multiprocessing
import os
import pathlib
import re
import shutil
import signal
import sys
import time
from typing import Optional

import pytest
import torch

import paramserver
from commands import errors, job_config, output, start_server, status, wait_for_status
from paramserver import Batch, serving
from paramserver.checkpoint import MANIFEST, CheckpointStore, assemble_rows, parse_range_name, save_tensors
from paramserver.checkpoint.export import EXPORT_MANIFEST
from paramserver.control import CoordinatorClient, CoordinatorServer, CoordinatorSettings
from paramserver.control.checkpoints import CheckpointOptions
from paramserver.serving import NotServable
from paramserver.tables import parse_part_name

sys.path.insert(0, str(pathlib.Path(__file__).parent / "jobs"))
from watch_next import FactorizationMachine, Planted  # noqa: E402

pytestmark = pytest.mark.timeout(400)

# One worker: its sparse and dense steps are the whole, deterministic trajectory.
SMALL = dict(spec={"vocab_sizes": [2000, 500, 200, 50], "bag_sizes": [1, 2, 1, 1], "num_dense": 4},
             batch_size=256, holdout_size=2048, log_every=10, eval_every=1000, row_wise_min_rows=1000,
             sparse_lr=64.0, hook="allreduce")


WATCH_NEXT = f"{pathlib.Path(__file__).parent / 'jobs' / 'watch_next.py'}:main"


def train(commands, shards: int, steps: int, *flags: str, job: str = "paramserver.jobs.ctr:main", started=None,
          figures: Optional[dict] = None, **config):
    """Run one ps-server and one worker to ``steps``; returns the server's log and the worker's.  ``started``:
    called with the server's status once it is ready; ``figures``: filled with the worker's figures."""
    # --group-size 1: its one worker's group forms as it joins, without waiting for more to come.
    server, address = start_server(commands, "--shards", str(shards), "--group-size", "1", "--job", job, "--job-config",
                                   job_config(**dict(config or SMALL, steps=steps)), *flags)
    if started is not None:
        started(status(commands, address))
    # On the CPU, whatever the host: runs compared to 1e-6 must train on one kind of device, and on a GPU host
    # whether a worker gets the GPU depends on the workers of other tests running beside it.
    worker = commands.start("ps-worker", "--connect", address, env={"CUDA_VISIBLE_DEVICES": ""})
    assert worker.wait(240) == 0, errors(worker)[-3000:]
    assert f"at step {steps}" in output(worker), output(worker)
    if figures is not None:
        figures.update(wait_for_status(commands, address, lambda s: s["workers"] and "steps" in s["workers"][0].get(
            "metrics", {}), 30)["workers"][0]["metrics"])
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert server.wait(30) == 0, errors(server)[-3000:]
    return errors(server), errors(worker)


def model_at(checkpoint: pathlib.Path) -> dict:
    """Everything a checkpoint holds, whole: dense parameters, every table and its optimizer state."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    model = {f"dense.{k}": v for k, v in torch.load(checkpoint / "dense.pt", weights_only=True)["module"].items()}
    pieces, dynamic = {}, {}
    for record in manifest["files"]:
        if record["name"].startswith("shard-"):
            for name, entry in torch.load(checkpoint / record["name"], weights_only=True)["tables"].items():
                if entry.get("dynamic"):
                    dynamic.setdefault(parse_part_name(name)[0], []).append(entry)
                    continue
                table, start, stop = parse_range_name(name)
                pieces.setdefault(table, []).append((start, stop, entry))
    for table, parts in dynamic.items():  # whatever the shards that held them: rows by id
        ids = torch.cat([entry["ids"] for entry in parts])
        order = ids.argsort()
        model[f"{table}.ids"] = ids[order]
        model[table] = torch.cat([entry["value"] for entry in parts])[order]
        model[f"{table}.momentum"] = torch.cat([entry["state"]["momentum_buffer"] for entry in parts])[order]
    for table, parts in pieces.items():
        rows = max(stop for _, stop, _ in parts)
        model[table] = assemble_rows([(a, b, e["value"]) for a, b, e in parts], 0, rows, table)
        model[f"{table}.momentum"] = assemble_rows([(a, b, e["state"]["momentum_buffer"]) for a, b, e in parts],
                                                   0, rows, table)
    return model


def table_ranges(checkpoint: pathlib.Path, table: str) -> list:
    """The row ranges the shard parts of ``checkpoint`` hold of fixed table ``table``."""
    return sorted(name for part in checkpoint.glob("shard-*.pt")
                  for name in torch.load(part, weights_only=True)["tables"] if name.startswith(f"{table}["))


def assert_same_model(restored: dict, straight: dict, exact: bool = False) -> None:
    assert sorted(restored) == sorted(straight)
    for name in straight:
        difference = (restored[name] - straight[name]).abs().max().item()
        assert difference == 0 if exact else difference <= 1e-6, f"{name} differs by {difference}"


def test_a_restored_run_continues_the_same_trajectory_on_2_then_3_then_2_shards_and_skips_a_damaged_one(
        commands, tmp_path):
    straight, resumed, again = tmp_path / "straight", tmp_path / "resumed", tmp_path / "again"
    # "user" (600 rows) split by rows over every shard
    watch_next = dict(job=WATCH_NEXT, log_every=10, eval_every=1000, dynamic_video=True, row_wise_min_rows=500)
    evaluated = tmp_path / "scores.pt"
    log, _ = train(commands, 2, 60, "--checkpoint-dir", str(straight), "--checkpoint-every", "20",
                   eval_scores=str(evaluated), **watch_next)
    assert sorted(p.name for p in straight.iterdir()) == [f"ckpt-{s:010d}" for s in (20, 40, 60)]
    assert re.search(r"checkpoint ckpt-0000000020 committed at step 20 by worker0: 3 files", log), log[-3000:]

    # Its newest checkpoint exported, served in this process: the scores of the run's last evaluation.
    exported = tmp_path / "exported"
    manifest = paramserver.export(straight, exported)
    assert manifest["step"] == 60 and manifest["checkpoint"] == str(straight / "ckpt-0000000060")
    assert table_ranges(straight / "ckpt-0000000060", "watch.user") == ["watch.user[0:300]", "watch.user[300:600]"]
    assert manifest["tables"]["user"] == {"kind": "fixed", "dim": 8, "mode": "sum", "rows": 600, "dtype": "float32",
                                          "file": "table-0-user.pt"}
    assert (manifest["tables"]["video"]["kind"], manifest["tables"]["history"]["mode"]) == ("dynamic", "mean")
    with pytest.raises(NotServable, match="FactorizationMachine cannot be imported here"):  # a job file's class
        serving.load(exported)
    model = serving.load(exported, dense=FactorizationMachine(**manifest["dense"]["kwargs"]))
    with torch.no_grad():
        scores = torch.cat([model(Planted(7, hashed_videos=True).batch(999, index, 1024)) for index in range(2)])
    assert (scores - torch.load(evaluated, weights_only=True)).abs().max().item() <= 1e-6

    # 2 -> 3 shards: from step 20 to 40 again.
    log, _ = train(commands, 3, 40, "--restore", str(straight / "ckpt-0000000020"), "--checkpoint-dir",
                   str(resumed), "--checkpoint-every", "20", **watch_next)
    assert "restoring from checkpoint" in log
    assert [p.name for p in resumed.iterdir()] == ["ckpt-0000000040"]  # not the starting point again
    assert_same_model(model_at(resumed / "ckpt-0000000040"), model_at(straight / "ckpt-0000000040"))

    # 3 -> 2 shards, restoring from a root whose newest checkpoint is damaged: it is refused by name, and the
    # one before it used (step 40, written on 3 shards).  The damaged one is the straight run's step 60, copied.
    damaged = resumed / "ckpt-0000000060"
    shutil.copytree(straight / "ckpt-0000000060", damaged)
    newest = damaged / "shard-shard1.pt"
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated, as by a full disk
    log, worker_log = train(commands, 2, 60, "--restore", str(resumed), "--checkpoint-dir", str(again),
                            "--checkpoint-every", "20", **watch_next)
    assert re.search(rf"refusing checkpoint .*ckpt-0000000060.*{re.escape(str(newest))}", log), log[-3000:]
    assert re.search(r"restoring from checkpoint .*ckpt-0000000040 \(step 40\)", log)
    assert "starts from checkpoint ckpt-0000000040 at step 40" in worker_log
    assert_same_model(model_at(again / "ckpt-0000000060"), model_at(straight / "ckpt-0000000060"))

    # The straight run again to step 40, with shard0's process SIGKILLed at step 30, between two checkpoints:
    # restarted, it restores step 20 and replays its push log, the worker sends again what it never applied,
    # and the run reaches step 40 where the undisturbed one did, bit for bit, with no step lost.
    killed, pid_file, figures = tmp_path / "killed", tmp_path / "shard0.pid", {}
    log, _ = train(commands, 2, 40, "--checkpoint-dir", str(killed), "--checkpoint-every", "20",
                   kill_shard=[str(pid_file), 30], figures=figures,
                   started=lambda s: pid_file.write_text(str(next(
                       shard["pid"] for shard in s["shards"] if shard["name"] == "shard0"))), **watch_next)
    assert not pid_file.exists() and re.search(r"shard0 .*replayed \d+ pushes and \d+ lookups from the push log "
                                               r"since checkpoint ckpt-0000000020", log), log[-3000:]
    assert figures["sparse_steps_lost"] == 0 and figures["shard_rebuilds"] == 1, figures
    assert figures["replayed_pushes"] > 0, figures
    assert_same_model(model_at(killed / "ckpt-0000000040"), model_at(straight / "ckpt-0000000040"), exact=True)
    fresh = model_at(straight / "ckpt-0000000020")
    assert (fresh["watch.user"] - model_at(again / "ckpt-0000000060")["watch.user"]).abs().max() > 1e-3
    assert fresh["watch.video.ids"].numel() > 100  # the dynamic table's rows, re-routed to 3 shards and back


def test_ps_ctl_checkpoint_waits_for_the_checkpoint_and_names_it_and_answers_with_the_newest_after_the_job(
        commands, tmp_path):
    root = tmp_path / "checkpoints"
    server, address = start_server(commands, "--shards", "2", "--group-size", "1", "--checkpoint-dir", str(root), "--job-config",
                                   job_config(**dict(SMALL, steps=100_000)))
    # Two trainer groups of one (--group-size 1): group 0 writes the checkpoints while group 1 trains on.
    worker, other_group = [commands.start("ps-worker", "--connect", address) for _ in range(2)]
    # (past step 30: its agreement at step 30, where it published, is behind it)
    wait_for_status(commands, address, lambda s: len(s["workers"]) == 2 and s["workers"][0]["step"] > 0
                    and s["workers"][1]["step"] > 30, 120)
    done = commands.run("ps-ctl", "--connect", address, "checkpoint", "--timeout", "120", timeout=150)
    assert done.returncode == 0, done.stderr
    match = re.match(r"checkpoint (ckpt-\d{10}) written at step (\d+): (.+)$", done.stdout.strip())
    assert match, done.stdout
    assert pathlib.Path(match.group(3)) == root / match.group(1) and (root / match.group(1) / MANIFEST).exists()
    # It holds group 1's data position too, published at its last agreement (every 10 steps) before it was
    # written: a restore resumes that worker's data there, not at its start.
    asked = root / match.group(1)
    positions = torch.load(asked / "dense.pt", weights_only=False)["data_positions"]
    assert sorted(positions) == [0, 1], positions
    assert positions[1]["used"] >= 30 and positions[1]["used"] % 10 == 0, positions[1]
    assert positions[1]["state"] == {"index": positions[1]["used"]}, positions[1]  # (the stream's next batch)

    # Exported from the live cluster: a checkpoint written now, its tables whole (the first one split by rows).
    exported = tmp_path / "exported"
    done = commands.run("ps-ctl", "--connect", address, "export", str(exported), "--timeout", "120", timeout=150)
    assert done.returncode == 0, done.stderr
    match = re.match(r"exported step (\d+) of (\S+) to ", done.stdout)
    assert match and pathlib.Path(match.group(2)).parent == root, done.stdout
    checkpoint, manifest = pathlib.Path(match.group(2)), json.loads((exported / EXPORT_MANIFEST).read_text())
    assert manifest["step"] == int(match.group(1)) and manifest["dense"]["class"] == "paramserver.jobs.ctr:Tower"
    first = next(iter(manifest["tables"]))  # 2000 rows: split (row_wise_min_rows 1000)
    assert manifest["tables"][first]["rows"] == 2000 and len(table_ranges(checkpoint, f"ctr.{first}")) == 2
    written = model_at(checkpoint)
    for name, table in manifest["tables"].items():
        weight = torch.load(exported / table["file"], weights_only=True)["weight"]
        assert torch.equal(weight, written[f"ctr.{name}"]), name
    dense = torch.load(exported / "dense.pt", weights_only=True)
    assert all(torch.equal(value, written[f"dense.{key}"]) for key, value in dense.items())
    model = serving.load(exported)  # the Tower built again from its recorded arguments
    ids = {name: torch.randint(0, table["rows"], (8, 2)) for name, table in manifest["tables"].items()}
    with torch.no_grad():
        assert torch.isfinite(model(Batch(ids, torch.randn(8, 4), torch.zeros(8)))).all()
    for each in (worker, other_group):
        each.terminate()
        assert each.wait(60) == 0, errors(each)[-3000:]
    # No trainer left: asked for a checkpoint, or an export, the cluster answers at once with its newest one.
    wait_for_status(commands, address, lambda s: not any(w["alive"] for w in s["workers"]), 60)
    done = commands.run("ps-ctl", "--connect", address, "checkpoint", "--timeout", "600", timeout=120)
    assert done.returncode == 0, done.stderr
    match = re.match(r"no trainer group is training: the newest checkpoint is (ckpt-\d{10}), written at step "
                     r"(\d+): (.+)$", done.stdout.strip())
    assert match and (root / match.group(1) / MANIFEST).exists(), done.stdout
    done = commands.run("ps-ctl", "--connect", address, "export", str(tmp_path / "after"), "--timeout", "600",
                        timeout=120)
    assert done.returncode == 0 and f"of {root / match.group(1)} to " in done.stdout, (done.stdout, done.stderr)
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert server.wait(30) == 0

    # Restored from the first checkpoint, two groups again: each worker reads on from its own position there.
    step = int(json.loads((asked / MANIFEST).read_text())["step"])
    server, address = start_server(commands, "--shards", "2", "--group-size", "1", "--restore", str(asked),
                                   "--checkpoint-dir", str(tmp_path / "again"),
                                   "--job-config", job_config(**dict(SMALL, steps=step + 5)))
    restored = [commands.start("ps-worker", "--connect", address) for _ in range(2)]
    for each in restored:
        assert each.wait(120) == 0, errors(each)[-3000:]
    for each in restored:
        index = int(re.search(r"joined \S+ as worker(\d+)", errors(each)).group(1))  # (whichever joined first)
        assert f"data position restored after {positions[index]['used']} batches" in errors(each), index
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert server.wait(30) == 0
    shutil.rmtree(root)


def _shard_verifying_slowly(address: str, seconds: float) -> None:
    """Child: a shard of ``address`` whose checkpoint takes ``seconds`` to verify (a big one, on a slow disk)."""
    from paramserver.checkpoint import storage
    from paramserver.runtime.shard_process import run_shard_member
    verify = storage.Checkpoint.verify

    def slowly(checkpoint):
        time.sleep(seconds)
        verify(checkpoint)
    storage.Checkpoint.verify = slowly
    run_shard_member(address, "shard0", "127.0.0.1")


def test_a_shard_verifying_a_checkpoint_for_long_keeps_its_heartbeats_and_obeys_a_stop(tmp_path):
    timeout = datetime.timedelta(seconds=1)
    store = CheckpointStore(tmp_path)
    directory = store.new_directory(10)
    store.commit(directory, [save_tensors(directory / "dense.pt", {"step": 10})], 10, {})
    server = CoordinatorServer(CoordinatorSettings(
        port=0, heartbeat_interval=datetime.timedelta(seconds=0.1), heartbeat_timeout=timeout,
        checkpoints=CheckpointOptions(directory=str(tmp_path), restore=str(directory))),
        request_shutdown=lambda reason: None).start()
    client = CoordinatorClient(server.address)
    shard = multiprocessing.get_context("spawn").Process(target=_shard_verifying_slowly,
                                                         args=(server.address, 4 * timeout.total_seconds()))
    shard.start()
    try:
        joined = time.monotonic() + 60
        while not client.status().shards and time.monotonic() < joined:
            time.sleep(0.05)
        time.sleep(2.5 * timeout.total_seconds())  # verifying: well past the heartbeat timeout
        [verifying] = client.status().shards
        assert (verifying.state, verifying.ready) == ("alive", False), verifying
        os.kill(shard.pid, signal.SIGTERM)  # before it serves: it must not serve after all
        shard.join(4 * timeout.total_seconds() + 15)
        assert shard.exitcode == 0
        [stopped] = client.status().shards
        assert (stopped.state, stopped.ready, stopped.reason) == ("left", False, "stopped"), stopped
    finally:
        if shard.is_alive():
            shard.kill()
        shard.join(10)
        client.close()
        server.stop(datetime.timedelta(seconds=0))
