"""What a shard process tells of its dynamic tables and its push log: per part for its metrics, summed for its
heartbeats.

Owns reading a shard server's state (``ShardState``, handed in by the
shard process that made it) into the two shapes the shard process hands
on: each dynamic table part's figures as ``(table, "index/count", stats)``
for ``paramserver.metrics.dynamic_tables``, and the ``dynamic.*`` heartbeat
figures that ``ps-ctl status`` shows, summed over the shard's dynamic
tables (none on a shard that holds no dynamic table; the rows its row store
holds on disk and their bytes where it has one); and the push log's
``push_log.*`` heartbeat figures (``LogRate``: its size, and appends per
second since the last beat).  It reads figures the parts and the log keep
anyway (``DynamicRows.stats``, ``LogFigures``) and changes nothing.
"""

import time

from typing import Dict, List, Mapping, Optional, Tuple

from ...tables import parse_part_name
from .state import ShardState

#: One part's stats: ``(table, "index/count", {"rows", "admitted", "evicted", "not_admitted", "bytes"})``, and
#: the row store's figures for a part with one (``DynamicRows.stats``).
PartStats = Tuple[str, str, Mapping[str, object]]

#: The heartbeat figures' names: ``dynamic.`` and these ``DynamicRows.stats`` keys; ``STORE_FIGURES`` too for
#: a shard with a row store (the rows in memory are ``rows``; those on disk, ``rows_on_disk``).
FIGURE_PREFIX = "dynamic."
FIGURES = ("rows", "admitted", "evicted", "bytes")
STORE_FIGURES = ("rows_on_disk", "disk_bytes")


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
    the dynamic table parts ``state`` hosts, and ``dynamic.rows_on_disk`` and ``dynamic.disk_bytes`` over those
    with a row store (where one has); ``{}`` when it hosts none."""
    parts = state.dynamic_stats().values() if state is not None else ()
    if not parts:
        return {}
    keys = FIGURES + STORE_FIGURES if any("rows_on_disk" in stats for stats in parts) else FIGURES
    return {f"{FIGURE_PREFIX}{key}": float(sum(stats.get(key, 0) for stats in parts)) for key in keys}


class LogRate:
    """``figures(state)``: ``{"push_log.bytes": ..., "push_log.appends_per_s": ...}`` for a heartbeat, the rate
    over the time since the last call (``{}`` when the shard keeps no push log)."""

    def __init__(self):
        self._last = (time.monotonic(), 0)

    def figures(self, state: Optional[ShardState]) -> Dict[str, float]:
        log = state.push_log if state is not None else None
        if log is None:
            return {}
        now, appends = time.monotonic(), log.figures.appends
        then, before = self._last
        self._last = (now, appends)
        return {"push_log.bytes": float(log.figures.size_bytes),
                "push_log.appends_per_s": round((appends - before) / max(now - then, 1e-3), 1)}
