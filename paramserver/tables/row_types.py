"""The types a table's rows may be stored in, and how an update is written into half-precision rows.

Owns the names every side agrees on: a ``Table``'s ``dtype`` and ``rounding`` are checked against them on
the trainer's side and again where a shard hosts the rows, and the optimizers' row-sparse driver
(``paramserver.optim.rounding``) rounds by them.  Compiles under TorchScript.
"""

from typing import List

import torch

#: Modes of writing a float32 update into a half-precision row: unbiased, seeded per step; or to nearest.
ROUNDINGS = ("stochastic", "nearest")


def row_dtypes() -> List[torch.dtype]:
    """The types a table's rows may be stored in (a function: TorchScript reads no module-level lists)."""
    return [torch.float32, torch.float16, torch.bfloat16]


def is_half(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a half-precision row type (its rows are updated in float32, then rounded)."""
    return dtype == torch.float16 or dtype == torch.bfloat16
