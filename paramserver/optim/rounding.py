"""Writing float32 values back into half-precision rows: stochastic rounding, or rounding to nearest.

Owns the one kernel that turns an update computed in float32 into a float16 or bfloat16 row (the row types
and the rounding modes, ``ROUNDINGS``, are ``paramserver.tables.row_types``).  Rounding to nearest
loses every update smaller than half a unit in the last place (at float16's 10 bits of mantissa, a row
near 0.01 ignores steps under about 5e-6), so tables round *stochastically* by default, as FBGEMM does:
a value is rounded up with probability equal to its distance from the value below, in units of the
gap between the two, so that rounding is unbiased on average and small updates accumulate.

The random bits come from a ``torch.Generator`` seeded from a seed of the row owner's choosing (a shard
seeds each table from its own name and the table's) and the number of the step (``rounding_generator``):
the same pushes in the same order give the same rows.

Everything compiles under TorchScript (the row-sparse driver calls it from scripted steps).
"""

import torch
from torch import Tensor

from ..tables.row_types import is_half

def rounding_generator(seed: int, step: int) -> torch.Generator:
    """The generator of step ``step``'s rounding bits for rows seeded with ``seed`` (the low 31 bits of
    ``seed`` and 32 of ``step`` count; the same in Python and TorchScript, whose ints are 64-bit)."""
    generator = torch.Generator()
    generator.manual_seed((seed % 2147483648) * 4294967296 + step % 4294967296)
    return generator


def round_stochastic(values: Tensor, dtype: torch.dtype, generator: torch.Generator) -> Tensor:
    """``values`` (float32) rounded to ``dtype`` (float16 or bfloat16) stochastically: to the upper of the two
    neighbouring values of ``dtype`` with the probability of its share of the gap between them, so unbiased.

    The gap at a value is a power of two read off its binary logarithm: ``2**(floor(log2|value|) - 10)`` for
    float16 (10 bits of mantissa; a fixed ``2**-24`` below its normal range) and ``2**(floor(log2|value|) - 7)``
    for bfloat16 (``2**-133`` at least); at most the gap at the type's largest value, so that an infinity
    stays one.  Dividing by it is exact, so the magnitude splits exactly into whole gaps and a fraction, and
    the fraction is compared with a uniform draw.  (For a value a few ulps below a power of two the logarithm
    rounds up to it, and the gap is doubled there: both its ends are still values of the type, so the
    rounding stays unbiased.)  Infinities and NaNs stay as they are; the result's sign is
    the value's."""
    magnitude = values.abs()
    if dtype == torch.bfloat16:
        gap_exponent = torch.clamp(torch.floor(torch.log2(magnitude)) - 7.0, min=-133.0, max=120.0)
    else:
        gap_exponent = torch.clamp(torch.floor(torch.log2(magnitude)) - 10.0, min=-24.0, max=5.0)
    gap = torch.exp2(gap_exponent)
    scaled = magnitude / gap
    lower = scaled.floor()
    uniform = torch.rand(values.shape, generator=generator, dtype=torch.float32, device=values.device)
    # An infinity stays one (its fraction is NaN, never above the draw); a NaN stays NaN.
    return torch.copysign((lower + (uniform < scaled - lower).to(torch.float32)) * gap, values).to(dtype)


def round_rows(values: Tensor, dtype: torch.dtype, nearest: bool, generator: torch.Generator) -> Tensor:
    """``values`` (float32) as ``dtype``: unchanged when ``dtype`` is not a half type, else rounded to nearest
    (``nearest``) or stochastically."""
    if not is_half(dtype) or values.dtype == dtype:
        return values
    if nearest:
        return values.to(dtype)
    return round_stochastic(values, dtype, generator)
