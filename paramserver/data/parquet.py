"""Parquet input: ``ParquetSchema`` (which columns are what) and reading one row group into samples.

Owns turning the columns a schema names into samples, read with pyarrow
one row group at a time (only the named columns): the label (0 or 1),
dense columns (numbers; empty reads 0; ``dense_log``: log(1 + x) as
for Criteo), categorical
columns (integers, one id per sample, in a table named after the column;
empty reads ``MISSING_ID``) and multi-hot columns (lists of integers, a
bag of ``bag`` ids per sample: longer lists are cut, shorter ones padded
with ``MISSING_ID``).  Columns of strings are taken as hexadecimal
hashes, as in Criteo's files (``strings="hex"``, the default), or any
string is hashed to its id (``strings="hash"``: XXH64 of its UTF-8 bytes,
``paramserver.tables.id_hash.string_ids``, which a serving client calls
for the same ids); an empty string or a null reads ``MISSING_ID``.  A row
with an empty or other label is malformed (its row group and row are
named).
"""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from ..tables.id_hash import string_ids
from .criteo import MISSING_ID, Parsed, Problem, hex_ids
from .errors import UnreadableFile
from .samples import Samples

if TYPE_CHECKING:
    from .parts import InputFiles


#: How a column of strings becomes ids (``ParquetSchema.strings``).
STRING_IDS = ("hex", "hash")


@dataclass(frozen=True)
class ParquetSchema:
    """Column names: ``label``; ``dense`` features; ``categorical`` ids (one per sample); ``multi_hot``
    list columns, each with its bag size."""

    label: str = "label"
    dense: Sequence[str] = ()
    categorical: Sequence[str] = ()
    multi_hot: Dict[str, int] = field(default_factory=dict)
    #: Dense values as ``log(1 + x)`` for ``x > 0``, else 0 (as for Criteo's counts); as they are otherwise.
    dense_log: bool = False
    #: What a string id is: ``"hex"``, a hexadecimal hash (Criteo's); ``"hash"``, any string, hashed.
    strings: str = "hex"

    def __post_init__(self):
        names = [self.label, *self.dense, *self.categorical, *self.multi_hot]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"Parquet schema names columns more than once: {', '.join(repeated)}")
        if not self.categorical and not self.multi_hot:
            raise ValueError("a Parquet schema needs at least one categorical or multi_hot column")
        for name, bag in self.multi_hot.items():
            if bag < 1:
                raise ValueError(f"multi_hot column {name!r}: the bag size must be at least 1, got {bag}")
        if self.strings not in STRING_IDS:
            raise ValueError(f"Parquet schema key strings must be one of {', '.join(map(repr, STRING_IDS))}, got "
                             f"{self.strings!r}")

    @classmethod
    def from_config(cls, config: Dict) -> "ParquetSchema":
        unknown = sorted(set(config) - {"label", "dense", "categorical", "multi_hot", "dense_log", "strings"})
        if unknown:
            raise ValueError(f"unknown Parquet schema keys: {', '.join(unknown)}")
        return cls(**{key: tuple(value) if isinstance(value, list) else value for key, value in config.items()})

    @property
    def columns(self) -> List[str]:
        return [self.label, *self.dense, *self.categorical, *self.multi_hot]

    @property
    def tables(self) -> List[str]:
        return [*self.categorical, *self.multi_hot]


def read_row_group(path: str, group: int, schema: ParquetSchema, inputs: Optional["InputFiles"] = None) -> Parsed:
    """Row group ``group`` of ``path`` (opened through ``inputs``, where it is listed) as samples; its malformed
    rows (numbered from 1 within the group)."""
    try:
        parquet = inputs.parquet(path) if inputs is not None else pq.ParquetFile(path)
        names = parquet.schema_arrow.names
        missing = [name for name in schema.columns if name not in names]
        if missing:
            raise UnreadableFile(path, f"it has no column {', '.join(map(repr, missing))} (it has "
                                       f"{', '.join(names)})")
        table = parquet.read_row_group(group, columns=schema.columns)
    except (OSError, pa.ArrowException) as error:
        raise UnreadableFile(path, str(error)) from error
    rows = table.num_rows
    problems: List[Problem] = []
    labels = pc.fill_null(table.column(schema.label).cast(pa.float64()), -1.0).to_numpy()
    keep = (labels == 0) | (labels == 1)
    for row in np.flatnonzero(~keep):
        problems.append(Problem(int(row) + 1, "the label must be 0 or 1", schema.label))
    dense = np.zeros((rows, len(schema.dense)), dtype=np.float32)
    for index, name in enumerate(schema.dense):
        dense[:, index] = pc.fill_null(table.column(name).cast(pa.float32()), 0.0).to_numpy()
    if schema.dense_log:
        np.log1p(np.maximum(dense, 0, out=dense), out=dense)
    ids: Dict[str, torch.Tensor] = {}
    for name in schema.categorical:
        column_ids, bad = _ids(table.column(name).combine_chunks(), schema.strings)
        _report(problems, keep, bad, name)
        ids[name] = torch.from_numpy(column_ids).view(rows, 1)
    for name, bag in schema.multi_hot.items():
        bags, bad = _bags(table.column(name).combine_chunks(), bag, schema.strings)
        _report(problems, keep, bad, name)
        ids[name] = torch.from_numpy(bags)
    problems.sort(key=lambda problem: problem.line)
    samples = Samples(torch.from_numpy(labels.astype(np.float32)), torch.from_numpy(dense), ids)
    if not keep.all():
        samples = _kept(samples, keep)
    return Parsed(samples, problems)


def _report(problems: List[Problem], keep: np.ndarray, bad: np.ndarray, column: str) -> None:
    for row in np.flatnonzero(bad & keep):
        problems.append(Problem(int(row) + 1, "not an integer id (nor a hexadecimal hash)", column))
    keep &= ~bad


def _kept(samples: Samples, keep: np.ndarray) -> Samples:
    where = torch.from_numpy(np.flatnonzero(keep))
    return Samples(samples.labels[where], samples.dense[where], {n: i[where] for n, i in samples.ids.items()})


def _ids(array: pa.Array, strings: str):
    """(int64 ids, ``MISSING_ID`` where empty; which are malformed) of an integer or string column (its strings
    read as ``strings`` says)."""
    if pa.types.is_string(array.type) or pa.types.is_large_string(array.type) or pa.types.is_binary(array.type):
        if strings == "hash":
            return _hashed_ids(array)
        return hex_ids(array.cast(pa.binary()).fill_null(b""))
    if not pa.types.is_integer(array.type):
        raise TypeError(f"column of {array.type}: categorical columns must hold integers or strings")
    values = np.array(pc.fill_null(array.cast(pa.int64()), MISSING_ID).to_numpy(), dtype=np.int64)  # writable
    return values, np.zeros(len(values), dtype=bool)


def _hashed_ids(array: pa.Array):
    """(each string's ``string_id``, ``MISSING_ID`` where empty or null; none malformed): each distinct string
    hashed once."""
    encoded = pc.dictionary_encode(array.cast(pa.binary()).fill_null(b""))
    distinct = string_ids(encoded.dictionary.to_pylist()).numpy()
    return distinct[encoded.indices.to_numpy()], np.zeros(len(array), dtype=bool)  # (a new, writable array)


def _bags(array: pa.Array, bag: int, strings: str):
    """(a (rows, bag) int64 matrix of each list's first ``bag`` ids, padded with ``MISSING_ID``; which rows
    are malformed) of a list column."""
    if not (pa.types.is_list(array.type) or pa.types.is_large_list(array.type)):
        raise TypeError(f"column of {array.type}: multi_hot columns must be lists of integers")
    rows = len(array)
    offsets = array.offsets.to_numpy()
    lengths = np.where(array.is_null().to_numpy(zero_copy_only=False), 0, np.diff(offsets))
    values, bad_values = _ids(array.values, strings)
    matrix = np.full((rows, bag), MISSING_ID, dtype=np.int64)
    bad = np.zeros(rows, dtype=bool)
    for position in range(bag):  # at most `bag` vectorized passes
        has = lengths > position
        where = offsets[:-1][has] + position
        matrix[has, position] = values[where]
        bad[has] |= bad_values[where]
    return matrix, bad
