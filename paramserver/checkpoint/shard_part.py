"""A shard's part of a checkpoint: its format, and reading it back after a restart or into an export.

Owns the file a shard writes into a checkpoint (``shard-<name>.pt``, format
``FORMAT``: every shared table's row range, with the optimizer state of
those rows; for a dynamic table's part, the rows it holds with their ids,
last touches, optimizer state and admission counts; and each optimizer's
ledger, the last step applied per pusher, by the optimizer's push-log tag,
so that a restored shard still knows which pushes it holds; the shard service
writes it, ``paramserver.shards.server.checkpoint_part``), and
``CheckpointSource``: the restore source a shard started from a
checkpoint is given (``ShardState.restore_source``), so that a table's
rows, and their optimizer state, come from the checkpoint when a trainer
asks for the table again.  The source reads every shard file of
the checkpoint (memory-mapped when local, into memory from an object
store) and cuts the rows each request names, so
the new shards need not be as many, nor split the tables the same way,
as the ones that wrote it (4 shards -> 2, 2 -> 4; a dynamic table's ids
are routed again by their hash, ``select_part``).  An export reads a
checkpoint's tables through ``CheckpointSource`` too (``export``).
"""

import logging
import threading
from pathlib import PurePosixPath
from typing import Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor

from ..logs import one_line
from ..tables import parse_part_name
from ..tables import part_name as dynamic_part_name
from ..tables.id_hash import shard_of
from .storage import (Checkpoint, CorruptCheckpoint, PathLike, assemble_rows, first_usable, load_tensors,
                      parse_range_name)

logger = logging.getLogger(__name__)

FORMAT = 1
PART_PREFIX = "shard-"


def part_name(shard: str) -> str:
    """The file shard ``shard`` writes into a checkpoint."""
    return f"{PART_PREFIX}{shard}.pt"


class CheckpointSource:
    """The shared tables of a checkpoint, by table, cut to whatever row ranges are asked for.

    Files are opened on first use, memory-mapped, after their size and
    sha256 were checked against the manifest.
    """

    def __init__(self, checkpoint: Checkpoint, verified: bool = False, convert_rows: bool = False):
        self.checkpoint = checkpoint
        #: Rows held in another type than a table asks for are converted (else refused: ``check_row_type``).
        self.convert_rows = convert_rows
        self._verified = verified  # its files' sha256 were checked already: not hashed again when read
        self._failure: Optional[CorruptCheckpoint] = None  # a file that could not be read: raised, logged once
        self._lock = threading.Lock()
        # table -> [(start, stop, entry)]
        self._pieces: Optional[Dict[str, List[Tuple[int, int, Dict]]]] = None
        self._dynamic_pieces: Dict[str, List[Dict]] = {}  # dynamic table -> the entries of all its parts
        self._ledgers: Dict[int, Dict[int, int]] = {}  # optimizer tag -> the last step applied per pusher

    @classmethod
    def newest_verified(cls, preferred: PathLike, step: int, shard: str,
                        convert_rows: bool = False) -> "CheckpointSource":
        """The checkpoint at ``preferred`` (the coordinator's choice, of ``step``) if every file of it
        verifies, else the newest one beside it that does and is not newer (``storage.first_usable``: each
        refusal logged once, naming the file; ``CorruptCheckpoint`` naming the shard and the files when
        none verifies)."""
        checkpoint, _ = first_usable(preferred, step, Checkpoint.verify, f"shard {shard}")
        return cls(checkpoint, verified=True, convert_rows=convert_rows)

    def check_row_type(self, table: str, held: torch.dtype, wanted: torch.dtype) -> None:
        """``ValueError`` naming ``table`` and both types when the checkpoint holds its rows as ``held`` and the
        table's are ``wanted``, unless this source converts rows (``convert_rows``)."""
        if held != wanted and not self.convert_rows:
            raise ValueError(f"table {table!r}: checkpoint {self.checkpoint.path} holds its rows as {held}, the "
                             f"table's are {wanted}; restore with --convert-rows (ps-server) to convert them")

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
                    for tag, ledger in part.get("ledgers", {}).items():
                        self._ledgers.setdefault(int(tag), {}).update({int(p): int(s) for p, s in ledger.items()})
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
        self.check_row_type(table, pieces[0][2]["value"].dtype, dtype)
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

    @property
    def key(self) -> str:
        """The checkpoint's name as a shard's push log marks it (its directory's name)."""
        return PurePosixPath(str(self.checkpoint.path).rstrip("/")).name

    def ledger(self, tag: int) -> Dict[int, int]:
        """The last step applied per pusher that the optimizer ``tag`` names (``push_log.tag_of``) kept, or ``{}``."""
        self._tables()
        return dict(self._ledgers.get(tag, {}))

    def optimizer_of(self, name: str) -> Optional[str]:
        """The optimizer class name whose state the checkpoint keeps for rows ``name``, or ``None``."""
        found = self._table(name)
        if found is None:
            return None
        kept = [e["optimizer"] for _, _, e in found[3] if e["optimizer"] and e["state"]]
        return kept[0] if kept else None

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
def select_part(pieces: List[Dict], index: int, count: int) -> Dict:
    """The rows of shard ``index`` of ``count`` among checkpoint entries of every part of one dynamic table
    (written by any number of shards): ids re-routed by ``shard_of``; admission counts of all parts."""
    ids = torch.cat([piece["ids"] for piece in pieces])
    mine = (shard_of(ids, count) == index).nonzero().view(-1)
    with_state = [piece for piece in pieces if piece["optimizer"]]
    optimizer = with_state[0]["optimizer"] if with_state and len(with_state) == len(pieces) else ""
    state = {}
    if optimizer:
        for key, value in with_state[0]["state"].items():
            state[key] = value.clone() if value.dim() == 0 else \
                torch.cat([piece["state"][key] for piece in pieces]).index_select(0, mine)
    return {"ids": ids.index_select(0, mine),
            "values": torch.cat([piece["value"] for piece in pieces]).index_select(0, mine),
            "last_touch": torch.cat([piece["last_touch"] for piece in pieces]).index_select(0, mine),
            "optimizer": optimizer, "state": state, "admission": [piece["admission"] for piece in pieces],
            "clock": max(int(piece["clock"]) for piece in pieces)}
