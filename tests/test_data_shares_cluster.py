"""Shares dealt by the membership, end to end through the real commands: two workers follow an input of
numbered lines (no ``data.workers`` anywhere; while one file is there, its holder trains on it and the other
member sits those steps out), one is SIGKILLed mid-stream, a third joins, more files land, and every line is
trained exactly once by a step the group completed (``tests/jobs/count_lines.py`` records the lines of every
step).  The killed worker's step in flight (not completed by the group) is re-read by
the member its part went to: each of its lines is counted once among the completed steps.  Then two trainer
groups (``--group-size 1``) follow one input: each line is trained once over both; a job restored from a
checkpoint onto one group reads what the lost second group had claimed since (claims are per run); and the
part a group lost whole had under way is trained by the other once the coordinator says the group is gone."""

import json
import os
import pathlib
import re
import signal
import sys
import time
from typing import Dict, List, Tuple

import pytest

from commands import errors, job_config, start_server, wait_for_status

sys.path.insert(0, str(pathlib.Path(__file__).parent / "jobs"))
from count_lines import numbered  # noqa: E402

pytestmark = pytest.mark.timeout(180)

JOB = f"{pathlib.Path(__file__).parent / 'jobs' / 'count_lines.py'}:main"
LINES_PER_FILE = 30  # with 4 lines a batch, batches run across files


def land(folder: pathlib.Path, number: int, first: int, count: int = LINES_PER_FILE) -> None:
    target = folder / f"part-{number:03d}.txt"
    scratch = folder / f".{target.name}.inprogress"  # hidden until whole, as writers do
    scratch.write_text("".join(numbered(index) + "\n" for index in range(first, first + count)))
    scratch.rename(target)


def attempts(folder: pathlib.Path) -> Dict[str, Dict[int, List[List[int]]]]:
    """Per worker, per step: the lines of each forward pass of that step, in order."""
    found: Dict[str, Dict[int, List[List[int]]]] = {}
    for path in folder.glob("*.txt"):
        steps = found.setdefault(path.stem, {})
        for text in path.read_text().splitlines():
            match = re.fullmatch(r"(\d+) ([\d,]+)", text)
            if match:  # (the killed worker's last record may be cut short)
                steps.setdefault(int(match.group(1)), []).append([int(line) for line in match.group(2).split(",")])
    return found


def records(folder: pathlib.Path) -> Dict[str, Dict[int, List[int]]]:
    """Per worker, per step: the lines of the last forward pass of that step (a step done again after its group
    re-formed trains the same batch: the last record stands)."""
    return {worker: {step: tries[-1] for step, tries in steps.items()}
            for worker, steps in attempts(folder).items()}


def trained(found, killed: str, resumed: int, final: Dict[str, int]) -> Tuple[List[int], List[int]]:
    """The lines of the steps the group completed (each member's records below the step it ended at; the killed
    worker's below the step its group resumed at), and the killed worker's step in flight."""
    lines, in_flight = [], []
    for worker, steps in found.items():
        end = resumed if worker == killed else final.get(worker, 1 << 62)
        for step, batch in steps.items():
            if step < end:
                lines += batch
            elif worker == killed and step == resumed:
                in_flight = batch
    return lines, in_flight


def wait_for(condition, timeout: float, what: str, processes=()):
    deadline = time.monotonic() + timeout
    while not condition():
        for process in processes:
            assert process.poll() is None, f"{process.args} exited {process.returncode}:\n{errors(process)[-3000:]}"
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.1)


def test_workers_joining_and_killed_mid_stream_train_every_line_once(commands, tmp_path):
    data, folder = tmp_path / "data", tmp_path / "records"
    data.mkdir()
    folder.mkdir()
    land(data, 0, 0)  # one part: one member holds it and trains; the other has none and sits the steps out
    server, address = start_server(commands, "--shards", "1", "--heartbeat-timeout", "2", "--job", JOB,
                                   "--job-config", job_config(train=str(data), records=str(folder)))
    first = [commands.start("ps-worker", "--connect", address) for _ in range(2)]
    sitting_out = re.compile(r"steps from \d+ go on without a batch of this member")
    wait_for(lambda: any(sitting_out.search(errors(worker)) for worker in first) and len(records(folder)) == 1, 60,
             "one member training on the one file while the other sits out", first)
    assert not all(sitting_out.search(errors(worker)) for worker in first)
    for number in range(1, 10):  # about 40 steps of two workers: the kill comes mid-stream
        land(data, number, number * LINES_PER_FILE)
    # both in one group and training: each has trained steps past the first dealing to two
    wait_for(lambda: len(records(folder)) == 2 and all(max(steps, default=0) >= 8
                                                       for steps in records(folder).values()),
             60, "two workers training", first)
    names = {worker["pid"]: worker["name"] for worker in wait_for_status(
        commands, address, lambda status: len(status["workers"]) == 2, 30)["workers"]}
    joiner = commands.start("ps-worker", "--connect", address)  # joins as it is up, about as the group re-forms
    killed_process = first[1]
    killed = names[killed_process.pid]
    os.kill(killed_process.pid, signal.SIGKILL)
    assert killed_process.wait(10) == -signal.SIGKILL
    survivor = first[0]
    for number in range(10, 14):  # land while the group re-forms: dealt by the new membership
        land(data, number, number * LINES_PER_FILE)
    total = 14 * LINES_PER_FILE

    def resumed_at():
        match = re.search(r"re-formed in [\d.]+ s after a failed collective at step \d+: .*, at step (\d+)",
                          errors(survivor))
        return int(match.group(1)) if match else None

    wait_for(lambda: resumed_at() is not None, 60, "the survivor re-forming", [survivor, joiner])
    resumed = resumed_at()

    # Every line trained by a completed step: the last batch of each reader waits for more lines, so padding
    # files (numbered past the lines counted) land until every counted line was trained.
    padding = 14
    deadline = time.monotonic() + 60
    while True:
        lines, _ = trained(records(folder), killed, resumed, {})
        if set(range(total)) <= set(lines) and len(records(folder)) == 3:
            break
        assert time.monotonic() < deadline, f"lines never trained: {sorted(set(range(total)) - set(lines))[:20]}"
        for process in (survivor, joiner):
            assert process.poll() is None, errors(process)[-3000:]
        for _ in range(4):  # enough, most likely, for every member's batches up to the next agreement
            land(data, padding, padding * LINES_PER_FILE, 24)
            padding += 1
        time.sleep(0.5)

    assert commands.run("ps-ctl", "--connect", address, "shutdown").returncode == 0
    for process in (survivor, joiner):
        assert process.wait(60) == 0, errors(process)[-3000:]
    assert server.wait(60) == 0, errors(server)[-3000:]

    figures = {name: json.loads((folder / f"{name}.json").read_text()) for name in records(folder) if name != killed}
    final = {name: figure["steps"] for name, figure in figures.items()}
    for name, figure in figures.items():  # every step accounted for once, the steps sat out with no batch too
        accounted = sum(figure[key] for key in ("sparse_steps", "sparse_steps_lost", "steps_skipped", "steps_sat_out"))
        assert accounted == figure["steps"], (name, figure)  # (the joiner's steps taken from the group: skipped)
    lines, in_flight = trained(records(folder), killed, resumed, final)
    counted = [line for line in lines if line < total]
    assert sorted(counted) == list(range(total)), (
        f"twice: {sorted({line for line in counted if counted.count(line) > 1})[:20]}, "
        f"never: {sorted(set(range(total)) - set(counted))[:20]}")
    padded = [line for line in lines if line >= total]
    assert len(padded) == len(set(padded))  # the padding too, as far as it was trained
    # The killed worker's step in flight (its sparse push may have been applied: docs/fault-tolerance.md): its
    # lines were read again by whoever took its part, once each.
    assert all(counted.count(line) == 1 for line in in_flight)
    # A step a member did again (its group re-formed meanwhile) trained the batch it tried, even where the
    # shares were dealt again in between (its sparse push, which may have left, was of those lines).
    for worker, steps in attempts(folder).items():
        assert all(tries == tries[:1] * len(tries) for tries in steps.values()), (worker, steps)
    joined = next(name for name in final if name not in names.values())
    assert records(folder)[joined], "the worker that joined trained nothing"
    text = errors(survivor)
    assert f"{killed} left the group" in text or f"{killed} left the group" in errors(joiner), text[-3000:]


def land_until(data: pathlib.Path, processes, enough, what, landed: int = 0, within: float = 60) -> int:
    """Land a file every 0.3 s, numbered on from ``landed``, until ``enough(files landed)`` holds, within
    ``within`` seconds (``what()`` says what did not happen), ``processes`` running meanwhile; the files landed."""
    deadline = time.monotonic() + within
    while not enough(landed):
        assert time.monotonic() < deadline, f"{what()}; {landed} files landed"
        for process in processes:
            assert process.poll() is None, errors(process)[-3000:]
        land(data, landed, landed * LINES_PER_FILE)
        landed += 1
        time.sleep(0.3)
    return landed


def pad_until(data: pathlib.Path, processes, trained, wanted: set, padding: int, size: int = LINES_PER_FILE,
              within: float = 60) -> int:
    """Land a short file (24 lines) every 0.5 s, numbered on from ``padding``, until every line of ``wanted``
    is in ``trained()`` (a reader's last batch waits for more lines), within ``within`` seconds,
    ``processes`` running meanwhile; the next file's number."""
    deadline = time.monotonic() + within
    while not wanted <= trained():
        assert time.monotonic() < deadline, f"never trained: {sorted(wanted - trained())[:20]}"
        for process in processes:
            assert process.poll() is None, errors(process)[-3000:]
        land(data, padding, padding * size, 24)
        padding += 1
        time.sleep(0.5)
    return padding


def test_a_job_restored_onto_fewer_groups_reads_what_a_lost_group_had_claimed_after_the_checkpoint(commands,
                                                                                                    tmp_path):
    """Two groups of one (``--group-size 1``) follow an input, each dealt alone: each part is trained by the
    group that claims it first (``paramserver.train.claims``), and every line once over both.  Claims belong to
    one run of the job: a checkpoint is taken, more files land and group 1 trains some of them; both workers
    are killed, and one worker starts the job again (one group) from the checkpoint: it trains every line of
    the files that landed after the checkpoint, those group 1 had claimed included."""
    data, folder, checkpoints = tmp_path / "data", tmp_path / "records", tmp_path / "checkpoints"
    for path in (data, folder):
        path.mkdir()
    server, address = start_server(commands, "--shards", "1", "--group-size", "1", "--heartbeat-timeout", "2",
                                   "--checkpoint-dir", str(checkpoints), "--job", JOB,
                                   "--job-config", job_config(train=str(data), records=str(folder)))
    first = [commands.start("ps-worker", "--connect", address) for _ in range(2)]
    files = land_until(data, first, lambda files: len(records(folder)) == 2 and files >= 12,
                       lambda: f"trained by {sorted(records(folder))} only")  # both groups trained some
    total = files * LINES_PER_FILE
    files = pad_until(data, first, lambda: set(trained(records(folder), "", 0, {})[0]), set(range(total)), files)
    # Every line once over both groups (each trains what it claimed, up to the kill below: no step of theirs
    # is done again), the padding too.
    lines, _ = trained(records(folder), "", 0, {})
    counted = [line for line in lines if line < total]
    assert sorted(counted) == list(range(total)), (
        f"twice: {sorted({line for line in counted if counted.count(line) > 1})[:20]}, "
        f"never: {sorted(set(range(total)) - set(counted))[:20]}")
    padded = [line for line in lines if line >= total]
    assert len(padded) == len(set(padded))
    assert any("is read by another reader" in errors(process) for process in first)  # parts were left
    assert commands.run("ps-ctl", "--connect", address, "checkpoint", timeout=90).returncode == 0
    after = files  # files from here on landed after the checkpoint
    names = {worker["pid"]: worker["name"] for worker in wait_for_status(
        commands, address, lambda status: len(status["workers"]) == 2, 30)["workers"]}
    group_one = names[first[1].pid]  # the second worker to join: group 1

    def claimed_by_group_one():
        return any(line >= after * LINES_PER_FILE for batch in records(folder).get(group_one, {}).values()
                   for line in batch)

    files = land_until(data, first, lambda files: claimed_by_group_one() and files >= after + 4,
                       lambda: "group 1 trained nothing that landed after the checkpoint", landed=files)
    for process in first:
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(10) == -signal.SIGKILL
    wait_for_status(commands, address, lambda status: not any(worker["alive"] for worker in status["workers"]), 30)
    again = commands.start("ps-worker", "--connect", address)
    wanted = set(range(after * LINES_PER_FILE, files * LINES_PER_FILE))

    def trained_again():
        return {line for name, steps in records(folder).items() if name not in names.values()
                for batch in steps.values() for line in batch}

    pad_until(data, [again], trained_again, wanted, files, within=90)
    assert "starts from checkpoint" in errors(again)
    assert commands.run("ps-ctl", "--connect", address, "shutdown").returncode == 0
    assert again.wait(60) == 0, errors(again)[-3000:]
    assert server.wait(60) == 0, errors(server)[-3000:]
    assert re.search(r"job run 2 starts", errors(server)), errors(server)[-3000:]


def test_a_group_lost_whole_has_its_part_under_way_read_again_by_another_once_the_coordinator_says_it_is_gone(
        commands, tmp_path):
    """Two groups of one follow an input of files of 120 lines; group 1's worker is SIGKILLed early in a file
    (the batches it read ahead reach well short of its end: the part is under way) and not replaced.  Once
    the coordinator says the group is gone (no live worker for ``--group-gone-after``), group 0 takes its
    part over and trains every line of it, from its start."""
    data, folder = tmp_path / "data", tmp_path / "records"
    data.mkdir()
    folder.mkdir()
    size = 120
    server, address = start_server(commands, "--shards", "1", "--group-size", "1", "--heartbeat-timeout", "2",
                                   "--group-gone-after", "1", "--job", JOB,
                                   "--job-config", job_config(train=str(data), records=str(folder)))
    workers = [commands.start("ps-worker", "--connect", address) for _ in range(2)]
    statuses = wait_for_status(commands, address, lambda status: len(status["workers"]) == 2, 30)["workers"]
    group_one = next(worker["name"] for worker in statuses if worker["trainer_group"] == 1)
    killed = next(process for process in workers
                  if process.pid == next(w["pid"] for w in statuses if w["name"] == group_one))
    survivor = next(process for process in workers if process is not killed)

    def last_line_of_group_one():
        steps = records(folder).get(group_one, {})
        return steps[max(steps)][-1] if steps else None

    def early_in_a_file(landed):  # group 1's last trained line in a file's first third: what it read ahead is in it
        last = last_line_of_group_one()
        return landed >= 4 and last is not None and last % size < size // 3

    files, next_file, deadline = 0, time.monotonic(), time.monotonic() + 90
    while not early_in_a_file(files):  # a file every 0.4 s, group 1's progress looked at every 0.02 s
        assert time.monotonic() < deadline, f"group 1 never trained early in a file: {last_line_of_group_one()}"
        for process in workers:
            assert process.poll() is None, errors(process)[-3000:]
        if time.monotonic() >= next_file:
            land(data, files, files * size, size)
            files, next_file = files + 1, next_file + 0.4
        time.sleep(0.02)
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.wait(10) == -signal.SIGKILL
    interrupted = last_line_of_group_one() // size  # the file group 1 had under way
    wanted = set(range(interrupted * size, (interrupted + 1) * size))

    def trained_by_group_zero():
        return {line for name, steps in records(folder).items() if name != group_one
                for batch in steps.values() for line in batch}

    pad_until(data, [survivor], trained_by_group_zero, wanted, files, size)
    assert wait_for_status(commands, address, lambda status: True, 10)["trainer_groups_gone"] == [1]
    assert commands.run("ps-ctl", "--connect", address, "shutdown").returncode == 0
    assert survivor.wait(60) == 0, errors(survivor)[-3000:]
    assert server.wait(60) == 0, errors(server)[-3000:]
    assert re.search(rf"takes over \S*/part-{interrupted:03d}\.txt@\S* from trainer group 1, gone", errors(survivor)), \
        errors(survivor)[-3000:]
    assert "trainer group 1 is gone" in errors(server)
