"""The shard process's side: what a process that owns parameters serves, and its one door.

``service`` holds every RPC target and custom op of a shard (the only
module that finds the process's state); ``state`` the ``ShardState`` it
serves; ``hosted`` (tensors and tables), ``rows`` (a step's fused lookup
and push), ``optimizers`` (the owner-side optimizers), ``checkpoint_part``
(writing the shard's part of a checkpoint) and ``figures`` (what it tells
of its dynamic tables) are plain objects and functions of a state;
``dynamic`` is the dynamic-table engine; ``row_store`` keeps the rows a dynamic
table's memory does not hold on disk; ``process`` runs a shard server.
"""

from .process import ShardServerOptions, run_shard_server, stop_shards
from .state import RestoreSource, ShardState

__all__ = ["RestoreSource", "ShardServerOptions", "ShardState", "run_shard_server", "stop_shards"]
