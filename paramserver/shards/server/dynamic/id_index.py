"""``IdIndex``: a hash map from int64 ids to row slots and last touches, vectorized over a batch of ids.

Owns where a dynamic table's ids are (``rows.DynamicRows``) and
the step each was last touched.  A Python dict costs a Python object and
a trip through the interpreter per id; this index is one tensor of
buckets of ``LANES`` lanes, each bucket 128 bytes in one piece (two
adjacent cache lines): the lanes' ids, then their slots (int32), then
their last touches (int32).  An id goes to the bucket its Fibonacci hash
names (``id_hash.bucket_of``), or, when that bucket is full, to the next
one that is not.  A lookup reads the id's whole bucket at once, writes its
touch in the same lines, and stops at the first bucket with an empty lane,
so nearly every id is found in the first round (the others in a round or
two more).  Lookups run in the C kernel it is handed (``native.Kernel``)
over the same tensor, which also reads the ids' rows; with none, in the
torch code here, with the same results.  Large indexes live on huge pages
(the ``huge_pages.HugePages`` it is handed).

Removing an id leaves a tombstone (the lane is reused by a later insert,
but still counts as taken for lookups, so that ids placed past it stay
found); the index is rebuilt when ids and tombstones together fill
``MAX_LOAD`` of the lanes, at twice the size when the ids alone fill more
than half.  Not thread-safe: its owner serializes calls.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import native
from .huge_pages import HugePages
from ....tables.id_hash import bucket_of, _GOLDEN

LANES = native.LANES  # the C kernel reads buckets of this many lanes
EMPTY = -1
REMOVED = -2
#: Lanes taken (ids and tombstones) at which the index is rebuilt.
MAX_LOAD = 0.6
_GOLDEN_INVERSE = pow(_GOLDEN % (1 << 64), -1, 1 << 64)
_GOLDEN_INVERSE -= (1 << 64) if _GOLDEN_INVERSE >= 1 << 63 else 0


class IdIndex:
    """int64 id -> (slot, a non-negative int32; last touch, an int32 step or -1), for batches of ids.

    ``kernel``: the C kernel build its lookups run in, or ``None`` for the torch path; ``huge_pages``: what
    makes its tensors (both its owner's, ``ShardState.kernels`` and ``ShardState.huge_pages``)."""

    def __init__(self, kernel: Optional[native.Kernel], huge_pages: HugePages, expected: int = 0):
        self.kernel = kernel
        self._huge_pages = huge_pages
        self._allocate(self._buckets_for(expected))
        self.size = 0
        self.removed = 0

    @staticmethod
    def _buckets_for(ids: int) -> int:
        buckets = 16
        while buckets * LANES * MAX_LOAD < 2 * ids:
            buckets *= 2
        return buckets

    def _allocate(self, buckets: int) -> None:
        self._bits = buckets.bit_length() - 1
        self._mask = buckets - 1
        #: Overflow never goes further than this past an id's own bucket (the index grows instead), so the
        #: unused key below can never be an id looked for in that bucket.
        self._max_run = max(1, buckets // 4)
        #: Each bucket: LANES ids, then LANES int32 slots and LANES int32 touches (as int64 pairs).
        self.table = self._huge_pages.empty((buckets, 2 * LANES), torch.int64)
        self.keys = self.table[:, :LANES]
        self.slots = self.table[:, LANES:LANES + LANES // 2].view(torch.int32)
        self.touches = self.table[:, LANES + LANES // 2:].view(torch.int32)
        self.keys.copy_(self._unused_keys(torch.arange(buckets)).unsqueeze(1).expand(buckets, LANES))
        self.table[:, LANES:] = -1  # every slot EMPTY, every touch -1

    def _unused_keys(self, buckets: Tensor) -> Tensor:
        """A key for an unused lane of each of ``buckets``: an id whose own bucket is half the index away."""
        far = (buckets + (self._mask + 1) // 2) & self._mask
        return (far << (64 - self._bits)) * _GOLDEN_INVERSE if self._bits else far

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        return self.table.numel() * self.table.element_size()

    @property
    def lanes(self) -> int:
        return self.keys.numel()

    def find(self, ids: Tensor) -> Tensor:
        """The slot of each of ``ids`` (int64), -1 where an id is not held."""
        if self.kernel is not None:
            return self.kernel.find(self.table, self._bits, self._max_run, ids)[0]
        return self._find_in_torch(ids)[0]

    def find_rows(self, ids: Tensor, table: Tensor, step: int = -1) -> Tuple[Tensor, Tensor, bool]:
        """(slots of ``ids`` as ``find`` gives them; their rows of ``table`` (the rows of the slots; zeros where
        an id is not held); whether every id is held).  With ``step`` >= 0 each id held is touched at it."""
        if self.kernel is not None:
            slots, rows, found = self.kernel.find(self.table, self._bits, self._max_run, ids, step, table)
            return slots, rows, found == ids.numel()
        slots, at = self._find_in_torch(ids)
        held = slots >= 0
        everywhere = bool(held.all())
        if step >= 0:
            lanes = at if everywhere else at[held]
            self.touches[lanes // LANES, lanes % LANES] = step
        if everywhere:
            return slots, table.index_select(0, slots), True
        rows = torch.zeros(ids.numel(), table.size(1), dtype=table.dtype)
        where = held.nonzero().view(-1)
        rows[where] = table.index_select(0, slots[where])
        return slots, rows, False

    def _find_in_torch(self, ids: Tensor) -> Tuple[Tensor, Tensor]:
        """(the slot of each id, -1 where not held; its lane as bucket * LANES + lane, -1 where not held)."""
        slots = torch.full((ids.numel(),), -1, dtype=torch.int64)
        at = torch.full((ids.numel(),), -1, dtype=torch.int64)
        active, wanted, probe = None, ids, bucket_of(ids, self._bits)
        for _ in range(self._max_run + 1):
            lane, hit = self._matching_lane(self.keys.index_select(0, probe), wanted)
            found = self.slots[probe, lane].long()
            where = probe * LANES + lane
            if active is None:
                slots = torch.where(hit, found, slots)
                at = torch.where(hit, where, at)
            else:
                slots[active[hit]] = found[hit]
                at[active[hit]] = where[hit]
            # an id not found goes on only past a bucket with no empty lane (it could have overflowed)
            missed = (~hit).nonzero().view(-1)
            if missed.numel() == 0:
                break
            going_on = missed[(self.slots.index_select(0, probe[missed]) != EMPTY).all(1)]
            if going_on.numel() == 0:
                break
            active = going_on if active is None else active[going_on]
            wanted, probe = wanted[going_on], (probe[going_on] + 1) & self._mask
        return slots, at

    @staticmethod
    def _matching_lane(rows: Tensor, wanted: Tensor) -> Tuple[Tensor, Tensor]:
        """The lane of each of ``rows`` (buckets' keys) holding the id ``wanted`` (0 if none), and whether one does.

        A bucket's matches are ``LANES`` bytes, read as ``LANES // 8`` int64 words: the only set byte of the
        only non-zero word says which lane.
        """
        words = (rows == wanted.unsqueeze(1)).view(torch.int64)
        word_index = (words != 0).int().argmax(1)
        word = words.gather(1, word_index.unsqueeze(1).long()).view(-1)
        byte = ((torch.frexp(word.double()).exponent.long() - 1) >> 3).clamp_(min=0)  # 0 where none matched
        return word_index.long() * 8 + byte, word != 0

    def insert(self, ids: Tensor, slots: Tensor, touches=-1) -> None:
        """Map ``ids`` (distinct, none held) to ``slots``, last touched at ``touches`` (a step for all, or one
        per id)."""
        if ids.numel() == 0:
            return
        if (self.size + self.removed + ids.numel()) > MAX_LOAD * self.lanes:
            self._rebuild(self.size + ids.numel())
        touches = touches.to(torch.int32) if isinstance(touches, Tensor) else \
            torch.full((ids.numel(),), int(touches), dtype=torch.int32)
        wanted, values, steps = ids, slots.to(torch.int32), touches
        while True:
            wanted, values, steps = self._place(wanted, values, steps)
            if wanted.numel() == 0:
                break
            self._rebuild(2 * (self.size + wanted.numel()))  # a run grew too long: a bigger index
        self.size += ids.numel()

    def _place(self, ids: Tensor, slots: Tensor, touches: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """Place what can be within ``_max_run`` buckets of its own; returns what could not."""
        home = bucket_of(ids, self._bits)
        wanted, values, steps, probe = ids, slots, touches, home
        while wanted.numel():
            lanes_free = self.slots.index_select(0, probe) < 0
            has_free = lanes_free.any(1)
            lane = lanes_free.int().argmax(1).long()
            trying = has_free.nonzero().view(-1)
            bucket, lane_tried = probe[trying], lane[trying]
            # ids after the same free lane all write it; the one whose write stands takes it, the others retry
            self.keys[bucket, lane_tried] = wanted[trying]
            won = self.keys[bucket, lane_tried] == wanted[trying]
            bucket, lane_won, winners = bucket[won], lane_tried[won], trying[won]
            self.removed -= int((self.slots[bucket, lane_won] == REMOVED).sum())
            self.slots[bucket, lane_won] = values[winners]
            self.touches[bucket, lane_won] = steps[winners]
            placed = torch.zeros(wanted.numel(), dtype=torch.bool)
            placed[winners] = True
            probe = torch.where(has_free, probe, (probe + 1) & self._mask)
            rest = ~placed
            wanted, values, steps, probe, home = wanted[rest], values[rest], steps[rest], probe[rest], home[rest]
            too_far = ((probe - home) & self._mask) > self._max_run
            if too_far.any():
                return wanted, values, steps
        return wanted, values, steps

    def remove(self, ids: Tensor) -> None:
        """Forget ``ids`` (those not held are ignored)."""
        self.remove_lanes(self._lanes_of(ids))

    def remove_lanes(self, at: Tensor) -> None:
        """Forget the ids in lanes ``at`` (bucket * LANES + lane, each held)."""
        if at.numel() == 0:
            return
        bucket, lane = at // LANES, at % LANES
        self.keys[bucket, lane] = self._unused_keys(bucket)
        self.slots[bucket, lane] = REMOVED
        self.touches[bucket, lane] = -1
        self.size -= at.numel()
        self.removed += at.numel()

    def _lanes_of(self, ids: Tensor) -> Tensor:
        """Lanes (bucket * LANES + lane) of those of ``ids`` that are held (an unused lane's key matches no id
        looked for in its bucket, so a match is the id's lane)."""
        found: List[Tensor] = []
        wanted, probe = ids, bucket_of(ids, self._bits)
        for _ in range(self._max_run + 1):
            if wanted.numel() == 0:
                break
            lane, hit = self._matching_lane(self.keys.index_select(0, probe), wanted)
            found.append(probe[hit] * LANES + lane[hit])
            wanted, probe = wanted[~hit], (probe[~hit] + 1) & self._mask
        return torch.cat(found) if found else torch.empty(0, dtype=torch.int64)

    def items(self) -> Tuple[Tensor, Tensor]:
        """Every (id, slot) held, as two tensors (int64, int64)."""
        _, ids, slots, _ = self.held()
        return ids, slots

    def held(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """Every id held: its lane (bucket * LANES + lane), id, slot (int64) and last touch (int32)."""
        mask = self.slots >= 0
        lanes = mask.view(-1).nonzero().view(-1)
        return lanes, self.keys[mask], self.slots[mask].long(), self.touches[mask]

    def _rebuild(self, ids: int) -> None:
        _, keys, slots, touches = self.held()
        buckets = max(self._buckets_for(ids), self.keys.size(0))
        while True:
            self._allocate(buckets)
            self.removed = 0
            left, _, _ = self._place(keys, slots.to(torch.int32), touches)
            if left.numel() == 0:
                return
            buckets *= 2
