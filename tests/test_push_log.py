"""The push log, in one process: a shard that logs its pushes, and a second ``ShardState`` that reads that log
back, as a restarted shard process does, holds the same rows, optimizer state and ledger, bit for bit, for
every row-wise optimizer, float32 and float16 rows, and a dynamic table that evicts; a log cut in its last
record replays the rest; a damaged record before the end is refused and set aside; a checkpoint's mark
anchors the replay, a gap stops it, and a commit cuts the segments before the mark; a shard restored from
its checkpoint part replays the rest of its log to the killed process's rows, bit for bit; a replay that fails
part way sets the log aside and faults the shard."""

import os

import pytest
import torch

from paramserver.filesystems import locate
from paramserver.optim import QHM
from paramserver.optim.records import builtin_records
from paramserver.shards.server import checkpoint_part
from paramserver.shards.server import push_log as push_logs
from paramserver.shards.server.hosted import host_dynamic, host_rows
from paramserver.shards.server.optimizers import OwnerOptimizer, owner_optimizer_for
from paramserver.shards.server.push_log import PushLog
from paramserver.shards.server.state import ShardFault, ShardState
from paramserver.tables import DynamicOptions

ROWS, DIM, PUSHER = 400, 8, 77
RECORDS = [(record.local[0], dict(record.example)) for record in builtin_records()]
RECORD_IDS = [record.name for record in builtin_records()]


def logged_state(folder, since: str = "") -> ShardState:
    state = ShardState()
    state.push_log = PushLog(folder, since)
    return state


def fixed_table(state: ShardState, dtype: torch.dtype, optimizer_cls, options):
    table = host_rows(state, "job.t[0:400]", ROWS, DIM, dtype, 5, 0, shared=True)
    return table, owner_optimizer_for(state, optimizer_cls, [table], [0], (), options)


def pushes(count: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randperm(ROWS, generator=generator)[:60].sort().values, torch.randn(60, DIM, generator=generator))
            for _ in range(count)]


def assert_same_optimizer(left, right) -> None:
    left_state, right_state = left.state_dict(), right.state_dict()
    assert left_state.keys() == right_state.keys()
    for index in left_state:
        for key, value in left_state[index].items():
            assert torch.equal(value, right_state[index][key]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("optimizer_cls, options", RECORDS, ids=RECORD_IDS)
def test_a_second_process_reading_the_log_holds_the_same_rows_state_and_ledger(tmp_path, optimizer_cls, options,
                                                                                dtype):
    state = logged_state(tmp_path)
    table, optimizer = fixed_table(state, dtype, optimizer_cls, options)
    for step, (ids, gradients) in enumerate(pushes(6)):
        assert optimizer.apply_rows([0], [ids], [gradients], "w", (PUSHER, step))
        state.flush_log()
    # as the killed process left it; a restarted one opens the same folder, from the same (initial) values
    again = logged_state(tmp_path)
    replayed_table, replayed = fixed_table(again, dtype, optimizer_cls, options)
    assert torch.equal(replayed_table, table)
    assert_same_optimizer(replayed, optimizer)
    assert replayed.ledger(PUSHER) == (5, 6)
    assert not replayed.apply_rows([0], [torch.tensor([1])], [torch.ones(1, DIM)], "w", (PUSHER, 5))  # known
    # it logs on where the log ended: a third process replays both
    ids, gradients = pushes(1, seed=9)[0]
    assert replayed.apply_rows([0], [ids], [gradients], "w", (PUSHER, 6))
    again.flush_log()
    third_table, third = fixed_table(logged_state(tmp_path), dtype, optimizer_cls, options)
    assert torch.equal(third_table, replayed_table) and third.ledger(PUSHER) == (6, 7)


def test_a_dynamic_table_that_evicts_replays_its_admissions_evictions_and_pushes(tmp_path):
    def made(state):
        slab = host_dynamic(state, "job.d", DIM, torch.float16, 3, 0.1, DynamicOptions(capacity=128), 0, 1)
        return state.dynamic_rows(slab), owner_optimizer_for(state, QHM, [slab], [0], (), dict(lr=0.1, momentum=0.9, nu=0.7))

    state = logged_state(tmp_path)
    rows, optimizer = made(state)
    generator = torch.Generator().manual_seed(1)
    for step in range(12):
        ids = torch.randint(-10**12, 10**12, (90,), generator=generator).unique()
        rows.lookup(ids, step)
        optimizer.apply_rows([0], [ids], [torch.randn(ids.numel(), DIM, generator=generator)], "w", (PUSHER, step))
        state.flush_log()
    assert rows.evicted > 0
    again = logged_state(tmp_path)
    replayed_rows, replayed = made(again)
    held, slots = rows.index.items()
    replayed_held, replayed_slots = replayed_rows.index.items()
    assert torch.equal(held.sort().values, replayed_held.sort().values)
    by_id = lambda ids, slots, slab: slab[slots[ids.argsort()]]  # noqa: E731
    assert torch.equal(by_id(held, slots, rows.slab), by_id(replayed_held, replayed_slots, replayed_rows.slab))
    assert (replayed_rows.admitted, replayed_rows.evicted) == (rows.admitted, rows.evicted)
    assert replayed.ledger(PUSHER) == (11, 12)


def test_a_cut_last_record_is_dropped_and_a_damaged_one_before_the_end_sets_the_log_aside(tmp_path, caplog):
    state = logged_state(tmp_path)
    table, optimizer = fixed_table(state, torch.float32, QHM, dict(lr=0.1, momentum=0.9, nu=0.7))
    applied = []
    for step, (ids, gradients) in enumerate(pushes(4)):
        optimizer.apply_rows([0], [ids], [gradients], "w", (PUSHER, step))
        state.flush_log()
        applied.append(table.detach().clone())
    segment = next(tmp_path.glob("segment-*.log"))
    size = segment.stat().st_size
    os.truncate(segment, size - 100)  # the last push's record, cut by the crash
    cut_table, cut = fixed_table(logged_state(tmp_path), torch.float32, QHM, dict(lr=0.1, momentum=0.9, nu=0.7))
    assert torch.equal(cut_table, applied[2]) and cut.ledger(PUSHER) == (2, 3)
    assert "dropped" in caplog.text

    data = bytearray(segment.read_bytes())
    data[200] ^= 0xFF  # inside the first push's record: records follow it
    segment.write_bytes(bytes(data))
    damaged = PushLog(tmp_path, "")
    assert damaged.fallback is not None and "before its end" in damaged.fallback
    assert list(tmp_path.glob("damaged-segment-*.log"))
    fresh_table, fresh = fixed_table(ShardState(), torch.float32, QHM, dict(lr=0.1, momentum=0.9, nu=0.7))
    state = ShardState()
    state.push_log = damaged
    fallen_table, fallen = fixed_table(state, torch.float32, QHM, dict(lr=0.1, momentum=0.9, nu=0.7))
    assert torch.equal(fallen_table, fresh_table) and fallen.ledger(PUSHER) == (-1, 0)


def test_marks_anchor_a_replay_a_gap_stops_it_and_a_commit_cuts_the_segments_before_the_mark(tmp_path):
    log = PushLog(tmp_path, "")
    ids, gradients = torch.tensor([1, 2]), torch.ones(2, DIM)
    log.append_push(5, PUSHER, 0, [0], [2], [DIM], [ids], [gradients])
    log.rotate()
    log.append_mark(5, "ckpt-1")
    log.append_push(5, PUSHER, 1, [0], [2], [DIM], [ids], [gradients])
    log.append_push(6, PUSHER, 1, [0], [2], [DIM], [ids], [gradients])
    log.append_gap(6)
    log.flush()
    read = PushLog(tmp_path, "")
    assert [entry.kind for entry in read.plan("", {5})] == [push_logs.PUSH] * 2
    assert len(read.plan("ckpt-1", {5})) == 1 and read.read(read.plan("ckpt-1", {5})[0]).step == 1
    assert read.plan("", {6}) is None and read.plan("ckpt-2", {5}) is None
    assert read.committed("ckpt-1") == 1
    assert len(list(tmp_path.glob("segment-*.log"))) == 1
    assert PushLog(tmp_path, "").plan("ckpt-1", {5}) is not None


class PartSource:
    """A checkpoint part as a restarted shard's restore source reads it (``CheckpointSource``'s methods)."""

    def __init__(self, part: dict, key: str):
        self.part, self.key = part, key

    def rows(self, name, num_rows, embedding_dim, dtype):
        entry = self.part["tables"].get(name)
        return None if entry is None else entry["value"].clone()

    def dynamic_part(self, table, index, count):
        entry = self.part["tables"].get(f"{table}@{index}/{count}")
        return None if entry is None else dict(ids=entry["ids"], values=entry["value"], last_touch=entry["last_touch"],
                                               optimizer=entry["optimizer"], state=entry["state"],
                                               admission=entry["admission"], clock=entry["clock"])

    def check_row_type(self, table, held, wanted):
        pass

    def optimizer_of(self, name):
        entry = self.part["tables"].get(name)
        return entry["optimizer"] if entry else None

    def optimizer_state(self, name, optimizer):
        entry = self.part["tables"].get(name)
        return entry["state"] if entry else None

    def ledger(self, tag):
        return {int(pusher): step for pusher, step in self.part["ledgers"].get(str(tag), {}).items()}


def test_a_shard_restored_from_its_checkpoint_part_and_log_holds_the_killed_processes_rows_bit_for_bit(tmp_path):
    """QHM keeps its momentum scaled; a checkpoint rounds what it keeps to what a restore of it holds."""
    def made(state):
        user = host_rows(state, "job.user[0:300]", 300, DIM, torch.float32, 7, 0, shared=True, init_std=0.1)
        videos = host_dynamic(state, "job.video", DIM, torch.float32, 9, 0.1, DynamicOptions(capacity=90), 0, 2)
        return [user, videos], owner_optimizer_for(state, QHM, [user, videos], [0, 1], (),
                                                    dict(lr=16.0, momentum=0.9, nu=0.7))

    def train(state, params, optimizer, steps, generator):
        for step in steps:
            ids = torch.randint(-10**9, 10**9, (50,), generator=generator).unique()
            state.dynamic_rows(params[1]).lookup(ids, step)
            rows = torch.randperm(300, generator=generator)[:80].sort().values
            optimizer.apply_rows([0, 1], [rows, ids], [torch.randn(80, DIM, generator=generator),
                                                       torch.randn(ids.numel(), DIM, generator=generator)],
                                 "w", (PUSHER, step))
            state.flush_log()

    state, generator = logged_state(tmp_path / "log"), torch.Generator().manual_seed(0)
    params, optimizer = made(state)
    train(state, params, optimizer, range(20), generator)
    (tmp_path / "ckpt-20").mkdir()
    checkpoint_part.write_part(state, locate(str(tmp_path / "ckpt-20")), "shard0")
    checkpoint_part.committed(state, str(tmp_path / "ckpt-20"))
    train(state, params, optimizer, range(20, 29), generator)  # then the process is killed

    part = torch.load(tmp_path / "ckpt-20" / "shard-shard0.pt", weights_only=True)
    again = ShardState(PartSource(part, "ckpt-20"))
    again.push_log = PushLog(tmp_path / "log", "ckpt-20")
    replayed, replayed_optimizer = made(again)
    assert torch.equal(replayed[0], params[0])
    momentum, momentum_again = optimizer.state_dict(), replayed_optimizer.state_dict()
    assert torch.equal(momentum[0]["momentum_buffer"], momentum_again[0]["momentum_buffer"])
    held, slots = state.dynamic_rows(params[1]).index.items()
    held_again, slots_again = again.dynamic_rows(replayed[1]).index.items()
    assert torch.equal(held.sort().values, held_again.sort().values)  # the same ids, in slots of their own
    by_id, by_id_again = slots[held.argsort()], slots_again[held_again.argsort()]
    assert torch.equal(params[1][by_id], replayed[1][by_id_again])
    assert torch.equal(momentum[1]["momentum_buffer"][by_id], momentum_again[1]["momentum_buffer"][by_id_again])
    assert replayed_optimizer.ledger(PUSHER) == (28, 9)


def test_a_replay_that_fails_part_way_sets_the_log_aside_and_faults_the_shard(tmp_path, monkeypatch):
    state = logged_state(tmp_path)
    _, optimizer = fixed_table(state, torch.float32, QHM, dict(lr=0.1, momentum=0.9, nu=0.7))
    for step, (ids, gradients) in enumerate(pushes(3)):
        optimizer.apply_rows([0], [ids], [gradients], "w", (PUSHER, step))
        state.flush_log()
    again = logged_state(tmp_path)
    applied = []

    def failing_on_the_second(self, *args, **options):
        applied.append(args)
        if len(applied) == 2:
            raise RuntimeError("out of memory (injected)")
        return original(self, *args, **options)
    original = OwnerOptimizer.apply_rows
    monkeypatch.setattr(OwnerOptimizer, "apply_rows", failing_on_the_second)
    with pytest.raises(ShardFault, match="replaying the push log failed after 1 pushes"):
        fixed_table(again, torch.float32, QHM, dict(lr=0.1, momentum=0.9, nu=0.7))
    assert again.faulted and not list(tmp_path.glob("segment-*.log"))
    assert len(list(tmp_path.glob("damaged-segment-*.log"))) == 1


def test_a_write_that_fails_sets_the_log_aside_and_nothing_more_is_logged(tmp_path, monkeypatch, caplog):
    state = logged_state(tmp_path)
    _, optimizer = fixed_table(state, torch.float32, QHM, dict(lr=0.1, momentum=0.9, nu=0.7))
    (ids, gradients), = pushes(1)
    optimizer.apply_rows([0], [ids], [gradients], "w", (PUSHER, 0))

    def full(*_args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(push_logs.os, "writev", full)
    state.flush_log()  # the push stays applied; the log goes
    monkeypatch.undo()
    assert "No space left on device" in state.push_log.broken and "set aside" in caplog.text
    optimizer.apply_rows([0], [ids], [gradients], "w", (PUSHER, 1))
    state.flush_log()
    assert not list(tmp_path.glob("segment-*.log")) and list(tmp_path.glob("damaged-segment-*.log"))
    _, restarted = fixed_table(logged_state(tmp_path), torch.float32, QHM, dict(lr=0.1, momentum=0.9, nu=0.7))
    assert restarted.ledger(PUSHER) == (-1, 0)  # a new log, from the initial values: nothing replayed


def test_the_logs_figures_are_its_metrics(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest
    from paramserver.metrics.push_log import PushLogCollector
    state = logged_state(tmp_path)
    _, optimizer = fixed_table(state, torch.float32, QHM, dict(lr=0.1, momentum=0.9, nu=0.7))
    (ids, gradients), = pushes(1)
    optimizer.apply_rows([0], [ids], [gradients], "w", (PUSHER, 0))
    state.flush_log()
    registry = CollectorRegistry()
    registry.register(PushLogCollector(lambda: state.push_log.figures.as_dict()))
    text = generate_latest(registry).decode()
    assert "paramserver_push_log_appends_total 2.0" in text  # the log's beginning and the push
    size = sum(path.stat().st_size for path in tmp_path.glob("segment-*.log"))
    assert f"paramserver_push_log_bytes {float(size)}" in text
    empty = CollectorRegistry()
    empty.register(PushLogCollector(lambda: None))
    assert "push_log" not in generate_latest(empty).decode()
