"""What each shard acknowledged of a worker's pushes: the steps a shard that came back may have lost.

Owns ``AckedSteps``: per shard, the steps (0 or more) whose push that
shard acknowledged, kept as runs of consecutive steps.  A shard process
that is killed comes back with its checkpoint and the pushes of its push
log; its ledger (``EmbeddingCollection.push_ledgers``) names the newest
step of this worker it applied.  Steps it had acknowledged after that one
were rolled back there (no log, a damaged log, a lost disk, a fallback to
an older checkpoint: a checkpoint part keeps the ledger it holds):
``rolled_back`` names them.  The runs kept per shard are bounded
(``MAX_RUNS``; the oldest go first), so a shard that a worker pushes to
only every other step for a long time is followed over its newest steps
only.  Nothing here sends a message: the pipeline
(``paramserver.train.pipeline``) asks the shards and counts the steps.
"""

import bisect
from typing import Dict, List, Sequence, Tuple

#: The most runs of consecutive steps kept per shard (the oldest are forgotten first).
MAX_RUNS = 4096


class AckedSteps:
    """Per shard, the steps whose push it acknowledged (see the module's docstring)."""

    def __init__(self, max_runs: int = MAX_RUNS):
        self._max_runs = max_runs
        self._runs: Dict[str, List[List[int]]] = {}  # shard -> sorted, disjoint [first, last] runs

    def add(self, shard: str, step: int) -> None:
        """``shard`` acknowledged the push of ``step`` (a negative step is not idempotent: not followed)."""
        if step < 0:
            return
        runs = self._runs.setdefault(shard, [])
        if runs and runs[-1][1] + 1 >= step >= runs[-1][0]:  # the common case: the newest run goes on
            runs[-1][1] = max(runs[-1][1], step)
            return
        at = bisect.bisect_left(runs, [step, step])
        if at > 0 and runs[at - 1][1] + 1 >= step:  # within or just after the run before
            runs[at - 1][1] = max(runs[at - 1][1], step)
            at -= 1
        elif at < len(runs) and runs[at][0] == step + 1:  # just before the run after
            runs[at][0] = step
        elif at < len(runs) and runs[at][0] == step:
            return
        else:
            runs.insert(at, [step, step])
        if at + 1 < len(runs) and runs[at][1] + 1 >= runs[at + 1][0]:  # the two runs meet
            runs[at][1] = max(runs[at][1], runs.pop(at + 1)[1])
        if len(runs) > self._max_runs:
            runs.pop(0)

    def through(self, shard: str) -> int:
        """The newest step ``shard`` acknowledged (-1: none followed)."""
        runs = self._runs.get(shard)
        return runs[-1][1] if runs else -1

    def steps(self, shard: str) -> List[int]:
        """Every step followed for ``shard``, oldest first."""
        return [step for first, last in self._runs.get(shard, []) for step in range(first, last + 1)]

    def rolled_back(self, shard: str, applied: int) -> List[int]:
        """The steps ``shard`` acknowledged after ``applied`` (the newest step its process holds now), oldest
        first; they are no longer followed for it."""
        runs = self._runs.get(shard, [])
        rolled = []
        while runs and runs[-1][1] > applied:
            first, last = runs[-1]
            if first > applied:
                runs.pop()
            else:
                runs[-1][1] = applied
                first = applied + 1
            rolled[:0] = range(first, last + 1)
        return rolled

    def forget(self, steps: Sequence[int]) -> None:
        """``steps`` are no longer followed on any shard (counted lost already)."""
        for runs in self._runs.values():
            for step in steps:
                at = bisect.bisect_right(runs, [step, float("inf")]) - 1
                if at < 0 or runs[at][1] < step:
                    continue
                first, last = runs[at]
                runs[at:at + 1] = [[first, last] for first, last in ((first, step - 1), (step + 1, last))
                                   if first <= last]


def describe_steps(steps: Sequence[int]) -> str:
    """``steps`` (sorted) as runs: ``"4-6, 9"``."""
    parts: List[Tuple[int, int]] = []
    for step in steps:
        if parts and parts[-1][1] + 1 == step:
            parts[-1] = (parts[-1][0], step)
        else:
            parts.append((step, step))
    return ", ".join(str(first) if first == last else f"{first}-{last}" for first, last in parts)
