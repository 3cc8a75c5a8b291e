"""How ``ps-server`` treats its shard processes, as plain values its command line reads before anything heavy
is imported.

Owns ``MAX_RESTARTS`` (how many times one lost shard process is started again) and ``SHARD_PRELOAD`` (what
the fork server that starts the shard processes imports once, ``paramserver.processes.start_fork_server``).
The supervisor (``supervisor``) applies them; ``ps-server`` starts that fork server first thing, so that it
imports the shard's code while the server itself imports the coordinator's.
"""

#: How many times one shard is restarted before the supervisor gives up on it.
MAX_RESTARTS = 3
#: What the fork server that starts the shard processes imports once.
SHARD_PRELOAD = ("paramserver.runtime.shard_process",)
