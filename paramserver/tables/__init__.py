"""What every side agrees on about a table without asking anyone: a dynamic table's options, how its parts
are named on the shards, the fixed hashes that route and seed its ids, and a lookup's distinct ids.

Owns plain values and pure functions: the trainer side (``paramserver.shards.client``), the shard side
(``paramserver.shards.server``), checkpoints and exports all read them, and this package imports none of
them (nor any C kernel): importing ``paramserver`` or building a ``Table`` loads nothing else.
"""

from .distinct import DistinctIds, distinct_ids
from .id_hash import MISSING_ID, string_ids
from .options import DynamicOptions
from .parts import parse_part_name, part_name

__all__ = ["MISSING_ID", "DistinctIds", "DynamicOptions", "distinct_ids", "parse_part_name", "part_name", "string_ids"]
