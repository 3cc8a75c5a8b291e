"""``ShardedEmbeddingBag``: an embedding table split row-wise over shard servers.

Owns the trainer side of sharded embeddings: creating the row ranges on the
shards, the forward pass (check ids, deduplicate them, send each shard only
the ids it owns, pool the returned rows locally), and fetching the table.
Inside a ``dist_autograd`` context the forward is differentiable: backward
sends each shard a row-sparse gradient of just the rows it served, and
``DistributedOptimizer`` over ``remote_parameters()`` updates only those rows.
Each lookup it sends is counted by its ``recorder`` when it was handed one
(a ``LookupRecorder``: the worker's data-plane metrics, when it serves
them); an ``EmbeddingCollection`` counts the lookups it sends itself.
"""

import uuid
from typing import Callable, List, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.rpc import RRef

from ...tables import DistinctIds, distinct_ids
from ...tables.row_types import is_half
from ..peer import creation_timeout
from ..server import service
from .placement import RowRange, split_rows
from .remote import fetch

_MODES = ("sum", "mean")


class LookupRecorder(Protocol):
    """What a table records of the lookups it sends (``paramserver.metrics.data_plane.DataPlaneMetrics`` has
    it): one call per lookup RPC, with the distinct rows asked of ``peer`` and the tensor bytes each way."""

    def lookup(self, peer: str, rows: int, sent_bytes: int, received_bytes: int) -> None: ...


def draw_seed() -> int:
    """A table's seed when none is given: drawn from torch's default generator, so ``torch.manual_seed``
    fixes it as it fixes a local ``nn.EmbeddingBag``'s initial rows."""
    return int(torch.randint(0, 2**62, (1,)).item())

def computed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type a worker computes with rows stored as ``dtype`` in: float32 for half-precision rows."""
    return torch.float32 if is_half(dtype) else dtype


def computed(rows: Tensor) -> Tensor:
    """Rows as they arrived from a shard, in the type the worker computes in (half-precision rows upcast to
    float32: the dense part and the row gradients are float32)."""
    return rows.to(torch.float32) if is_half(rows.dtype) else rows


class ShardedEmbeddingBag(nn.Module):
    """Like ``nn.EmbeddingBag(num_embeddings, embedding_dim, mode=...)``, with its rows on ``shards``.

    ``shards`` are RPC peer names; rows are split into one contiguous range
    per shard (give one shard to keep a small table whole).  Rows start
    N(0, 1) from ``seed``, drawn on the shards, or from ``_weight`` (a full
    table, sent to the shards once).  ``shared=True`` (with a ``name``)
    makes every trainer that builds the same table use one copy on the
    shards: the first creates it, the others find it by name.  ``init_std``
    scales the initial rows (recommendation models often start near zero,
    so that rows of ids never seen add no noise).  ``recorder``: where the
    lookups its forward pass sends are counted (``None``: nowhere).

    ``dtype``: the rows' type on the shards: float32, or float16 or bfloat16
    (half the memory and half the bytes of a lookup); half-precision rows are
    upcast to float32 where they arrive, updated in float32 on the shards
    and written back with ``rounding`` (``"stochastic"``, the default, or
    ``"nearest"``: ``paramserver.optim.rounding``).

    ``forward(input, offsets=None, per_sample_weights=None)`` takes the
    arguments of ``nn.EmbeddingBag``: a 2-D ``(bags, ids per bag)`` tensor,
    or 1-D ids with ``offsets``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "sum", *,
                 shards: Sequence[str], name: Optional[str] = None, seed: Optional[int] = None,
                 dtype: torch.dtype = torch.float32, shared: bool = False, init_std: float = 1.0,
                 recorder: Optional[LookupRecorder] = None, rounding: str = "stochastic",
                 _weight: Optional[Tensor] = None):
        super().__init__()
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if num_embeddings <= 0 or embedding_dim <= 0:
            raise ValueError(f"num_embeddings and embedding_dim must be positive, got "
                             f"{num_embeddings} and {embedding_dim}")
        if _weight is not None and tuple(_weight.shape) != (num_embeddings, embedding_dim):
            raise ValueError(f"_weight has shape {list(_weight.shape)}, expected [{num_embeddings}, {embedding_dim}]")
        if shared and (name is None or _weight is not None):
            raise ValueError("a shared table needs a name (how other trainers find it) and no _weight")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.mode = mode
        self.dtype = dtype
        self.recorder = recorder
        self.name = name or f"embedding-{uuid.uuid4().hex[:8]}"
        self.ranges: List[RowRange] = split_rows(num_embeddings, list(shards))
        #: The shards holding rows of it.
        self.shards: List[str] = [rows.shard for rows in self.ranges]
        seed = draw_seed() if seed is None else seed
        futures, timeout = [], creation_timeout()
        for rows in self.ranges:
            part = f"{self.name}[{rows.start}:{rows.stop}]"
            if _weight is None:
                futures.append(rpc.rpc_async(rows.shard, service.host_rows, args=(
                    part, rows.num_rows, embedding_dim, dtype, seed, rows.start, shared, init_std, rounding),
                    timeout=timeout))
            else:
                # Each shard gets a compact copy of just its rows.
                futures.append(rpc.rpc_async(rows.shard, service.host_tensor, args=(
                    part, _weight[rows.start:rows.stop].to(dtype).clone()), timeout=timeout))
        self._shard_rrefs: List[RRef] = [future.wait() for future in futures]
        #: Bytes of one row (what a lookup returns per id).
        self.row_bytes = embedding_dim * torch.empty((), dtype=dtype).element_size()
        self.register_buffer("_range_starts", torch.tensor([r.start for r in self.ranges], dtype=torch.long),
                             persistent=False)

    @classmethod
    def from_pretrained(cls, weight: Tensor, mode: str = "sum", *, shards: Sequence[str],
                        name: Optional[str] = None, recorder: Optional[LookupRecorder] = None
                        ) -> "ShardedEmbeddingBag":
        """A sharded table holding a copy of ``weight`` (rows x dim)."""
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D (rows x dim), got shape {list(weight.shape)}")
        return cls(weight.size(0), weight.size(1), mode, shards=shards, name=name, dtype=weight.dtype,
                   recorder=recorder, _weight=weight.detach())

    def remote_parameters(self) -> List[RRef]:
        """RRefs to the row ranges (in ``ranges`` order), for ``DistributedOptimizer``."""
        return list(self._shard_rrefs)

    def forward(self, input: Tensor, offsets: Optional[Tensor] = None,
                per_sample_weights: Optional[Tensor] = None) -> Tensor:
        return self.start(input, offsets, per_sample_weights)()

    def start(self, input: Tensor, offsets: Optional[Tensor] = None,
              per_sample_weights: Optional[Tensor] = None) -> Callable[[], Tensor]:
        """The forward pass in two halves: send the lookups now, pool when the returned function is called.

        Starting every table's lookups before finishing any overlaps their
        round trips (the forward of a model with many tables waits about
        one round trip instead of one per table).  Each row range is one
        RPC, differentiable inside a ``dist_autograd`` context; an
        ``EmbeddingCollection`` sends one RPC per shard for many tables.
        """
        route = self.route(input, offsets)
        recorder = self.recorder
        pending = []
        for index, local in route.requests:
            pending.append(rpc.rpc_async(self.ranges[index].shard, service.lookup_rows,
                                         args=(self._shard_rrefs[index], local)))
            if recorder is not None:
                recorder.lookup(self.ranges[index].shard, local.numel(), local.numel() * local.element_size(),
                               local.numel() * self.row_bytes)

        def finish() -> Tensor:
            unique_rows = torch.cat([future.wait() for future in pending]) if pending else \
                self.no_rows(torch.is_grad_enabled())
            return route.pool(computed(unique_rows), offsets, per_sample_weights)
        return finish

    def route(self, input: Tensor, offsets: Optional[Tensor] = None,
              distinct: Optional[DistinctIds] = None) -> "Route":
        """Where the ids of a lookup go: checked, deduplicated (``distinct``: done already, by
        ``distinct_ids(input)``), and split by row range."""
        ids = self._check_ids(input, offsets)
        unique_ids, inverse = distinct_ids(ids, distinct, self.name)
        self._check_range(unique_ids)
        if len(self.ranges) == 1:  # a whole table: its one range starts at row 0, its local ids are the ids
            return Route(self, inverse.view(ids.shape), [(0, unique_ids)] if unique_ids.numel() else [])
        # Sorted unique ids split into consecutive runs, one per shard's row range.
        bounds = torch.searchsorted(unique_ids, self._range_starts).tolist() + [unique_ids.numel()]
        requests = []
        for index, rows in enumerate(self.ranges):
            lo, hi = bounds[index], bounds[index + 1]
            if hi > lo:
                requests.append((index, unique_ids[lo:hi] - rows.start))
        return Route(self, inverse.view(ids.shape), requests)

    def no_rows(self, requires_grad: bool) -> Tensor:
        """The rows of a lookup without ids: none, yet differentiable as ``nn.EmbeddingBag``'s result is (of
        the type the worker computes in: float32 for half-precision rows)."""
        return torch.empty(0, self.embedding_dim, dtype=computed_dtype(self.dtype), requires_grad=requires_grad)

    def _check_ids(self, input: Tensor, offsets: Optional[Tensor]) -> Tensor:
        """Everything about the ids' tensor that can be checked before sending anything (their values:
        ``_check_range``)."""
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ids must be an integer tensor (int64 or int32), got {input.dtype}")
        if input.dim() == 2 and offsets is not None:
            raise ValueError("offsets must be None when ids are 2-D (one bag per row)")
        if input.dim() == 1 and offsets is None:
            raise ValueError("1-D ids need offsets (the start of each bag)")
        if input.dim() not in (1, 2):
            raise ValueError(f"ids must be 1-D (with offsets) or 2-D, got shape {list(input.shape)}")
        return input.long()

    def _check_range(self, unique_ids: Tensor) -> None:
        """Every id a row of the table (``unique_ids`` sorted: the first and last are the least and greatest),
        before anything is sent."""
        if unique_ids.numel() > 0:
            # The first and the last through a strided view: one read whatever the device, and 4x cheaper than
            # indexing with a list (which builds an index tensor) on a step's path.
            ends = unique_ids[::max(1, unique_ids.numel() - 1)].tolist()
            low, high = ends[0], ends[-1]
            bad = low if low < 0 else high if high >= self.num_embeddings else None
            if bad is not None:
                raise IndexError(f"{self.name}: id {bad} is out of range for a table of "
                                 f"{self.num_embeddings} rows")

    def fetch_weight(self) -> Tensor:
        """The whole table as it is now on the shards (a local copy)."""
        return torch.cat(fetch(self._shard_rrefs))

    def extra_repr(self) -> str:
        shards = ", ".join(f"{r.shard}[{r.start}:{r.stop}]" for r in self.ranges)
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, shards=({shards})"


class Route:
    """A lookup's ids, routed: ``requests`` are ``(range index, local row ids)`` (sorted, distinct) in range
    order; ``pool`` turns the rows they return (concatenated in that order) into the bags' embeddings."""

    def __init__(self, table: ShardedEmbeddingBag, inverse: Tensor, requests: List[Tuple[int, Tensor]]):
        self.table, self.inverse, self.requests = table, inverse, requests

    def pool(self, unique_rows: Tensor, offsets: Optional[Tensor] = None,
             per_sample_weights: Optional[Tensor] = None) -> Tensor:
        mode, inverse = self.table.mode, self.inverse
        if offsets is None and per_sample_weights is None and mode in ("sum", "mean") and inverse.dim() == 2 \
                and inverse.size(1) > 0:
            # Bags of one size: a gather and a reduction, whose backward is one index_add: on CPU several times
            # faster, forward and backward, than embedding_bag, whose backward sorts.  Bags of one id are their
            # row, exactly (a sum or mean of one value is that value): no reduction, forward or backward.
            if inverse.size(1) == 1:
                return unique_rows.index_select(0, inverse.reshape(-1))
            bags = unique_rows.index_select(0, inverse.reshape(-1)).view(*inverse.shape, unique_rows.size(1))
            return bags.sum(1) if mode == "sum" else bags.mean(1)
        return F.embedding_bag(inverse, unique_rows, offsets, mode=mode, per_sample_weights=per_sample_weights)
