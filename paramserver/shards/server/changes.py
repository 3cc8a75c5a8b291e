"""Which rows of a hosted table changed since the last live export took them: ``RowMarks``.

Owns one mark per row of a hosted 2-D tensor (a fixed table's row range, or a dynamic table's slab, whose
marks grow with it), set by every update applied here (a push's rows, an optimizer step's parameters, the
rows a dynamic table creates for new ids), and the ids a dynamic table evicted since.  ``take()`` hands
what is marked to a live export (``export_part``) and starts afresh; ``give_back()`` returns it when that
export failed, so a change is never lost between two exports.  A tensor starts marked whole: until its
first export, and in a process that restarted from a checkpoint (whose rows may be older than what an
earlier delta exported), the next export carries all of it.  Callers hold the tensor's lock
(``ShardState.lock_for``); nothing here knows of RPC or files.
"""

from dataclasses import dataclass
from typing import List

import torch
from torch import Tensor


@dataclass
class Changes:
    """What changed of one tensor: ``whole`` (every row), or ``rows`` (sorted distinct row indices); for a
    dynamic table, ``evicted`` ids, and ``spilled`` ids: rows changed, then moved to its row store."""

    whole: bool
    rows: Tensor
    evicted: Tensor
    spilled: Tensor = torch.zeros(0, dtype=torch.int64)


class RowMarks:
    """The changed rows of one hosted tensor (see the module's text)."""

    def __init__(self):
        self._marked = torch.zeros(0, dtype=torch.bool)
        self._whole = True
        self._evicted: List[Tensor] = []
        self._spilled: List[Tensor] = []

    def mark(self, rows: Tensor) -> None:
        """Rows ``rows`` (indices) changed."""
        if self._whole or rows.numel() == 0:
            return
        needed = int(rows.max()) + 1
        if needed > self._marked.numel():
            grown = torch.zeros(max(needed, 2 * self._marked.numel()), dtype=torch.bool)
            grown[:self._marked.numel()] = self._marked
            self._marked = grown
        self._marked[rows] = True

    def mark_whole(self) -> None:
        """Every row changed (a dense optimizer step, a restore)."""
        if self._whole:  # nothing is marked or evicted while whole: every dense step after the first costs nothing
            return
        self._whole = True
        self._marked = torch.zeros(0, dtype=torch.bool)
        self._evicted, self._spilled = [], []

    def evicted(self, ids: Tensor) -> None:
        """A dynamic table dropped ``ids`` (an export taken whole lists the ids held instead)."""
        if not self._whole and ids.numel():
            self._evicted.append(ids.clone())

    def spilled(self, ids: Tensor, rows: Tensor) -> None:
        """A dynamic table moved ``ids`` from rows ``rows`` (their slots, free now) to its row store: those of
        them marked are remembered as changed there, by id."""
        if self._whole or ids.numel() == 0:
            return
        inside = rows < self._marked.numel()
        marked = torch.zeros(ids.numel(), dtype=torch.bool)
        marked[inside] = self._marked[rows[inside]]
        if bool(marked.any()):
            self._spilled.append(ids[marked])
            self._marked[rows[marked]] = False

    def take(self) -> Changes:
        """What changed since the last ``take``; marks start afresh."""
        nothing = torch.zeros(0, dtype=torch.int64)
        changes = Changes(self._whole, self._marked.nonzero().view(-1),
                          torch.cat(self._evicted) if self._evicted else nothing,
                          torch.cat(self._spilled) if self._spilled else nothing)
        self._whole, self._marked, self._evicted, self._spilled = False, torch.zeros(0, dtype=torch.bool), [], []
        return changes

    def give_back(self, changes: Changes) -> None:
        """``changes`` (a ``take``'s) were not exported: marked again, with whatever changed since."""
        if changes.whole:
            self.mark_whole()
            return
        self.mark(changes.rows)
        self.evicted(changes.evicted)
        if changes.spilled.numel():
            self._spilled.append(changes.spilled)
