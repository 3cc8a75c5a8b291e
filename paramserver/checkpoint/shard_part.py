"""A shard's part of a checkpoint: writing what it serves, and serving it again after a restart.

Owns, on a shard server, the file it writes into a checkpoint
(``shard-<name>.pt``: every shared table's row range, with the optimizer
state of those rows, each parameter copied together with its state
between two steps, read from the shard's ``ShardState``; for a dynamic
table's part, the rows it holds with their ids, last touches, optimizer
state and admission counts), and
``CheckpointSource``: the restore source a shard started from a
checkpoint is given (``ShardState.restore_source``), so that a table's
rows, and their optimizer state, come from the checkpoint when a trainer
asks for the table again.  The source reads every shard file of
the checkpoint (memory-mapped) and cuts the rows each request names, so
the new shards need not be as many, nor split the tables the same way,
as the ones that wrote it (4 shards -> 2, 2 -> 4; a dynamic table's ids
are routed again by their hash).

``write_part`` is what a trainer calls by RPC (``remote_write_part``)
while its trainer group is paused at a step boundary.  An export reads a
checkpoint's tables through ``CheckpointSource`` too (``export``).
"""

import logging
import pathlib
import threading
from typing import Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor

from ..shards.dynamic import parse_part_name, select_part
from ..shards.dynamic import part_name as dynamic_part_name
from ..shards.state import ShardState
from ..logs import one_line
from .storage import (Checkpoint, CorruptCheckpoint, assemble_rows, first_usable, load_tensors, parse_range_name,
                      save_tensors)

logger = logging.getLogger(__name__)

FORMAT = 1
PART_PREFIX = "shard-"


def part_name(shard: str) -> str:
    return f"{PART_PREFIX}{shard}.pt"


def remote_write_part(directory: str) -> Dict:
    """RPC target: write this shard's part into checkpoint ``directory``; its ``FileRecord`` as JSON."""
    import torch.distributed.rpc as rpc  # the RPC agent only exists in a serving shard
    return write_part(pathlib.Path(directory), rpc.get_worker_info().name).to_json()


def write_part(directory: pathlib.Path, shard: str):
    """Every shared table hosted here, with its optimizer state, into ``directory/shard-<shard>.pt``."""
    shard_state = ShardState.current()
    tables = shard_state.shared_tables()
    entries: Dict[str, Dict] = {}
    # Parameters with an optimizer: value and state copied together, under its locks (a dynamic table's come
    # as its entry: the rows held, by id, with their state).
    for optimizer in shard_state.optimizers():
        values, state = optimizer.snapshot()
        for index, (param, value) in enumerate(zip(optimizer.params, values)):
            name = shard_state.name_of(param)
            if name in tables and name not in entries:
                entries[name] = value if isinstance(value, dict) else \
                    {"value": value, "optimizer": optimizer.class_name, "state": state.get(index, {})}
    for name, table in tables.items():  # no optimizer (yet): the values alone
        if name not in entries:
            dynamic = shard_state.dynamic_rows(table)
            entries[name] = dynamic.checkpoint_entry() if dynamic is not None else \
                {"value": table.detach().clone(), "optimizer": "", "state": {}}
    record = save_tensors(directory / part_name(shard), {"format": FORMAT, "shard": shard, "tables": entries})
    logger.info("checkpoint part %s written: %d table ranges, %.1f MB", record.name, len(entries), record.bytes / 1e6)
    return record


class CheckpointSource:
    """The shared tables of a checkpoint, by table, cut to whatever row ranges are asked for.

    Files are opened on first use, memory-mapped, after their size and
    sha256 were checked against the manifest.
    """

    def __init__(self, checkpoint: Checkpoint, verified: bool = False):
        self.checkpoint = checkpoint
        self._verified = verified  # its files' sha256 were checked already: not hashed again when read
        self._failure: Optional[CorruptCheckpoint] = None  # a file that could not be read: raised, logged once
        self._lock = threading.Lock()
        # table -> [(start, stop, entry)]
        self._pieces: Optional[Dict[str, List[Tuple[int, int, Dict]]]] = None
        self._dynamic_pieces: Dict[str, List[Dict]] = {}  # dynamic table -> the entries of all its parts

    @classmethod
    def newest_verified(cls, preferred: str, step: int, shard: str) -> "CheckpointSource":
        """The checkpoint at ``preferred`` (the coordinator's choice, of ``step``) if every file of it
        verifies, else the newest one beside it that does and is not newer (``storage.first_usable``: each
        refusal logged once, naming the file; ``CorruptCheckpoint`` naming the shard and the files when
        none verifies)."""
        checkpoint, _ = first_usable(preferred, step, Checkpoint.verify, f"shard {shard}")
        return cls(checkpoint, verified=True)

    def _tables(self) -> Dict[str, List[Tuple[int, int, Dict]]]:
        with self._lock:
            if self._failure is not None:
                raise self._failure
            if self._pieces is None:
                pieces: Dict[str, List[Tuple[int, int, Dict]]] = {}
                for record in self.checkpoint.files:
                    if not record.name.startswith(PART_PREFIX):
                        continue
                    try:
                        part = load_tensors(self.checkpoint.file(record.name), None if self._verified else record,
                                            mmap=True)
                    except CorruptCheckpoint as error:  # every table asked for would fail alike: said once
                        self._failure = error
                        logger.error("cannot restore from checkpoint %s: %s", self.checkpoint.path, one_line(error))
                        raise
                    for name, entry in part["tables"].items():
                        parsed = parse_range_name(name)
                        dynamic = parse_part_name(name) if entry.get("dynamic") else None
                        if dynamic is not None:
                            self._dynamic_pieces.setdefault(dynamic[0], []).append(entry)
                        elif parsed is not None:
                            table, start, stop = parsed
                            pieces.setdefault(table, []).append((start, stop, entry))
                self._pieces = pieces
                logger.info("reading checkpoint %s (step %d): %d tables", self.checkpoint.path, self.checkpoint.step,
                            len(pieces))
            return self._pieces

    def table_names(self) -> Set[str]:
        """Every table the checkpoint holds rows of (fixed and dynamic)."""
        return set(self._tables()) | set(self._dynamic_pieces)

    def _table(self, name: str) -> Optional[Tuple[str, int, int, List[Tuple[int, int, Dict]]]]:
        parsed = parse_range_name(name)
        if parsed is None:
            return None
        table, start, stop = parsed
        pieces = self._tables().get(table)
        return (table, start, stop, pieces) if pieces else None

    def rows(self, name: str, num_rows: int, embedding_dim: int, dtype: torch.dtype) -> Optional[Tensor]:
        """Rows of ``name`` ("table[start:stop]") as the checkpoint holds them; ``None`` if it has no such table."""
        found = self._table(name)
        if found is None:
            return None
        table, start, stop, pieces = found
        total = max(piece_stop for _, piece_stop, _ in pieces)
        shape = tuple(pieces[0][2]["value"].shape[1:])
        if stop > total or shape != (embedding_dim,) or stop - start != num_rows:
            raise ValueError(f"table {table!r} in checkpoint {self.checkpoint.path} has {total} rows of "
                             f"{list(shape)}, asked for rows {start}:{stop} of [{embedding_dim}]")
        rows = assemble_rows([(a, b, e["value"]) for a, b, e in pieces], start, stop, f"table {table!r}")
        logger.info("%s read from checkpoint step %d", name, self.checkpoint.step)
        return rows.to(dtype).contiguous()

    def dynamic_part(self, table: str, index: int, count: int) -> Optional[Dict]:
        """What shard ``index`` of ``count`` holds of dynamic table ``table`` (``DynamicRows.restore``'s
        arguments), from every part the checkpoint has of it; ``None`` if it has none."""
        self._tables()
        pieces = self._dynamic_pieces.get(table)
        if not pieces:
            return None
        part = select_part(pieces, index, count)
        logger.info("%s read from checkpoint step %d: %d rows", dynamic_part_name(table, index, count),
                    self.checkpoint.step, part["ids"].numel())
        return part

    def optimizer_state(self, name: str, optimizer: str) -> Optional[Dict[str, Tensor]]:
        """The state ``optimizer`` (a class name) kept for rows ``name``; ``None`` if the checkpoint has none."""
        found = self._table(name)
        if found is None:
            return None
        table, start, stop, pieces = found
        with_state = [(a, b, e) for a, b, e in pieces if e["optimizer"] == optimizer and e["state"]]
        if not with_state:
            return None
        state: Dict[str, Tensor] = {}
        for key, value in with_state[0][2]["state"].items():
            if value.dim() == 0:  # a scalar (a step count): the same for every piece
                state[key] = value.clone()
            else:
                state[key] = assemble_rows([(a, b, e["state"][key]) for a, b, e in with_state], start, stop,
                                           f"optimizer state {key!r} of table {table!r}")
        return state
