"""``paramserver.connect``: a Python driver's handle on a running cluster.

Owns the driver side: join the coordinator as a client, join the data plane
under the assigned name, and offer the cluster's shards for placing
parameters and sharded embeddings, the cluster's status and, with the admin
token, its commands (checkpoint, shutdown); ``close()`` (or leaving a ``with``
block) releases what this process placed and leaves both planes.
"""

import datetime
import logging
from typing import List, Optional, Sequence

from torch import Tensor, nn

from ..control import TlsFiles, pb
from ..control.addresses import address_facing
from ..shards import DynamicEmbeddingBag, PlacedModule, ShardedEmbeddingBag, peer, place_parameters
from .member import MemberSession

logger = logging.getLogger(__name__)


class Cluster:
    """A connection to the cluster at ``address``; see ``connect``."""

    def __init__(self, address: str, token: Optional[str] = None, tls: Optional[TlsFiles] = None,
                 host: Optional[str] = None, name: Optional[str] = None,
                 retry_for: Optional[datetime.timedelta] = None, admin_token: Optional[str] = None):
        host = host or address_facing(address)
        self._session = MemberSession(address, pb.ROLE_CLIENT, name=name, host=host, token=token, tls=tls,
                                      retry_for=retry_for, admin_token=admin_token)
        self.assignment = self._session.join()
        self._session.start_heartbeats()
        try:
            peer.join(self.assignment.rpc_name, self.assignment.rpc_rank, None, self._session.init_method,
                      bind_host=host)
        except Exception:
            self._session.leave("could not join the data plane")
            raise
        self._session.mark_ready()
        self._closed = False

    @property
    def name(self) -> str:
        """This driver's RPC name."""
        return self.assignment.rpc_name

    @property
    def shards(self) -> List[str]:
        """RPC names of the live shards (refreshed with every heartbeat)."""
        return self._session.shards

    def status(self) -> pb.StatusResponse:
        return self._session.client.status()

    def checkpoint(self, timeout_seconds: float = 120.0) -> pb.CheckpointResponse:
        """A checkpoint now, as ``ps-ctl checkpoint`` (needs ``admin_token`` where the cluster has one)."""
        return self._session.client.checkpoint(timeout_seconds)

    def shutdown(self, reason: str = "paramserver.connect") -> None:
        """Stop the whole cluster, as ``ps-ctl shutdown`` (needs ``admin_token`` where the cluster has one)."""
        self._session.client.shutdown(reason)

    def place(self, module: nn.Module, name: Optional[str] = None) -> PlacedModule:
        """``module`` with its parameters hosted on the shards (see ``PlacedModule``)."""
        return PlacedModule(module, self._require_shards(), name=name)

    def place_parameters(self, named_tensors, prefix: str = ""):
        return place_parameters(named_tensors, self._require_shards(), prefix=prefix)

    def embedding_bag(self, num_embeddings: int, embedding_dim: int, mode: str = "sum", **kwargs
                      ) -> ShardedEmbeddingBag:
        """A ``ShardedEmbeddingBag`` whose rows are split over the shards."""
        return ShardedEmbeddingBag(num_embeddings, embedding_dim, mode, shards=self._require_shards(), **kwargs)

    def dynamic_embedding_bag(self, embedding_dim: int, mode: str = "sum", **kwargs) -> DynamicEmbeddingBag:
        """A ``DynamicEmbeddingBag`` (any int64 id) over every shard; train it through an
        ``EmbeddingCollection``."""
        return DynamicEmbeddingBag(embedding_dim, mode, shards=self._require_shards(), **kwargs)

    def embedding_bag_from_pretrained(self, weight: Tensor, mode: str = "sum", **kwargs) -> ShardedEmbeddingBag:
        return ShardedEmbeddingBag.from_pretrained(weight, mode, shards=self._require_shards(), **kwargs)

    def _require_shards(self) -> Sequence[str]:
        shards = self.shards
        if not shards:
            raise RuntimeError(f"the cluster at {self._session.client.address} has no live shard")
        return shards

    def close(self) -> None:
        """Release what this driver placed, leave the data plane and the cluster."""
        if self._closed:
            return
        self._closed = True
        peer.leave(graceful=True)
        self._session.leave("closed")

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def connect(address: str, token: Optional[str] = None, *, tls_ca: Optional[str] = None,
            host: Optional[str] = None, name: Optional[str] = None,
            retry_for: Optional[datetime.timedelta] = None, admin_token: Optional[str] = None) -> Cluster:
    """Connect this Python process to the cluster at ``address`` (``HOST:PORT`` of ps-server).

    ``token``: the cluster token, if the server has one.  ``admin_token``:
    the admin token (``ps-server --admin-token-file``), for ``checkpoint()``
    and ``shutdown()`` on a cluster that has one.  ``tls_ca``: PEM
    file to trust when the server speaks TLS (its certificate, if
    self-signed).  ``host``: this machine's address as the cluster's
    members reach it (the data plane listens there); by default the
    address of the interface facing the coordinator.
    """
    tls = TlsFiles(ca=tls_ca) if tls_ca else None
    return Cluster(address, token=token, tls=tls, host=host, name=name, retry_for=retry_for,
                   admin_token=admin_token)
