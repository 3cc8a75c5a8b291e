"""The storage side of checkpoints (pure, no processes): atomic files, the
manifest written last, refusing corrupt checkpoints by file name in favour
of the previous one (also for a shard or a worker restarted mid-job), a
full disk named with the file, a failed checkpoint reported in one line,
pruning, and cutting row ranges for resharding."""

import errno
import hashlib
import io
import json
import logging
import os
import pathlib
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from paramserver.checkpoint import storage as checkpoint_module
from paramserver.checkpoint.shard_part import CheckpointSource
from paramserver.checkpoint.dense_part import DENSE_PART
from paramserver.checkpoint.records import CheckpointFailure, CheckpointSettings
from paramserver.runtime.context import JobContext
from paramserver.train.checkpoints import TrainerCheckpoints, restore_point
from paramserver.checkpoint import (MANIFEST, CheckpointStore, CorruptCheckpoint, FileRecord, assemble_rows,
                                    atomic_write, load_tensors, open_checkpoint, parse_range_name, range_name,
                                    save_tensors)


def write_checkpoint(store, step, value):
    directory = store.new_directory(step)
    record = save_tensors(directory / "part.pt", {"value": torch.full((4, 3), float(value))})
    return store.commit(directory, [record], step, {"note": value})


def half_then_fail(file):
    file.write(b"new")
    raise RuntimeError("disk gone")


def temporaries(root):
    return [name for _, _, names in os.walk(root) for name in names if ".tmp-" in name]


def test_atomic_write_replaces_the_file_and_records_what_it_wrote(tmp_path):
    target = tmp_path / "file.bin"
    target.write_bytes(b"old contents")

    def write(file):
        file.write(b"new ")
        assert [n for n in os.listdir(tmp_path) if n.startswith(".file.bin.tmp-")]  # written aside...
        assert target.read_bytes() == b"old contents"  # ...until it is whole
        file.write(memoryview(b"contents!"))
    record = atomic_write(target, write)
    assert target.read_bytes() == b"new contents!"
    assert record == FileRecord("file.bin", 13, hashlib.sha256(b"new contents!").hexdigest())
    assert FileRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    assert temporaries(tmp_path) == []


def test_an_interrupted_write_leaves_the_old_file_whole_and_no_temporary(tmp_path):
    target = tmp_path / "file.bin"
    target.write_bytes(b"old contents")
    with pytest.raises(RuntimeError, match="disk gone"):
        atomic_write(target, half_then_fail)
    assert target.read_bytes() == b"old contents" and os.listdir(tmp_path) == ["file.bin"]


def test_a_crash_while_writing_a_checkpoint_leaves_the_previous_one_in_use(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path, keep=5)
    previous = write_checkpoint(store, 10, 1.0)
    directory = store.new_directory(20)
    record = save_tensors(directory / "part.pt", {"value": torch.zeros(4, 3)})

    def crash(*_):
        raise OSError("power lost")
    monkeypatch.setattr(checkpoint_module.os, "replace", crash)  # the manifest never lands
    with pytest.raises(OSError, match="power lost"):
        store.commit(directory, [record], 20, {})
    with pytest.raises(RuntimeError, match="disk gone"):  # nor does a file that failed midway
        atomic_write(directory / "other.pt", half_then_fail)
    monkeypatch.undo()
    assert not (directory / MANIFEST).exists() and temporaries(tmp_path) == []
    refusals = []
    chosen = store.newest_valid(refusals.append)
    assert chosen.path == previous.path and refusals == []
    assert torch.equal(load_tensors(chosen.file("part.pt"), chosen.files[0])["value"], torch.ones(4, 3))


def test_save_and_load_round_trip_with_size_and_hash(tmp_path):
    obj = {"t": torch.arange(10.0), "m": torch.randn(3, 4, dtype=torch.float16), "nested": {"n": 3, "l": [1, "a"]}}
    record = save_tensors(tmp_path / "a.pt", obj)
    assert record.name == "a.pt" and record.bytes == (tmp_path / "a.pt").stat().st_size and len(record.sha256) == 64
    reference = io.BytesIO()
    torch.save(obj, reference)
    assert record.bytes == len(reference.getvalue())
    for mmap in (False, True):
        loaded = load_tensors(tmp_path / "a.pt", record, mmap=mmap)
        assert torch.equal(loaded["t"], obj["t"]) and torch.equal(loaded["m"], obj["m"])
        assert loaded["nested"] == obj["nested"]
    assert torch.equal(load_tensors(tmp_path / "a.pt")["t"], obj["t"])  # no record: not checked


class OnAnotherDevice(torch.Tensor):
    """Stands in for a GPU tensor where there is none: written as it is, it would not load with
    ``weights_only``; its ``cpu()`` is a plain tensor."""

    def cpu(self, *args, **kwargs):
        return self.as_subclass(torch.Tensor).clone()


@pytest.mark.parametrize("device", ["stand-in", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU here"))])
def test_tensors_on_a_device_are_written_as_cpu_tensors(tmp_path, device):
    def on_device(tensor):
        return tensor.as_subclass(OnAnotherDevice) if device == "stand-in" else tensor.to(device)

    weight = on_device(torch.arange(6.0).view(2, 3))
    module = OrderedDict(weight=weight)
    module._metadata = OrderedDict([("", {"version": 2})])  # as a state_dict carries it
    obj = {"module": module, "optimizer": {"state": {0: {"momentum": on_device(torch.ones(3))}}}, "step": 7,
           "shape": (2, [3, on_device(torch.zeros(1))]), "size": torch.Size([2, 3])}
    record = save_tensors(tmp_path / "dense.pt", obj)
    loaded = load_tensors(tmp_path / "dense.pt", record)  # weights_only: plain CPU tensors, or it fails
    assert isinstance(loaded["module"], OrderedDict) and loaded["module"]._metadata == module._metadata
    assert loaded["step"] == 7 and loaded["size"] == torch.Size([2, 3]) and loaded["shape"][0] == 2
    assert torch.equal(loaded["shape"][1][1], torch.zeros(1))
    assert module["weight"] is weight  # what was saved is left as it was
    for tensor, expected in ((loaded["module"]["weight"], torch.arange(6.0).view(2, 3)),
                             (loaded["optimizer"]["state"][0]["momentum"], torch.ones(3))):
        assert type(tensor) is torch.Tensor and tensor.device.type == "cpu" and torch.equal(tensor, expected)


def test_an_unloadable_file_is_a_corrupt_checkpoint_naming_it(tmp_path):
    path = tmp_path / "junk.pt"
    record = atomic_write(path, lambda file: file.write(b"not a torch file"))
    with pytest.raises(CorruptCheckpoint, match=rf"{path}: not loadable"):
        load_tensors(path, record)
    with pytest.raises(CorruptCheckpoint, match=rf"{tmp_path / 'gone.pt'}: missing"):
        load_tensors(tmp_path / "gone.pt", record)


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:-10], "bytes, expected"),
    (lambda data: data[:100] + bytes([data[100] ^ 1]) + data[101:], "sha256 mismatch"),
])
def test_a_damaged_newest_checkpoint_is_refused_by_file_name_and_the_previous_used(tmp_path, damage, message):
    store = CheckpointStore(tmp_path, keep=5)
    write_checkpoint(store, 10, 1.0)
    newest = write_checkpoint(store, 20, 2.0)
    part = pathlib.Path(newest.file("part.pt"))
    part.write_bytes(damage(part.read_bytes()))
    with pytest.raises(CorruptCheckpoint, match=rf"{part}: .*{message}"):
        load_tensors(part, newest.files[0])
    refusals = []
    chosen = store.newest_valid(refusals.append)
    assert chosen.step == 10
    assert len(refusals) == 1 and str(part) in refusals[0] and message in refusals[0]
    assert refusals[0].startswith(f"refusing checkpoint {newest.path}: ") and "trying the previous one" in refusals[0]
    with pytest.raises(CorruptCheckpoint, match=str(part)):
        open_checkpoint(newest.path)
    assert open_checkpoint(tmp_path, refusals.append).step == 10


def test_a_restarting_shard_restores_from_the_newest_checkpoint_that_verifies(tmp_path, caplog):
    store = CheckpointStore(tmp_path, keep=5)
    write_checkpoint(store, 10, 1.0)
    newest = write_checkpoint(store, 20, 2.0)
    write_checkpoint(store, 30, 3.0)  # newer than the one the coordinator names (a --restore of an older point)
    assert CheckpointSource.newest_verified(str(newest.path), 20, "shard1").checkpoint.step == 20
    part = pathlib.Path(newest.file("part.pt"))
    part.write_bytes(part.read_bytes()[:-10])  # damaged after it was committed
    source = CheckpointSource.newest_verified(str(newest.path), 20, "shard1")
    assert source.checkpoint.step == 10
    refusals = [r.getMessage() for r in caplog.records if "not restoring from" in r.getMessage()]
    assert refusals == [f"shard shard1: not restoring from {newest.path}: {part}: size "
                        f"{part.stat().st_size} bytes, expected {newest.files[0].bytes} (truncated or replaced)"]
    older = pathlib.Path(source.checkpoint.file("part.pt"))
    older.write_bytes(older.read_bytes()[:-1])
    with pytest.raises(CorruptCheckpoint, match=rf"^shard shard1: no checkpoint to restore from verifies: .*{part}.*"
                                                rf"; .*{older}"):
        CheckpointSource.newest_verified(str(newest.path), 20, "shard1")


def test_a_checkpoint_source_that_cannot_read_its_file_says_so_once_not_per_table_asked_for(tmp_path, caplog):
    store = CheckpointStore(tmp_path)
    directory = store.new_directory(10)
    part = save_tensors(directory / "shard-shard0.pt", {"format": 1, "shard": "shard0", "tables": {
        "t[0:4]": {"value": torch.ones(4, 3), "optimizer": "", "state": {}}}})
    checkpoint = store.commit(directory, [part], 10, {})
    assert torch.equal(CheckpointSource(checkpoint).rows("t[1:3]", 2, 3, torch.float32), torch.ones(2, 3))
    pathlib.Path(directory / part.name).write_bytes(b"\0" * part.bytes)  # broken after it was checked (or never checked)
    for verified in (True, False):
        caplog.clear()
        source = CheckpointSource(checkpoint, verified=verified)
        for _ in range(100):  # every table a trainer asks for
            with pytest.raises(CorruptCheckpoint, match=str(directory / part.name)):
                source.rows("t[0:4]", 4, 3, torch.float32)
        assert len([r for r in caplog.records if "cannot restore from checkpoint" in r.getMessage()]) == 1


def test_a_worker_joining_mid_job_starts_from_the_newest_dense_part_that_verifies(tmp_path, caplog):
    # the warnings and errors only, whatever level an earlier test in this process left a logger at
    caplog.set_level(logging.WARNING)
    store = CheckpointStore(tmp_path, keep=5)

    def dense_checkpoint(step):
        directory = store.new_directory(step)
        return store.commit(directory, [save_tensors(directory / DENSE_PART, {"step": step})], step, {})
    dense_checkpoint(10)
    newest = dense_checkpoint(20)
    ctx = SimpleNamespace(rpc_name="worker1", checkpoint=CheckpointSettings(
        directory=str(tmp_path), restore_from=str(newest.path), restore_step=20))
    assert restore_point(ctx)["step"] == 20
    dense = pathlib.Path(newest.file(DENSE_PART))
    dense.write_bytes(dense.read_bytes()[:50] + b"X" + dense.read_bytes()[51:])  # damaged after its commit
    assert restore_point(ctx)["step"] == 10
    said = [r.getMessage() for r in caplog.records if "worker1" in r.getMessage()]
    assert len(said) == 2 and said[0].startswith(f"worker1: not restoring from {newest.path}: {dense}: sha256 mismatch")
    assert said[1] == "worker1 falls back to checkpoint ckpt-0000000010 (step 10): the one it was told, of step 20, " \
                      "does not verify"


def test_a_failed_checkpoint_is_reported_to_the_coordinator_in_one_line(tmp_path, caplog):
    reported = []

    def refuse(commit):
        raise RuntimeError(f"coordinator refused CommitCheckpoint: {commit.directory} is odd\n  and a traceback")
    ctx = JobContext(rpc_name="worker0", worker_index=0, trainer_group=0, shards=[], group=None,
                     checkpoint=CheckpointSettings(directory=str(tmp_path)), _commit_checkpoint=refuse,
                     _fail_checkpoint=reported.append)
    replica = SimpleNamespace(step=30, module=torch.nn.Linear(2, 1), hook="allreduce", hook_options={})
    replica.optimizer = torch.optim.SGD(replica.module.parameters(), lr=0.1)
    members = [{"rpc_name": "worker0", "worker_index": 0, "position": {"used": 30, "state": None},
                "hook_state": b""}]
    checkpoints = TrainerCheckpoints(ctx, replica, data_position=lambda: members[0]["position"])
    assert checkpoints._write_on_rank0(members, request=4) is None
    directory = tmp_path / "ckpt-0000000030"
    reason = f"RuntimeError: coordinator refused CommitCheckpoint: {directory} is odd"
    assert reported == [CheckpointFailure(request=4, directory=str(directory), step=30, reason=reason)]
    logged = [r.getMessage() for r in caplog.records if "failed, not committed" in r.getMessage()]
    assert logged == [f"worker0: checkpoint at step 30 failed, not committed: {reason}"]


@pytest.mark.parametrize("manifest", ["{not json", '{"step": 20}', '{"step": "x", "files": []}', "[]"])
def test_a_garbage_manifest_is_refused_and_a_directory_without_one_skipped(tmp_path, manifest):
    store = CheckpointStore(tmp_path, keep=5)
    write_checkpoint(store, 10, 1.0)
    pathlib.Path(write_checkpoint(store, 20, 2.0).path / MANIFEST).write_text(manifest)
    store.new_directory(30)  # a crash before the manifest: incomplete, skipped without a word
    refusals = []
    assert store.newest_valid(refusals.append).step == 10
    assert [c.step for c in store.complete()] == [10]
    assert len(refusals) == 1 and f"ckpt-0000000020/{MANIFEST}" in refusals[0] and "not a valid manifest" in refusals[0]


def test_commit_refuses_missing_or_wrongly_sized_files_and_writes_no_manifest(tmp_path):
    store = CheckpointStore(tmp_path)
    directory = store.new_directory(5)
    record = save_tensors(directory / "part.pt", {"x": torch.zeros(3)})
    with pytest.raises(CorruptCheckpoint, match=rf"{directory / 'other.pt'}: missing"):
        store.commit(directory, [record, FileRecord("other.pt", 1, "0" * 64)], 5, {})
    with pytest.raises(CorruptCheckpoint, match=rf"part.pt: size {record.bytes} bytes, expected {record.bytes + 1}"):
        store.commit(directory, [FileRecord("part.pt", record.bytes + 1, record.sha256)], 5, {})
    assert not (directory / MANIFEST).exists() and store.complete() == []
    checkpoint = store.commit(directory, [record], 5, {"k": 1})
    manifest = json.loads(pathlib.Path(directory / MANIFEST).read_text())
    assert manifest["info"] == {"k": 1} and manifest["format"] == 1 and manifest["id"] == directory.name
    assert checkpoint.step == 5 and checkpoint.id == directory.name and checkpoint.files == [record]
    assert store.complete()[0].manifest == manifest


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep must be at least 1, got 0"):
        CheckpointStore(tmp_path, keep=0)


def test_directories_are_never_reused(tmp_path):
    store = CheckpointStore(tmp_path / "new" / "root")
    assert store.new_directory(7).name == "ckpt-0000000007"
    assert store.new_directory(7).name == "ckpt-0000000007-1"
    assert store.new_directory(7).name == "ckpt-0000000007-2"
    assert write_checkpoint(store, 8, 0.0).id == "ckpt-0000000008"
    assert store.new_directory(8).name == "ckpt-0000000008-1"


def test_pruning_keeps_the_newest_and_incomplete_ones_newer_than_them(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    older_incomplete = store.new_directory(5)
    pathlib.Path(older_incomplete / ".part.pt.tmp-abc").write_bytes(b"half")
    for step in (10, 20):
        write_checkpoint(store, step, step)
    middle_incomplete = store.new_directory(25)
    unreadable = store.new_directory(26)
    pathlib.Path(unreadable / MANIFEST).write_text("{half a manif")
    write_checkpoint(store, 30, 30)
    newer_incomplete = store.new_directory(40)
    assert [c.step for c in store.complete()] == [30, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000020", "ckpt-0000000030", newer_incomplete.name]
    assert not any(d.exists() for d in (older_incomplete, middle_incomplete, unreadable))


def test_the_newest_of_one_step_is_the_later_one(tmp_path):
    store = CheckpointStore(tmp_path)
    first, second = write_checkpoint(store, 10, 1.0), write_checkpoint(store, 10, 2.0)
    assert second.id == "ckpt-0000000010-1" and store.newest_valid().path == second.path
    assert [c.path for c in store.complete()] == [second.path, first.path]


def test_open_checkpoint_on_a_root_and_on_a_directory(tmp_path):
    store = CheckpointStore(tmp_path / "root")
    with pytest.raises(FileNotFoundError, match=rf"no checkpoint at {tmp_path / 'root'}"):
        open_checkpoint(tmp_path / "root")
    older = write_checkpoint(store, 10, 1.0)
    newest = write_checkpoint(store, 20, 2.0)
    assert open_checkpoint(store.root).path == newest.path
    assert open_checkpoint(str(older.path)).step == 10
    incomplete = store.new_directory(30)
    with pytest.raises(FileNotFoundError, match=rf"{incomplete} is incomplete"):
        open_checkpoint(incomplete)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=rf"no valid checkpoint under {tmp_path / 'empty'}"):
        open_checkpoint(tmp_path / "empty")


def test_range_names_round_trip_and_odd_names_are_no_ranges():
    assert range_name("ctr.feature0", 0, 50000) == "ctr.feature0[0:50000]"
    assert parse_range_name("ctr.feature0[0:50000]") == ("ctr.feature0", 0, 50000)
    assert parse_range_name(range_name("t", 7, 9)) == ("t", 7, 9)
    assert parse_range_name("a[b][3:9]") == ("a[b]", 3, 9)
    for name in ("plain", "t[5:5]", "t[9:3]", "[0:4]", "t[-1:4]", "t[0:4]x", "t[0:]", "t[a:4]"):
        assert parse_range_name(name) is None, name


def split(rows, parts):
    bounds = [round(i * rows / parts) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize("written, wanted", [(4, 2), (2, 4), (3, 1), (1, 3), (3, 7)])
def test_rows_written_in_some_ranges_are_cut_into_others(written, wanted):
    table = torch.randn(103, 5)
    momentum = torch.randn(103)  # 1-D state: rows are its only dimension
    pieces = [(a, b, table[a:b].clone()) for a, b in reversed(split(103, written))]  # in any order
    state = [(a, b, momentum[a:b].clone()) for a, b in split(103, written)]
    ranges = split(103, wanted)
    resharded = [assemble_rows(pieces, a, b, "t") for a, b in ranges]
    assert torch.equal(torch.cat(resharded), table) and all(r.is_contiguous() for r in resharded)
    assert torch.equal(torch.cat([assemble_rows(state, a, b, "m") for a, b in ranges]), momentum)
    whole = assemble_rows(pieces, 0, 103, "t")
    whole[0] += 1  # a copy, not a view of a piece
    assert torch.equal(pieces[-1][2], table[:pieces[-1][1]])


def test_missing_rows_are_named():
    pieces = [(20, 30, torch.zeros(10, 2)), (0, 10, torch.zeros(10, 2))]
    with pytest.raises(ValueError, match="table t: the checkpoint lacks rows 10:20"):
        assemble_rows(pieces, 5, 25, "table t")
    with pytest.raises(ValueError, match="table t: the checkpoint lacks rows 30:35"):
        assemble_rows(pieces, 25, 35, "table t")
    with pytest.raises(ValueError, match="table t: the checkpoint lacks rows 10:12"):
        assemble_rows(pieces + [(12, 20, torch.zeros(8, 2))], 0, 30, "table t")
    with pytest.raises(ValueError, match="holds none of rows 40:50"):
        assemble_rows(pieces, 40, 50, "table t")
    with pytest.raises(ValueError, match=r"table t: piece 0:10 holds a tensor of shape \(9, 2\), not 10 rows"):
        assemble_rows([(0, 10, torch.zeros(9, 2))], 0, 5, "table t")


def test_a_full_disk_is_named_with_the_file_and_leaves_nothing_behind(tiny_disk):
    store = CheckpointStore(tiny_disk)
    directory = store.new_directory(10)
    save_tensors(directory / "shard-shard0.pt", {"rows": torch.zeros(1000)})  # a part that fitted
    with pytest.raises(OSError) as full:
        save_tensors(directory / "shard-shard1.pt", {"rows": torch.zeros(1_000_000)})  # 4 MB
    assert full.value.errno == errno.ENOSPC
    assert str(full.value) == f"[Errno {errno.ENOSPC}] No space left on device: writing {directory}/shard-shard1.pt"
    assert temporaries(tiny_disk) == []
    store.discard(directory)  # what the coordinator does when told the checkpoint failed
    assert list(tiny_disk.iterdir()) == []
