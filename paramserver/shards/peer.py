"""Joining and leaving the torch RPC data plane.

Owns how a process (shard server, trainer, driver) becomes a torch RPC peer:
the TensorPipe backend options (worker threads, default RPC timeout), the
intra-op thread count, and the orderly way out.  It knows nothing of what
peers host or compute.
"""

import datetime
import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch
import torch.distributed.rpc as rpc

#: Environment overrides for the defaults below.
RPC_TIMEOUT_ENV = "PARAMSERVER_RPC_TIMEOUT"
RPC_THREADS_ENV = "PARAMSERVER_RPC_THREADS"
RPC_TRANSPORTS_ENV = "PARAMSERVER_RPC_TRANSPORTS"

DEFAULT_RPC_TIMEOUT = datetime.timedelta(seconds=60)
DEFAULT_RPC_THREADS = 16


def _env_timeout() -> datetime.timedelta:
    value = os.environ.get(RPC_TIMEOUT_ENV)
    return datetime.timedelta(seconds=float(value)) if value else DEFAULT_RPC_TIMEOUT


def _env_transports() -> Optional[Tuple[str, ...]]:
    value = os.environ.get(RPC_TRANSPORTS_ENV)
    return tuple(part.strip() for part in value.split(",") if part.strip()) if value else None


def _env_threads() -> int:
    value = os.environ.get(RPC_THREADS_ENV)
    return int(value) if value else DEFAULT_RPC_THREADS


@dataclass(frozen=True)
class PeerOptions:
    """How a process takes part in the data plane.

    ``intra_op_threads``: threads each PyTorch op may use (``None`` keeps
    PyTorch's default).  Shard servers default to 1: they get their
    parallelism from concurrent RPC threads and from running several
    shards, and a per-op thread pool would only fight them for cores.

    ``transports``: TensorPipe transports to offer, in order (``None``: its
    default, which on one host prefers shared memory, ``shm``).  The ``shm``
    transport polls: every idle peer keeps most of a core busy (measured:
    about 65% each on a 2-core machine).  ``("uv",)`` (TCP) idles at zero
    CPU for a little more latency per message; choose it where many peers
    share few cores and latency matters less than idle CPU.
    """

    rpc_timeout: datetime.timedelta = field(default_factory=_env_timeout)
    num_worker_threads: int = field(default_factory=_env_threads)
    intra_op_threads: Optional[int] = None
    transports: Optional[Tuple[str, ...]] = field(default_factory=_env_transports)

    def __post_init__(self):
        if self.rpc_timeout.total_seconds() <= 0:
            raise ValueError(f"rpc_timeout must be positive, got {self.rpc_timeout}")
        if self.num_worker_threads < 1:
            raise ValueError(f"num_worker_threads must be at least 1, got {self.num_worker_threads}")
        if self.intra_op_threads is not None and self.intra_op_threads < 1:
            raise ValueError(f"intra_op_threads must be at least 1, got {self.intra_op_threads}")


def join(name: str, rank: int, world_size: int, init_method: str,
         options: Optional[PeerOptions] = None) -> None:
    """Become RPC peer ``name`` (``rank`` of ``world_size``), meeting the others at ``init_method``.

    ``init_method`` is a ``tcp://HOST:PORT`` rendezvous (rank 0 hosts it).
    """
    options = options or PeerOptions()
    if options.intra_op_threads is not None:
        torch.set_num_threads(options.intra_op_threads)
    backend_options = rpc.TensorPipeRpcBackendOptions(
        init_method=init_method,
        num_worker_threads=options.num_worker_threads,
        rpc_timeout=options.rpc_timeout.total_seconds(),
        _transports=list(options.transports) if options.transports else None,
    )
    rpc.init_rpc(name, rank=rank, world_size=world_size, rpc_backend_options=backend_options)


def leave(graceful: bool = True, timeout: Optional[datetime.timedelta] = None) -> None:
    """Stop being a peer.  Graceful: wait until every peer leaves and all
    outstanding work is done (bounded by ``timeout`` when given)."""
    if timeout is None:
        rpc.shutdown(graceful=graceful)
    else:
        rpc.shutdown(graceful=graceful, timeout=timeout.total_seconds())
