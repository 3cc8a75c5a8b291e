"""The storage side of checkpoints (pure, no processes): atomic files, the
manifest written last, refusing corrupt checkpoints by file name in favour
of the previous one, pruning, and cutting row ranges for resharding."""

import json
import os

import pytest
import torch

from paramserver.checkpoint import (MANIFEST, CheckpointStore, CorruptCheckpoint, assemble_rows, atomic_write,
                                    load_tensors, open_checkpoint, parse_range_name, range_name, save_tensors)


def write_checkpoint(store, step, value):
    directory = store.new_directory(step)
    record = save_tensors(directory / "part.pt", {"value": torch.full((4, 3), float(value))})
    return store.commit(directory, [record], step, {"note": value})


def test_an_interrupted_write_leaves_the_old_file_whole_and_no_temporary(tmp_path):
    target = tmp_path / "file.bin"
    target.write_bytes(b"old contents")

    def half_then_fail(file):
        file.write(b"new")
        raise RuntimeError("disk gone")
    with pytest.raises(RuntimeError, match="disk gone"):
        atomic_write(target, half_then_fail)
    assert target.read_bytes() == b"old contents" and os.listdir(tmp_path) == ["file.bin"]


def test_save_and_load_round_trip_with_size_and_hash(tmp_path):
    obj = {"t": torch.arange(10.0), "nested": {"n": 3, "b": b"\x00x"}}
    record = save_tensors(tmp_path / "a.pt", obj)
    assert record.name == "a.pt" and record.bytes == (tmp_path / "a.pt").stat().st_size and len(record.sha256) == 64
    for mmap in (False, True):
        loaded = load_tensors(tmp_path / "a.pt", record, mmap=mmap)
        assert torch.equal(loaded["t"], obj["t"]) and loaded["nested"] == obj["nested"]


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:-10], "bytes, the manifest says"),
    (lambda data: data[:100] + bytes([data[100] ^ 1]) + data[101:], "sha256"),
])
def test_a_damaged_newest_checkpoint_is_refused_by_file_name_and_the_previous_used(tmp_path, damage, message):
    store = CheckpointStore(tmp_path, keep=5)
    write_checkpoint(store, 10, 1.0)
    newest = write_checkpoint(store, 20, 2.0)
    part = newest.file("part.pt")
    part.write_bytes(damage(part.read_bytes()))
    refusals = []
    chosen = store.newest_valid(refusals.append)
    assert chosen.step == 10
    assert len(refusals) == 1 and str(part) in refusals[0] and message in refusals[0]
    with pytest.raises(CorruptCheckpoint, match=str(part)):
        open_checkpoint(newest.path)
    assert open_checkpoint(tmp_path, refusals.append).step == 10


def test_a_garbage_manifest_is_refused_and_a_directory_without_one_skipped(tmp_path):
    store = CheckpointStore(tmp_path, keep=5)
    write_checkpoint(store, 10, 1.0)
    (write_checkpoint(store, 20, 2.0).path / MANIFEST).write_text("{not json")
    store.new_directory(30)  # a crash before the manifest: incomplete
    refusals = []
    assert store.newest_valid(refusals.append).step == 10
    assert len(refusals) == 1 and "ckpt-0000000020" in refusals[0] and "not a valid manifest" in refusals[0]


def test_commit_refuses_missing_or_short_files_and_writes_no_manifest(tmp_path):
    store = CheckpointStore(tmp_path)
    directory = store.new_directory(5)
    record = save_tensors(directory / "part.pt", {"x": torch.zeros(3)})
    with pytest.raises(CorruptCheckpoint, match="other.pt: missing"):
        store.commit(directory, [record, record.__class__("other.pt", 1, "0" * 64)], 5, {})
    with pytest.raises(CorruptCheckpoint, match="its writer reported"):
        store.commit(directory, [record.__class__("part.pt", record.bytes + 1, record.sha256)], 5, {})
    assert not (directory / MANIFEST).exists() and store.complete() == []
    checkpoint = store.commit(directory, [record], 5, {"k": 1})
    assert json.loads((directory / MANIFEST).read_text())["info"] == {"k": 1} and checkpoint.step == 5


def test_directories_are_never_reused_and_pruning_keeps_the_newest(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    assert store.new_directory(7).name == "ckpt-0000000007"
    assert store.new_directory(7).name == "ckpt-0000000007-1"
    for step in (10, 20, 30):
        write_checkpoint(store, step, step)
    newer_incomplete = store.new_directory(40)
    assert [c.step for c in store.complete()] == [30, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000020", "ckpt-0000000030", newer_incomplete.name]


def test_range_names_round_trip_and_odd_names_are_no_ranges():
    assert parse_range_name(range_name("ctr.feature0", 0, 50)) == ("ctr.feature0", 0, 50)
    assert parse_range_name("a[b][3:9]") == ("a[b]", 3, 9)
    for name in ("plain", "t[5:5]", "t[9:3]", "[0:4]", "t[-1:4]"):
        assert parse_range_name(name) is None


@pytest.mark.parametrize("written, wanted", [(4, 2), (2, 4), (3, 1), (1, 3)])
def test_rows_written_in_some_ranges_are_cut_into_others(written, wanted):
    table = torch.randn(103, 5)
    momentum = torch.randn(103)

    def ranges(parts):
        bounds = [round(i * 103 / parts) for i in range(parts + 1)]
        return list(zip(bounds[:-1], bounds[1:]))
    pieces = [(a, b, table[a:b].clone()) for a, b in reversed(ranges(written))]  # in any order
    state = [(a, b, momentum[a:b].clone()) for a, b in ranges(written)]
    for a, b in ranges(wanted):
        assert torch.equal(assemble_rows(pieces, a, b, "t"), table[a:b])
        assert torch.equal(assemble_rows(state, a, b, "m"), momentum[a:b])


def test_missing_rows_are_named():
    pieces = [(0, 10, torch.zeros(10, 2)), (20, 30, torch.zeros(10, 2))]
    with pytest.raises(ValueError, match="table t: the checkpoint lacks rows 10:25"):
        assemble_rows(pieces, 5, 25, "table t")
    with pytest.raises(ValueError, match="holds none of rows 40:50"):
        assemble_rows(pieces, 40, 50, "table t")
