"""What a shard hosts: named parameter tensors, embedding row ranges and dynamic table parts.

Owns creating the tensors a shard serves and finding them again, in a
``ShardState`` it is handed (and where a hosted tensor's rows sit in their
table, ``rounding_place``): a hosted tensor lives as long as some RRef to
it does.  A *shared* table (``host_rows(..., shared=True)``) is created by
the first caller and found by name by the others, and lives as long as the
shard: it is the model the shard serves, whichever worker asked for it
first.  A dynamic table's part (``host_dynamic``) is always shared.  When
the shard was started from a checkpoint (the state's ``restore_source``), a
shared table's rows come from it instead of the seed.  Optimizer state is
not kept here (see ``optimizers``).  Plain functions of a state: they know
nothing of RPC (``service`` calls them and wraps what they return in RRefs).
"""

import zlib
from typing import Optional, Tuple

import torch
from torch import Tensor

from ...checkpoint.storage import parse_range_name
from ...tables import DynamicOptions, parse_part_name, part_name
from ...tables.row_types import ROUNDINGS, row_dtypes
from .dynamic import DynamicRows
from .push_log import tag_of
from .state import ShardState


def host_tensor(state: ShardState, name: str, value: Tensor) -> Tensor:
    """A copy of ``value`` hosted as a trainable (leaf, requires-grad) parameter named ``name``."""
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise TypeError(f"parameter {name!r} must be a floating-point tensor, got {type(value).__name__}"
                        + (f" of {value.dtype}" if isinstance(value, Tensor) else ""))
    return state.register(name, value.detach().clone().contiguous().requires_grad_(True))


#: Rows of a half-precision table drawn at a time (in float32, then stored): 4 MiB at dimension 16.
DRAW_ROWS = 65_536


def check_row_type(table: str, dtype: torch.dtype, rounding: str) -> None:
    """``ValueError`` naming ``table`` unless its rows may be of ``dtype`` and updated with ``rounding``."""
    if dtype not in row_dtypes():
        raise ValueError(f"table {table!r}: rows are float32, float16 or bfloat16, not {dtype}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"table {table!r}: rounding is one of {ROUNDINGS}, not {rounding!r}")


def host_rows(state: ShardState, name: str, num_rows: int, embedding_dim: int, dtype: torch.dtype, seed: int,
              start_row: int, shared: bool = False, init_std: float = 1.0, rounding: str = "stochastic") -> Tensor:
    """``num_rows`` embedding rows, initialized N(0, init_std²) (N(0, 1) like ``nn.EmbeddingBag``).

    Each row's values come from ``(seed, start_row)``, drawn here (in float32,
    then stored as ``dtype``), so a big table never crosses the network to
    be created.  With ``shared``, a table already hosted under ``name`` (by
    another trainer) is reused when its shape and dtype match, and kept for
    the shard's lifetime.  ``rounding``: how updates are written into
    half-precision rows (``paramserver.optim.rounding``).
    """
    if num_rows <= 0 or embedding_dim <= 0:
        raise ValueError(f"table {name!r}: rows and embedding_dim must be positive, "
                         f"got {num_rows} x {embedding_dim}")
    check_row_type(name, dtype, rounding)

    def initial_rows() -> Tensor:
        rows = state.restore_source.rows(name, num_rows, embedding_dim, dtype) \
            if shared and state.restore_source is not None else None
        if rows is None:
            generator = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + start_row) % 2**63)
            rows = torch.empty(num_rows, embedding_dim, dtype=dtype)
            if dtype == torch.float32:
                rows.normal_(0.0, init_std, generator=generator)
            else:  # drawn in float32 a slice at a time (the same values), so no float32 copy of the table is made
                drawn = torch.empty(min(num_rows, DRAW_ROWS), embedding_dim)
                for start in range(0, num_rows, DRAW_ROWS):
                    piece = drawn[:min(DRAW_ROWS, num_rows - start)]
                    rows[start:start + piece.size(0)] = piece.normal_(0.0, init_std, generator=generator)
        return rows.requires_grad_(True)

    if not shared:
        table = state.register(name, initial_rows())
        state.set_rounding(table, rounding)
        return table
    table = state.shared_table(name, initial_rows)  # one creator wins; the others find its table
    state.set_rounding(table, rounding)
    if tuple(table.shape) != (num_rows, embedding_dim) or table.dtype != dtype:
        raise ValueError(f"shared table {name!r} is hosted here as {list(table.shape)} "
                         f"{table.dtype}, asked for [{num_rows}, {embedding_dim}] {dtype}")
    return table


def host_dynamic(state: ShardState, table: str, embedding_dim: int, dtype: torch.dtype, seed: int, init_std: float,
                 options: DynamicOptions, index: int, count: int, rounding: str = "stochastic") -> Tensor:
    """This shard's part (``index`` of ``count``) of dynamic table ``table`` (every trainer naming it shares
    it; kept for the shard's lifetime), restored from the checkpoint the shard started from, if any, whatever
    the number of shards that wrote it; returns its slab.  ``options`` were checked where they were made;
    ``dtype`` and ``rounding`` as ``host_rows`` takes them."""
    if embedding_dim <= 0:
        raise ValueError(f"dynamic table {table!r}: embedding_dim must be positive, got {embedding_dim}")
    check_row_type(table, dtype, rounding)
    name = part_name(table, index, count)

    def create() -> DynamicRows:
        stores = state.row_stores
        rows = DynamicRows(name, embedding_dim, dtype, seed, init_std, options, lambda t: state.lock_for(t)[1],
                           kernel=state.kernels.chosen(), huge_pages=state.huge_pages,
                           store=stores.tier(name) if stores is not None else None)
        restored = state.restore_source.dynamic_part(table, index, count) if state.restore_source else None
        if stores is not None:  # its part of --row-memory, where it has no capacity of its own, asked for the
            # rows it restores: those the share pays for stay in memory
            stores.share(rows, restored["ids"].numel() if restored is not None else 0)
            rows.on_store_failure = state.store_failed
        if restored is not None:
            state.restore_source.check_row_type(table, restored["values"].dtype, dtype)
            rows.restore(**restored)
        log = state.push_log
        if log is not None:  # its training lookups change it: they are logged with the pushes
            rows.log_tag = tag_of(f"dynamic\0{name}")
            rows.journal = lambda ids, step: log.append_lookup(rows.log_tag, ids, step)
        return rows

    rows = state.shared_dynamic(name, create)
    if rows.embedding_dim != embedding_dim or rows.dtype != dtype or rows.options != options:
        raise ValueError(f"dynamic table {name!r} is hosted here with rows of {rows.embedding_dim} {rows.dtype} and "
                         f"{rows.options}, asked for {embedding_dim} {dtype} and {options}")
    state.set_rounding(rows.slab, rounding)
    return rows.slab


def rounding_place(state: ShardState, tensor: Tensor) -> Tuple[int, int, Optional[Tensor]]:
    """Where hosted ``tensor``'s rows sit in their table, for the bits its half-precision rows are rounded with
    (``paramserver.optim.rounding``): ``(key, first_row, ids)``, the table's 32-bit key (a CRC-32 of its name,
    the same on every shard), and each row's id in it: ``ids[row]`` for a dynamic table's part (its slots'
    ids, ``DynamicRows.slot_ids``), else ``first_row + row`` (a fixed table's rows ``[first_row:...]``, hosted
    as ``"table[start:stop]"``; 0 for a tensor hosted whole)."""
    dynamic = state.dynamic_rows(tensor)
    if dynamic is not None:
        parsed = parse_part_name(dynamic.name)
        return _table_key(parsed[0] if parsed is not None else dynamic.name), 0, dynamic.slot_ids
    name = state.name_of(tensor)
    if name is None:
        return 0, 0, None
    rows = parse_range_name(name)
    if rows is None:
        return _table_key(name), 0, None
    return _table_key(rows[0]), rows[1], None


def _table_key(table: str) -> int:
    return zlib.crc32(table.encode())


def read_dynamic(state: ShardState, slab: Tensor, ids: Tensor) -> Tensor:
    """Rows of ``ids`` (distinct) in a dynamic table's part, read only (zeros for ids without one)."""
    return state.dynamic_rows(slab).lookup(ids, -1)
