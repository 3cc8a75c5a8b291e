"""``DynamicRows``: one shard's part of a dynamic table (any int64 id; rows made, kept and dropped here).

Owns, on a shard server, the rows of a table without a fixed size: the
ids that hash to this shard (``id_hash.shard_of``) get a row on first
admission (``Admission``), found through an ``IdIndex``; rows live in one
slab tensor (the hosted parameter, which grows in place by ``GROWTH``;
large ones on huge pages, ``huge_pages``); the index keeps each id's slot
and the step it was last touched.  A lookup finds,
touches and reads its ids in one call (``IdIndex.find_rows``: in the C
kernel build it is handed, ``native``, or torch operations without one).
The slab is an ordinary parameter to the owner-side optimizer
(``paramserver.shards.server.optimizers``): a push's ids become slots, and the same
fused sparse update as a fixed table's runs over them.  The optimizer's
per-row state lives in tensors shaped like the slab, so it follows the
rows: this object tells every optimizer attached to it when the slab
grows and when a slot gets a new id (its state rows start from zero).

Memory is bounded by ``capacity`` rows: a lookup that would pass it first
evicts the least recently touched rows (by the step of their last touch,
then by a hash of their ids, so wherever they sit; never a row touched in
the lookup's step), at least ``capacity // 64``
at a time so that a full shard scans its rows once per that many new ids,
not once per step; ids that still find no room read the default row and
get no row.  ``ttl_steps``: rows untouched for more steps are evicted, in
sweeps every ``ttl_steps // 8`` steps (so within ``ttl_steps * 9/8``).  An
evicted id that comes back starts again from its initial value
(``id_hash.initial_rows``) with fresh optimizer state.

Every method takes the slab's lock (the one the optimizer's steps take),
except those named ``*_locked``, whose caller holds it.  A lookup with a
negative step reads only: nothing is admitted, touched or counted.
"""

import logging
import threading
import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ....logs import RateLimitedLog
from ....tables import DynamicOptions
from ....tables.id_hash import initial_rows
from ....tables.row_types import is_half
from ..changes import RowMarks
from .admission import Admission
from .huge_pages import HugePages
from .id_index import IdIndex
from .native import Kernel
from ..row_store.tier import StoreRead, StoreTier

logger = logging.getLogger(__name__)

#: The slab grows by this factor (at least ``MIN_SLOTS`` rows) when it has no free slot: small, so that at
#: most an eighth of it (and of the optimizer state shaped like it) is ever unused, at the price of more copies
#: while a table fills (each row is copied about 1 / (GROWTH - 1) = 8 times on the way).
GROWTH = 1.125
MIN_SLOTS = 1024
_NEVER = torch.iinfo(torch.int32).max
#: With a store, rows are evicted at least ``capacity`` / this at a time: each eviction scans every row held,
#: and an evicted row costs only its write (and a read if it comes back), not its values.
STORE_EVICTION_SHARE = 16
#: Rows read from the store at a time for a checkpoint or an export.
STORE_SCAN_ROWS = 1 << 16
#: Rows last touched at the same step are evicted in the order of ``_tie_break`` of their ids, below this.
_TIE_SPAN = 1 << 31


def _tie_break(ids: Tensor) -> Tensor:
    """A 31-bit hash of each id (Fibonacci hashing: its bits mixed, so that no range of ids goes first)."""
    return ((ids * -7046029254386353131) >> 33) & (_TIE_SPAN - 1)


class DynamicRows:
    """The rows of ids ``shard_index`` of ``shard_count`` serves, of one dynamic table.

    ``kernel``: the C kernel build its lookups run in, or ``None`` for the torch path; ``huge_pages``: what
    makes its large tensors.  Its owner's (``ShardState.kernels.chosen()``, ``ShardState.huge_pages``).
    ``store``: where rows evicted for ``capacity`` are kept (``row_store.StoreTier``), or ``None`` to drop
    them."""

    def __init__(self, name: str, embedding_dim: int, dtype: torch.dtype, seed: int, init_std: float,
                 options: DynamicOptions, lock_for: Callable[[Tensor], threading.Lock], *,
                 kernel: Optional[Kernel], huge_pages: HugePages, store: Optional[StoreTier] = None):
        self.name, self.embedding_dim, self.dtype = name, embedding_dim, dtype
        self.seed, self.init_std, self.options = seed, init_std, options
        #: Rows it keeps in memory at most: ``options.capacity``, or what its shard's row store gives it of
        #: ``--row-memory`` (``row_store.RowStores.share``; changed while it serves as tables come).
        self.capacity: Optional[int] = options.capacity
        #: The hosted parameter: row ``slot`` holds the id the index maps to ``slot`` (free slots: none).
        self.slab = torch.empty(0, embedding_dim, dtype=dtype)
        #: Half-precision rows only (``None`` otherwise): the id each slot was last given (free slots keep their
        #: last id), whose bits a row's update is rounded with (``paramserver.optim.rounding``).  Grows in place
        #: with the slab.
        self.slot_ids: Optional[Tensor] = torch.empty(0, dtype=torch.int64) if is_half(dtype) else None
        self._free = torch.empty(0, dtype=torch.int64)
        self._used = 0  # slots below this were used at least once
        self._huge_pages = huge_pages
        self.index = IdIndex(kernel, huge_pages)
        self.admission = Admission(options, seed)
        self.clock = -1
        self._last_sweep = -1
        self.admitted = self.evicted = self.not_admitted = 0
        self._optimizers: List[Tuple["weakref.ref", int]] = []
        self._restored_state: Optional[Tuple[str, Dict[str, Tensor]]] = None
        self._lock = lock_for(self.slab)
        #: Slots changed and ids evicted since a live export took them (``changes``; under the lock).
        self.marks = RowMarks()
        #: Names this part in the shard's push log (``push_log.tag_of``), and what a training lookup is logged
        #: with, under the lock (``journal(ids, step)``; ``None``: not logged).
        self.log_tag = 0
        self.journal: Optional[Callable[[Tensor, int], None]] = None
        #: The rows evicted for ``capacity``, with their optimizer state, on disk (``None``: dropped).  It holds
        #: exactly the rows not in memory: a row read back is deleted there.
        self.store = store
        #: What a write to the store that failed (an ``OSError``: a full disk) becomes, raised in its place (its
        #: shard's: ``ShardState.store_failed``, which ends the shard).
        self.on_store_failure: Callable[[OSError], Exception] = lambda error: error
        #: Called when a lookup finds it full, before it evicts (``RowStores.rebalance``, where ``capacity`` is
        #: its share of a shard's ``--row-memory``; ``None``: a capacity of its own).
        self.on_full: Optional[Callable[[], None]] = None
        #: Steps that held more rows than ``capacity`` (a store keeps them all), logged at a bounded rate.
        self._past_capacity = RateLimitedLog(logger, "{count} step{s} of a dynamic table held rows past its capacity",
                                             level=logging.WARNING)
        #: Training lookups' ids found in memory, and those read from the store (``stats``).
        self.memory_hits = self.store_reads = 0

    # -- the optimizers whose state follows the rows -----------------------------
    def attach(self, optimizer, index: int) -> None:
        """``optimizer`` keeps per-row state of this slab as its parameter ``index``: it is told of growth
        (``resize_rows``) and of slots given new ids (``reset_rows``), under the lock."""
        with self._lock:
            self._optimizers.append((weakref.ref(optimizer), index))

    def _each_optimizer(self):
        live = [(ref(), index) for ref, index in self._optimizers]
        self._optimizers = [(ref, index) for (ref, index), (optimizer, _) in zip(self._optimizers, live)
                            if optimizer is not None]
        return [(optimizer, index) for optimizer, index in live if optimizer is not None]

    # -- lookups and pushes ------------------------------------------------------
    def lookup(self, ids: Tensor, step: int) -> Tensor:
        """Rows of ``ids`` (distinct int64); an id without a row reads zeros.  With ``step`` >= 0 (training)
        the ids are touched at ``step`` and new ones admitted, evicting what ``capacity`` requires; an id
        whose row is in the store has it read back (and is not admitted again)."""
        with self._lock:
            if step >= 0:
                self._advance_locked(step)  # before finding the ids: a TTL sweep frees the slots it evicts
            # the ids held are touched now, before any eviction: they must stay
            slots, rows, all_held = self.index.find_rows(ids, self.slab, step)
            missing = None if all_held else (slots < 0).nonzero().view(-1)
            if step >= 0:
                self.memory_hits += ids.numel() - (0 if missing is None else missing.numel())
            inserts: Optional[List[Tuple[Tensor, Tensor, Tensor]]] = None  # (the index takes them in one insert)
            if missing is not None and self.store is not None:
                if step >= 0:
                    back_from_store = self._read_back_locked(ids[missing])
                    # one eviction for the rows read back and the new ones admitted (an upper bound of them)
                    self._room_locked(missing.numel(), step)
                    inserts = []
                    loaded = self._place_locked(ids[missing], back_from_store, step, inserts)
                    back = (loaded >= 0).nonzero().view(-1)
                    rows[missing[back]] = self.slab.index_select(0, loaded[back])
                    missing = missing[loaded < 0]
                else:  # read only: the rows stay where they are
                    read = self.store.peek(ids[missing])
                    if read is not None:
                        live = self._unexpired(read.touches)
                        rows[missing[read.found.nonzero().view(-1)[live]]] = read.values[live].to(rows.dtype)
            if step >= 0 and missing is not None and missing.numel():
                admitted = missing[self.admission.admit(ids[missing], step)]
                self.not_admitted += missing.numel() - admitted.numel()
                if admitted.numel():
                    created = self._create_locked(ids[admitted], step, inserts)
                    made = (created >= 0).nonzero().view(-1)
                    rows[admitted[made]] = self.slab.index_select(0, created[made])
            if inserts:
                self.index.insert(*(torch.cat(parts) if len(inserts) > 1 else parts[0] for parts in zip(*inserts)))
            if step >= 0 and self.journal is not None:  # what it admitted, touched and evicted happens again
                self.journal(ids, step)
            return rows

    def slots_locked(self, ids: Tensor) -> Tensor:
        """The slots of ``ids`` now, -1 for ids without a row (a push's gradients for those are dropped).  Rows
        in the store come back for it, keeping their last touch, and evicting none of the push's rows."""
        slots = self.index.find(ids)
        if self.store is not None:
            missing = (slots < 0).nonzero().view(-1)
            if missing.numel():
                slots[missing] = self._load_locked(ids[missing], -1, self.clock, protect=slots[slots >= 0])
        return slots

    def prefetch(self, ids: Tensor) -> None:
        """The next lookup will ask for ``ids`` (distinct): start reading those the store holds, in the
        background, while the push before it is applied (``row_store.StoreTier.prefetch``)."""
        if self.store is None:
            return
        with self._lock:
            missing = ids[self.index.find(ids) < 0]
            scale = self._state_scale_locked()
        self.store.prefetch(missing, scale)

    def _unexpired(self, touches: Tensor) -> Tensor:
        """Which rows last touched at ``touches`` the TTL sweeps so far have not expired (a row in the store is
        swept when it is read: it expired if a sweep came more than ``ttl_steps`` after its touch)."""
        ttl = self.options.ttl_steps
        if ttl is None:
            return torch.ones(touches.numel(), dtype=torch.bool)
        return touches >= self._last_sweep - ttl

    def _load_locked(self, ids: Tensor, touch: int, evict_before: int, protect: Optional[Tensor] = None) -> Tensor:
        """Rows of ``ids`` (distinct, none in memory) read back from the store with their optimizer state, touched
        at ``touch`` (negative: their last touch kept), evicting rows touched before ``evict_before`` (none of
        ``protect``'s slots) to make room; their slots, -1 for ids the store does not hold (or holds expired:
        those are dropped)."""
        back = self._read_back_locked(ids)
        if back is not None:
            self._room_locked(back[0].numel(), evict_before, protect)
        return self._place_locked(ids, back, touch)

    def _read_back_locked(self, ids: Tensor) -> Optional[Tuple[Tensor, StoreRead]]:
        """The rows of ``ids`` (distinct, none in memory) the store holds, not expired, taken out of it: their
        positions among ``ids`` and their records; ``None`` for none (expired ones are dropped)."""
        read = self.store.read(ids, self._state_scale_locked())
        if read is None:
            return None
        found = read.found.nonzero().view(-1)
        self.store.drop(ids.index_select(0, found))  # the store holds the rows not in memory; expired ones go
        live = self._unexpired(read.touches)
        if not bool(live.all()):
            self.marks.evicted(ids.index_select(0, found[~live]))
            found, read = found[live], read.select(live)
        return (found, read) if found.numel() else None

    def _place_locked(self, ids: Tensor, back: Optional[Tuple[Tensor, StoreRead]], touch: int,
                      inserts: Optional[List[Tuple[Tensor, Tensor, Tensor]]] = None) -> Tensor:
        """Rows read back (``_read_back_locked``'s, of ``ids``) placed in memory with their state, touched at
        ``touch`` (negative: their last touch kept); the slots of ``ids``, -1 for those not read back.  Room was
        made for them (or the slab passes ``capacity``).  ``inserts``: where their (ids, slots, touches) go for
        the caller to put in the index, which they are not in yet."""
        slots = torch.full((ids.numel(),), -1, dtype=torch.int64)
        if back is None:
            return slots
        found, read = back
        count = found.numel()
        loaded = ids.index_select(0, found)
        taken = self._take_slots_locked(count)
        self.slab.index_copy_(0, taken, read.values.to(self.dtype))
        touches = torch.full((count,), touch, dtype=torch.int32) if touch >= 0 else read.touches.to(torch.int32)
        if inserts is None:
            self.index.insert(loaded, taken, touches)
        else:
            inserts.append((loaded, taken, touches))
        if self.slot_ids is not None:
            self.slot_ids.index_copy_(0, taken, loaded)
        self.marks.mark(taken)
        for optimizer, index in self._each_optimizer():
            optimizer.load_state_rows(index, taken, read.state, read.fresh_state)
        self.store_reads += count
        slots[found] = taken
        return slots

    def _advance_locked(self, step: int) -> None:
        if step <= self.clock:
            return
        self.clock = step
        ttl = self.options.ttl_steps
        if ttl is not None and step - self._last_sweep >= max(1, ttl // 8):
            self._last_sweep = step
            lanes, ids, slots, touches = self.index.held()
            expired = (touches < step - ttl).nonzero().view(-1)
            self._evict_locked(lanes[expired], slots[expired], ids[expired])

    def _create_locked(self, ids: Tensor, step: int,
                       inserts: Optional[List[Tuple[Tensor, Tensor, Tensor]]] = None) -> Tensor:
        """Rows for ``ids`` (distinct, none held), made room for; their slots, -1 for those left without.
        ``inserts``: as ``_place_locked`` takes it."""
        slots = torch.full((ids.numel(),), -1, dtype=torch.int64)
        count = self._room_locked(ids.numel(), step)
        if count < ids.numel():
            self.not_admitted += ids.numel() - count
        if count <= 0:
            return slots
        new_ids = ids[:count]
        taken = self._take_slots_locked(count)
        self.slab.index_copy_(0, taken, initial_rows(new_ids, self.seed, self.embedding_dim, self.init_std,
                                                     self.dtype))
        if inserts is None:
            self.index.insert(new_ids, taken, step)
        else:
            inserts.append((new_ids, taken, torch.full((count,), step, dtype=torch.int32)))
        if self.slot_ids is not None:
            self.slot_ids.index_copy_(0, taken, new_ids)
        self.marks.mark(taken)
        for optimizer, index in self._each_optimizer():
            optimizer.reset_rows(index, taken)
        self.admitted += count
        slots[:count] = taken
        return slots

    def _room_locked(self, count: int, step: int, protect: Optional[Tensor] = None) -> int:
        """How many of ``count`` new rows get a slot, evicting rows touched before ``step`` (none of
        ``protect``'s slots) as ``capacity`` requires: all of them with a store (the slab passes ``capacity``
        for as long as rows touched at ``step`` fill it), as many as there is room for without one."""
        capacity = self.capacity
        if capacity is None:
            return count
        room = capacity - len(self.index)
        if count > room and self.on_full is not None:  # its share of a shard's budget may grow first
            self.on_full()
            capacity = self.capacity
            room = capacity - len(self.index)
        if count > room:
            room += self._evict_least_recent_locked(count - room, step, protect)
        if self.store is None:
            return max(0, min(count, room))
        if count > room:
            self._past_capacity.record("past capacity", (
                f"dynamic table {self.name!r}: step {step} holds {count - room} rows past its capacity of {capacity} "
                f"(rows touched in a step stay until the next): its memory passes the budget meanwhile; it needs "
                f"a capacity of at least {len(self.index) + count} rows (Table capacity, or ps-server --row-memory)"))
        return count

    def _evict_least_recent_locked(self, needed: int, step: int, protect: Optional[Tensor] = None) -> int:
        """Evict at least ``needed`` rows (``capacity // 64`` if more) of those least recently touched before
        ``step`` (none of ``protect``'s slots), into the store where there is one; returns how many were
        evicted (fewer when too few rows were touched before ``step``)."""
        lanes, ids, slots, touches = self.index.held()
        evictable = touches < step
        if protect is not None and protect.numel():
            evictable &= ~torch.isin(slots, protect)
        batch = (self.capacity or 0) // (STORE_EVICTION_SHARE if self.store is not None else 64)
        count = min(max(needed, batch), int(evictable.sum()))
        if count <= 0:
            return 0
        # The least recently touched, and among rows touched at the same step those whose ids' hashes are the
        # least: the same victims wherever the rows sit (a restored part numbers its slots afresh).
        order = torch.where(evictable, touches.to(torch.int64), _NEVER) * _TIE_SPAN + _tie_break(ids)
        victims = torch.topk(order, count, largest=False, sorted=False).indices
        self._evict_locked(lanes[victims], slots[victims], ids[victims], touches[victims])
        return count

    def _evict_locked(self, lanes: Tensor, slots: Tensor, ids: Tensor, kept: Optional[Tensor] = None) -> None:
        """Drop ``ids``, in index lanes ``lanes``; their ``slots`` become free.  ``kept``: their last touches,
        for rows the store keeps (those evicted for ``capacity``; ``None``: expired, dropped everywhere)."""
        if slots.numel() == 0:
            return
        if kept is not None and self.store is not None:
            try:
                self.store.write(ids, kept, self.slab.index_select(0, slots), self._state_rows_locked(slots),
                                 self._state_scale_locked())
            except OSError as error:  # the rows stay where they are: nothing is dropped
                raise self.on_store_failure(error) from error
            self.marks.spilled(ids, slots)
        else:
            self.marks.evicted(ids)
        self.index.remove_lanes(lanes)
        self._free = torch.cat((self._free, slots))
        self.evicted += slots.numel()

    def _state_scale_locked(self) -> float:
        """What its optimizer keeps the first kind of its state rows multiplied by (``state_scale``)."""
        for optimizer, _ in self._each_optimizer():
            return optimizer.state_scale()
        return 1.0

    def _state_rows_locked(self, slots: Tensor) -> List[Tensor]:
        """The optimizer state of rows ``slots`` (its tensors with rows, in its order; none before it has state)."""
        for optimizer, index in self._each_optimizer():
            tensors = optimizer.state_rows(index, False)
            if tensors is not None:
                return [tensor.index_select(0, slots) for tensor in tensors]
        if self._restored_state is not None:  # restored rows evicted before their optimizer came for the state
            return [rows.index_select(0, slots) for rows in self._restored_state[1].values() if rows.dim() > 0]
        return []

    def _take_slots_locked(self, count: int) -> Tensor:
        reused = min(count, self._free.numel())
        taken = self._free[self._free.numel() - reused:]
        self._free = self._free[:self._free.numel() - reused].clone()
        fresh = count - reused
        if fresh:
            if self._used + fresh > self.slab.size(0):
                self._grow_locked(self._used + fresh)
            taken = torch.cat((taken, torch.arange(self._used, self._used + fresh)))
            self._used += fresh
        return taken

    def _grow_locked(self, needed: int) -> None:
        rows = max(needed, int(self.slab.size(0) * GROWTH), MIN_SLOTS)
        if self.capacity is not None:
            rows = max(needed, min(rows, self.capacity))
        # The slab changes its memory in place (set_): the optimizers and RRefs hold this very tensor.
        self.slab.set_(self._huge_pages.grown(self.slab, rows))
        if self.slot_ids is not None:
            self.slot_ids.resize_(rows)
        for optimizer, index in self._each_optimizer():
            optimizer.resize_rows(index, rows)

    # -- figures -------------------------------------------------------------------
    def stats(self) -> Dict[str, object]:
        """Rows held, admitted, evicted, not admitted (below the admission bar, or no room), and bytes of the
        rows (and, for half-precision rows, of their slots' ids), the index (ids, slots, touches) and admission
        counts (optimizer state not included); with a store, its figures too (``_store_stats``)."""
        with self._lock:
            stats = {"rows": len(self.index), "admitted": self.admitted, "evicted": self.evicted,
                     "not_admitted": self.not_admitted, "bytes": self._nbytes_locked()}
            if self.store is not None:
                stats.update(memory_hits=self.memory_hits, store_reads=self.store_reads)
        if self.store is not None:  # the engines' counters are read after the lock: lookups wait for no disk
            stats.update(self._store_stats())
        return stats

    def _nbytes_locked(self) -> int:
        ids = self.slot_ids.numel() * self.slot_ids.element_size() if self.slot_ids is not None else 0
        return self.slab.numel() * self.slab.element_size() + ids + self.index.nbytes + self.admission.nbytes

    # -- checkpoints -------------------------------------------------------------------
    def checkpoint_entry(self) -> Dict:
        """``checkpoint_entry_locked`` without optimizer state (a table no optimizer is over yet)."""
        with self._lock:
            return self.checkpoint_entry_locked("", {})

    def checkpoint_entry_locked(self, optimizer: str, state: Dict[str, Tensor]) -> Dict:
        """The rows held (ids, values, last touches), with the rows of ``state`` (the slab's state in
        ``optimizer``, a class name; its caller holds the optimizer's locks, so no step runs meanwhile),
        admission counts and clock."""
        _, ids, slots, touches = self.index.held()
        order = torch.argsort(slots)
        ids, slots, touches = ids[order], slots[order], touches[order]
        entry = {"dynamic": True, "ids": ids, "value": self.slab.index_select(0, slots),
                 "last_touch": touches, "optimizer": optimizer,
                 "state": {key: value.index_select(0, slots) if value.dim() > 0 else value.clone()
                           for key, value in state.items()},
                 "admission": self.admission.state_dict(), "clock": self.clock}
        if self.store is not None:
            self._add_stored_rows_locked(entry)
        return entry

    def _add_stored_rows_locked(self, entry: Dict) -> None:
        """Add the rows in the store (not expired) to checkpoint ``entry``, with their state where the entry
        has state (its keys with rows, in order, are the records' state; records written before the
        optimizer had state get its initial values)."""
        keys = [key for key, value in entry["state"].items() if value.dim() > 0]
        pieces: Dict[str, List[Tensor]] = {"ids": [], "value": [], "last_touch": [], **{key: [] for key in keys}}
        owner = next(iter(self._each_optimizer()), None)
        scale = self._state_scale_locked()
        for read in self.store.scan(STORE_SCAN_ROWS, scale):
            live = self._unexpired(read.touches)
            read = read.select(live)
            pieces["ids"].append(read.ids)
            pieces["value"].append(read.values)
            pieces["last_touch"].append(read.touches.to(torch.int32))
            if keys:
                state = read.state if read.state is not None else \
                    owner[0].initial_state_rows(owner[1], read.ids.numel())
                if read.fresh_state is not None and bool(read.fresh_state.any()):
                    fresh = owner[0].initial_state_rows(owner[1], read.ids.numel())
                    state = [torch.where(read.fresh_state.view((-1,) + (1,) * (rows.dim() - 1)), initial, rows)
                             for rows, initial in zip(state, fresh)]
                if scale != 1.0:  # as the optimizer's state_dict gives its own
                    state = [state[0].div(scale), *state[1:]]
                for key, rows in zip(keys, state):
                    pieces[key].append(rows)
        for key in ("ids", "value", "last_touch"):
            entry[key] = torch.cat([entry[key], *pieces[key]])
        for key in keys:
            entry["state"][key] = torch.cat([entry["state"][key], *pieces[key]])

    def export_entry_locked(self, changes) -> Dict:
        """A live export's entry (``changes.take()``'s ``Changes``; the caller holds the lock): every row held
        (``whole``), or the rows of the slots changed that hold an id now and the ids evicted that are not held
        again."""
        _, ids, slots, _ = self.index.held()
        if changes.whole:
            order = torch.argsort(slots)
            ids, slots = ids[order], slots[order]
            evicted = torch.zeros(0, dtype=torch.int64)
        else:
            changed = torch.zeros(max(self.slab.size(0), int(changes.rows.max()) + 1 if changes.rows.numel() else 0),
                                  dtype=torch.bool)
            changed[changes.rows] = True
            chosen = changed[slots].nonzero().view(-1)
            ids, slots = ids[chosen], slots[chosen]
            evicted = changes.evicted[~torch.isin(changes.evicted, ids)] if changes.evicted.numel() else \
                changes.evicted
            evicted = evicted.unique() if evicted.numel() else evicted
            if evicted.numel():
                held_now = self.index.find(evicted) >= 0  # evicted, then admitted again to an unchanged slot?
                evicted = evicted[~held_now]
        entry = {"dynamic": True, "whole": changes.whole, "ids": ids.clone(),
                 "values": self.slab.index_select(0, slots), "evicted": evicted}
        if self.store is not None:
            self._add_stored_export_rows_locked(entry, changes)
        return entry

    def _add_stored_export_rows_locked(self, entry: Dict, changes) -> None:
        """Add to a live export's ``entry`` the rows in the store it carries (not expired): all of them for a
        whole export, else those changed before they moved there (``changes.spilled``) and still there."""
        if changes.whole:
            reads = [read for read in self.store.scan(STORE_SCAN_ROWS)]
            pieces = [(read.ids, read.touches, read.values) for read in reads]
        else:
            spilled = changes.spilled.unique() if changes.spilled.numel() else changes.spilled
            on_disk = spilled[self.index.find(spilled) < 0] if spilled.numel() else spilled  # (not read back)
            read = self.store.peek(on_disk)
            pieces = [] if read is None else [(on_disk[read.found], read.touches, read.values)]
        for ids, touches, values in pieces:
            live = self._unexpired(touches)
            entry["ids"] = torch.cat([entry["ids"], ids[live]])
            entry["values"] = torch.cat([entry["values"], values[live].to(entry["values"].dtype)])

    def restore(self, ids: Tensor, values: Tensor, last_touch: Tensor, optimizer: str, state: Dict[str, Tensor],
                admission: List[Dict[str, Tensor]], clock: int) -> None:
        """Hold ``ids`` with ``values`` (before any lookup); ``state`` (rows in the same order) is handed to the
        optimizer that asks (``restored_optimizer_state``)."""
        with self._lock:
            if len(self.index) or self._optimizers:
                raise RuntimeError(f"dynamic table {self.name!r} is in use: it can only be restored before")
            if self.store is not None and self.capacity is not None and ids.numel() > self.capacity:
                ids, values, last_touch, state = self._restore_to_store_locked(ids, values, last_touch, state)
            count = ids.numel()
            if count:
                slots = self._take_slots_locked(count)
                self.slab[:count] = values.to(self.dtype)
                self.index.insert(ids, slots, last_touch.to(torch.int32))
                if self.slot_ids is not None:
                    self.slot_ids.index_copy_(0, slots, ids)
            self.admission.merge_state(admission)
            self.clock = self._last_sweep = clock
            self._restored_state = (optimizer, state) if optimizer else None

    def _restore_to_store_locked(self, ids: Tensor, values: Tensor, last_touch: Tensor, state: Dict[str, Tensor]):
        """Rows restored past ``capacity``: the least recently touched (as eviction orders them) go to the store
        with their state (as the checkpoint holds it: at scale 1), the rest are returned to be held."""
        order = torch.argsort(last_touch.to(torch.int64) * _TIE_SPAN + _tie_break(ids), descending=True)
        held, stored = order[:self.capacity], order[self.capacity:]
        with_rows = [rows.index_select(0, stored) for rows in state.values() if rows.dim() > 0]
        try:
            self.store.write(ids.index_select(0, stored), last_touch.index_select(0, stored),
                             values.index_select(0, stored).to(self.dtype), with_rows, 1.0)
        except OSError as error:
            raise self.on_store_failure(error) from error
        return (ids.index_select(0, held), values.index_select(0, held), last_touch.index_select(0, held),
                {key: rows.index_select(0, held) if rows.dim() > 0 else rows for key, rows in state.items()})

    def restored_optimizer(self) -> Optional[str]:
        """The optimizer class name whose state the restore held for these rows, or ``None``."""
        with self._lock:
            return self._restored_state[0] if self._restored_state is not None else None

    def restored_optimizer_state(self, optimizer: str) -> Optional[Dict[str, Tensor]]:
        """The restored state of ``optimizer`` (a class name) for the whole slab, or ``None``."""
        with self._lock:
            if self._restored_state is None or self._restored_state[0] != optimizer:
                return None
            full = {}
            for key, rows in self._restored_state[1].items():
                if rows.dim() == 0:
                    full[key] = rows.clone()
                    continue
                value = torch.zeros((self.slab.size(0),) + tuple(rows.shape[1:]), dtype=rows.dtype)
                value[:rows.size(0)] = rows
                full[key] = value
            return full

    # -- the store's figures -----------------------------------------------------------
    def _store_stats(self) -> Dict[str, object]:
        """The store's figures (its caller has ``memory_hits``, training lookups' ids found in memory, and
        ``store_reads``, ids read back into memory): ``rows_on_disk``, ``disk_bytes`` (its files), and its
        engines' counters: ``store_writes`` (records written: rows evicted into it) and
        ``store_written_bytes``, ``store_read_bytes`` (records found by every read: reads ahead and lookups that
        only read too); ``store_waits``, lookups that waited for a read ahead; ``store_read_latency``, its
        reads' times (``row_store.latency.LatencySnapshot``)."""
        engines = self.store.stats()
        return {"rows_on_disk": engines.get("rows", 0), "disk_bytes": engines.get("disk_bytes", 0),
                "store_writes": engines.get("writes", 0), "store_read_bytes": engines.get("read_bytes", 0),
                "store_written_bytes": engines.get("written_bytes", 0),
                "store_waits": self.store.waited_for_prefetch,
                "store_read_latency": self.store.read_latency.snapshot()}
