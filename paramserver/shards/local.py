"""A whole data plane on this machine: shard servers plus trainer processes.

Owns ``run_local_cluster``, which tests, benchmarks and demos use to run
trainer functions against N shard servers, every process a child started
from a fork server on loopback (see ``paramserver.processes``).  Trainers are
named ``trainer0..``, shards ``shard0..``; ``trainer0`` hosts the rendezvous
and, when its function returns, asks the shards to leave.
"""

import datetime
from typing import Callable, Dict, Mapping, Optional, Sequence, Tuple


from .._torch_compat import current_rpc_agent
from ..processes import Child, free_port, run_children
from .peer import PeerOptions, join, leave
from .server.process import ShardServerOptions, run_shard_server, stop_shards


def shard_names(num_shards: int):
    return [f"shard{i}" for i in range(num_shards)]


def _run_trainer(target: Callable, args: tuple, name: str, rank: int, world_size: int, init_method: str,
                 shards: Sequence[str], options: Optional[PeerOptions]) -> None:
    join(name, rank, world_size, init_method, options)
    try:
        target(*args)
    finally:
        # A target may have left already (for example after losing a peer on purpose).
        if current_rpc_agent() is not None:
            if rank == 0:
                stop_shards(shards)
            leave(graceful=True)


def run_local_cluster(trainers: Sequence[Tuple[Callable, tuple]], num_shards: int,
                      timeout: datetime.timedelta = datetime.timedelta(seconds=120),
                      shard_options: Optional[ShardServerOptions] = None,
                      trainer_options: Optional[PeerOptions] = None,
                      expected_exit_codes: Optional[Mapping[str, int]] = None,
                      host: str = "127.0.0.1") -> Dict[str, int]:
    """Run each ``(target, args)`` as a trainer process next to ``num_shards`` shard servers.

    ``target(*args)`` runs after the process joined the RPC group; shard
    names are ``shard_names(num_shards)``.  Returns exit codes; raises
    ``ChildProcessesFailed`` on a timeout or an unexpected exit code.
    """
    shards = shard_names(num_shards)
    world_size = len(trainers) + num_shards
    init_method = f"tcp://{host}:{free_port(host)}"
    children = [
        Child(f"trainer{i}", _run_trainer, (target, tuple(args), f"trainer{i}", i, world_size, init_method,
                                            shards, trainer_options))
        for i, (target, args) in enumerate(trainers)
    ]
    children += [
        Child(name, run_shard_server, (name, len(trainers) + i, world_size, init_method, shard_options))
        for i, name in enumerate(shards)
    ]
    return run_children(children, timeout, expected_exit_codes)
