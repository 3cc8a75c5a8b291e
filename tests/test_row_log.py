"""The row store's log-structured engine (``RowLog`` over ``row_log.c``), in one process.

Puts, gets, overwrites and deletes; records read before they are written to a file; many records over many
segment files; a random sequence of puts and deletes against a dict, compacted as it goes, every current record
read back bit for bit and scanned exactly, the files' bytes bounded by the live ones; reads and writes from two
threads at once; opening and closing a folder; refused arguments; a full disk raised as an ``OSError`` naming
the file.  Small segments and buffers, so that a few thousand records cross many files.
"""

import errno
import gc
import os
import random
import threading
import time

import pytest
import torch

from paramserver.native import CACHE_ENV, source_digest
from paramserver.shards.server.row_store import row_log
from paramserver.shards.server.row_store.engine import ENGINE_STATS
from paramserver.shards.server.row_store.row_log import SOURCE_PATH, RowLog, RowLogBuilds

RECORD = 20
BUFFER = 8192
SEGMENT = 4 * BUFFER
REC = RECORD + 8  # a record on disk: its id, then its bytes


def records_of(ids: torch.Tensor, version=0) -> torch.Tensor:
    """A record per id: its id (8 bytes), its ``version`` (an int or a tensor per id: 4 bytes) and 8 bytes made
    of both, so that a wrong, stale or torn record shows."""
    versions = torch.zeros(ids.numel(), dtype=torch.int32) + torch.as_tensor(version, dtype=torch.int32)
    mixed = (ids.view(-1, 1) * 1_000_003 + versions.view(-1, 1) * 7919 + torch.arange(8)) % 251
    return torch.cat([ids.contiguous().view(torch.uint8).view(-1, 8), versions.view(torch.uint8).view(-1, 4),
                      mixed.to(torch.uint8)], dim=1)


def open_log(folder, **options) -> RowLog:
    return RowLog(folder, RECORD, buffer_bytes=BUFFER, segment_bytes=SEGMENT, **options)


def read(log: RowLog, ids: torch.Tensor):
    out = torch.zeros(ids.numel(), RECORD, dtype=torch.uint8)
    return log.get(ids, out), out


def file_bytes(folder) -> int:
    total = 0
    for path in folder.iterdir():
        try:
            total += path.stat().st_size
        except FileNotFoundError:  # compacted away meanwhile
            pass
    return total


def settled_file_bytes(log: RowLog, folder) -> int:
    """The bytes of the store's files, once its counter says the same before and after they are listed (its
    writer and compaction threads may be at work)."""
    for _ in range(200):
        before, listed, after = log.stats()["disk_bytes"], file_bytes(folder), log.stats()["disk_bytes"]
        if before == listed == after:
            return listed
        time.sleep(0.01)
    raise AssertionError(f"the files hold {listed} bytes, the store counts {after}")


@pytest.fixture
def log(tmp_path):
    log = open_log(tmp_path / "log")
    yield log
    log.close(remove=True)


def test_the_library_is_built_from_the_source_beside_it(monkeypatch, tmp_path):
    assert RowLogBuilds().library().digest == source_digest(SOURCE_PATH.read_bytes())
    # row_log.c edited since the install: built on first use, with its threads, and a store opens on it
    edited = tmp_path / "row_log.c"
    edited.write_bytes(SOURCE_PATH.read_bytes() + b"/* edited */\n")
    monkeypatch.setattr(row_log, "SOURCE_PATH", edited)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    builds = RowLogBuilds()
    if builds.build("baseline") is None:
        pytest.skip("no C compiler to build the edited source with")
    library = builds.library()
    assert not library.installed and library.origin.parent == tmp_path / "cache"
    assert library.digest == source_digest(edited.read_bytes())
    log = open_log(tmp_path / "log", builds=builds)
    log.put(torch.tensor([4]), records_of(torch.tensor([4])))
    log.flush()
    assert torch.equal(read(log, torch.tensor([4]))[1], records_of(torch.tensor([4])))
    log.close(remove=True)


def test_put_get_overwrite_delete(log):
    ids = torch.tensor([5, -3, 1 << 62, 0], dtype=torch.int64)
    log.put(ids, records_of(ids))
    found, out = read(log, torch.tensor([0, 5, 7, -3, 1 << 62]))
    assert found.tolist() == [True, True, False, True, True]
    assert torch.equal(out[[0, 1, 3, 4]], records_of(torch.tensor([0, 5, -3, 1 << 62])))
    assert torch.equal(out[2], torch.zeros(RECORD, dtype=torch.uint8))  # a row not held is left as it was
    log.put(ids[:2], records_of(ids[:2], version=1))
    log.delete(torch.tensor([0, 99]))
    found, out = read(log, ids)
    assert found.tolist() == [True, True, True, False]
    assert torch.equal(out[:2], records_of(ids[:2], version=1))
    assert torch.equal(out[2], records_of(ids[2:3])[0])
    stats = log.stats()
    assert list(stats) == list(ENGINE_STATS)
    assert stats["rows"] == 3 and stats["writes"] == 6 and stats["written_bytes"] == 6 * RECORD
    assert stats["reads"] == 7 and stats["read_bytes"] == 7 * RECORD
    memory = log.memory_bytes()
    assert memory["index"] == 1024 * 16 and memory["buffers"] >= 3 * BUFFER


def test_records_are_read_before_they_reach_a_file(log, tmp_path):
    ids = torch.arange(10, dtype=torch.int64)
    log.put(ids, records_of(ids))
    assert file_bytes(tmp_path / "log") == 0 and log.stats()["disk_bytes"] == 0  # still in the write buffer
    found, out = read(log, ids)
    assert found.all() and torch.equal(out, records_of(ids))
    log.flush()
    assert file_bytes(tmp_path / "log") == log.stats()["disk_bytes"] == 4096  # padded to the alignment
    log.put(ids[:3], records_of(ids[:3], version=2))  # the flushed buffer goes on filling
    log.flush()
    found, out = read(log, ids)
    assert torch.equal(out[:3], records_of(ids[:3], version=2)) and torch.equal(out[3:], records_of(ids[3:]))


#: How a store may read: O_DIRECT files on the kernel's asynchronous I/O, or on threads; page-cached files.
READS = {"aio": dict(direct_io=True, kernel_aio=True), "threads": dict(direct_io=True, kernel_aio=False),
         "cached": dict(direct_io=False)}


@pytest.mark.parametrize("reads", READS)
def test_many_records_over_many_segments(tmp_path, reads):
    log = open_log(tmp_path / "log", read_threads=4, **READS[reads])
    try:
        ids = torch.randperm(20_000, dtype=torch.int64)[:6000] * 1_000_000_007
        for batch in ids.split(1000):
            log.put(batch, records_of(batch))
        log.flush()
        assert len(list((tmp_path / "log").iterdir())) >= 6000 * REC // SEGMENT
        assert file_bytes(tmp_path / "log") == log.stats()["disk_bytes"]
        assert log.direct_io == READS[reads]["direct_io"]  # local filesystems take O_DIRECT
        assert log.kernel_aio == (reads == "aio")
        shuffled = ids[torch.randperm(ids.numel())]
        found, out = read(log, torch.cat([shuffled, torch.tensor([3, 4])]))
        assert found[:-2].all() and not found[-2:].any()
        assert torch.equal(out[:-2], records_of(shuffled))
    finally:
        log.close(remove=True)


@pytest.mark.parametrize("reads", READS)
def test_random_puts_and_deletes_match_a_dict_compacted_as_they_go(tmp_path, reads):
    log = open_log(tmp_path / "log", read_threads=3, **READS[reads])
    chooser = random.Random(7)
    model = {}
    universe = torch.arange(1500, dtype=torch.int64) * 37 - 20_000
    try:
        for step in range(300):
            batch = universe[torch.tensor(chooser.sample(range(universe.numel()), chooser.randint(1, 60)))]
            if chooser.random() < 0.3:
                log.delete(batch)
                for id in batch.tolist():
                    model.pop(id, None)
            else:
                rows = records_of(batch, version=step)
                log.put(batch, rows)
                model.update(zip(batch.tolist(), rows))
            if step % 50 == 49:
                log.compact()
                live = len(model) * REC
                # compaction leaves at most twice the live bytes, plus the segments being written (and the
                # buffer its records went to, which the writer may be writing now)
                assert settled_file_bytes(log, tmp_path / "log") <= 2 * live + 2 * SEGMENT + BUFFER
            if step % 25 == 0 or step == 299:
                found, out = read(log, universe)
                assert found.tolist() == [id in model for id in universe.tolist()]
                for id, row in zip(universe.tolist(), out):
                    if id in model:
                        assert torch.equal(row, model[id]), id
        assert log.stats()["compactions"] > 0
        assert log.stats()["rows"] == len(model)
        scanned = {}
        for ids, rows in log.scan(97):
            assert 0 < ids.numel() <= 97 and rows.shape == (ids.numel(), RECORD)
            for id, row in zip(ids.tolist(), rows):
                assert id not in scanned
                scanned[id] = row.clone()
        assert scanned.keys() == model.keys()
        assert all(torch.equal(scanned[id], model[id]) for id in model)
    finally:
        log.close(remove=True)


@pytest.mark.parametrize("reads", ["aio", "threads"])
def test_gets_beside_puts_and_compaction_read_whole_current_records(tmp_path, reads):
    log = open_log(tmp_path / "log", read_threads=4, **READS[reads])
    ids = torch.arange(800, dtype=torch.int64)
    log.put(ids, records_of(ids))
    failures = []

    def write():
        for version in range(1, 150):
            log.put(ids, records_of(ids, version))

    writer = threading.Thread(target=write)
    writer.start()
    reads = 0
    try:
        while (writer.is_alive() or reads < 20) and not failures:
            found, out = read(log, ids)
            reads += 1
            # each row is one of its id's versions, whole
            versions = out[:, 8:12].contiguous().view(torch.int32).view(-1)
            if not found.all() or not torch.equal(out, records_of(ids, versions)):
                failures.append("a row read beside writes is not a record its id had")
    finally:
        writer.join(timeout=60)
    assert not writer.is_alive() and not failures
    log.compact()
    assert log.stats()["compactions"] > 0
    found, out = read(log, ids)
    assert found.all() and torch.equal(out, records_of(ids, 149))
    log.close(remove=True)


@pytest.mark.parametrize("reads", ["aio", "threads"])
def test_gets_from_several_threads_at_once_each_read_their_own_records(tmp_path, reads):
    log = open_log(tmp_path / "log", read_threads=3, **READS[reads])
    ids = torch.arange(4000, dtype=torch.int64) * 11
    log.put(ids, records_of(ids))
    log.flush()
    wrong = []

    def get(seed):
        generator = torch.Generator().manual_seed(seed)
        for _ in range(8):
            asked = ids[torch.randint(0, ids.numel(), (300,), generator=generator)]
            found, out = read(log, asked)
            if not found.all() or not torch.equal(out, records_of(asked)):
                wrong.append(seed)

    readers = [threading.Thread(target=get, args=(seed,)) for seed in range(3)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(timeout=60)
    assert not any(reader.is_alive() for reader in readers) and not wrong
    log.close(remove=True)


def test_puts_from_several_threads_at_once_keep_every_record(tmp_path):
    log = open_log(tmp_path / "log")
    parts = [torch.arange(start, 6000, 3, dtype=torch.int64) for start in range(3)]

    def put(ids):
        for version in range(5):  # overwrites: compaction runs beside the puts
            for batch in ids.split(40):
                log.put(batch, records_of(batch, version))

    writers = [threading.Thread(target=put, args=(ids,)) for ids in parts]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=60)
    assert not any(writer.is_alive() for writer in writers)
    ids = torch.arange(6000, dtype=torch.int64)
    found, out = read(log, ids)
    assert found.all() and torch.equal(out, records_of(ids, 4))
    assert sorted(torch.cat([batch for batch, _ in log.scan(1000)]).tolist()) == ids.tolist()
    log.close(remove=True)


def test_a_scan_is_bounded_by_its_batch_and_sees_records_in_buffers(log):
    ids = torch.arange(1000, dtype=torch.int64)
    log.put(ids, records_of(ids))
    log.delete(ids[::2].contiguous())
    batches = list(log.scan(64))
    assert all(batch.numel() <= 64 for batch, _ in batches)
    got = torch.cat([batch for batch, _ in batches])
    assert sorted(got.tolist()) == ids[1::2].tolist()
    assert torch.equal(torch.cat([rows for _, rows in batches]), records_of(got))
    partial = log.scan(5)
    assert next(partial)[0].numel() == 5
    partial.close()


def test_closing_keeps_or_removes_the_folder_and_a_closed_log_refuses_calls(tmp_path):
    log = open_log(tmp_path / "kept")
    log.put(torch.tensor([1]), records_of(torch.tensor([1])))
    scan = log.scan(4)
    next(scan)  # a scan left open is closed with the log
    log.close()
    assert (tmp_path / "kept").is_dir()
    with pytest.raises(ValueError, match="closed"):
        read(log, torch.tensor([1]))
    with pytest.raises(ValueError, match="closed"):
        log.put(torch.tensor([1]), records_of(torch.tensor([1])))
    log.close()  # again: nothing
    scan.close()
    removed = open_log(tmp_path / "removed")
    removed.put(torch.arange(2000), records_of(torch.arange(2000)))
    removed.flush()
    removed.close(remove=True)
    assert not (tmp_path / "removed").exists()
    # (threads counted by their ids: others of this process, a timer's, may come and go meanwhile)
    before = set(os.listdir("/proc/self/task"))
    dropped = open_log(tmp_path / "dropped", kernel_aio=False, read_threads=3)
    its_threads = set(os.listdir("/proc/self/task")) - before
    assert len(its_threads) >= 4  # the writer, the compactor, two readers
    del dropped  # never closed: its threads stop all the same
    gc.collect()
    assert not its_threads & set(os.listdir("/proc/self/task")) and (tmp_path / "dropped").is_dir()


def test_opening_clears_an_earlier_logs_segments_and_refuses_other_files(tmp_path):
    first = open_log(tmp_path / "log")
    first.put(torch.arange(3000), records_of(torch.arange(3000)))
    first.flush()
    first.close()  # a process that ended: its files stay, unreadable without its index
    assert len(list((tmp_path / "log").iterdir())) > 1
    second = open_log(tmp_path / "log")
    try:
        assert second.stats()["rows"] == 0 and file_bytes(tmp_path / "log") == 0
        assert not read(second, torch.arange(3))[0].any()
    finally:
        second.close(remove=True)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a log's")
    with pytest.raises(FileExistsError, match="notes.txt"):
        open_log(tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").exists()


def test_bad_arguments_are_refused_naming_what_was_wrong(log, tmp_path):
    ids = torch.arange(4, dtype=torch.int64)
    good = records_of(ids)
    refusals = [
        (lambda: log.put(ids.int(), good), "ids must be a 1-D int64"),
        (lambda: log.put(ids.view(2, 2), good), "ids must be a 1-D int64"),
        (lambda: log.put(torch.arange(8)[::2], good), "contiguous"),
        (lambda: log.put(ids, good[:3]), r"records must be a uint8 tensor of shape \[4, 20\]"),
        (lambda: log.put(ids, good.float()), "records must be a uint8"),
        (lambda: log.put(ids, torch.zeros(RECORD, 4, dtype=torch.uint8).t()), "contiguous"),
        (lambda: log.put([1, 2], good), "list"),
        (lambda: log.get(ids, torch.zeros(4, RECORD + 1, dtype=torch.uint8)), "out must be a uint8 tensor"),
        (lambda: log.delete(ids.to(torch.int32)), "ids must be"),
        (lambda: log.scan(0), "batch"),
        (lambda: RowLog(tmp_path / "a", 0), "record_bytes"),
        (lambda: RowLog(tmp_path / "b", 8, buffer_bytes=5000), "buffer_bytes must be a multiple of 4096"),
        (lambda: RowLog(tmp_path / "c", 8, buffer_bytes=8192, segment_bytes=12288), "segment_bytes"),
        (lambda: RowLog(tmp_path / "d", 8, read_threads=0), "read_threads"),
        (lambda: RowLog(tmp_path / "e", 8, direct_io=1), "direct_io"),
        (lambda: RowLog(tmp_path / "f", 8, kernel_aio=None), "kernel_aio"),
    ]
    for call, message in refusals:
        with pytest.raises(ValueError, match=message):
            call()
    assert log.stats()["writes"] == 0


def fill_past_the_first_segment(log: RowLog) -> None:
    ids = torch.arange(3 * SEGMENT // REC, dtype=torch.int64)
    for batch in ids.split(200):
        log.put(batch, records_of(batch))


def test_a_failed_write_is_raised_with_its_errno_and_file_and_every_later_write_too(tmp_path):
    log = open_log(tmp_path / "log")
    full = tmp_path / "log" / "segment-00000001.log"
    full.symlink_to("/dev/full")  # the second segment's writes fail as on a full disk
    try:
        with pytest.raises(OSError) as raised:
            fill_past_the_first_segment(log)
            log.flush()
        assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(full)
        with pytest.raises(OSError) as again:
            log.put(torch.tensor([1]), records_of(torch.tensor([1])))
            log.flush()
        assert again.value.errno == errno.ENOSPC
        found, out = read(log, torch.arange(10))  # reads are still answered
        assert found.all() and torch.equal(out, records_of(torch.arange(10)))
    finally:
        log.close(remove=True)
    assert not (tmp_path / "log").exists()


def test_a_full_disk_is_raised_as_an_oserror_naming_the_file(tiny_disk):
    log = RowLog(tiny_disk / "log", RECORD, buffer_bytes=BUFFER, segment_bytes=16 * BUFFER)
    try:
        with pytest.raises(OSError) as raised:
            for start in range(0, 200_000, 5000):
                batch = torch.arange(start, start + 5000, dtype=torch.int64)
                log.put(batch, records_of(batch))
            log.flush()
        assert raised.value.errno == errno.ENOSPC
        assert os.path.dirname(raised.value.filename) == str(tiny_disk / "log")
    finally:
        log.close(remove=True)
    assert list(tiny_disk.iterdir()) == []
