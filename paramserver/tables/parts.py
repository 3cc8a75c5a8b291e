"""How a dynamic table's parts are named on the shards: ``"<table>@<index>/<count>"``.

Owns the name of shard ``index`` of ``count``'s part of a dynamic table and
reading it back: the shard hosts its part under it, checkpoints file the
part's rows under it, metrics label the part by it.  Pure functions.
"""

from typing import Optional, Tuple


def part_name(table: str, index: int, count: int) -> str:
    """How shard ``index`` of ``count`` hosts its part of dynamic table ``table``."""
    return f"{table}@{index}/{count}"


def parse_part_name(name: str) -> Optional[Tuple[str, int, int]]:
    """``"t@1/4"`` -> ``("t", 1, 4)``; ``None`` for a name that is no dynamic part."""
    table, at, where = name.rpartition("@")
    index, slash, count = where.partition("/")
    if not at or not slash or not index.isdigit() or not count.isdigit():
        return None
    return table, int(index), int(count)
