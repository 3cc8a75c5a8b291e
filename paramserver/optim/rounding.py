"""Writing float32 values back into half-precision rows: stochastic rounding, or rounding to nearest.

Owns the one kernel that turns an update computed in float32 into a float16 or bfloat16 row (the row types
and the rounding modes, ``ROUNDINGS``, are ``paramserver.tables.row_types``), and the random bits it rounds
with.  Rounding to nearest loses every update smaller than half a unit in the last place (at float16's 10
bits of mantissa, a row near 0.01 ignores steps under about 5e-6), so tables round *stochastically* by
default, as FBGEMM does: a value is rounded up with probability equal to its distance from the value below,
in units of the gap between the two, so that rounding is unbiased on average and small updates accumulate.

The random bits are counter-based: each value's 32 bits are a hash of (table, step, row, column), where the
row is the row's id in its table (``rounding_bits``), not its place in a part or on a shard.  So a push gives
the same rows whether it is applied in one part or in several at once, and a table's rows get the same bits
however the table is cut over shards; the same pushes in the same order give the same rows, and no state
but the step's number is kept.  The hash is MurmurHash3's 32-bit finalizer (``fmix32``: two multiplies and
three xor-shifts, a bijection in which every input bit flips each output bit with probability close to
1/2), chained over the words of the key (``stream_seed``: table, step; ``rounding_bits``: the row id's two
words, then the column's Weyl constant), as splitmix-style generators run a counter through a strong
finalizer.  It was chosen over Philox-4x32 (ten rounds of 32x32->64-bit multiplies: dozens of tensor
operations per value in torch) and over splitmix64's finalizer (the same quality, but int64 lanes hold half
as many values and need masked shifts too): vectorised in int32 it costs a dozen elementwise operations per
value, and in C it is a few lines of ``uint32_t`` arithmetic that a native kernel reproduces bit for bit.
(Torch's int32 multiplies wrap modulo 2**32, as ``uint32_t`` ones do; right shifts are masked to be logical.)

How a value is rounded with its bits (``round_stochastic``): the gap between the type's two values around
it is a power of two read off the value's float32 gap (``nextafter``: TorchScript has no bit cast to read the
exponent's bits with); the value divided by it (exact) splits into its floor
and a fraction, and the fraction is compared with 24 random bits.  Infinities and NaNs stay as they are, and
so does a zero's sign (a negative value rounded to zero gives +0).

Everything compiles under TorchScript (the row-sparse driver calls it from scripted steps).
"""

import torch
from torch import Tensor

from ..tables.row_types import is_half

# (TorchScript reads no module-level numbers: the constants are written where they are used.  The words of the
# hash are unsigned 32-bit integers, masked with 0xFFFFFFFF; the column's word is ``(column + 1) * 0x9E3779B9``,
# the Weyl constant 2**32 / golden ratio; 0x85EBCA6B and 0xC2B2AE35 are MurmurHash3's finalizer's multipliers,
# -2048144789 and -1028477387 as signed int32, how torch's int32 tensors hold them.)


def _mul32(a: int, b: int) -> int:
    """``a * b mod 2**32`` for words ``a``, ``b``, without products over 2**49 (TorchScript ints are int64)."""
    return ((a & 0xFFFF) * b + ((((a >> 16) * b) & 0xFFFF) << 16)) & 0xFFFFFFFF


def fmix32(h: int) -> int:
    """MurmurHash3's finalizer of word ``h`` (a bijection of 32-bit words), on Python ints."""
    h = h & 0xFFFFFFFF
    h ^= h >> 16
    h = _mul32(h, 0x85EBCA6B)
    h ^= h >> 13
    h = _mul32(h, 0xC2B2AE35)
    h ^= h >> 16
    return h


def fmix32_(h: Tensor) -> Tensor:
    """``fmix32`` of every element of ``h`` (int32, the word's bits), in place; returns ``h``."""
    h.bitwise_xor_(torch.bitwise_right_shift(h, 16).bitwise_and_(0xFFFF))  # (a logical shift: masked)
    h.mul_(-2048144789)
    h.bitwise_xor_(torch.bitwise_right_shift(h, 13).bitwise_and_(0x7FFFF))
    h.mul_(-1028477387)
    h.bitwise_xor_(torch.bitwise_right_shift(h, 16).bitwise_and_(0xFFFF))
    return h


def stream_seed(table: int, step: int) -> int:
    """The word all of step ``step``'s bits of table ``table`` (a 32-bit key) derive from (the low 32 bits of
    ``step`` count)."""
    return fmix32(fmix32(table) ^ (step & 0xFFFFFFFF))


def rounding_bits(seed: int, ids: Tensor, columns: int) -> Tensor:
    """32 random bits (int32) for each of ``columns`` values of each row of ``ids`` (int64 row ids, any
    values) in the stream ``seed`` (``stream_seed``): shape ``[len(ids), columns]``, value ``[r, c]`` being
    ``fmix32(fmix32(seed ^ lo ^ hi * 0x9E3779B9) ^ (c + 1) * 0x9E3779B9)`` with ``lo``, ``hi`` the low and high
    words of ``ids[r]``, all in ``uint32`` arithmetic (two ids share their bits only where their words collide
    so, which ids under 2**32 never do)."""
    # lo ^ hi * 0x9E3779B9 ^ seed in the low word of an int64, which the cast to int32 keeps (bits as they are)
    rows = fmix32_(((ids >> 32) * 0x9E3779B9 ^ ids ^ seed).to(torch.int32))
    weyl = torch.arange(1, columns + 1, dtype=torch.int32, device=ids.device) * -1640531527  # 0x9E3779B9, int32
    return fmix32_(rows.unsqueeze(1).bitwise_xor(weyl.unsqueeze(0)))


def round_stochastic(values: Tensor, dtype: torch.dtype, bits: Tensor) -> Tensor:
    """``values`` (float32) rounded to ``dtype`` (float16 or bfloat16) stochastically with random ``bits``
    (int32, one word per value, shaped like ``values``; used up: overwritten): to the upper of the two neighbouring values of
    ``dtype`` with the probability of its share of the gap between them, so unbiased (probabilities in steps
    of ``2**-24``: the low 24 random bits are the draw).

    The gap at a value is its float32 gap (``nextafter`` up, minus it) times ``2**13`` for float16 (13 fewer
    bits of mantissa), at least ``2**-24`` (its subnormals' gap) and at most ``2**5`` (its largest values'),
    or ``2**16`` for bfloat16 (its subnormals are float32's, cut the same way), at most ``2**120``: a power of
    two, so dividing by it is exact and the quotient splits exactly into a floor and a fraction.  (A
    magnitude is capped at the type's largest value before its gap is read, so an infinity stays one.)"""
    infinity = torch.full([1], float("inf"), dtype=torch.float32, device=values.device)
    if dtype == torch.bfloat16:
        magnitude = values.abs().clamp_(max=3.3895313892515355e38)
        gap = torch.nextafter(magnitude, infinity).sub_(magnitude).mul_(65536.0)
    else:  # (from 2**-14 down, float16's gap is its subnormals' 2**-24: float32's at 2**-14, times 2**13)
        magnitude = values.abs().clamp_(min=6.103515625e-05, max=65504.0)
        gap = torch.nextafter(magnitude, infinity).sub_(magnitude).mul_(8192.0)
    scaled = values / gap  # exact; the signed floor rounds negative values unbiased too
    lower = scaled.floor()
    uniform = bits.bitwise_and_(0xFFFFFF).to(torch.float32).mul_(5.960464477539063e-08)
    # floor(draw - fraction) is -1 when the draw is below the fraction (round up), else 0: lower - that.  An
    # infinity stays one (its fraction is NaN: no step), a NaN stays NaN, and a zero keeps its sign (-0 - +0).
    down = uniform.sub_(scaled.sub_(lower)).floor_().nan_to_num_(0.0)
    return lower.sub_(down).mul_(gap).to(dtype)


def round_rows(values: Tensor, dtype: torch.dtype, nearest: bool, seed: int, ids: Tensor) -> Tensor:
    """``values`` (float32 rows ``ids`` of a table, int64) as ``dtype``: unchanged when ``dtype`` is not a half
    type, else rounded to nearest (``nearest``) or stochastically with the bits of stream ``seed``
    (``stream_seed``) for those rows."""
    if not is_half(dtype) or values.dtype == dtype:
        return values
    if nearest:
        return values.to(dtype)
    columns = 1
    for size in values.shape[1:]:
        columns *= size
    flat = values.reshape(values.size(0), columns) if values.dim() != 2 else values
    bits = rounding_bits(seed, ids, columns)
    return round_stochastic(flat, dtype, bits).view(values.shape)
