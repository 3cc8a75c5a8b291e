"""``Admission``: which new ids of a dynamic table get a row, in bounded memory.

Owns the admission policy of a dynamic table's shard
(``rows.DynamicRows``): an id gets a row once it has been seen
``admit_after`` times (then, optionally, with probability
``admit_probability``).  Counts are kept in a count-min sketch
(``SKETCH_DEPTH`` rows of ``SKETCH_WIDTH`` int32 counters, allocated only
when ``admit_after > 1``): memory does not grow with the ids seen, and a
count is never under-estimated, only over-estimated by collisions, so an
id may be admitted early, never late.  A count is one lookup that carried
the id (two workers' lookups of one step count twice).  The probability
draw is a fixed function of (seed, id, step), so runs repeat.
"""

from typing import Dict, Optional

import torch
from torch import Tensor

from ....tables import DynamicOptions
from ....tables.id_hash import salted, unit_interval

SKETCH_DEPTH = 2
SKETCH_WIDTH = 1 << 18


class Admission:
    """Counts the ids a shard was asked for and says which may have a row now."""

    def __init__(self, options: DynamicOptions, seed: int = 0):
        """``options``' ``admit_after`` and ``admit_probability`` (checked where the options were made)."""
        self.admit_after, self.admit_probability, self.seed = options.admit_after, options.admit_probability, seed
        self.counts: Optional[Tensor] = torch.zeros(SKETCH_DEPTH, SKETCH_WIDTH, dtype=torch.int32) \
            if self.admit_after > 1 else None

    def admit(self, ids: Tensor, step: int) -> Tensor:
        """Count ``ids`` (distinct, none with a row) as seen once more; which of them may have a row now."""
        admitted = torch.ones(ids.numel(), dtype=torch.bool)
        if self.counts is not None:
            seen = None
            for depth in range(SKETCH_DEPTH):
                cells = salted(ids, self.seed * SKETCH_DEPTH + depth) & (SKETCH_WIDTH - 1)
                self.counts[depth].index_add_(0, cells, torch.ones_like(cells, dtype=torch.int32))
                count = self.counts[depth].index_select(0, cells)
                seen = count if seen is None else torch.minimum(seen, count)
            admitted &= seen >= self.admit_after
        if self.admit_probability < 1.0:
            admitted &= unit_interval(ids ^ step, self.seed + 1) < self.admit_probability
        return admitted

    @property
    def nbytes(self) -> int:
        return 0 if self.counts is None else self.counts.numel() * self.counts.element_size()

    def state_dict(self) -> Dict[str, Tensor]:
        return {} if self.counts is None else {"counts": self.counts.clone()}

    def merge_state(self, states) -> None:
        """Add the counts of ``states`` (sketches of other shards, or of this one before a restart): counts of
        the same width add up, which over-estimates an id's count (it is admitted early) and never
        under-estimates it."""
        if self.counts is None:
            return
        for state in states:
            counts = state.get("counts")
            if counts is not None and counts.shape == self.counts.shape:
                self.counts += counts.to(torch.int32)
