"""The Criteo Display Advertising format: tab-separated lines parsed into samples, vectorized.

Owns the format of Criteo's click logs (Kaggle's 7 days, the 1 TB set of
24 days): a line is a label (0 or 1), 13 integer features ``I1``..``I13``
and 26 categorical features ``C1``..``C26`` given as hexadecimal hashes,
any feature possibly empty.  A chunk of whole lines is parsed at once:
pyarrow's CSV reader splits the fields and converts the integers (in C++,
without the GIL), and the hashes are decoded from their bytes with numpy,
so no Python runs per line.

What a sample becomes: integer features ``log(1 + x)`` for ``x > 0``, 0
for an empty or non-positive value (negative values clamped, as is usual
for this data); each hash the int64 id it spells (up to 16 hex digits),
an empty one ``MISSING_ID``, each in its own table ``C1``..``C26``: ready
for dynamic tables, without a vocabulary pass.

A malformed line (not 40 fields, a label other than 0 or 1, an integer
feature that is not an integer, a hash that is not hexadecimal or longer
than 16 digits) is reported with its line number within the chunk; the
reader turns that into an error naming the file and line, or skips the
line and counts it.
"""

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import torch

from ..tables import id_hash
from .samples import Samples

LABEL = "label"
DENSE = tuple(f"I{i}" for i in range(1, 14))
CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))
FIELDS = (LABEL,) + DENSE + CATEGORICAL
#: The id of an empty categorical feature (no hash spells it but 8000000000000000): ``tables.id_hash``'s.
MISSING_ID = id_hash.MISSING_ID
MAX_HEX_DIGITS = 16

_NOT_HEX = 255
_NIBBLES = np.full(256, _NOT_HEX, dtype=np.uint8)
for _digit in b"0123456789":
    _NIBBLES[_digit] = _digit - ord("0")
for _digit in b"abcdef":
    _NIBBLES[_digit] = _digit - ord("a") + 10
    _NIBBLES[_digit - 32] = _digit - ord("a") + 10
_NIBBLES.setflags(write=False)


@dataclass
class Problem:
    """A malformed line: its number within the chunk (1-based), the column at fault (if one), why."""

    line: int
    reason: str
    column: Optional[str] = None


@dataclass
class Parsed:
    """A chunk's samples (its good lines, in order) and its malformed lines (in order)."""

    samples: Samples
    problems: List[Problem] = field(default_factory=list)


def _csv_options(types) -> Tuple:
    problems: List[Problem] = []

    def wrong_field_count(row) -> str:
        problems.append(Problem(int(row.number), f"{row.actual_columns} fields, expected {len(FIELDS)}"))
        return "skip"

    read = pacsv.ReadOptions(column_names=list(FIELDS), use_threads=False, block_size=1 << 26)
    parse = pacsv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False, double_quote=False,
                               ignore_empty_lines=False, invalid_row_handler=wrong_field_count)
    convert = pacsv.ConvertOptions(column_types=types, null_values=[""], strings_can_be_null=False,
                                   check_utf8=False)
    return read, parse, convert, problems


_FAST_TYPES = dict({LABEL: pa.int64()}, **{name: pa.int64() for name in DENSE},
                   **{name: pa.binary() for name in CATEGORICAL})
_TEXT_TYPES = {name: pa.string() for name in (LABEL,) + DENSE} | {name: pa.binary() for name in CATEGORICAL}


def parse(text: bytes) -> Parsed:
    """The samples of ``text`` (whole lines), and its malformed lines (left out of the samples)."""
    read, parse_options, convert, problems = _csv_options(_FAST_TYPES)
    try:
        table = pacsv.read_csv(pa.py_buffer(text), read, parse_options, convert)
    except pa.ArrowInvalid:  # an integer field that is no integer: read them as text, find which
        read, parse_options, convert, problems = _csv_options(_TEXT_TYPES)
        table = pacsv.read_csv(pa.py_buffer(text), read, parse_options, convert)
        table = _integers_checked(table, problems)
    lines = _line_numbers(table.num_rows, problems)
    bad_rows: List[Tuple[int, str, Optional[str]]] = []
    labels = pc.fill_null(table.column(LABEL), -1).to_numpy()
    for row in np.flatnonzero((labels != 0) & (labels != 1)):
        bad_rows.append((int(row), "the label must be 0 or 1", LABEL))
    ids = []
    for name in CATEGORICAL:
        column_ids, bad = hex_ids(table.column(name).combine_chunks())
        ids.append(column_ids)
        for row in np.flatnonzero(bad):
            bad_rows.append((int(row), f"not a hash of at most {MAX_HEX_DIGITS} hexadecimal digits", name))
    dense = np.empty((table.num_rows, len(DENSE)), dtype=np.float32)
    for index, name in enumerate(DENSE):
        dense[:, index] = pc.fill_null(table.column(name), 0).to_numpy()
    np.log1p(np.maximum(dense, 0, out=dense), out=dense)
    keep = None
    if bad_rows:
        keep = np.ones(table.num_rows, dtype=bool)
        for row, reason, column in bad_rows:
            if keep[row]:
                keep[row] = False
                problems.append(Problem(int(lines[row]), reason, column))
    problems.sort(key=lambda problem: problem.line)
    label_values = labels.astype(np.float32)
    if keep is not None:
        label_values, dense, ids = label_values[keep], dense[keep], [column[keep] for column in ids]
    samples = Samples(torch.from_numpy(label_values), torch.from_numpy(dense),
                      {name: torch.from_numpy(column).view(-1, 1) for name, column in zip(CATEGORICAL, ids)})
    return Parsed(samples, problems)


def _line_numbers(rows: int, problems: List[Problem]) -> np.ndarray:
    """The line (within the chunk, 1-based) of each row read: lines skipped as malformed have no row."""
    skipped = np.array([problem.line for problem in problems], dtype=np.int64)
    return np.setdiff1d(np.arange(1, rows + skipped.size + 1, dtype=np.int64), skipped, assume_unique=True)


def _integers_checked(table: pa.Table, problems: List[Problem]) -> pa.Table:
    """``table`` (label and integer features as text) with its lines of bad integers reported and dropped,
    the rest converted to int64."""
    lines = _line_numbers(table.num_rows, problems)
    good = np.ones(table.num_rows, dtype=bool)
    columns = {}
    for name in (LABEL,) + DENSE:
        column = table.column(name)
        integer = pc.match_substring_regex(column, r"^([+-]?[0-9]{1,18})?$").to_numpy(zero_copy_only=False)
        for row in np.flatnonzero(~integer & good):
            good[row] = False
            problems.append(Problem(int(lines[row]), f"{column[int(row)].as_py()!r} is not an integer", name))
        columns[name] = pc.if_else(pc.equal(column, ""), pa.scalar(None, pa.string()), column)  # empty: none
    table = pa.table({name: columns.get(name, table.column(name)) for name in FIELDS}).filter(pa.array(good))
    return table.cast(pa.schema([(name, _FAST_TYPES[name]) for name in FIELDS]))


_BYTES = {name: np.uint64(int.from_bytes(bytes([value]) * 8, "little")) for name, value in (
    ("high", 0x80), ("lower", 0x20), ("low_nibble", 0x0F), ("one", 0x01),
    ("to_0", 0x80 - 0x30), ("past_9", 0x80 - 0x3A), ("to_a", 0x80 - 0x61), ("past_f", 0x80 - 0x67))}


def _eight_hex_digits(words: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(the value, whether valid) of each 8-byte word read as 8 hexadecimal digits, the first byte the most
    significant digit: all 8 bytes of a word at once, in 64-bit integer operations (no per-byte work)."""
    b = _BYTES
    ascii_ = (words & b["high"]) == 0
    lower = words | b["lower"]  # letters to lower case; digits already have that bit
    digit = (lower + b["to_0"]) & ~(lower + b["past_9"])  # the high bit of each byte: '0' <= byte <= '9'
    letter = (lower + b["to_a"]) & ~(lower + b["past_f"])  # 'a' <= byte <= 'f'
    valid = ascii_ & (((digit | letter) & b["high"]) == b["high"])
    nibbles = (lower & b["low_nibble"]) + ((lower >> np.uint64(6)) & b["one"]) * np.uint64(9)
    # bytes n0..n7 (n0 first, the lowest byte) -> n0 n1 .. n7 as one 32-bit number
    pairs = ((nibbles & np.uint64(0x000F000F000F000F)) << np.uint64(4)) | \
        ((nibbles >> np.uint64(8)) & np.uint64(0x000F000F000F000F))
    quads = ((pairs & np.uint64(0x000000FF000000FF)) << np.uint64(8)) | \
        ((pairs >> np.uint64(16)) & np.uint64(0x000000FF000000FF))
    values = ((quads & np.uint64(0xFFFF)) << np.uint64(16)) | ((quads >> np.uint64(32)) & np.uint64(0xFFFF))
    return values, valid


def hex_ids(array: pa.Array) -> Tuple[np.ndarray, np.ndarray]:
    """(the int64 id each of ``array``'s strings spells in hexadecimal, ``MISSING_ID`` where empty; whether
    each is malformed: not hexadecimal, or longer than ``MAX_HEX_DIGITS``)."""
    count = len(array)
    if count == 0:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int32)[array.offset:array.offset + count + 1]
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None else np.empty(0, np.uint8)
    lengths = np.diff(offsets)
    ids = np.full(count, MISSING_ID, dtype=np.int64)
    bad = lengths > MAX_HEX_DIGITS
    first, last = int(offsets[0]), int(offsets[-1])
    if last == first:
        return ids, bad
    eight = lengths == 8
    if bool(np.all(eight | (lengths == 0))):  # Criteo's hashes: 8 digits each, one 64-bit word
        words = np.frombuffer(data_buffer, dtype=np.uint8, count=last - first, offset=first).view("<u8")
        values, valid = _eight_hex_digits(words)
        ids[eight] = values.astype(np.int64)
        bad[eight] = ~valid
        return ids, bad
    nibbles = _NIBBLES[data[first:last]]
    owner = np.repeat(np.arange(count), lengths)
    from_end = (offsets[1:][owner] - first - 1) - np.arange(last - first)
    bad[owner[nibbles == _NOT_HEX]] = True
    contributions = nibbles.astype(np.uint64) << (4 * np.minimum(from_end, MAX_HEX_DIGITS - 1)).astype(np.uint64)
    present = np.flatnonzero(lengths > 0)
    starts = offsets[:-1][present] - first
    ids[present] = np.bitwise_or.reduceat(contributions, starts).view(np.int64)
    return ids, bad
