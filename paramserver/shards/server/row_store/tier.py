"""``StoreTier``: one table part's rows on disk, with their last touch and optimizer state.

Owns a part's records in its engine (``engine``): writing rows evicted from
memory, reading back the rows of ids that return, dropping rows that expire,
scanning them all for checkpoints and exports, and the figures of its reads
(its engines' counters, ``stats``; its reads' times, ``read_latency``).
It never decides which rows are in memory: its table part (``DynamicRows``)
does, under its lock, and calls it there.

Records are laid out by ``layout.RowLayout``.  When the layout changes (an
optimizer's state appears after rows were written without it), records go to
a new engine (a generation) and the older ones are read where the newer lack
an id: a record is never rewritten to change its layout.
"""

import threading
import time
from concurrent.futures import Executor, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .engine import RowStoreEngine
from .latency import ReadLatency
from .layout import RowLayout

#: Reads ahead kept at once (a shard's workers each send the next step's ids before their pushes).
MAX_STAGED = 4
#: How long a read waits at most for a read ahead of the same rows still running (it reads them itself after).
PREFETCH_WAIT_SECONDS = 30.0


@dataclass
class StoreRead:
    """What a read found: ``found`` (bool, one per id asked), and for the ids found, in their order, their
    ``touches`` (int64), ``values`` and ``state`` rows (``None`` for records written without state);
    ``fresh_state``: which of them had none (their ``state`` rows are zeros), where some had; ``ids``: the
    ids found, in a scan."""

    found: Tensor
    touches: Tensor
    values: Tensor
    state: Optional[List[Tensor]]
    fresh_state: Optional[Tensor] = None
    ids: Optional[Tensor] = None

    def select(self, chosen: Tensor) -> "StoreRead":
        """The rows found that ``chosen`` (bool, one per row found) picks (``found`` left as it was)."""
        return StoreRead(self.found, self.touches[chosen], self.values[chosen],
                         None if self.state is None else [rows[chosen] for rows in self.state],
                         None if self.fresh_state is None else self.fresh_state[chosen],
                         None if self.ids is None else self.ids[chosen])


def _rescaled(state: List[Tensor], written: float, wanted: float) -> List[Tensor]:
    """``state`` rows written at scale ``written`` brought to ``wanted``, as the optimizer rescales its own
    (``FunctionalQHM._rescale_buffers``: one multiplication by their ratio)."""
    if written == wanted or not state:
        return state
    return [state[0].mul(wanted / written), *state[1:]]


@dataclass
class _Staged:
    """One read ahead: ``ids`` (sorted), ``positions`` (each one's place among the ids it read), ``read`` (theirs,
    ``None``: it found none), at ``scale``; ``valid``: which ids are still good (neither written nor dropped
    since it began)."""

    ids: Tensor
    positions: Tensor
    read: Optional[StoreRead]
    scale: float
    valid: Tensor


class StoreTier:
    """The records of one table part, in engines that ``open_engine(record_bytes)`` opens (each in a folder of
    its own)."""

    def __init__(self, open_engine: Callable[[int], RowStoreEngine], reader: Optional[Executor] = None):
        self._open_engine = open_engine
        #: (layout, engine), the newest first: where records are written, then where older ones are read.
        self._generations: List[Tuple[RowLayout, RowStoreEngine]] = []
        #: Reads of its engines, and their times in a histogram's buckets (what the shard's metrics export).
        #: Rows held: its table part writes only ids it does not hold and drops only ids it holds (a row read
        #: back is dropped here), so counting them is exact.
        self.rows = 0
        self.read_calls = 0
        self.read_latency = ReadLatency()
        #: Where reads ahead run (``prefetch``), or ``None``: no reads ahead.
        self._reader = reader
        #: The latest reads ahead (``MAX_STAGED``), each id good until it is written or dropped, and those still
        #: running, each with the ids changed meanwhile.  Under ``_staging``.
        self._staging = threading.Lock()
        self._staged: List[_Staged] = []
        self._ahead: List[Tuple[Future, List[Tensor]]] = []
        #: Ids asked for that a read ahead had brought (``prefetched``), and reads that waited for one.
        self.prefetched = self.waited_for_prefetch = 0
        self._closing = threading.Lock()  # figures read from another thread never meet a closed engine

    # -- writes --------------------------------------------------------------
    def write(self, ids: Tensor, touches: Tensor, values: Tensor, state: Sequence[Tensor], scale: float = 1.0) -> None:
        """Keep rows ``ids`` (distinct, none held here): their last ``touches``, ``values`` and ``state`` rows
        (the optimizer's state tensors that have rows, in its order; none before it has state; the first kept
        multiplied by ``scale``)."""
        if ids.numel() == 0:
            return
        self._changed(ids)
        self.rows += ids.numel()
        layout = RowLayout.of(values, state, scale)
        if not self._generations or self._generations[0][0] != layout:
            self._generations.insert(0, (layout, self._open_engine(layout.record_bytes)))
        newest_layout, engine = self._generations[0]
        engine.put(ids.contiguous(), newest_layout.pack(touches, values, state))

    def drop(self, ids: Tensor) -> None:
        """``ids`` (every one held) are held no more."""
        if ids.numel():
            self._changed(ids)
            self.rows -= ids.numel()
            for _, engine in self._generations:
                engine.delete(ids.contiguous())

    # -- reads ahead -----------------------------------------------------------
    def prefetch(self, ids: Tensor, scale: float = 1.0) -> None:
        """Start reading the records of ``ids`` (distinct, none in memory) in the background, for a ``read`` of
        them soon (the next step's lookup, which its message brought before its push is applied).  An id
        written or dropped after this is read again by that ``read``: it never sees an older record."""
        if self._reader is None or not self._generations or ids.numel() == 0:
            return
        changed: List[Tensor] = []
        with self._staging:
            self._ahead.append((self._reader.submit(self._read_ahead, ids.clone(), scale, changed), changed))

    def _read_ahead(self, ids: Tensor, scale: float, changed: List[Tensor]) -> None:
        try:
            read = self._read_engines(ids, scale)
        finally:
            with self._staging:
                self._ahead = [(future, ids_changed) for future, ids_changed in self._ahead
                               if ids_changed is not changed]
        sorted_ids, positions = torch.sort(ids)
        with self._staging:  # (the ids changed while it read were recorded until now)
            valid = ~torch.isin(sorted_ids, torch.cat(changed)) if changed else \
                torch.ones(ids.numel(), dtype=torch.bool)
            self._staged.append(_Staged(sorted_ids, positions, read, scale, valid))
            del self._staged[:-MAX_STAGED]

    def _changed(self, ids: Tensor) -> None:
        """``ids`` were written or dropped: what was read ahead of them is read again."""
        with self._staging:
            for staged in self._staged:
                staged.valid &= ~torch.isin(staged.ids, ids)
            for _, changed in self._ahead:
                changed.append(ids.clone())

    def _staged_for(self, ids: Tensor, scale: float) -> Tuple[List[Tuple[Tensor, "_Staged", Tensor]], Tensor]:
        """Where ``ids`` were read ahead: ``(pieces, rest)``, each piece ``(positions among ids, what read them,
        positions among the ids it read)``, the newest read first; ``rest``, the positions of the others.
        Waits (at most ``PREFETCH_WAIT_SECONDS``) for the reads ahead still running."""
        with self._staging:
            running = [future for future, _ in self._ahead]
        if any(not future.done() for future in running):
            self.waited_for_prefetch += 1
        for future in running:
            try:
                future.result(timeout=PREFETCH_WAIT_SECONDS)
            except (FutureTimeout, OSError):  # read now instead (a failure shows there again)
                pass
        with self._staging:
            entries = list(self._staged)
        pieces, rest = [], torch.arange(ids.numel())
        for staged in reversed(entries):
            if staged.scale != scale or staged.ids.numel() == 0 or rest.numel() == 0:
                continue
            wanted = ids.index_select(0, rest)
            at = torch.searchsorted(staged.ids, wanted).clamp_(max=staged.ids.numel() - 1)
            hit = (staged.ids.index_select(0, at) == wanted) & staged.valid.index_select(0, at)
            if bool(hit.any()):
                pieces.append((rest[hit], staged, staged.positions.index_select(0, at[hit])))
                rest = rest[~hit]
        return pieces, rest

    # -- reads ---------------------------------------------------------------
    def read(self, ids: Tensor, scale: float = 1.0) -> Optional[StoreRead]:
        """The records of ``ids`` (distinct) held here, or ``None`` when none of them is; state rows at ``scale``
        (``layout.RowLayout.scale``).  Those read ahead (``prefetch``) come from there."""
        if not self._generations or ids.numel() == 0:
            return None
        if not self._ahead and not self._staged:
            return self._read_engines(ids, scale)
        staged, rest = self._staged_for(ids, scale)
        if not staged:
            return self._read_engines(ids, scale)
        self.prefetched += ids.numel() - rest.numel()
        pieces = []  # one read of ``ids``: the records read ahead, the rest read now
        for mine, ahead, within in staged:
            if ahead.read is None:  # it found none of its ids
                continue
            found = ahead.read.found.index_select(0, within)
            rank = torch.cumsum(ahead.read.found.to(torch.int64), 0) - 1  # a found id's place among those found
            chosen = rank.index_select(0, within[found])
            if chosen.numel():
                pieces.append((mine[found], ahead.read.touches[chosen], ahead.read.values[chosen],
                               None if ahead.read.state is None else [rows[chosen] for rows in ahead.read.state]))
        read_now = self._read_engines(ids.index_select(0, rest), scale) if rest.numel() else None
        if read_now is not None:
            pieces.append((rest[read_now.found], read_now.touches, read_now.values, read_now.state))
        if not pieces:
            return None
        return self._merged(torch.zeros(ids.numel(), dtype=torch.bool), pieces)

    def peek(self, ids: Tensor, scale: float = 1.0) -> Optional[StoreRead]:
        """``read``, leaving what was read ahead for the read it was for (a read that brings nothing back into
        memory: a read-only lookup, an export)."""
        if not self._generations or ids.numel() == 0:
            return None
        return self._read_engines(ids, scale)

    def _read_engines(self, ids: Tensor, scale: float) -> Optional[StoreRead]:
        began = time.perf_counter()
        ids = ids.contiguous()
        found = torch.zeros(ids.numel(), dtype=torch.bool)
        pieces = []  # (positions among ids, touches, values, state)
        remaining = torch.arange(ids.numel())
        # (a copy: a read ahead runs on a thread of its own while its table part may open a generation)
        for layout, engine in list(self._generations):
            out = torch.empty(remaining.numel(), layout.record_bytes, dtype=torch.uint8)
            hit = engine.get(ids.index_select(0, remaining), out)
            at = hit.nonzero().view(-1)
            if at.numel():
                touches, values, state = layout.unpack(out.index_select(0, at))
                state = _rescaled(state, layout.scale, scale)
                pieces.append((remaining.index_select(0, at), touches, values, state if layout.has_state else None))
                remaining = remaining[~hit]
            if remaining.numel() == 0:
                break
        with self._staging:  # (reads ahead count here too, from their own threads)
            self.read_calls += 1
        self.read_latency.observe(time.perf_counter() - began)
        if not pieces:
            return None
        if len(pieces) == 1:
            positions, touches, values, state = pieces[0]
            found[positions] = True
            order = torch.argsort(positions)
            return StoreRead(found, touches[order], values[order],
                             None if state is None else [rows[order] for rows in state])
        return self._merged(found, pieces)

    @staticmethod
    def _merged(found: Tensor, pieces) -> StoreRead:
        """Records found in several generations, in the order of the ids asked: a generation without state
        gives its rows the newest one's state layout at zeros, and says which they are in ``fresh_state``."""
        positions = torch.cat([piece[0] for piece in pieces])
        found[positions] = True
        order = torch.argsort(positions)
        touches = torch.cat([piece[1] for piece in pieces])[order]
        values = torch.cat([piece[2] for piece in pieces])[order]
        with_state = next((piece[3] for piece in pieces if piece[3] is not None), None)
        if with_state is None:
            return StoreRead(found, touches, values, None)
        state, fresh = [], torch.cat([torch.full((piece[0].numel(),), piece[3] is None) for piece in pieces])[order]
        for k, like in enumerate(with_state):
            state.append(torch.cat([piece[3][k] if piece[3] is not None else
                                    torch.zeros((piece[0].numel(),) + tuple(like.shape[1:]), dtype=like.dtype)
                                    for piece in pieces])[order])
        return StoreRead(found, touches, values, state, fresh)

    def scan(self, batch: int, scale: float = 1.0) -> Iterator[StoreRead]:
        """Every row held, in batches of at most ``batch`` (with their ``ids``), state rows at ``scale``."""
        for generation, (layout, engine) in enumerate(self._generations):
            for ids, records in engine.scan(batch):
                if generation:  # an id a newer generation holds is read there
                    newer = torch.zeros(ids.numel(), dtype=torch.bool)
                    for _, other in self._generations[:generation]:
                        newer |= other.get(ids, torch.empty(ids.numel(), other.record_bytes, dtype=torch.uint8))
                    ids, records = ids[~newer], records[~newer]
                if ids.numel():
                    touches, values, state = layout.unpack(records)
                    state = _rescaled(state, layout.scale, scale)
                    yield StoreRead(torch.ones(ids.numel(), dtype=torch.bool), touches, values,
                                    state if layout.has_state else None, ids=ids)

    # -- figures and the end -----------------------------------------------------
    def stats(self) -> Dict[str, int]:
        """Its engines' counters, added up (``engine.ENGINE_STATS``; none before its first write).  It may be
        called without its table part's lock (a scrape, a heartbeat): the engines count under locks of their
        own."""
        total: Dict[str, int] = {}
        with self._closing:
            for _, engine in list(self._generations):  # a write may add one meanwhile
                for key, value in engine.stats().items():
                    total[key] = total.get(key, 0) + int(value)
        total["rows"] = self.rows  # (counted here: an engine may only estimate its keys)
        return total

    def close(self, remove: bool = True) -> None:
        """Close its engines; ``remove``: delete their files (a table part that goes, a shard that stops)."""
        with self._closing:
            generations, self._generations = self._generations, []
            for _, engine in generations:
                engine.close(remove=remove)
