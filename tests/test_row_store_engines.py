"""The row store's engines, in one process, each against the contract (``row_store/engine.py``): put, get,
overwrite and delete, each seen by the next call; ``scan`` gives exactly the records held; a random sequence
of calls, large batches among them, against a dict, bit for bit; the counters; ``close(remove=True)`` removes
the folder; bad arguments refused naming what was wrong; a full disk (a 1 MiB tmpfs) raised as an
``OSError`` naming where.  Then what only RocksRows does: reopening a folder,
and an estimated row count.  The log engine's own cases are in ``test_row_log.py``."""

import errno
import random

import pytest
import torch

from paramserver.shards.server.row_store.engine import ENGINE_STATS
from paramserver.shards.server.row_store.rocks import RocksRows
from paramserver.shards.server.row_store.row_log import RowLog, RowLogBuilds

RECORD_BYTES = 12


@pytest.fixture(params=["rocks", "row_log"])
def engine_class(request):
    if request.param == "rocks":
        return RocksRows
    if RowLogBuilds().build("baseline") is None:
        pytest.skip("no build of the row log's C library here (no C compiler)")
    return RowLog


@pytest.fixture
def engine(engine_class, tmp_path):
    opened = engine_class(tmp_path / "rows", RECORD_BYTES, read_threads=4)
    yield opened
    opened.close()


def records_of(ids: torch.Tensor, version: int) -> torch.Tensor:
    """A record for each id that tells the id and the version apart (every byte of it)."""
    bytes_ = torch.arange(RECORD_BYTES, dtype=torch.int64)
    return ((ids.view(-1, 1) * 1_000_003 + version * 7919 + bytes_ * 31) % 251).to(torch.uint8).contiguous()


def read(engine, ids: torch.Tensor):
    out = torch.full((ids.numel(), RECORD_BYTES), 0xAB, dtype=torch.uint8)
    found = engine.get(ids, out)
    assert found.dtype == torch.bool and tuple(found.shape) == (ids.numel(),)
    assert (out[~found] == 0xAB).all(), "a row of out whose id is not held was written"
    return found, out


def scanned(engine, batch: int) -> dict:
    held = {}
    for ids, records in engine.scan(batch):
        assert ids.dtype == torch.int64 and records.dtype == torch.uint8
        assert 0 < ids.numel() <= batch and tuple(records.shape) == (ids.numel(), RECORD_BYTES)
        for key, record in zip(ids.tolist(), records):
            assert key not in held, f"id {key} scanned twice"
            held[key] = bytes(record.tolist())
    return held


def test_put_get_overwrite_delete(engine):
    ids = torch.tensor([5, 0, -3, 2**62, -2**63, 2**63 - 1, 17], dtype=torch.int64)
    engine.put(ids, records_of(ids, 1))
    found, out = read(engine, ids)
    assert found.all() and torch.equal(out, records_of(ids, 1))

    engine.put(ids[:3], records_of(ids[:3], 2))  # an overwrite is seen at once
    found, out = read(engine, torch.cat([ids, torch.tensor([99])]))
    assert found.tolist() == [True] * 7 + [False]
    assert torch.equal(out[:3], records_of(ids[:3], 2)) and torch.equal(out[3:7], records_of(ids[3:], 1))

    engine.delete(torch.tensor([0, 2**62, 12345]))  # an id not held is ignored
    found, out = read(engine, ids)
    assert found.tolist() == [True, False, True, False, True, True, True]
    assert engine.stats()["rows"] == 5

    engine.put(torch.tensor([0]), records_of(torch.tensor([0]), 3))  # a deleted id put again
    found, out = read(engine, torch.tensor([0]))
    assert found.item() and torch.equal(out, records_of(torch.tensor([0]), 3))

    empty = torch.empty(0, dtype=torch.int64)
    engine.put(empty, torch.empty(0, RECORD_BYTES, dtype=torch.uint8))
    engine.delete(empty)
    assert read(engine, empty)[0].numel() == 0


def test_scan_gives_exactly_the_records_held(engine):
    ids = torch.arange(-50, 250, dtype=torch.int64)
    engine.put(ids, records_of(ids, 1))
    engine.flush()
    engine.put(ids[::3].contiguous(), records_of(ids[::3], 2))
    engine.delete(ids[1::5].contiguous())
    expected = {}
    for key in ids.tolist():
        if (key + 50) % 5 != 1:
            version = 2 if (key + 50) % 3 == 0 else 1
            expected[key] = bytes(records_of(torch.tensor([key]), version)[0].tolist())
    assert scanned(engine, 7) == expected
    assert scanned(engine, 10_000) == expected
    assert engine.stats()["rows"] == len(expected)


def test_random_calls_against_a_dict(engine_class, tmp_path):
    """Puts, overwrites, deletes, gets (some of 700 ids, over several read threads), scans and flushes, drawn
    at random, each checked against a dict of what should be held."""
    rng = random.Random(7)
    universe = list(range(-40, 600)) + [2**63 - 1, -2**63, 2**40 + 3]
    model = {}
    engine = engine_class(tmp_path / "rows", RECORD_BYTES, read_threads=3)
    try:
        for step in range(160):
            action = rng.random()
            size = rng.choice((1, 5, 40, 700))
            ids = torch.tensor(rng.sample(universe, min(size, len(universe))), dtype=torch.int64)
            if action < 0.45:
                records = torch.randint(0, 256, (ids.numel(), RECORD_BYTES), dtype=torch.uint8)
                engine.put(ids, records)
                for key, record in zip(ids.tolist(), records):
                    model[key] = bytes(record.tolist())
            elif action < 0.6:
                engine.delete(ids)
                for key in ids.tolist():
                    model.pop(key, None)
            elif action < 0.9:
                found, out = read(engine, ids)
                for key, hit, record in zip(ids.tolist(), found.tolist(), out):
                    assert hit == (key in model), f"step {step}: id {key} held is {hit}"
                    if hit:
                        assert bytes(record.tolist()) == model[key], f"step {step}: id {key}'s record"
            elif action < 0.95:
                assert scanned(engine, rng.choice((1, 64, 1000))) == model, f"step {step}: scan"
            else:
                engine.flush()
            assert engine.stats()["rows"] == len(model), f"step {step}: rows"
        assert scanned(engine, 100) == model
    finally:
        engine.close()


def test_stats_count_what_was_read_and_written(engine):
    assert set(engine.stats()) == set(ENGINE_STATS)
    ids = torch.arange(100, dtype=torch.int64)
    engine.put(ids, records_of(ids, 1))
    engine.put(ids[:10], records_of(ids[:10], 2))
    read(engine, torch.arange(50, 150, dtype=torch.int64))
    engine.flush()
    stats = engine.stats()
    assert set(stats) == set(ENGINE_STATS) and all(isinstance(value, int) for value in stats.values())
    assert stats["rows"] == 100
    assert (stats["writes"], stats["written_bytes"]) == (110, 110 * RECORD_BYTES)
    assert (stats["reads"], stats["read_bytes"]) == (50, 50 * RECORD_BYTES)  # found records only
    assert stats["disk_bytes"] >= 100 * RECORD_BYTES
    assert stats["compactions"] >= 0


def test_close_with_remove_removes_the_folder(engine_class, tmp_path):
    folder = tmp_path / "rows"
    engine = engine_class(folder, RECORD_BYTES)
    engine.put(torch.arange(10), records_of(torch.arange(10), 1))
    engine.flush()
    assert folder.is_dir()
    engine.close(remove=True)
    assert not folder.exists()
    engine.close()  # a second close does nothing


def test_bad_arguments_are_refused_naming_what_was_wrong(engine_class, engine, tmp_path):
    for record_bytes in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="record_bytes"):
            engine_class(tmp_path / "other", record_bytes)
    with pytest.raises(ValueError, match="read_threads"):
        engine_class(tmp_path / "other", RECORD_BYTES, read_threads=0)
    ids = torch.arange(4, dtype=torch.int64)
    good = records_of(ids, 1)
    for bad_ids in (ids.to(torch.int32), ids.view(2, 2), ids.tolist()):
        with pytest.raises(ValueError, match="ids"):
            engine.put(bad_ids, good)
        with pytest.raises(ValueError, match="ids"):
            engine.get(bad_ids, torch.empty(4, RECORD_BYTES, dtype=torch.uint8))
        with pytest.raises(ValueError, match="ids"):
            engine.delete(bad_ids)
    for bad in (good.to(torch.int16), good[:, :-1].contiguous(), good[:3], good.t().contiguous().t()):
        with pytest.raises(ValueError, match="records"):
            engine.put(ids, bad)
        with pytest.raises(ValueError, match="out"):
            engine.get(ids, bad)
    for batch in (0, -5, 2.0):
        with pytest.raises(ValueError, match="batch"):
            next(iter(engine.scan(batch)))
    assert engine.stats()["rows"] == 0  # nothing refused was written


def test_a_folder_that_cannot_be_made_is_an_os_error_naming_it(engine_class, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(OSError) as raised:
        engine_class(blocker / "rows", RECORD_BYTES)
    assert str(blocker) in str(raised.value)


def test_rocks_keeps_its_records_over_a_reopening(tmp_path):
    """RocksRows opens the database a closed one left (the log engine never reopens: its index is in memory)."""
    ids = torch.arange(-5, 500, dtype=torch.int64)
    engine = RocksRows(tmp_path / "rows", RECORD_BYTES)
    engine.put(ids, records_of(ids, 1))
    engine.delete(ids[:5])
    engine.close()
    engine = RocksRows(tmp_path / "rows", RECORD_BYTES)
    try:
        assert engine.stats()["rows"] == 500
        found, out = read(engine, ids)
        assert found.tolist() == [False] * 5 + [True] * 500
        assert torch.equal(out[5:], records_of(ids[5:], 1))
        with pytest.raises(ValueError, match="distinct"):  # a row count needs them: RocksRows checks
            engine.put(torch.tensor([1, 2, 1]), records_of(torch.tensor([1, 2, 1]), 1))
    finally:
        engine.close(remove=True)


def test_rocks_with_estimated_rows_keeps_the_same_records(tmp_path):
    """``exact_rows=False`` changes only the row count: an estimate, right while no id is put twice."""
    engine = RocksRows(tmp_path / "rows", RECORD_BYTES, exact_rows=False)
    try:
        ids = torch.arange(300, dtype=torch.int64)
        engine.put(ids, records_of(ids, 1))
        assert engine.stats()["rows"] == 300
        engine.put(ids[:100], records_of(ids[:100], 2))
        engine.delete(ids[200:])
        found, out = read(engine, ids)
        assert found.tolist() == [True] * 200 + [False] * 100
        assert torch.equal(out[:100], records_of(ids[:100], 2))
        assert torch.equal(out[100:200], records_of(ids[100:200], 1))
        assert set(scanned(engine, 64)) == set(range(200))
    finally:
        engine.close(remove=True)


def test_a_full_disk_is_an_os_error_naming_the_folder(engine_class, tiny_disk):
    folder = tiny_disk / "rows"
    engine = engine_class(folder, RECORD_BYTES)
    ids = torch.arange(16_384, dtype=torch.int64)
    with pytest.raises(OSError) as raised:
        for batch in range(64):  # 12 MB in all, on a disk of 1 MiB
            engine.put(ids + batch * ids.numel(), records_of(ids, batch))
            engine.flush()
    assert raised.value.errno == errno.ENOSPC
    assert raised.value.filename.startswith(str(folder))
    engine.close(remove=True)
    assert not folder.exists()
