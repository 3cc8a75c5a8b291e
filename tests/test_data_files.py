"""paramserver.data: Criteo-format and Parquet files parsed, shared among workers, resumed, refused when bad.

Every file here is written by the test itself; everything runs in this
process (the reader's threads included).
"""

import gzip
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import xxhash

import paramserver

from paramserver.data import CATEGORICAL, MISSING_ID, FileReader, MalformedInput, ParquetSchema, UnreadableFile
from paramserver.data import criteo

HASH_MASK = 0xFFFFFFFF


def line(index: int, label: int = None, dense=None, hashes=None) -> str:
    """A Criteo line whose C1 spells ``index`` (so every line can be told apart)."""
    label = index % 2 if label is None else label
    dense = [str((index * 7 + j) % 50 - 3) if (index + j) % 9 else "" for j in range(13)] if dense is None else dense
    if hashes is None:
        hashes = ["%08x" % index] + ["%08x" % ((index * 2654435761 + j) & HASH_MASK) if (index + j) % 11 else ""
                                     for j in range(1, 26)]
    return "\t".join([str(label), *dense, *hashes])


def write(path, lines, compress=False) -> str:
    data = ("\n".join(lines) + "\n").encode()
    with (gzip.open if compress else open)(path, "wb") as out:
        out.write(data)
    return str(path)


def first_ids(batches) -> list:
    return [int(i) for batch in batches for i in batch.sparse["C1"].view(-1)]


def test_a_criteo_line_becomes_log_counts_and_hash_ids(tmp_path):
    dense = ["5", "", "-4", "0", "1", "2", "3", "4", "100", "7", "8", "9", "10"]
    hashes = ["68fd1e64", "", "DEADBEEF"] + ["0000000a"] * 23
    reader = FileReader(write(tmp_path / "one.txt", [line(0, 1, dense, hashes)]), 4)
    (batch,) = list(reader)
    assert batch.labels.tolist() == [1.0] and batch.labels.dtype == torch.float32
    expected = [math.log1p(max(int(v), 0)) if v else 0.0 for v in dense]
    assert torch.allclose(batch.dense[0], torch.tensor(expected))
    assert sorted(batch.sparse) == sorted(CATEGORICAL)
    assert batch.sparse["C1"].tolist() == [[0x68FD1E64]] and batch.sparse["C2"].tolist() == [[MISSING_ID]]
    assert batch.sparse["C3"].tolist() == [[0xDEADBEEF]] and batch.sparse["C26"].tolist() == [[10]]


def test_hashes_of_any_length_up_to_16_digits():
    strings = [b"1", b"", b"ffffffffffffffff", b"7fffffffffffffff", b"x1", b"1" * 17, b"aBc"]
    ids, bad = criteo.hex_ids(pa.array(strings, pa.binary()))
    assert ids[[0, 1, 2, 3, 6]].tolist() == [1, MISSING_ID, -1, 2 ** 63 - 1, 0xABC]
    assert bad.tolist() == [False, False, False, False, True, True, False]
    eight = [b"%08x" % v for v in range(0, 2 ** 32, 2 ** 32 // 997)] + [b"0000000g", b"g0000000", b"12:45678"]
    ids, bad = criteo.hex_ids(pa.array(eight, pa.binary()))
    assert ids[:-3].tolist() == [int(s, 16) for s in eight[:-3]] and bad.tolist() == [False] * 998 + [True] * 3


def test_gzip_and_plain_files_read_alike_and_every_line_once_over_workers(tmp_path):
    lines = [line(i) for i in range(3000)]
    files = [write(tmp_path / "a.txt", lines[:1400]), write(tmp_path / "b.txt", lines[1400:2200]),
             write(tmp_path / "c.gz", lines[2200:], compress=True)]
    seen = []
    for worker in range(3):
        reader = FileReader(str(tmp_path / "*"), 128, worker=worker, workers=3, chunk_bytes=20_000)
        seen += first_ids(reader)
    assert sorted(seen) == list(range(3000))  # each line once, over every worker
    whole = first_ids(FileReader(files, 500, chunk_bytes=9_000))
    assert whole == list(range(3000))  # one worker: in file order, gzip included


def test_a_restored_reader_resumes_at_the_same_sample(tmp_path):
    lines = [line(i) for i in range(2500)]
    files = [write(tmp_path / "a.txt", lines[:1500]), write(tmp_path / "b.gz", lines[1500:], compress=True)]
    straight = first_ids(FileReader(files, 96, workers=2, worker=1, chunk_bytes=7_000, epochs=2))
    for stop_after in (1, 5, 11, 17):  # mid-chunk, across parts and into the second epoch
        reader = FileReader(files, 96, workers=2, worker=1, chunk_bytes=7_000, epochs=2)
        head = []
        for index, batch in enumerate(reader):
            head += first_ids([batch])
            if index + 1 == stop_after:
                break
        state = reader.state_dict()
        # chunks cut alike, smaller (the position's rows span several) or larger: the same samples
        for chunk_bytes in (7_000, 2_500, 20_000):
            again = FileReader(files, 96, workers=2, worker=1, chunk_bytes=chunk_bytes, epochs=2)
            again.load_state_dict(state)
            assert head + first_ids(again) == straight, (stop_after, chunk_bytes)
    assert len(straight) == 2 * len(first_ids(FileReader(files, 96, workers=2, worker=1, chunk_bytes=7_000)))


def test_a_reading_starts_with_a_small_chunk_then_whole_ones(tmp_path, monkeypatch):
    from paramserver.data import parts
    monkeypatch.setattr(parts, "FIRST_CHUNK_BYTES", 3_000)
    path = write(tmp_path / "a.txt", [line(i) for i in range(400)])
    (part,) = parts.text_parts([path], 1)
    for offset in (0, 31_337):
        offset = next(c.offset for c in parts.text_chunks(part, 0, 1_000) if c.offset >= offset)
        chunks = list(parts.text_chunks(part, offset, 10_000))
        assert len(chunks[0].text) <= 3_000 and all(8_000 < len(c.text) <= 10_000 for c in chunks[1:-1])
        assert b"".join(c.text for c in chunks) == open(path, "rb").read()[offset:]
    assert first_ids(FileReader(path, 64)) == list(range(400))


@pytest.mark.parametrize("bad, reason, column", [
    ("1\t2\t3", "3 fields, expected 40", None),
    (line(9, dense=["1", "x2"] + ["0"] * 11), "'x2' is not an integer", "I2"),
    (line(9, hashes=["%08x" % 9] * 4 + ["xyz"] + ["0"] * 21), "not a hash", "C5"),
    (line(9, label=2), "the label must be 0 or 1", "label"),
])
def test_a_malformed_line_is_named_or_skipped_and_counted(tmp_path, bad, reason, column):
    lines = [line(i) for i in range(300)]
    lines.insert(211, bad)
    path = write(tmp_path / "data.gz", lines, compress=True)
    with pytest.raises(MalformedInput) as raised:
        list(FileReader(path, 64, chunk_bytes=5_000))
    assert raised.value.path == path and raised.value.place == "line 212" and raised.value.column == column
    assert reason in str(raised.value) and "line 212" in str(raised.value)
    reader = FileReader(path, 64, chunk_bytes=5_000, skip_malformed=True)
    assert first_ids(reader) == list(range(300)) and reader.malformed == 1
    for stop_after in (3, 4):  # resumed in the malformed line's chunk, and after it: counted once
        partial = FileReader(path, 64, chunk_bytes=5_000, skip_malformed=True)
        head = [b for _, b in zip(range(stop_after), partial)]
        resumed = FileReader(path, 64, chunk_bytes=5_000, skip_malformed=True)
        resumed.load_state_dict(partial.state_dict())
        assert first_ids(head) + first_ids(resumed) == list(range(300)) and resumed.malformed == 1


def test_a_malformed_line_in_a_later_part_of_a_split_file_names_its_line(tmp_path):
    lines = [line(i) for i in range(400)]
    lines[350] = "0\tnot enough"
    path = write(tmp_path / "big.txt", lines)
    with pytest.raises(MalformedInput, match="line 351"):
        list(FileReader(path, 32, worker=1, workers=2, chunk_bytes=3_000))


def test_unreadable_input_names_the_path(tmp_path):
    with pytest.raises(UnreadableFile, match="nothing-here"):
        FileReader(str(tmp_path / "nothing-here-*.gz"), 8)
    with pytest.raises(UnreadableFile, match="missing.txt"):
        FileReader(str(tmp_path / "missing.txt"), 8)
    broken = tmp_path / "broken.gz"
    broken.write_bytes(gzip.compress(("\n".join(line(i) for i in range(2000)) + "\n").encode())[:3000])
    with pytest.raises(UnreadableFile, match="broken.gz"):
        list(FileReader(str(broken), 8))
    with pytest.raises(ValueError, match="no part"):
        FileReader(write(tmp_path / "one.gz", [line(0)], compress=True), 8, worker=1, workers=2)


def parquet_file(path, rows: int, row_group_size: int) -> ParquetSchema:
    table = pa.table({
        "clicked": pa.array([i % 2 for i in range(rows)], pa.int8()),
        "price": pa.array([float(i) if i % 5 else None for i in range(rows)], pa.float64()),
        "item": pa.array([i if i % 7 else None for i in range(rows)], pa.int64()),
        "shop": pa.array(["%x" % (i * 3) for i in range(rows)]),
        "tags": pa.array([list(range(i, i + i % 4)) if i % 6 else None for i in range(rows)]),
    })
    pq.write_table(table, path, row_group_size=row_group_size)
    return ParquetSchema(label="clicked", dense=["price"], categorical=["item", "shop"], multi_hot={"tags": 2})


def test_parquet_columns_by_schema_row_groups_over_workers_and_resume(tmp_path):
    schema = parquet_file(tmp_path / "p.parquet", 1000, 128)
    reader = FileReader(str(tmp_path / "p.parquet"), 100, format="parquet", schema=schema)
    batches = list(reader)
    labels = torch.cat([b.labels for b in batches])
    item = torch.cat([b.sparse["item"] for b in batches]).view(-1)
    assert labels.tolist() == [float(i % 2) for i in range(1000)]
    assert item.tolist() == [i if i % 7 else MISSING_ID for i in range(1000)]
    assert torch.cat([b.sparse["shop"] for b in batches]).view(-1).tolist() == [i * 3 for i in range(1000)]
    tags = torch.cat([b.sparse["tags"] for b in batches])
    assert tags[5].tolist() == [5, MISSING_ID] and tags[6].tolist() == [MISSING_ID] * 2  # padded; none
    assert tags[7].tolist() == [7, 8]  # cut to the bag size
    assert torch.cat([b.dense for b in batches]).view(-1)[:6].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 0.0]
    shares = [torch.cat([b.sparse["item"] for b in FileReader(str(tmp_path / "p.parquet"), 64, format="parquet",
                                                                schema=schema, worker=w, workers=3)]).numel()
              for w in range(3)]
    assert sum(shares) == 1000 and min(shares) > 0
    partial = FileReader(str(tmp_path / "p.parquet"), 100, format="parquet", schema=schema)
    iterator = iter(partial)
    for _ in range(4):
        next(iterator)
    resumed = FileReader(str(tmp_path / "p.parquet"), 100, format="parquet", schema=schema)
    resumed.load_state_dict(partial.state_dict())
    rest = torch.cat([b.labels for b in resumed])
    assert rest.numel() == 600 and torch.equal(rest, labels[400:])


def test_a_parquet_row_without_a_label_is_named_by_row_group_and_row(tmp_path):
    table = pa.table({"y": pa.array([1, 0, None, 1, 0, 1], pa.int64()), "c": pa.array(range(6), pa.int64())})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=2)
    schema = ParquetSchema(label="y", categorical=["c"])
    with pytest.raises(MalformedInput, match="row group 1, row 1"):
        list(FileReader(str(tmp_path / "p.parquet"), 4, format="parquet", schema=schema))
    reader = FileReader(str(tmp_path / "p.parquet"), 4, format="parquet", schema=schema, skip_malformed=True)
    assert torch.cat([b.sparse["c"] for b in reader]).view(-1).tolist() == [0, 1, 3, 4, 5] and reader.malformed == 1
    with pytest.raises(UnreadableFile, match="no column"):
        list(FileReader(str(tmp_path / "p.parquet"), 4, format="parquet",
                        schema=ParquetSchema(label="y", categorical=["nope"])))


def test_parquet_string_categoricals_are_hashed_as_serving_hashes_them(tmp_path):
    words = ["shoes", "ünïcode", "", None, "shoes", "a much longer category value"]
    table = pa.table({"y": pa.array([1, 0] * 3, pa.int8()), "c": pa.array(words),
                      "tags": pa.array([["red", "blue"], [], None, ["blue"], ["x", "y", "z"], ["red"]])})
    pq.write_table(table, tmp_path / "s.parquet", row_group_size=4)
    schema = ParquetSchema.from_config({"label": "y", "categorical": ["c"], "multi_hot": {"tags": 2},
                                        "strings": "hash"})
    batches = list(FileReader(str(tmp_path / "s.parquet"), 6, format="parquet", schema=schema))
    ids = torch.cat([b.sparse["c"] for b in batches]).view(-1)
    assert torch.equal(ids, paramserver.string_ids(words))  # what a serving client computes for the same values
    assert ids[2] == ids[3] == MISSING_ID and ids[0] == ids[4] != ids[1]
    assert paramserver.string_ids(["shoes"]).item() == xxhash.xxh64_intdigest(b"shoes") - (1 << 64) * (
        xxhash.xxh64_intdigest(b"shoes") >= 1 << 63)  # XXH64, seed 0, as a signed int64
    tags = torch.cat([b.sparse["tags"] for b in batches])
    red, blue = paramserver.string_ids(["red", "blue"]).tolist()
    assert tags[0].tolist() == [red, blue] and tags[1].tolist() == [MISSING_ID] * 2 and tags[5].tolist() == [
        red, MISSING_ID]
    # The default reads strings as hexadecimal hashes, as Criteo's are: these are refused as not hexadecimal.
    with pytest.raises(MalformedInput, match="hexadecimal"):
        list(FileReader(str(tmp_path / "s.parquet"), 6, format="parquet",
                        schema=ParquetSchema(label="y", categorical=["c"])))
    with pytest.raises(ValueError, match="strings must be one of 'hex', 'hash'"):
        ParquetSchema(label="y", categorical=["c"], strings="md5")


def test_epochs_max_rows_and_a_reader_that_is_closed(tmp_path):
    path = write(tmp_path / "a.txt", [line(i) for i in range(100)])
    assert first_ids(FileReader(path, 30, epochs=3)) == list(range(100)) * 3
    assert first_ids(FileReader(path, 30, max_rows=45)) == list(range(45))
    endless = FileReader(path, 30, epochs=None)
    taken = []
    for batch in endless:
        taken += first_ids([batch])
        if len(taken) >= 1000:
            endless.close()
    assert taken[:1000] == list(range(100)) * 10
    evaluation = FileReader(path, 64)
    assert first_ids(evaluation) == first_ids(evaluation)  # re-iterable from its start

