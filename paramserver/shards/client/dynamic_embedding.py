"""``DynamicEmbeddingBag``: an embedding table keyed by any int64 id, its rows made on the shards as ids come.

Owns the trainer side of dynamic tables: creating a table's part on every
shard (``service.host_dynamic``; the rows themselves are the business
of ``paramserver.shards.server.dynamic``), checking a lookup's ids and
routing them to the shard their fixed hash names (``id_hash.shard_of``:
every worker routes an id alike, without asking anyone), and pooling the
rows that come back like ``nn.EmbeddingBag``.  Training goes through an
``EmbeddingCollection`` (one lookup and one push per shard per step, ids
named as they are); ``forward`` reads rows without admitting or touching
any (evaluation).
"""

import uuid
from typing import List, Optional, Sequence

import torch
import torch.distributed.rpc as rpc
from torch import Tensor, nn
from torch.distributed.rpc import RRef

from ...tables import DistinctIds, DynamicOptions, distinct_ids
from ...tables.id_hash import shard_of
from ..peer import creation_timeout
from ..server import service
from .embedding import Route, computed, computed_dtype, draw_seed

_MODES = ("sum", "mean")


class DynamicEmbeddingBag(nn.Module):
    """Like ``nn.EmbeddingBag(?, embedding_dim, mode=...)`` for ids anywhere in int64, its rows on ``shards``.

    Every shard holds the rows of the ids that hash to it, made the first
    time an id is admitted (``admit_after`` lookups, then with probability
    ``admit_probability``), starting N(0, ``init_std``²) as a function of
    (``seed``, id); until then an id reads zeros and its gradient is
    dropped.  ``capacity`` (rows per shard) and ``ttl_steps`` bound what a
    shard keeps; the four limits come as keywords or whole as ``options``
    (a ``paramserver.tables.DynamicOptions``, which the ``Trainer`` passes on
    from a ``Table``), and travel whole to the shards.  Every trainer naming the
    same table (``name``) shares it; it lives as long as the shards.
    """

    num_embeddings = None

    def __init__(self, embedding_dim: int, mode: str = "sum", *, shards: Sequence[str], name: Optional[str] = None,
                 seed: Optional[int] = None, dtype: torch.dtype = torch.float32, init_std: float = 0.01,
                 options: Optional[DynamicOptions] = None, rounding: str = "stochastic", **limits):
        super().__init__()
        self.name = name or f"dynamic-{uuid.uuid4().hex[:8]}"
        if mode not in _MODES:
            raise ValueError(f"table {self.name!r}: mode must be one of {_MODES}, got {mode!r}")
        if embedding_dim <= 0:
            raise ValueError(f"table {self.name!r}: embedding_dim must be positive, got {embedding_dim}")
        if not shards:
            raise ValueError(f"table {self.name!r}: no shards given")
        if options is not None and limits:
            raise TypeError(f"table {self.name!r}: give the limits as options= or as keywords, not both")
        self.options = options if options is not None else DynamicOptions.for_table(self.name, **limits)
        self.embedding_dim, self.mode, self.dtype = embedding_dim, mode, dtype
        self.shards: List[str] = list(shards)
        seed = draw_seed() if seed is None else seed
        timeout = creation_timeout()
        futures = [rpc.rpc_async(shard, service.host_dynamic, args=(
            self.name, embedding_dim, dtype, seed, init_std, self.options, index, len(self.shards), rounding),
            timeout=timeout)
            for index, shard in enumerate(self.shards)]
        self._shard_rrefs: List[RRef] = [future.wait() for future in futures]
        #: Bytes of one row (what a lookup returns per id).
        self.row_bytes = embedding_dim * torch.empty((), dtype=dtype).element_size()

    def remote_parameters(self) -> List[RRef]:
        """RRefs to every shard's slab (in ``shards`` order), for ``DistributedOptimizer``."""
        return list(self._shard_rrefs)

    def route(self, input: Tensor, offsets: Optional[Tensor] = None, distinct: Optional[DistinctIds] = None) -> Route:
        """Where the ids of a lookup go: checked, deduplicated (``distinct``: done already, by
        ``distinct_ids(input)``), and split by the shard each hashes to."""
        ids = self._check_ids(input, offsets)
        unique_ids, inverse = distinct_ids(ids, distinct, self.name)
        owner = shard_of(unique_ids, len(self.shards))
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner, minlength=len(self.shards)).tolist()
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel())
        requests, start = [], 0
        for index, count in enumerate(counts):
            if count:
                requests.append((index, unique_ids.index_select(0, order[start:start + count])))
            start += count
        # rows come back in shard order: the bags' indices follow them there
        return Route(self, position[inverse].view(ids.shape), requests)

    def no_rows(self, requires_grad: bool) -> Tensor:
        """The rows of a lookup without ids: none, yet differentiable as ``nn.EmbeddingBag``'s result is (of
        the type the worker computes in)."""
        return torch.empty(0, self.embedding_dim, dtype=computed_dtype(self.dtype), requires_grad=requires_grad)

    def _check_ids(self, input: Tensor, offsets: Optional[Tensor]) -> Tensor:
        """Everything that can be checked before sending anything (any int64 value is an id)."""
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"table {self.name!r}: ids must be an integer tensor (int64 or int32), got {input.dtype} "
                            f"of shape {list(input.shape)}")
        if input.dim() == 2 and offsets is not None:
            raise ValueError(f"table {self.name!r}: offsets must be None when ids are 2-D (one bag per row)")
        if input.dim() == 1 and offsets is None:
            raise ValueError(f"table {self.name!r}: 1-D ids need offsets (the start of each bag)")
        if input.dim() not in (1, 2):
            raise ValueError(f"table {self.name!r}: ids must be 1-D (with offsets) or 2-D, got shape "
                             f"{list(input.shape)}")
        return input.long()

    def forward(self, input: Tensor, offsets: Optional[Tensor] = None,
                per_sample_weights: Optional[Tensor] = None) -> Tensor:
        """The bags' embeddings from the rows held now (read only: nothing admitted, touched or trained)."""
        route = self.route(input, offsets)
        futures = [rpc.rpc_async(self.shards[index], service.read_dynamic, args=(self._shard_rrefs[index], ids))
                   for index, ids in route.requests]
        rows = torch.cat([future.wait() for future in futures]) if futures else self.no_rows(False)
        return route.pool(computed(rows), offsets, per_sample_weights)

    def extra_repr(self) -> str:
        return f"?, {self.embedding_dim}, mode={self.mode!r}, shards={self.shards}, {self.options}"
