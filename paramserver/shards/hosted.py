"""What a shard server hosts: named parameter tensors and embedding row ranges.

Owns the owner side of the data plane's tensors: creating them (functions
that peers call by RPC: the tensor lives here and the caller gets an RRef), naming them, and the TorchScript functions that
peers call to read them (``lookup_rows`` for embedding rows, ``gather`` for
dense parameters).  Those run as TorchScript RPCs: no Python, no GIL, on
the owner.  Called inside a ``dist_autograd`` context, they record the
send/receive pair, so a backward pass delivers gradients back here: dense
for dense parameters, row-sparse COO for embedding rows.

What is hosted is kept in the process's ``ShardState`` (``state``): a
hosted tensor lives as long as some RRef to it does.  A *shared* table
(``host_rows(..., shared=True)``) is created by the first caller and found
by name by the others, and lives as long as the shard: it is the model
the shard serves, whichever worker asked for it first.  A dynamic table's
part (``host_dynamic``) is always shared.  When the shard
was started from a checkpoint (the state's ``restore_source``), a shared
table's rows come from it instead of the seed.  Optimizer state is not
kept here (see ``paramserver.optim.owner``).
"""

from typing import List, Optional

import torch
from torch import Tensor
from torch.distributed.rpc import RRef

from .dynamic import DynamicOptions, DynamicRows
from .dynamic import part_name as dynamic_part_name
from .state import ShardState


def host_tensor(name: str, value: Tensor) -> RRef:
    """Host a copy of ``value`` as a trainable (leaf, requires-grad) parameter named ``name``.

    Called by RPC; returns the RRef that the caller keeps.
    """
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise TypeError(f"parameter {name!r} must be a floating-point tensor, got {type(value).__name__}"
                        + (f" of {value.dtype}" if isinstance(value, Tensor) else ""))
    return RRef(ShardState.current().register(name, value.detach().clone().contiguous().requires_grad_(True)))


def host_rows(name: str, num_rows: int, embedding_dim: int, dtype: torch.dtype, seed: int,
              start_row: int, shared: bool = False, init_std: float = 1.0) -> RRef:
    """Host ``num_rows`` embedding rows, initialized N(0, init_std²) (N(0, 1) like ``nn.EmbeddingBag``).

    Each row's values come from ``(seed, start_row)``, drawn here, so a big
    table never crosses the network to be created.  With ``shared``, a table
    already hosted under ``name`` (by another trainer) is reused when its
    shape and dtype match, and kept for the shard's lifetime.  Called by
    RPC; returns the RRef that the caller keeps.
    """
    if num_rows <= 0 or embedding_dim <= 0:
        raise ValueError(f"table {name!r}: rows and embedding_dim must be positive, "
                         f"got {num_rows} x {embedding_dim}")
    state = ShardState.current()

    def initial_rows() -> Tensor:
        rows = state.restore_source.rows(name, num_rows, embedding_dim, dtype) \
            if shared and state.restore_source is not None else None
        if rows is None:
            generator = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + start_row) % 2**63)
            rows = torch.empty(num_rows, embedding_dim, dtype=dtype)
            rows.normal_(0.0, init_std, generator=generator)
        return rows.requires_grad_(True)

    if not shared:
        return RRef(state.register(name, initial_rows()))
    table = state.shared_table(name, initial_rows)  # one creator wins; the others find its table
    if tuple(table.shape) != (num_rows, embedding_dim) or table.dtype != dtype:
        raise ValueError(f"shared table {name!r} is hosted here as {list(table.shape)} "
                         f"{table.dtype}, asked for [{num_rows}, {embedding_dim}] {dtype}")
    return RRef(table)


def host_dynamic(table: str, embedding_dim: int, dtype: torch.dtype, seed: int, init_std: float,
                 options: DynamicOptions, index: int, count: int) -> RRef:
    """Host this shard's part (``index`` of ``count``) of dynamic table ``table`` (every trainer naming it
    shares it; kept for the shard's lifetime), restored from the checkpoint the shard started from, if any,
    whatever the number of shards that wrote it.  Called by RPC; returns an RRef to its slab."""
    if embedding_dim <= 0:
        raise ValueError(f"dynamic table {table!r}: embedding_dim must be positive, got {embedding_dim}")
    options.check(table)
    state = ShardState.current()
    name = dynamic_part_name(table, index, count)

    def create() -> DynamicRows:
        rows = DynamicRows(name, embedding_dim, dtype, seed, init_std, options, lambda t: state.lock_for(t)[1])
        restored = state.restore_source.dynamic_part(table, index, count) if state.restore_source else None
        if restored is not None:
            rows.restore(**restored)
        return rows

    rows = state.shared_dynamic(name, create)
    if rows.embedding_dim != embedding_dim or rows.dtype != dtype or rows.options != options:
        raise ValueError(f"dynamic table {name!r} is hosted here with rows of {rows.embedding_dim} {rows.dtype} and "
                         f"{rows.options}, asked for {embedding_dim} {dtype} and {options}")
    return RRef(rows.slab)


def read_dynamic(slab: RRef, ids: Tensor) -> Tensor:
    """RPC target: rows of ``ids`` (distinct) in a dynamic table's part, read only (zeros for ids without one)."""
    return ShardState.current().dynamic_rows(slab.local_value()).lookup(ids, -1)


def shared_tables():
    """The shared tables hosted here, by name (what a checkpoint of this shard holds)."""
    return ShardState.current().shared_tables()


def name_of(tensor: Tensor) -> Optional[str]:
    """The name ``tensor`` is hosted under, or ``None``."""
    return ShardState.current().name_of(tensor)


@torch.jit.script
def lookup_rows(table: RRef[Tensor], rows: Tensor) -> Tensor:
    """Rows ``rows`` (local indices) of a hosted table; backward yields a row-sparse gradient."""
    return torch.embedding(table.local_value(), rows, -1, False, True)


@torch.jit.script
def gather(params: List[RRef[Tensor]]) -> List[Tensor]:
    """The hosted parameters themselves (differentiable inside a dist_autograd context)."""
    return [param.local_value() for param in params]


def values(params: List[RRef]) -> List[Tensor]:
    """Detached copies of the current values, for evaluation."""
    return [param.local_value().detach().clone() for param in params]
