"""Chaos: a shard process SIGKILLed while two workers train the default job.

ps-server restarts it; the new process restores its tables (and their
optimizer state) from the newest checkpoint; the workers rebuild their
handles on the shards, redo or skip the step that failed, and finish the
job.  What the restarted shard serves is the checkpoint's model, not a
fresh one: the loss after recovery stays far below the untrained loss."""

import os
import re
import signal

import pytest

from commands import errors, job_config, output, start_server, status, wait_for_status

pytestmark = pytest.mark.timeout(400)

#: Held-out AUC of rank 0 after 400 steps of this job (oracle 0.789): 0.76 with a shard killed at step ~120,
#: measured, and as much undisturbed.
MIN_AUC = 0.74

SMALL = dict(spec={"vocab_sizes": [2000, 500, 200, 50], "bag_sizes": [1, 2, 1, 1], "num_dense": 4},
             batch_size=256, holdout_size=4096, log_every=10, eval_every=50, row_wise_min_rows=1000,
             sparse_lr=64.0, hook="allreduce")


def test_a_killed_shard_is_restarted_from_the_newest_checkpoint_and_training_goes_on(commands, tmp_path):
    root = tmp_path / "checkpoints"
    server, address = start_server(commands, "--shards", "2", "--heartbeat-timeout", "4", "--checkpoint-dir",
                                   str(root), "--checkpoint-every", "20",
                                   "--job-config", job_config(**dict(SMALL, steps=400)))
    workers = [commands.start("ps-worker", "--connect", address) for _ in range(2)]
    before = wait_for_status(commands, address, lambda s: len(s["workers"]) == 2 and all(
        w["step"] >= 100 for w in s["workers"]) and list(root.glob("ckpt-*/MANIFEST.json")), 240)
    shard1 = next(s for s in before["shards"] if s["name"] == "shard1")
    os.kill(shard1["pid"], signal.SIGKILL)

    for worker in workers:
        assert worker.wait(300) == 0, errors(worker)[-4000:]
    log = errors(server)
    assert re.search(r"restarted shard1 \(pid \d+; restart 1 of at most 3\)", log), log[-3000:]
    after = status(commands, address)
    shard1_now = [s for s in after["shards"] if s["name"] == "shard1" and s["alive"]]
    assert shard1_now and shard1_now[0]["pid"] != shard1["pid"]
    for worker in after["workers"]:
        metrics = worker["metrics"]
        assert worker["state"] == "left" and worker["step"] == 400, worker
        assert metrics["shard_rebuilds"] >= 1, metrics
        # Every step accounted for once: applied, or its sparse update lost with the shard (never twice).
        assert metrics["sparse_steps"] + metrics["sparse_steps_lost"] + metrics["steps_skipped"] == 400, metrics
        assert metrics["sparse_steps_lost"] <= 1, metrics
    group_rank0 = next(w for w in after["workers"] if w["metrics"]["group_rank"] == 0)
    assert group_rank0["metrics"]["auc"] > MIN_AUC, group_rank0
    # The newest checkpoint committed before the kill is what the new shard1 serves, rows and optimizer state.
    log = errors(server)
    killed_at = log.index(f"shard process shard1 (pid {shard1['pid']}) exited")
    newest = re.findall(r"checkpoint (ckpt-\d{10}) committed at step (\d+)", log[:killed_at])[-1]
    assert re.search(rf"shard1 restores its tables from \S*{newest[0]} \(step {newest[1]}\)", log), log[-3000:]
    assert re.search(r"shard1 .* state of (\d+) of its \1 parameters restored from the checkpoint", log), log[-3000:]
    for worker in workers:
        text = errors(worker)
        assert "rebuilding the sparse part" in text, text[-3000:]
        assert "finished" in output(worker)
        # The restarted shard served the checkpoint's rows: the first loss after the rebuild is near a
        # trained model's (as before the kill), not a fresh one's (the first window's, ~0.68).
        losses = window_losses(text)
        rebuilt_at = text.index("sparse part rebuilt")
        trained = [loss for at, _, loss in losses if at < rebuilt_at][-1]
        after_rebuild = next(loss for at, _, loss in losses if at > rebuilt_at)
        fresh = losses[0][2]
        assert after_rebuild < trained + 0.5 * (fresh - trained), (fresh, trained, after_rebuild)
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert server.wait(30) == 0, errors(server)[-3000:]


def window_losses(text: str):
    """(offset in the log, step, loss) of every progress line of a worker's log."""
    return [(m.start(), int(m.group(1)), float(m.group(2)))
            for m in re.finditer(r"step (\d+)/\d+: loss ([\d.]+)", text)]
