"""What a shard process tells of its dynamic tables: per part for its metrics, summed for its heartbeats.

Owns reading a shard server's state (``ShardState``, handed in by the
shard process that made it) into the two shapes the shard process hands
on: each dynamic table part's figures as ``(table, "index/count", stats)``
for ``paramserver.metrics.dynamic_tables``, and the ``dynamic.*`` heartbeat
figures that ``ps-ctl status`` shows, summed over the shard's dynamic
tables (none on a shard that holds no dynamic table).  It reads figures the
parts keep anyway (``DynamicRows.stats``) and changes nothing.
"""

from typing import Dict, List, Mapping, Optional, Tuple

from ...tables import parse_part_name
from .state import ShardState

#: One part's stats: ``(table, "index/count", {"rows", "admitted", "evicted", "not_admitted", "bytes"})``.
PartStats = Tuple[str, str, Mapping[str, int]]

#: The heartbeat figures' names: ``dynamic.`` and these ``DynamicRows.stats`` keys.
FIGURE_PREFIX = "dynamic."
FIGURES = ("rows", "admitted", "evicted", "bytes")


def dynamic_parts(state: Optional[ShardState]) -> List[PartStats]:
    """Each dynamic table part ``state`` hosts: ``(table, "index/count", stats)``, in name order."""
    if state is None:
        return []
    parts = []
    for name, stats in state.dynamic_stats().items():
        parsed = parse_part_name(name)
        table, part = (parsed[0], f"{parsed[1]}/{parsed[2]}") if parsed is not None else (name, "")
        parts.append((table, part, stats))
    return parts


def dynamic_figures(state: Optional[ShardState]) -> Dict[str, float]:
    """``{"dynamic.rows": ..., "dynamic.admitted": ..., "dynamic.evicted": ..., "dynamic.bytes": ...}`` summed over
    the dynamic table parts ``state`` hosts; ``{}`` when it hosts none."""
    parts = state.dynamic_stats().values() if state is not None else ()
    if not parts:
        return {}
    return {f"{FIGURE_PREFIX}{key}": float(sum(stats[key] for stats in parts)) for key in FIGURES}
