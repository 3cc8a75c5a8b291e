"""paramserver.data following files as they land (online training): new files read once each, in name
order, complete ones only; positions that resume after a restore; workers sharing what lands; an object
store (a real S3 API on loopback) read like a local directory.

Everything runs in this process (the reader's threads included); the tests write the files themselves.
"""

import datetime
import gzip
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from paramserver.data import FileReader, ParquetSchema
from paramserver.data.reader import reader_from_config
from paramserver.data.shares import deal

from test_data_files import first_ids, line

POLL = datetime.timedelta(milliseconds=50)
BATCH = 50


def lines_bytes(first: int, count: int) -> bytes:
    return ("\n".join(line(i) for i in range(first, first + count)) + "\n").encode()


def land(directory, name: str, first: int, count: int, compress: bool = False) -> None:
    """A writer's file: written under a temporary name, then given its final one (as Spark and Flink do)."""
    data = gzip.compress(lines_bytes(first, count)) if compress else lines_bytes(first, count)
    target = directory / name
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.inprogress")
    temporary.write_bytes(data)
    temporary.rename(target)


def take(batches, count: int) -> list:
    """The first ids of the next ``count`` batches (each blocks until its rows have landed)."""
    return first_ids(next(batches) for _ in range(count))


def follower(pattern, **options) -> FileReader:
    return FileReader(str(pattern), BATCH, follow=True, poll=POLL, chunk_bytes=4_000, **options)


def test_files_are_read_as_they_land_once_each_in_name_order_complete_ones_only(tmp_path):
    land(tmp_path, "hour=01/part-0.txt", 0, 100)
    (tmp_path / "hour=01" / "_SUCCESS").write_bytes(b"")
    (tmp_path / "hour=01" / "part-1.txt.tmp").write_bytes(lines_bytes(9000, 50))  # still being written
    (tmp_path / "_temporary").mkdir()
    (tmp_path / "_temporary" / "part-9.txt").write_bytes(lines_bytes(9100, 50))  # a job's scratch
    reader = follower(tmp_path)  # a directory: every complete file below it
    batches = iter(reader)
    assert take(batches, 2) == list(range(100))
    # Both land in a hidden directory (still being written), then appear at once as it is renamed: one listing
    # finds both, and reads them in name order whatever order they were written in.
    land(tmp_path, ".hour=02/part-1.gz", 250, 100, compress=True)
    land(tmp_path, ".hour=02/part-0.txt", 100, 150)
    (tmp_path / ".hour=02").rename(tmp_path / "hour=02")
    assert take(batches, 5) == list(range(100, 350))
    got = []

    def read_on():  # batch by batch, waiting for more until the reader is closed
        for batch in batches:
            got.extend(first_ids([batch]))
    reading = threading.Thread(target=read_on)
    reading.start()
    land(tmp_path, "hour=03/part-0.txt", 350, 75)  # 1.5 batches: the half waits for more rows
    land(tmp_path, "hour=03/part-1.txt", 425, 25)
    deadline = time.monotonic() + 20  # a busy machine may take a while to list and read them
    while len(got) < 100 and time.monotonic() < deadline:
        time.sleep(0.02)
    reading.join(0.3)  # anything read twice would show up by now
    reader.close()
    reading.join(10)
    assert not reading.is_alive(), "a closed reader still waits for files"
    assert got == list(range(350, 450))
    assert "hour=03/part-1.txt" in reader.state_dict()["done"][-1]


def test_a_ready_marker_holds_a_directory_back_until_it_is_written(tmp_path):
    land(tmp_path, "day=1/part-0.txt", 0, 50)
    land(tmp_path, "day=2/part-0.txt", 50, 50)
    (tmp_path / "day=2" / "_SUCCESS").write_bytes(b"")
    reader = follower(tmp_path / "day=*" / "part-*", ready_marker="_SUCCESS")
    batches = iter(reader)
    assert take(batches, 1) == list(range(50, 100))  # day=1 has no marker yet
    (tmp_path / "day=1" / "_SUCCESS").write_bytes(b"")
    assert take(batches, 1) == list(range(50))
    reader.close()


def test_a_restored_follower_reads_on_without_reading_a_file_again(tmp_path):
    land(tmp_path, "a.txt", 0, 230)
    land(tmp_path, "b.gz", 230, 170, compress=True)
    for stop_after in (1, 4, 6):  # mid-file (plain and compressed) and at a file's end
        reader = follower(tmp_path / "*")
        batches = iter(reader)
        head = take(batches, stop_after)
        state = reader.state_dict()
        reader.close()
        again = follower(tmp_path / "*")
        again.load_state_dict(state)
        rest = iter(again)
        assert head + take(rest, 8 - stop_after) == list(range(400)), stop_after
        again.close()
    with pytest.raises(ValueError, match="saved position is of a followed input"):
        FileReader(str(tmp_path / "a.txt"), BATCH).load_state_dict(state)


def test_a_stream_whose_old_files_are_deleted_keeps_a_position_of_the_size_of_what_is_left(tmp_path, caplog):
    reader = follower(tmp_path / "part-*")
    batches = iter(reader)
    name = lambda index: str(tmp_path / f"part-{index:03d}.txt")  # noqa: E731
    for index in range(12):  # a file lands each hour; files older than two hours are deleted (retention)
        land(tmp_path, f"part-{index:03d}.txt", index * 100, 100)
        if index >= 2:
            (tmp_path / f"part-{index - 2:03d}.txt").unlink()
        assert take(batches, 2) == list(range(index * 100, index * 100 + 100))
    state = reader.state_dict()
    assert state["done_below"] in (name(9), name(10))  # the oldest file of a listing since the 10th landed
    files_done = {key.split("@")[0] for key in state["done"]}  # a part's key: its file's name and byte range
    assert files_done <= {name(9), name(10), name(11)} and name(11) in files_done
    assert sum(part is not None for part in reader.parts) <= 3
    # A file landing with a name older than every file the input held is not read; newer ones are.
    with caplog.at_level("WARNING", logger="paramserver.data.reader"):
        land(tmp_path, "part-005b.txt", 9000, 100)
        land(tmp_path, "part-012.txt", 1200, 100)
        assert take(batches, 2) == list(range(1200, 1300))
    assert f"{tmp_path / 'part-005b.txt'} is older than every file" in caplog.text
    assert caplog.text.count("part-005b.txt is older") == 1  # once, however often it is listed
    reader.close()
    again = follower(tmp_path / "part-*")  # restored: reads on, nothing again, the old name still skipped
    again.load_state_dict(state)
    rest = iter(again)
    assert take(rest, 2) == list(range(1200, 1300))
    again.close()


def test_the_oldest_name_is_taken_only_when_every_pattern_found_a_file(tmp_path):
    """A followed input of two patterns, one still empty: its first file may sort below the other's files."""
    from paramserver.data.parts import InputFiles
    land(tmp_path / "views", "day-2.txt", 0, 10)
    (tmp_path / "clicks").mkdir()
    inputs = InputFiles([str(tmp_path / "views" / "*"), str(tmp_path / "clicks" / "*")])
    assert inputs.list(missing_ok=True) == [str(tmp_path / "views" / "day-2.txt")] and inputs.oldest_found == ""
    land(tmp_path / "clicks", "day-1.txt", 0, 10)
    (tmp_path / "clicks" / ".day-0.txt.inprogress").write_bytes(b"")  # still written: found, not complete
    assert len(inputs.list(missing_ok=True)) == 2
    assert inputs.oldest_found == str(tmp_path / "clicks" / ".day-0.txt.inprogress")


def test_workers_share_what_lands_each_line_once(tmp_path):
    for index in range(5):
        land(tmp_path, f"part-{index}.txt", index * 100, 100)
    land(tmp_path, "part-5.gz", 500, 100, compress=True)
    seen = []
    for worker in range(2):
        # every file (not cut by the number of workers) goes to the worker its name hashes to
        reader = FileReader(str(tmp_path), 1, follow=True, poll=POLL, worker=worker, workers=2)
        batches = iter(reader)
        seen += take(batches, sum(_lines_in(part) for part in reader.parts))
        reader.close()
    assert sorted(seen) == list(range(600))


def test_a_followed_position_names_the_same_parts_on_another_number_of_workers(tmp_path):
    for index in range(4):
        land(tmp_path, f"part-{index}.txt", index * 100, 100)
    alone = follower(tmp_path)
    batches = iter(alone)
    head = take(batches, 5)  # 250 lines: files 0 and 1 read whole, file 2 under way
    state = alone.state_dict()
    alone.close()
    readers = [FileReader(str(tmp_path), 1, follow=True, poll=POLL, worker=worker, workers=2) for worker in range(2)]
    rest = []
    for worker, dealt in enumerate(deal([None, None], [state])):  # restored onto two workers: each its share
        readers[worker].reshare(worker, 2, dealt)
    for reader in readers:
        threading.Thread(target=lambda reader=reader: [rest.extend(first_ids([batch])) for batch in reader],
                         daemon=True).start()
    deadline = time.monotonic() + 30
    while len(rest) < 400 - len(head) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # anything read twice would show up by now
    for reader in readers:
        reader.close()
    assert sorted(head + rest) == list(range(400))


def _lines_in(part) -> int:
    """The lines of a part: those whose first byte is in it."""
    with (gzip.open if part.path.endswith(".gz") else open)(part.path, "rb") as file:
        data = file.read()
    stop = len(data) if part.stop is None else part.stop
    return sum(1 for offset in range(len(data)) if part.start <= offset < stop and (offset == 0 or data[offset - 1] == 10))


def test_a_followed_input_takes_config_keys_and_refuses_bad_ones(tmp_path):
    land(tmp_path, "a.txt", 0, 50)
    config = {"train": str(tmp_path), "follow": True, "poll_seconds": 0.05}
    reader = reader_from_config(config, "train", BATCH, 0, 1, epochs=None)
    assert reader.follow and take(iter(reader), 1) == list(range(50))
    reader.close()
    with pytest.raises(ValueError, match="poll_seconds must be a positive number"):
        reader_from_config(dict(config, poll_seconds="soon"), "train", BATCH, 0, 1, epochs=None)
    with pytest.raises(ValueError, match="epochs must be 1"):
        FileReader(str(tmp_path), BATCH, follow=True, epochs=2)


def test_an_object_store_prefix_is_followed_like_a_directory(s3, tmp_path):
    fs = s3.filesystem()
    prefix = f"{s3.bucket}/logs"
    fs.pipe(f"{prefix}/hour=01/part-0.gz", gzip.compress(lines_bytes(0, 100)))
    fs.pipe(f"{prefix}/hour=01/_SUCCESS", b"")
    reader = follower(f"s3://{prefix}/hour=*/part-*")
    batches = iter(reader)
    assert take(batches, 2) == list(range(100))
    fs.pipe(f"{prefix}/hour=02/part-0.txt", lines_bytes(100, 100))
    assert take(batches, 2) == list(range(100, 200))
    assert [key.split("@")[0] for key in reader.state_dict()["done"]] == [f"s3://{prefix}/hour=01/part-0.gz",
                                                                          f"s3://{prefix}/hour=02/part-0.txt"]
    reader.close()


def test_parquet_on_an_object_store_without_following(s3, tmp_path):
    table = pa.table({"clicked": pa.array([i % 2 for i in range(300)], pa.int8()),
                      "item": pa.array(list(range(300)), pa.int64())})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=100)
    s3.filesystem().put(str(tmp_path / "p.parquet"), f"{s3.bucket}/p.parquet")
    schema = ParquetSchema(label="clicked", categorical=["item"])
    reader = FileReader(f"s3://{s3.bucket}/*.parquet", 100, format="parquet", schema=schema)
    assert [int(i) for batch in reader for i in batch.sparse["item"].view(-1)] == list(range(300))


def test_a_listing_that_fails_for_a_while_is_retried_not_fatal(tmp_path, monkeypatch):
    from paramserver.data import UnreadableFile

    land(tmp_path, "a.txt", 0, 50)
    reader = follower(tmp_path)
    batches = iter(reader)
    assert take(batches, 1) == list(range(50))
    listed = reader.inputs.list
    failures = []

    def flaky(missing_ok=False):
        if len(failures) < 3:
            failures.append(1)
            raise UnreadableFile(str(tmp_path), "cannot list it: the store is unreachable")
        return listed(missing_ok)

    monkeypatch.setattr(reader.inputs, "list", flaky)
    land(tmp_path, "b.txt", 50, 50)
    assert take(batches, 1) == list(range(50, 100)) and len(failures) == 3
    reader.close()
