"""The data plane's shards: shard servers, parameter placement, sharded embeddings.

Owns where parameters live and how trainers reach them over torch RPC:
``run_shard_server`` (a shard server process), ``placement`` (which shard
holds what), ``hosted``, ``rows`` and ``dynamic`` (the owner side), ``ShardedEmbeddingBag``,
``DynamicEmbeddingBag`` (any int64 id),
``EmbeddingCollection`` (many tables, one RPC per shard each way),
``PlacedModule`` / ``place_parameters`` / ``fetch`` (the trainer side) and
``peer`` (joining the RPC group).  Optimizer steps on the owners belong to
``paramserver.optim``; the control plane never reaches in here.
"""

from .client import PlacedModule, fetch, gather, place_parameters
from .collection import EmbeddingCollection, ShardRequestFailed
from .dynamic_embedding import DynamicEmbeddingBag
from .embedding import ShardedEmbeddingBag
from .peer import PeerOptions, join, leave
from .placement import RowRange, plan_dense, shard_loads, split_rows
from .server import ShardServerOptions, request_stop, run_shard_server, stop_shards

__all__ = [
    "PlacedModule", "fetch", "gather", "place_parameters",
    "DynamicEmbeddingBag", "EmbeddingCollection", "ShardRequestFailed", "ShardedEmbeddingBag",
    "PeerOptions", "join", "leave",
    "RowRange", "plan_dense", "shard_loads", "split_rows",
    "ShardServerOptions", "request_stop", "run_shard_server", "stop_shards",
]
