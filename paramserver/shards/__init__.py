"""The data plane's shards, in two rooms that say which side of the wire they are on.

``client`` is the trainer's side: tables as a worker sees them
(``ShardedEmbeddingBag``, ``DynamicEmbeddingBag``), the
``EmbeddingCollection`` (many tables, one RPC per shard each way),
``placement`` (which shard holds what) and ``PlacedModule`` /
``place_parameters`` / ``fetch``.  ``server`` is the shard process's side:
``service`` is its one door (every RPC target), the ``ShardState`` it
serves, hosted tensors, row updates, the owner-side optimizers and the
dynamic-table engine; ``run_shard_server`` runs one.  ``peer`` (joining the
RPC group) and ``local`` (a whole data plane on this machine) are the
process plumbing both use.  The control plane never reaches in here.
"""

from .client import (DynamicEmbeddingBag, EmbeddingCollection, PlacedModule, RowRange, ShardedEmbeddingBag,
                     ShardRequestFailed, fetch, gather, place_parameters, plan_dense, shard_loads, split_rows)
from .peer import PeerOptions, join, leave
from .server import ShardServerOptions, run_shard_server, stop_shards

__all__ = [
    "PlacedModule", "fetch", "gather", "place_parameters",
    "DynamicEmbeddingBag", "EmbeddingCollection", "ShardRequestFailed", "ShardedEmbeddingBag",
    "PeerOptions", "join", "leave",
    "RowRange", "plan_dense", "shard_loads", "split_rows",
    "ShardServerOptions", "run_shard_server", "stop_shards",
]
