"""``RowStores``: a shard's row store, one folder on the host's disk, a tier in it per table part.

Owns the shard's folder under ``--row-store DIR`` (``DIR/<shard>``: cleared when
the shard starts, removed when it stops), the engine its tiers' records are
kept in (``ENGINES``), opening a tier for each table part that asks
(``tier``; a table part lives as long as its shard: its files go with the
shard's), and sharing ``--row-memory`` among the parts.  What is durable
is the checkpoint and the push log: a shard that starts again restores its
checkpoint and replays its log, and its store is made again from them, so a
store is never reopened.
"""

import importlib
import itertools
import os
import pathlib
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from .engine import RowStoreEngine
from .tier import StoreTier

#: The engines, by the name ``--row-store-engine`` takes: (module, class).  ``DEFAULT_ENGINE`` is the one the
#: engine benchmark chose (docs/row-store.md).
ENGINES = {"log": ("paramserver.shards.server.row_store.row_log", "RowLog"),
           "rocksdb": ("paramserver.shards.server.row_store.rocks", "RocksRows")}
DEFAULT_ENGINE = "log"
#: Each engine's options in a row store: RocksDB's count of rows is not needed (``StoreTier.rows`` is exact),
#: and making it exact costs a read per id put.
ENGINE_OPTIONS = {"rocksdb": {"exact_rows": False}}


@dataclass(frozen=True)
class RowStoreOptions:
    """A shard's row store: its ``folder`` (``--row-store``: the host's, where each shard makes one of its own),
    its ``engine`` (a name in ``ENGINES``) and the memory its tables' rows may take in all (``memory``
    bytes, ``--row-memory``; ``None``: each table's own ``capacity`` alone bounds it)."""

    folder: str
    engine: str = DEFAULT_ENGINE
    memory: Optional[int] = None

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise ValueError(f"--row-store-engine must be one of {sorted(ENGINES)}, got {self.engine!r}")
        if self.memory is not None and self.memory <= 0:
            raise ValueError(f"--row-memory must be a positive size, got {self.memory} bytes")


def check_folder(folder: str) -> None:
    """``ValueError`` naming ``--row-store`` unless ``folder`` is a directory this process may write."""
    path = pathlib.Path(folder)
    if not path.is_dir():
        raise ValueError(f"--row-store {folder}: no such directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--row-store {folder}: this process may not write there")


def engine_class(name: str):
    module, attribute = ENGINES[name]
    return getattr(importlib.import_module(module), attribute)


#: Threads reading ahead for a shard's tiers (one table part's read ahead at a time each).
READ_AHEAD_THREADS = 2
#: A table part's ask of ``--row-memory`` passes the rows it holds by an eighth of them, or by this many rows.
SHARE_STEP_ROWS = 1024
#: Bytes a row in memory takes besides its values and its optimizer state: its place in the id index (a
#: 16-byte lane at most 0.6 full), its slot's id (half-precision rows), the index's slot and touch.
ROW_OVERHEAD_BYTES = 40
#: Bytes of optimizer state per value a row's budget allows for: two float32 values per value (Adam's two
#: moments, the most a built-in optimizer keeps).
STATE_BYTES_PER_VALUE = 8


def row_bytes(part) -> int:
    """The memory one row of dynamic table part ``part`` takes at most, its optimizer state included."""
    values = part.embedding_dim * torch.empty(0, dtype=part.dtype).element_size()
    return values + part.embedding_dim * STATE_BYTES_PER_VALUE + ROW_OVERHEAD_BYTES


class RowStores:
    """The row store of the shard named ``shard`` (a folder of its own under ``options.folder``)."""

    def __init__(self, options: RowStoreOptions, shard: str):
        check_folder(options.folder)
        self.options = options
        self.folder = pathlib.Path(options.folder) / re.sub(r"[^A-Za-z0-9_.-]", "_", shard)
        shutil.rmtree(self.folder, ignore_errors=True)  # a store is never reopened: made again from the checkpoint
        self.folder.mkdir(parents=True)
        self._engine = engine_class(options.engine)
        self._lock = threading.Lock()
        self._tiers: Dict[str, StoreTier] = {}
        self._numbers = itertools.count()
        #: Where its tiers' reads ahead run (``StoreTier.prefetch``): the engines read in parallel within one.
        self._reader = ThreadPoolExecutor(max_workers=READ_AHEAD_THREADS, thread_name_prefix="row-store-read")
        self._shared: List = []  # dynamic table parts that share --row-memory
        self._parts: List = []  # every dynamic table part with a tier here

    def tier(self, part: str) -> StoreTier:
        """The tier of table part ``part`` (made on first ask; its engines in folders of their own)."""
        with self._lock:
            tier = self._tiers.get(part)
            if tier is None:
                stem = re.sub(r"[^A-Za-z0-9_.-]", "_", part)

                def open_engine(record_bytes: int) -> RowStoreEngine:
                    return self._engine(self.folder / f"{stem}-{next(self._numbers)}", record_bytes,
                                        **ENGINE_OPTIONS.get(self.options.engine, {}))
                tier = self._tiers[part] = StoreTier(open_engine, self._reader)
            return tier

    def share(self, rows, restoring: int = 0) -> None:
        """Give dynamic table part ``rows`` (a ``DynamicRows`` with a tier here) its part of ``memory``, where
        it has no ``capacity`` of its own (``rebalance``, again whenever such a part is full).  ``restoring``:
        the rows a restore is about to give it, which its share asks for as if it held them (so that a restore
        keeps in memory the rows the budget pays for, and sends only the rest to the store).  ``ValueError``
        when an equal share of what the tables with a capacity of their own leave pays for no row."""
        with self._lock:
            self._parts.append(rows)
            if self.options.memory is None:
                return
            if rows.options.capacity is None:
                self._shared.append(rows)
                rows.on_full = self.rebalance
            left, parts = self._left_locked(), list(self._shared)
        for part in parts:
            if left // len(parts) < row_bytes(part):
                raise ValueError(f"--row-memory {self.options.memory} bytes leaves table part {part.name!r} no "
                                 f"row in memory (it needs at least {row_bytes(part)} bytes per row, besides the "
                                 f"{self.options.memory - left} bytes the tables with a capacity of their own take)")
        self.rebalance(rows, restoring)

    def rebalance(self, restored=None, restoring: int = 0) -> None:
        """Share ``memory`` (what the tables with a capacity of their own leave) among the parts without one by
        what they hold: each asks for its rows held and an eighth more (at least ``SHARE_STEP_ROWS``), and the
        budget is filled from the smallest ask up, each getting its ask or an equal part of what is left, so
        small tables keep what they use and the large ones share the rest.  A part that fills its share calls
        this again (``DynamicRows.on_full``), so shares follow the tables as they grow.  Reads the parts' row
        counts without their locks (a count a step old does no harm: capacities only place rows); part
        ``restored`` counts as holding ``restoring`` rows (``share``)."""
        with self._lock:
            left, parts = self._left_locked(), list(self._shared)
        held = [restoring if part is restored else len(part.index) for part in parts]
        asks = sorted(((count + max(count // 8, SHARE_STEP_ROWS)) * row_bytes(part), index)
                      for index, (part, count) in enumerate(zip(parts, held)))
        for place, (ask, index) in enumerate(asks):
            part = parts[index]
            given = min(ask, left // (len(parts) - place))
            part.capacity = max(1, given // row_bytes(part))
            left -= part.capacity * row_bytes(part)

    def _left_locked(self) -> int:
        return self.options.memory - sum(row_bytes(part) * part.options.capacity for part in self._others_locked())

    def _others_locked(self):
        return [part for part in self._parts if part.options.capacity is not None]

    def close(self) -> None:
        """The shard stops: every tier's files and the shard's folder are removed."""
        with self._lock:
            tiers, self._tiers = list(self._tiers.values()), {}
        self._reader.shutdown(wait=True, cancel_futures=True)
        for tier in tiers:
            tier.close(remove=True)
        shutil.rmtree(self.folder, ignore_errors=True)
