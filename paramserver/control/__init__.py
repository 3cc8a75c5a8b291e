"""The control plane: a gRPC Coordinator that forms, watches and steers a cluster.

Owns membership (join, leave, heartbeats, failure detection, generations),
the job spec handed to workers, commands (stop, checkpoint, forget a lost
peer), status, the data plane's rendezvous store, and the security of the
gRPC port (token auth, roles scoped by the shard and admin credentials, TLS).  It never imports the data plane
(``paramserver.shards``, ``paramserver.optim``): the two meet in
``paramserver.runtime``.

The server side (``CoordinatorServer``, which hosts the store and so needs
torch) is imported on first use, so clients such as ``ps-ctl`` start fast.
"""

from .client import (CoordinatorClient, CoordinatorError, CoordinatorUnavailable, HeartbeatLoop, NotAuthenticated,
                     NotPermitted)
from .protocol import DEFAULT_PORT, pb
from .security import TlsFiles, read_token_file


def __getattr__(name):
    if name in ("CoordinatorServer", "CoordinatorSettings"):
        from . import server
        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CoordinatorClient", "CoordinatorError", "CoordinatorUnavailable", "HeartbeatLoop", "NotAuthenticated", "NotPermitted",
    "DEFAULT_PORT", "pb", "TlsFiles", "read_token_file",
    "CoordinatorServer", "CoordinatorSettings",
]
