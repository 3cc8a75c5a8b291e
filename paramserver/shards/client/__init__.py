"""The trainer's side of the shards: tables as a worker sees them, and how it reaches them.

``placement`` (which shard holds what), ``remote`` (parameters placed on
shards: ``PlacedModule``, ``place_parameters``, ``fetch``, ``gather``),
``embedding`` (``ShardedEmbeddingBag``), ``dynamic_embedding``
(``DynamicEmbeddingBag``: any int64 id) and ``collection``
(``EmbeddingCollection``: one lookup and one push per shard per step).
Everything here sends RPCs to ``paramserver.shards.server.service`` and
owns nothing on a shard.
"""

from .collection import EmbeddingCollection, ShardRequestFailed
from .dynamic_embedding import DynamicEmbeddingBag
from .embedding import ShardedEmbeddingBag
from .placement import RowRange, plan_dense, shard_loads, split_rows
from .remote import PlacedModule, fetch, gather, place_parameters

__all__ = ["DynamicEmbeddingBag", "EmbeddingCollection", "PlacedModule", "RowRange", "ShardRequestFailed",
           "ShardedEmbeddingBag", "fetch", "gather", "place_parameters", "plan_dense", "shard_loads", "split_rows"]
