"""The planted CTR data written as files: Criteo-format text (plain or gzip) and Parquet.

Owns writing samples of ``ctr_data.PlantedCTR`` (26 categorical features,
13 dense ones, labels from the planted model) as the files a user brings:
Criteo's tab-separated lines (each id as the 8-digit hexadecimal hash of
its feature and id, some fields empty, some integers negative) or a
Parquet file of the same columns.  Tests, ``benchmarks/data_reader.py``
and anyone trying the file path without downloading Criteo use it; the
planted model's AUC on the written samples is the yardstick.
"""

import gzip
from typing import List, Optional

import numpy as np
import torch

from paramserver.data.criteo import CATEGORICAL, DENSE
from paramserver.tables.id_hash import salted
from paramserver.jobs.ctr_data import CTRSpec, PlantedCTR, auc

#: Share of fields left empty.
MISSING_SHARE = 0.05


def criteo_spec() -> CTRSpec:
    """26 categorical features (skewed vocabularies of 50 to 20,000 ids) and 13 dense ones."""
    vocab = tuple(int(50 * (20_000 / 50) ** (i / 25)) for i in range(len(CATEGORICAL)))
    return CTRSpec(vocab_sizes=vocab[::-1], bag_sizes=(1,) * len(CATEGORICAL), num_dense=len(DENSE))


class PlantedFiles:
    """Writes samples of the planted data; ``stream`` numbers make disjoint sets (train, eval)."""

    def __init__(self, seed: int = 0):
        self.data = PlantedCTR(criteo_spec(), seed=seed)

    def columns(self, stream: int, rows: int):
        """(labels, integer features with ``None`` where empty, 8-digit hashes with "" where empty, the
        planted logits) of ``rows`` samples."""
        batch = self.data.batch(stream, 0, rows)
        generator = np.random.default_rng(stream)
        # dense: a count-like integer that grows with the planted feature (log1p of it is close to linear)
        counts = np.floor(np.expm1(np.clip(batch.dense.numpy() + 2.0, 0, None) * 1.5)).astype(np.int64)
        counts[generator.random(counts.shape) < 0.02] = -1  # Criteo has a few negative values
        empty_dense = generator.random(counts.shape) < MISSING_SHARE
        hashes = []
        for feature, ids in enumerate(batch.ids):
            values = salted(ids.view(-1), feature).numpy().astype(np.uint64) & np.uint64(0xFFFFFFFF)
            text = np.char.mod("%08x", values.astype(np.int64))
            text[generator.random(rows) < MISSING_SHARE] = ""
            hashes.append(text)
        return batch.labels.numpy().astype(np.int64), counts, empty_dense, hashes, batch.true_logits

    def write_criteo(self, path: str, stream: int, rows: int, extra_lines: Optional[List[str]] = None) -> float:
        """``rows`` samples as Criteo lines (gzip when ``path`` ends in .gz), ``extra_lines`` appended as they
        are; returns the planted model's AUC on them."""
        labels, counts, empty, hashes, logits = self.columns(stream, rows)
        dense_text = np.where(empty, "", counts.astype(str))
        lines = ["\t".join([str(label), *dense_row, *hash_row]) for label, dense_row, hash_row in
                 zip(labels.tolist(), dense_text.tolist(), np.stack(hashes, 1).tolist())]
        text = ("\n".join(lines + list(extra_lines or [])) + "\n").encode()
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "wb") as out:
            out.write(text)
        return auc(logits, torch.from_numpy(labels).float())

    def write_parquet(self, path: str, stream: int, rows: int, row_group_size: int = 1000) -> float:
        """``rows`` samples as Parquet: ``label``, ``I1``..``I13`` (int64, null where empty), ``C1``..``C26``
        (int64 ids: the hashes' values, null where empty) and ``tags`` (a list of C1 and C2's ids, for
        multi-hot); returns the planted model's AUC on them."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        labels, counts, empty, hashes, logits = self.columns(stream, rows)
        columns = {"label": pa.array(labels)}
        for index, name in enumerate(DENSE):
            columns[name] = pa.array(counts[:, index], mask=empty[:, index])
        ids = []
        for name, text in zip(CATEGORICAL, hashes):
            values = np.array([int(value, 16) if value else 0 for value in text.tolist()], dtype=np.int64)
            ids.append(values)
            columns[name] = pa.array(values, mask=text == "")
        columns["tags"] = pa.array([[int(a), int(b)][:1 + i % 2] for i, (a, b) in enumerate(zip(ids[0], ids[1]))])
        pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
        return auc(logits, torch.from_numpy(labels).float())

