"""What a shard server hosts: named parameter tensors and embedding row ranges.

Owns the owner side of the data plane's tensors: creating them (functions
that peers call by RPC: the tensor lives here and the caller gets an RRef), naming them, and the TorchScript functions that
peers call to read them (``lookup_rows`` for embedding rows, ``gather`` for
dense parameters).  Those run as TorchScript RPCs: no Python, no GIL, on
the owner.  Called inside a ``dist_autograd`` context, they record the
send/receive pair, so a backward pass delivers gradients back here: dense
for dense parameters, row-sparse COO for embedding rows.

A hosted tensor lives as long as some RRef to it does; the name index
holds it weakly.  A *shared* table (``host_rows(..., shared=True)``) is
created by the first caller and found by name by the others, and lives
as long as the shard: it is the model the shard serves, whichever worker
asked for it first.  When the shard was started from a checkpoint
(``restore_source``, see ``snapshot``), a shared table's rows come from
it instead of the seed.  Optimizer state is not kept here (see
``paramserver.optim.owner``).
"""

import threading
import weakref
from typing import Dict, List, Optional, Protocol

import torch
from torch import Tensor
from torch.distributed.rpc import RRef

_lock = threading.Lock()
_by_name: "weakref.WeakValueDictionary[str, Tensor]" = weakref.WeakValueDictionary()
_names_by_id: Dict[int, str] = {}
_shared: Dict[str, Tensor] = {}


class RestoreSource(Protocol):
    """Where a restarted or resharded shard finds the values it hosted before (``snapshot.CheckpointSource``)."""

    def rows(self, name: str, num_rows: int, embedding_dim: int, dtype: torch.dtype) -> Optional[Tensor]: ...

    def optimizer_state(self, name: str, optimizer: str) -> Optional[Dict[str, Tensor]]: ...


#: Set once, before serving, by a shard started from a checkpoint.
restore_source: Optional[RestoreSource] = None


def _register(name: str, tensor: Tensor) -> Tensor:
    with _lock:
        return _register_locked(name, tensor)


def _register_locked(name: str, tensor: Tensor) -> Tensor:
    if name in _by_name:
        raise ValueError(f"a tensor named {name!r} is already hosted here")
    _by_name[name] = tensor
    _names_by_id[id(tensor)] = name
    weakref.finalize(tensor, _forget, id(tensor))
    return tensor


def _forget(tensor_id: int) -> None:
    with _lock:
        _names_by_id.pop(tensor_id, None)


def host_tensor(name: str, value: Tensor) -> RRef:
    """Host a copy of ``value`` as a trainable (leaf, requires-grad) parameter named ``name``.

    Called by RPC; returns the RRef that the caller keeps.
    """
    if not isinstance(value, Tensor) or not value.is_floating_point():
        raise TypeError(f"parameter {name!r} must be a floating-point tensor, got {type(value).__name__}"
                        + (f" of {value.dtype}" if isinstance(value, Tensor) else ""))
    return RRef(_register(name, value.detach().clone().contiguous().requires_grad_(True)))


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
    with _lock:  # one creator wins; the others find its table
        existing = _shared.get(name) if shared else None
        if existing is not None:
            if tuple(existing.shape) != (num_rows, embedding_dim) or existing.dtype != dtype:
                raise ValueError(f"shared table {name!r} is hosted here as {list(existing.shape)} "
                                 f"{existing.dtype}, asked for [{num_rows}, {embedding_dim}] {dtype}")
            return RRef(existing)
        rows = restore_source.rows(name, num_rows, embedding_dim, dtype) \
            if shared and restore_source is not None else None
        if rows is None:
            generator = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + start_row) % 2**63)
            rows = torch.empty(num_rows, embedding_dim, dtype=dtype)
            rows.normal_(0.0, init_std, generator=generator)
        _register_locked(name, rows.requires_grad_(True))
        if shared:
            _shared[name] = rows
    return RRef(rows)


def shared_tables() -> Dict[str, Tensor]:
    """The shared tables hosted here, by name (what a checkpoint of this shard holds)."""
    with _lock:
        return dict(_shared)


def name_of(tensor: Tensor) -> Optional[str]:
    """The name ``tensor`` is hosted under, or ``None``."""
    with _lock:
        return _names_by_id.get(id(tensor))


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
