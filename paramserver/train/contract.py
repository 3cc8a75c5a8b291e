"""What a job hands the Trainer: ``Table`` (an embedding table on the shards) and ``Batch`` (one step's data).

Owns the two plain types of the Trainer's contract and their checks;
nothing here talks to a shard or a trainer group.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from torch import Tensor

from ..tables import DistinctIds, DynamicOptions, distinct_ids
from ..tables.row_types import ROUNDINGS, row_dtypes

MODES = ("sum", "mean")


def is_count(value, least: int = 1) -> bool:
    """Whether ``value`` is a whole number (an ``int``, not a ``bool``) of at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True)
class Table:
    """An embedding table on the shards, shared by every worker that names it.

    Like ``nn.EmbeddingBag(num_embeddings, embedding_dim, mode=mode)``;
    rows start N(0, ``init_std``²).  Placed whole on one shard (by size) or,
    from ``Trainer(row_wise_min_rows=...)`` rows up, split by rows over
    every shard.

    ``num_embeddings=None`` makes a dynamic table (``DynamicEmbeddingBag``):
    any int64 id is valid, its row made on the shard its hash names when it
    is admitted (``admit_after`` lookups, then with probability
    ``admit_probability``), and each shard keeps at most ``capacity`` rows,
    evicting the least recently touched, and drops rows untouched for
    ``ttl_steps`` steps.  Those four options are for dynamic tables only.

    ``dtype``: the type its rows are stored in on the shards: ``torch.float32``,
    or ``torch.float16`` / ``torch.bfloat16`` (half the memory, half the
    bytes of a lookup); half-precision rows are upcast to float32 on the
    worker, updated in float32 on the shards (their optimizer state is
    float32) and written back with ``rounding``: ``"stochastic"`` (unbiased:
    small updates accumulate; seeded per shard and step) or ``"nearest"``.

    ``cache_rows``: at most this many of the table's rows in each worker's
    row cache at once (``paramserver.train.pipeline``), beside the
    Trainer's bound over every table (``Trainer(cache_rows=...)``); a
    table's bound alone turns the cache on.  A worker's setting, not the
    table's: it does not take part in comparing tables.
    """

    num_embeddings: Optional[int]
    embedding_dim: int
    mode: str = "sum"
    init_std: float = 0.01
    capacity: Optional[int] = None
    ttl_steps: Optional[int] = None
    admit_after: int = 1
    admit_probability: float = 1.0
    dtype: torch.dtype = torch.float32
    rounding: str = "stochastic"
    cache_rows: Optional[int] = field(default=None, compare=False)

    #: The admission and eviction options as one value (made and checked once, here): what travels to the
    #: shards for a dynamic table.
    options: DynamicOptions = field(init=False, repr=False, compare=False)

    @property
    def dynamic(self) -> bool:
        return self.num_embeddings is None

    def __post_init__(self):
        options = DynamicOptions(self.capacity, self.ttl_steps, self.admit_after, self.admit_probability)
        object.__setattr__(self, "options", options)
        if self.num_embeddings is None:
            if self.embedding_dim <= 0:
                raise ValueError(f"a table needs a positive embedding_dim, got {self.embedding_dim}")
        elif options != DynamicOptions():
            raise ValueError("capacity, ttl_steps, admit_after and admit_probability are for dynamic tables "
                             "(num_embeddings=None)")
        elif self.num_embeddings <= 0 or self.embedding_dim <= 0:
            raise ValueError(f"a table needs positive num_embeddings and embedding_dim, got "
                             f"{self.num_embeddings} x {self.embedding_dim}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not self.init_std >= 0:
            raise ValueError(f"init_std must be a non-negative number, got {self.init_std}")
        if self.dtype not in row_dtypes():
            raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {self.dtype!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}")
        if self.cache_rows is not None and not is_count(self.cache_rows):
            raise ValueError(f"a table's cache_rows must be a whole number of rows, 1 or more (or None: no bound "
                             f"of its own); got {self.cache_rows!r}")


@dataclass
class Batch:
    """One step's samples: ``sparse[name]`` is a ``(batch, bag)`` int64 tensor of ids for table ``name``;
    ``dense`` a ``(batch, features)`` float tensor; ``labels`` a ``(batch,)`` float tensor."""

    sparse: Dict[str, Tensor]
    dense: Tensor
    labels: Tensor
    #: Per table, its ids' distinct values as ``find_distinct_ids`` found them (a step's routing starts there).
    distinct: Dict[str, DistinctIds] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return self.labels.numel()

    def find_distinct_ids(self) -> None:
        """Deduplicate every table's ids now, into ``distinct``: the Trainer's batch reader does it in its own
        thread, ahead of the step.  Ids of a type no table takes are left to ``check`` to name."""
        for name, ids in self.sparse.items():
            if name not in self.distinct and isinstance(ids, Tensor) and ids.dtype in (torch.int64, torch.int32):
                self.distinct[name] = distinct_ids(ids)

    def check(self, tables: Dict[str, Table]) -> None:
        """Raise ``ValueError`` naming what does not fit ``tables`` (nothing has been sent yet)."""
        size = self.labels.numel()
        if self.labels.dim() != 1:
            raise ValueError(f"labels must have shape (batch,), got {list(self.labels.shape)}")
        if self.dense.dim() != 2 or self.dense.size(0) != size:
            raise ValueError(f"dense must have shape ({size}, features), got {list(self.dense.shape)}")
        missing = sorted(set(tables) - set(self.sparse))
        unknown = sorted(set(self.sparse) - set(tables))
        if missing or unknown:
            raise ValueError(f"batch has ids for tables {sorted(self.sparse)}, the Trainer has {sorted(tables)}"
                             + (f" (missing: {', '.join(missing)})" if missing else "")
                             + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        for name, ids in self.sparse.items():
            if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2 or ids.size(0) != size:
                raise ValueError(f"table {name!r}: ids must be a ({size}, bag) int64 tensor, got "
                                 f"{ids.dtype} of shape {list(ids.shape)}")
