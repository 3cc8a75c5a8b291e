"""A shard process killed three times at random points of a two-worker job, through the real commands: its push
log brings it back with every update.

One cluster of two shards and two workers in one trainer group trains the fault tests' job
(``tests/jobs/watch_next.py``) with float16 rows, its video table dynamic and evicting (a capacity below the ids
it meets), pushes applied one step behind with the row cache, and a checkpoint every 100 steps.  shard1's process
is SIGKILLed three times, at points drawn at random (the seed is printed):

1. as it serves: restarted, it restores the newest checkpoint and replays its log; the workers send again what
   it never applied; nothing is lost;
2. with the last record of its log cut short, as a crash in the middle of a write leaves it (the process
   stopped, a partial record appended, then killed): the cut record is dropped and the rest replayed; nothing
   is lost;
3. with a record in the middle of its log damaged: the restarted shard says in one line that its log is damaged
   and keeps its checkpoint's rows; the workers count every step it rolled back as lost, and nothing else.

Every step of each worker is counted once (applied, lost, or taken from the group)."""

import os
import pathlib
import random
import re
import signal
import time

import pytest

from commands import errors, job_config, start_server, status, wait_for_status
from paramserver.shards.server.push_log import HEADER, PUSH

pytestmark = pytest.mark.timeout(300)

JOB = f"{pathlib.Path(__file__).parent / 'jobs' / 'watch_next.py'}:main"
STEPS = 450
#: Steps the workers train between two kills (past the restart), before a pause drawn at random.
BETWEEN_KILLS = 40


def shard1(state: dict) -> dict:
    return next(s for s in state["shards"] if s["name"] == "shard1" and s["alive"])


def wait_past(commands, address: str, step: int, workers) -> dict:
    """The status once both workers trained past ``step`` with shard1 serving (each worker still running)."""
    deadline = time.monotonic() + 120
    while True:
        state = status(commands, address)
        trained = [w for w in state["workers"] if w["alive"]]
        if len(trained) == 2 and min(w["step"] for w in trained) >= step and any(
                s["name"] == "shard1" and s["alive"] and s["ready"] for s in state["shards"]):
            return state
        assert time.monotonic() < deadline and all(w.poll() is None for w in workers), \
            [errors(w)[-2000:] for w in workers]
        time.sleep(0.1)


def pushes_in(segment: pathlib.Path) -> list:
    """The offsets of the push records of a log segment."""
    data, offset, pushes = segment.read_bytes(), 0, []
    while offset + HEADER.size <= len(data):
        _, kind, length, _ = HEADER.unpack_from(data, offset)
        if kind == PUSH:
            pushes.append(offset)
        offset += HEADER.size + length
    return pushes


def newest_segment(folder: pathlib.Path, pushes: int = 0) -> pathlib.Path:
    """The newest segment of a push log holding at least ``pushes`` push records (a checkpoint may have begun a
    new one, its marks only, since the log was last looked at)."""
    return max((path for path in folder.glob("segment-*.log") if len(pushes_in(path)) >= pushes),
               key=lambda path: int(path.stem.split("-")[1]))


def test_a_shard_killed_three_times_comes_back_with_every_update_unless_its_log_is_damaged(commands, tmp_path):
    seed = random.randrange(1 << 30)
    print(f"kills drawn with seed {seed}")
    draw = random.Random(seed)
    logs = tmp_path / "push-log"
    server, address = start_server(commands, "--shards", "2", "--group-size", "2", "--group-settle", "1",
                                   "--heartbeat-timeout", "3", "--checkpoint-dir", str(tmp_path / "checkpoints"),
                                   "--checkpoint-every", "100", "--push-log", str(logs), "--job", JOB,
                                   "--job-config", job_config(steps=STEPS, stateful=True, staleness=1,
                                                              cache_rows=10_000, cache_steps=2, dynamic_video=True,
                                                              video_capacity=120, row_dtype="float16",
                                                              log_every=10, eval_every=1000))
    workers = [commands.start("ps-worker", "--connect", address) for _ in range(2)]
    # ps-ctl status shows each shard's log (its size, its appends per second), from its heartbeats
    logged = wait_for_status(commands, address, lambda s: shard1(s)["metrics"].get("push_log.bytes", 0) > 0, 30)
    assert "push_log.appends_per_s" in shard1(logged)["metrics"], shard1(logged)
    trained = 0
    for number in (1, 2, 3):  # each once the workers trained on after the one before, then a pause at random
        trained = max(w["step"] for w in wait_past(commands, address, trained + BETWEEN_KILLS, workers)["workers"])
        deadline = time.monotonic() + 60
        while number == 3 and len(pushes_in(newest_segment(logs / "shard1"))) < 10:  # pushes since its checkpoint
            assert time.monotonic() < deadline, "shard1 logged no pushes"
            time.sleep(0.05)
        time.sleep(draw.uniform(0.0, 0.3))
        victim = shard1(status(commands, address))
        if number > 1:  # stopped first: nothing is written while its log is changed
            os.kill(victim["pid"], signal.SIGSTOP)
            segment = newest_segment(logs / "shard1", pushes=2 if number == 3 else 0)
            if number == 2:  # a record cut short at the end, as a crash in the middle of its write leaves it
                with open(segment, "ab") as log:
                    log.write(b"PSLG\x03\x00\x00\x00\x00\x10\x00\x00")
            else:  # a damaged record before the end: a byte of the first push's payload since the checkpoint flipped
                data = bytearray(segment.read_bytes())
                data[pushes_in(segment)[0] + HEADER.size + 8] ^= 0xFF
                segment.write_bytes(bytes(data))
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for_status(commands, address, lambda s: any(
            x["name"] == "shard1" and x["alive"] and x["ready"] and x["pid"] != victim["pid"] for x in s["shards"]),
                        60)
    for worker in workers:
        assert worker.wait(180) == 0, errors(worker)[-4000:]
    final = status(commands, address)
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert server.wait(30) == 0, errors(server)[-3000:]

    log = errors(server)
    replays = re.findall(r"shard1 INFO \S+ optimizer \d+: replayed (\d+) pushes", log)
    # kills 1 and 2 (one of them may land right as a checkpoint commits, with nothing after it to replay)
    assert replays and all(int(count) > 0 for count in replays), log[-4000:]
    assert re.search(r"push log \S+shard1/segment-\d+\.log: a header cut short at its end .* dropped", log), \
        log[-4000:]
    assert re.search(r"shard shard1: its push log is damaged \(.*before its end\): its tables stay at checkpoint "
                     r"ckpt-\d+, and the pushes applied since are lost", log), log[-4000:]
    assert list((logs / "shard1").glob("damaged-segment-*.log"))
    for worker in workers:
        text, figures = errors(worker), next(w["metrics"] for w in final["workers"] if w["pid"] == worker.pid)
        assert figures["steps"] == STEPS, figures
        assert figures["sparse_steps"] + figures["sparse_steps_lost"] + figures["steps_skipped"] == STEPS, figures
        assert figures["replayed_pushes"] > 0 and figures["shard_rebuilds"] >= 3, figures
        # Only the damaged log lost anything: what shard1 rolled back then, each step counted once.
        rolled = [int(n) for n in re.findall(r"shard shard1 came back without the pushes of (\d+) steps?", text)]
        assert len(rolled) == 1 and figures["sparse_steps_lost"] == rolled[0] > 0, (rolled, figures, text[-3000:])
