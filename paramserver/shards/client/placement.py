"""Where parameters live: deciding which shard holds what.

Owns the placement decisions, as pure functions over sizes and shard names
(no RPC, no tensors):

* dense parameters are spread over shards by byte size: greedy bin packing,
  largest first onto the least-loaded shard, then a pass of moves and swaps
  between the fullest and the emptiest shard while that narrows the gap;
* an embedding table is split row-wise into one contiguous range per shard,
  sizes differing by at most one row;
* whole tables are packed onto as few shards as keep the fullest no fuller
  than the balanced plan's (``pack_whole``): every shard a step's tables
  live on costs a message per worker and step;
* or spread over every shard, as many on each as can be (``spread_whole``):
  each shard then has the fewest tables to update per push.

Shards that already hold something (``initial_load``) are filled around it.
"""

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, stop)`` of a table, held by ``shard``."""

    shard: str
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


def split_rows(num_rows: int, shards: Sequence[str]) -> List[RowRange]:
    """Split ``num_rows`` rows into one contiguous range per shard (sizes differ by at most 1).

    With fewer rows than shards, the last shards get no range.
    """
    if num_rows <= 0:
        raise ValueError(f"a table needs at least one row, got num_rows={num_rows}")
    _check_shards(shards)
    base, extra = divmod(num_rows, len(shards))
    ranges, start = [], 0
    for index, shard in enumerate(shards):
        size = base + (1 if index < extra else 0)
        if size > 0:
            ranges.append(RowRange(shard, start, start + size))
        start += size
    return ranges


def plan_dense(sizes: Mapping[str, int], shards: Sequence[str],
               initial_load: Optional[Mapping[str, int]] = None) -> Dict[str, str]:
    """Assign each parameter (name -> bytes) to a shard; returns name -> shard.

    Largest parameters first, each onto the least-loaded shard (ties: the
    shard listed first), then moves and swaps between the most and the least
    loaded shard while they narrow the gap between them.  Deterministic.
    """
    _check_shards(shards)
    for name, size in sizes.items():
        if size < 0:
            raise ValueError(f"parameter {name!r} has a negative size ({size} bytes)")
    load = {shard: int((initial_load or {}).get(shard, 0)) for shard in shards}
    held: Dict[str, Dict[str, int]] = {shard: {} for shard in shards}
    order = {shard: i for i, shard in enumerate(shards)}
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        target = min(shards, key=lambda shard: (load[shard], order[shard]))
        held[target][name] = size
        load[target] += size
    _rebalance(load, held, order)
    return {name: shard for shard, names in held.items() for name in names}


def shard_loads(plan: Mapping[str, str], sizes: Mapping[str, int], shards: Sequence[str],
                initial_load: Optional[Mapping[str, int]] = None) -> Dict[str, int]:
    """Bytes per shard under ``plan`` (plus ``initial_load``)."""
    load = {shard: int((initial_load or {}).get(shard, 0)) for shard in shards}
    for name, shard in plan.items():
        load[shard] += sizes[name]
    return load


def _rebalance(load: Dict[str, int], held: Dict[str, Dict[str, int]], order: Dict[str, int]) -> None:
    """Improve a greedy plan by moving or swapping one parameter at a time
    between the fullest and the emptiest shard, while the gap shrinks."""
    for _ in range(10 * sum(len(names) for names in held.values()) + 10):
        fullest = max(load, key=lambda shard: (load[shard], -order[shard]))
        emptiest = min(load, key=lambda shard: (load[shard], order[shard]))
        gap = load[fullest] - load[emptiest]
        best: Optional[Tuple[int, str, Optional[str]]] = None
        # Moving d bytes from fullest to emptiest leaves a pair gap of |gap - 2d|.
        for name, size in held[fullest].items():
            candidates = [(abs(gap - 2 * size), name, None)]
            for other, other_size in held[emptiest].items():
                if other_size < size:
                    candidates.append((abs(gap - 2 * (size - other_size)), name, other))
            for candidate in candidates:
                if candidate[0] < gap and (best is None or candidate < best):
                    best = candidate
        if best is None:
            return
        _, name, other = best
        size = held[fullest].pop(name)
        held[emptiest][name] = size
        load[fullest] -= size
        load[emptiest] += size
        if other is not None:
            other_size = held[emptiest].pop(other)
            held[fullest][other] = other_size
            load[emptiest] -= other_size
            load[fullest] += other_size


def _check_shards(shards: Sequence[str]) -> None:
    if len(shards) == 0:
        raise ValueError("placement needs at least one shard")
    if len(set(shards)) != len(shards):
        raise ValueError(f"shard names must be unique, got {list(shards)}")


def pack_whole(sizes: Mapping[str, int], shards: Sequence[str]) -> Dict[str, str]:
    """Assign whole tables (name -> bytes) to as few shards as keep the fullest no fuller than ``plan_dense``'s
    would be; returns name -> shard.

    A step sends one message to every shard holding a table it reads, so
    small tables spread over every shard cost every shard a message per
    worker and step, where the same tables on fewer shards cost fewer
    (each message's fixed cost, not its rows, dominates for small tables).
    The bound is the fullest shard of ``plan_dense``'s balanced plan
    (never less than the largest table): tables go largest first onto the
    first shard they fit in (first fit decreasing).  When that needs more
    shards than there are, the balanced plan is the answer.  Deterministic.
    """
    _check_shards(shards)
    balanced = plan_dense(sizes, shards)
    bound = max(shard_loads(balanced, sizes, shards).values(), default=0)
    load = [0] * len(shards)
    plan: Dict[str, str] = {}
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        target = next((i for i, held in enumerate(load) if held + size <= bound), None)
        if target is None:
            return balanced
        plan[name] = shards[target]
        load[target] += size
    return plan


def spread_whole(sizes: Mapping[str, int], shards: Sequence[str]) -> Dict[str, str]:
    """Assign whole tables (name -> bytes) to every shard, their counts differing by at most one; returns name ->
    shard.

    A push costs its shard a fixed amount per table it names, besides its
    rows, so a shard holding most of the small tables is the one every
    worker waits for when they push together.  Tables go largest first to
    the shard holding the fewest so far (then the fewest bytes, then the
    first named).  Deterministic.
    """
    _check_shards(shards)
    tables = {shard: 0 for shard in shards}
    load = {shard: 0 for shard in shards}
    plan: Dict[str, str] = {}
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        if size < 0:
            raise ValueError(f"{name!r} has a negative size {size}")
        target = min(shards, key=lambda shard: (tables[shard], load[shard]))
        plan[name] = target
        tables[target] += 1
        load[target] += size
    return plan
