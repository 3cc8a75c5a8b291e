"""``DynamicOptions``: how a dynamic table's shards admit and evict rows, one immutable value.

Owns the options and their one check: a ``DynamicOptions`` that exists is
valid (``ValueError`` naming the option otherwise), so that the value made
from a user's ``Table`` (or ``DynamicEmbeddingBag``) travels whole to the
rows on the shards that use it, and nobody on the way checks it again.
"""

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class DynamicOptions:
    """How a dynamic table's shards admit and evict rows (every limit is per shard).

    ``capacity``: rows a shard keeps at most (the least recently touched are
    evicted first); ``ttl_steps``: rows untouched for more steps are
    dropped; an id gets a row after ``admit_after`` training lookups, then
    with probability ``admit_probability``.
    """

    capacity: Optional[int] = None
    ttl_steps: Optional[int] = None
    admit_after: int = 1
    admit_probability: float = 1.0

    def __post_init__(self):
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity must be at least 1 row per shard, got {self.capacity}")
        if self.ttl_steps is not None and self.ttl_steps < 1:
            raise ValueError(f"ttl_steps must be at least 1, got {self.ttl_steps}")
        if self.admit_after < 1:
            raise ValueError(f"admit_after must be at least 1, got {self.admit_after}")
        if not 0.0 < self.admit_probability <= 1.0:
            raise ValueError(f"admit_probability must be in (0, 1], got {self.admit_probability}")

    @classmethod
    def for_table(cls, table: str, **options) -> "DynamicOptions":
        """``DynamicOptions(**options)``; the ``ValueError`` of a wrong one names ``table`` too."""
        try:
            return cls(**options)
        except ValueError as error:
            raise ValueError(f"table {table!r}: {error}") from None
