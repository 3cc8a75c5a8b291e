"""The coordinator's side of checkpoints (``paramserver.control.checkpoints``),
in process: requests go to the workers as commands (also every N seconds),
a commit is checked before its manifest is written and answers every
request made before it, a checkpoint that never comes is a timeout naming
why, a writer cannot commit outside the checkpoint root, and members are
told to restore from the newest commit."""

import datetime
import json
import logging
import pathlib
import threading
import time

import grpc
import pytest

from paramserver.checkpoint import MANIFEST, CheckpointStore, save_tensors
from paramserver.control import CoordinatorClient
from paramserver.control.checkpoints import CheckpointCoordinator, CheckpointOptions
from paramserver.control.client import CoordinatorError, CoordinatorUnavailable
from paramserver.control.protocol import pb
from paramserver.control.validation import RequestError


class Workers:
    """Stands in for the membership table: records the commands sent to the workers (``live`` of them)."""

    def __init__(self, live: int = 2):
        self.commands = []
        self.lock = threading.Lock()
        self.live = live

    def __call__(self, command: pb.Command) -> int:
        with self.lock:
            self.commands.append(command)
        return self.live


def written(store: CheckpointStore, step: int):
    """A checkpoint directory with one file in it, as a trainer would have written it."""
    directory = store.new_directory(step)
    record = save_tensors(directory / "dense.pt", {"step": step})
    return directory, [pb.CheckpointFile(**record.to_json())]


def commit_request(directory, files, step, request=0):
    return pb.CommitCheckpointRequest(member_id="m", request=request, directory=str(directory), step=step,
                                      files=files, info_json=json.dumps({"shards": ["shard0"]}))


def test_a_request_reaches_the_workers_and_is_answered_by_the_next_commit(tmp_path):
    workers, store = Workers(), CheckpointStore(tmp_path)
    coordinator = CheckpointCoordinator(store, workers)
    first, second = coordinator.request("ps-ctl checkpoint"), coordinator.request("ps-ctl checkpoint")
    assert [(c.kind, c.checkpoint_id) for c in workers.commands] == [(pb.Command.KIND_CHECKPOINT, "1"),
                                                                     (pb.Command.KIND_CHECKPOINT, "2")]
    directory, files = written(store, 40)
    checkpoint = coordinator.commit("worker0", commit_request(directory, files, 40, request=second))
    assert (directory / MANIFEST).exists() and checkpoint.step == 40
    timeout = datetime.timedelta(seconds=1)
    assert coordinator.wait(first, timeout) == checkpoint and coordinator.wait(second, timeout) == checkpoint
    settings = coordinator.settings()
    assert (settings.restore_from, settings.restore_step, settings.directory) == (str(directory), 40, str(tmp_path))


def test_a_checkpoint_that_never_comes_is_a_timeout_saying_why(tmp_path):
    coordinator = CheckpointCoordinator(CheckpointStore(tmp_path), Workers())
    with pytest.raises(RequestError) as late:
        coordinator.wait(coordinator.request("test"), datetime.timedelta(seconds=0.2))
    # Not DEADLINE_EXCEEDED: a client reads that as the coordinator unreachable.
    assert late.value.code == grpc.StatusCode.FAILED_PRECONDITION and "no trainer group 0 is training" in \
        late.value.message


def test_a_checkpoint_that_failed_answers_its_requests_at_once_and_its_parts_are_removed(tmp_path):
    store = CheckpointStore(tmp_path)
    coordinator = CheckpointCoordinator(store, Workers())
    first, second = coordinator.request("ps-ctl checkpoint"), coordinator.request("ps-ctl checkpoint")
    directory, files = written(store, 40)  # a part written before the failure
    coordinator.fail("worker0", pb.CommitCheckpointRequest(
        member_id="m", request=first, directory=str(directory), step=40,
        failure="RuntimeError: shard1 failed\n  a traceback"))
    started = time.monotonic()
    with pytest.raises(RequestError) as failed:
        coordinator.wait(first, datetime.timedelta(seconds=30))
    assert time.monotonic() - started < 10  # at once, not after the 30 s timeout
    assert failed.value.code == grpc.StatusCode.ABORTED
    assert failed.value.message == ("checkpoint request 1 failed: worker0 could not write it: "
                                     "RuntimeError: shard1 failed a traceback")  # one line
    assert not directory.exists()
    # A later request is answered by a later checkpoint, as ever.
    directory, files = written(store, 50)
    checkpoint = coordinator.commit("worker0", commit_request(directory, files, 50, request=second))
    assert coordinator.wait(second, datetime.timedelta(seconds=1)) == checkpoint


def test_a_failure_settles_only_the_requests_made_and_stays_a_failure(tmp_path):
    store = CheckpointStore(tmp_path)
    coordinator = CheckpointCoordinator(store, Workers())
    first = coordinator.request("ps-ctl checkpoint")
    started = time.monotonic()
    coordinator.fail("worker0", pb.CommitCheckpointRequest(member_id="m", request=2**63, step=10, failure="lost"))
    assert time.monotonic() - started < 10  # not a loop to the number it names
    second = coordinator.request("ps-ctl checkpoint")
    directory, files = written(store, 20)
    checkpoint = coordinator.commit("worker0", commit_request(directory, files, 20, request=second))
    timeout = datetime.timedelta(seconds=1)
    with pytest.raises(RequestError, match="^checkpoint request 1 failed: worker0 could not write it: lost$"):
        coordinator.wait(first, timeout)
    assert coordinator.wait(second, timeout) == checkpoint


def test_a_coordinator_that_stops_answers_a_waiting_request_at_once(tmp_path):
    coordinator = CheckpointCoordinator(CheckpointStore(tmp_path), Workers())
    number = coordinator.request("ps-ctl checkpoint")
    threading.Timer(0.1, coordinator.stop).start()
    started = time.monotonic()
    with pytest.raises(RequestError) as abandoned:
        coordinator.wait(number, datetime.timedelta(seconds=30))
    assert time.monotonic() - started < 5
    assert abandoned.value.code == grpc.StatusCode.ABORTED
    assert abandoned.value.message == "checkpoint request 1 abandoned: the coordinator is shutting down"


class NoAnswer(grpc.RpcError):
    """What a stub raises when a call ends without an answer from the server."""

    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "Deadline Exceeded" if self._code == grpc.StatusCode.DEADLINE_EXCEEDED else "failed to connect"


class Stub:
    def __init__(self, code):
        self.code = code

    def Checkpoint(self, request, timeout, metadata):  # noqa: N802 - the RPC's name
        raise NoAnswer(self.code)


def test_ps_ctl_checkpoint_says_unreachable_only_when_the_coordinator_was_not_reached():
    client = CoordinatorClient("127.0.0.1:1")
    try:
        client._stub = Stub(grpc.StatusCode.DEADLINE_EXCEEDED)  # its wait outlasted the call's deadline
        with pytest.raises(CoordinatorError) as silent:
            client.checkpoint(60)
        assert not isinstance(silent.value, CoordinatorUnavailable)
        assert str(silent.value) == "coordinator 127.0.0.1:1 gave no answer to Checkpoint within 65 s " \
                                    "(DEADLINE_EXCEEDED)"
        client._stub = Stub(grpc.StatusCode.UNAVAILABLE)
        with pytest.raises(CoordinatorUnavailable, match="^coordinator 127.0.0.1:1 unreachable for Checkpoint"):
            client.checkpoint(60)
    finally:
        client.close()


def test_a_starting_cluster_removes_checkpoints_interrupted_before_it_and_keeps_the_committed(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    directory, files = written(store, 20)
    committed = CheckpointCoordinator(store, Workers()).commit("worker0", commit_request(directory, files, 20))
    interrupted = [store.new_directory(step) for step in (10, 30)]  # a crash mid-write, one after the commit
    save_tensors(interrupted[1] / "shard-shard0.pt", {"rows": 1})
    caplog.set_level(logging.INFO, logger="paramserver.control.checkpoints")
    CheckpointCoordinator(store, Workers(), restored=committed).start().stop()
    assert [p.name for p in tmp_path.iterdir()] == [committed.id]
    said = [r.getMessage() for r in caplog.records if "interrupted" in r.getMessage()]
    assert said == [f"removed 2 interrupted checkpoint directories (no {MANIFEST}) under {tmp_path}: "
                    "ckpt-0000000010, ckpt-0000000030"]


def test_every_n_seconds_asks_for_checkpoints_until_stopped(tmp_path):
    workers = Workers()
    coordinator = CheckpointCoordinator(CheckpointStore(tmp_path), workers, every_seconds=0.1).start()
    try:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=10)
        while len(workers.commands) < 3 and datetime.datetime.now() < deadline:
            threading.Event().wait(0.05)
    finally:
        coordinator.stop()
    assert [c.checkpoint_id for c in workers.commands[:3]] == ["1", "2", "3"]


@pytest.mark.parametrize("damage, message", [
    (lambda d, f: (pathlib.Path(d).parent.parent / "elsewhere", f), "is not a checkpoint directory directly inside"),
    (lambda d, f: (d, []), "files is empty"),
    (lambda d, f: (d, [pb.CheckpointFile(name="../escape.pt", bytes=1, sha256="0" * 64)]), "plain file name"),
    (lambda d, f: (d, [pb.CheckpointFile(name="dense.pt", bytes=f[0].bytes, sha256="XYZ")]), "64 lowercase hex"),
    (lambda d, f: (d, [pb.CheckpointFile(name="dense.pt", bytes=f[0].bytes + 1, sha256=f[0].sha256)]),
     "checkpoint refused"),
])
def test_a_bad_commit_is_refused_naming_what_and_writes_no_manifest(tmp_path, damage, message):
    store = CheckpointStore(tmp_path / "root")
    coordinator = CheckpointCoordinator(store, Workers())
    directory, files = written(store, 20)
    bad_directory, bad_files = damage(directory, files)
    with pytest.raises(RequestError, match=message):
        coordinator.commit("worker0", commit_request(bad_directory, bad_files, 20))
    assert not (directory / MANIFEST).exists() and coordinator.newest is None


def test_negative_intervals_are_refused(tmp_path):
    with pytest.raises(ValueError, match="must not be negative"):
        CheckpointCoordinator(CheckpointStore(tmp_path), Workers(), every_seconds=-1)


def test_with_no_trainer_training_a_checkpoint_request_is_answered_at_once_with_the_newest(tmp_path):
    store, workers = CheckpointStore(tmp_path), Workers(live=0)
    coordinator = CheckpointCoordinator(store, workers)
    long = datetime.timedelta(seconds=120)
    with pytest.raises(RequestError) as none:  # none joined yet and nothing committed: nothing to answer with
        coordinator.checkpoint_now("ps-ctl checkpoint", long)
    assert none.value.code == grpc.StatusCode.FAILED_PRECONDITION and "no trainer is training" in \
        none.value.message and "no committed checkpoint" in none.value.message
    directory, files = written(store, 60)
    committed = coordinator.commit("worker0", commit_request(directory, files, 60))
    assert coordinator.checkpoint_now("ps-ctl checkpoint", long) == (committed, False)  # the job ended: at once
    workers.live = 1  # a trainer again: a new checkpoint is asked for and waited for
    with pytest.raises(RequestError, match="was not written within"):
        coordinator.checkpoint_now("ps-ctl checkpoint", datetime.timedelta(seconds=0.2))


def test_a_relative_checkpoint_directory_is_handed_to_members_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = CheckpointStore(tmp_path / "ckpt")
    directory, files = written(store, 20)
    CheckpointCoordinator(store, Workers()).commit("worker0", commit_request(directory, files, 20))
    coordinator = CheckpointCoordinator.from_options(CheckpointOptions(directory="ckpt", restore="ckpt"), Workers())
    settings = coordinator.settings()
    assert settings.directory == str(tmp_path / "ckpt")
    assert settings.restore_from == str(tmp_path / "ckpt" / directory.name) and settings.restore_step == 20


def test_a_coordinator_resumed_from_the_journal_continues_the_numbering_and_stamps_none_of_its_requests(tmp_path):
    """``resume``: request numbers continue above the journaled ones, the requests of the coordinator before
    count as settled (the first commit here answers only the requests made here), and the journaled newest
    checkpoint is what members restore from."""
    store, workers = CheckpointStore(tmp_path), Workers()
    before = CheckpointCoordinator(store, workers)
    directory, files = written(store, 20)
    committed = before.commit("worker0", commit_request(directory, files, 20))
    unanswered = [before.request("ps-ctl checkpoint") for _ in range(3)]  # asked, never written: it was lost
    snapshot = json.loads(json.dumps(before.snapshot()))  # as the journal holds it

    after = CheckpointCoordinator(store, workers)
    after.resume(snapshot)
    assert after.newest.path == committed.path and after.settings().restore_step == 20
    number = after.request("ps-ctl checkpoint")
    assert number == unanswered[-1] + 1 and workers.commands[-1].checkpoint_id == str(number)
    directory, files = written(store, 40)
    checkpoint = after.commit("worker0", commit_request(directory, files, 40, request=unanswered[0]))
    assert after.wait(number, datetime.timedelta(seconds=1)) == checkpoint
    assert sorted(after._answered) == [number]  # none of the journaled requests stamped with it
    assert after.snapshot() == {"requests": number, "newest": str(checkpoint.path)}
