"""Fixed hashes of int64 ids: which shard serves an id, its bucket in an index, and its initial row; and the
id of a string.

Owns the pure functions over id tensors that dynamic tables agree on
without asking anyone: every worker routes an id to the same shard
(``shard_of``), a shard places it in its index (``bucket_of``), and a row
re-created anywhere starts from the same values (``initial_rows``, a
function of the table's seed and the id only).  Everything is vectorized
torch integer arithmetic on int64 (products wrap around, as in C), so the
results are the same on every machine and in every process.  A string
categorical value becomes an id through ``string_ids``: xxHash's XXH64 of
its UTF-8 bytes with seed 0, read as a signed int64 (the ``xxhash``
package; the same value any XXH64 implementation gives), so a reader in
training and a client in serving agree without sharing anything.  No
state.
"""

import math
from typing import Iterable, Optional, Union

import torch
import xxhash
from torch import Tensor


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 torch computes with."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX_1 = _signed(0xBF58476D1CE4E5B9)
_MIX_2 = _signed(0x94D049BB133111EB)
_SHARD_SALT = 0x5EED5A17
_LOW_63 = (1 << 63) - 1
_ALL_64 = (1 << 64) - 1


def shift_right(values: Tensor, bits: int) -> Tensor:
    """``values >> bits`` as unsigned 64-bit integers (torch's ``>>`` on int64 keeps the sign)."""
    return (values >> bits) & ((1 << (64 - bits)) - 1)


def mix64(values: Tensor) -> Tensor:
    """splitmix64's finalizer: every bit of the result depends on every bit of ``values`` (int64)."""
    z = values + _GOLDEN
    z = (z ^ shift_right(z, 30)) * _MIX_1
    z = (z ^ shift_right(z, 27)) * _MIX_2
    return z ^ shift_right(z, 31)


def _mix_int(value: int) -> int:
    """``mix64`` of one Python int (the same bits, without making a tensor)."""
    z = (value + _GOLDEN) & _ALL_64
    z = ((z ^ (z >> 30)) * (_MIX_1 & _ALL_64)) & _ALL_64
    z = ((z ^ (z >> 27)) * (_MIX_2 & _ALL_64)) & _ALL_64
    return _signed(z ^ (z >> 31))


def salted(values: Tensor, salt: int) -> Tensor:
    """``mix64`` of ``values`` under ``salt`` (independent hashes of the same ids for different uses)."""
    return mix64(values ^ _mix_int(salt))


def shard_of(ids: Tensor, count: int) -> Tensor:
    """The shard (0..count-1) that serves each of ``ids``: the same everywhere, for any int64 id."""
    return (salted(ids, _SHARD_SALT) & _LOW_63) % count


def bucket_of(ids: Tensor, bits: int) -> Tensor:
    """Fibonacci hashing: the top ``bits`` bits of ``ids * 2^64/phi`` (a bucket among ``2**bits``)."""
    if bits == 0:
        return torch.zeros_like(ids)
    return shift_right(ids * _GOLDEN, 64 - bits)


def unit_interval(ids: Tensor, salt: int) -> Tensor:
    """A uniform number in [0, 1) per id (float64), fixed by ``(salt, id)``."""
    return shift_right(salted(ids, salt), 11).double() * (1.0 / (1 << 53))


def initial_rows(ids: Tensor, seed: int, embedding_dim: int, std: float, dtype: torch.dtype) -> Tensor:
    """Rows N(0, std²) for ``ids``, each a function of ``(seed, id)`` only (Box-Muller over hashed uniforms)."""
    pairs = (embedding_dim + 1) // 2
    base = salted(ids.reshape(-1), seed)
    draws = mix64(base.unsqueeze(1) + torch.arange(pairs, dtype=torch.int64) * _GOLDEN)
    high = (shift_right(draws, 32).double() + 1.0) * (1.0 / (1 << 32))  # (0, 1]: log is finite
    low = (draws & 0xFFFFFFFF).double() * (2.0 * math.pi / (1 << 32))
    radius = torch.sqrt(-2.0 * torch.log(high))
    normals = torch.stack((radius * torch.cos(low), radius * torch.sin(low)), dim=2).reshape(ids.numel(), 2 * pairs)
    return (normals[:, :embedding_dim] * std).to(dtype)


#: The id of a missing categorical value (an empty field, a null): the smallest int64.
MISSING_ID = -(1 << 63)
#: The seed of ``string_ids``' XXH64 (part of the documented hash: changing it changes every string's id).
STRING_HASH_SEED = 0


def string_id(value: Union[str, bytes]) -> int:
    """The int64 id of one string (UTF-8) or byte string: XXH64 with seed ``STRING_HASH_SEED``, signed."""
    data = value.encode() if isinstance(value, str) else bytes(value)
    return _signed(xxhash.xxh64_intdigest(data, STRING_HASH_SEED))


def string_ids(values: Iterable[Optional[Union[str, bytes]]]) -> Tensor:
    """The int64 ids of ``values`` (``string_id`` of each), ``MISSING_ID`` for ``None`` and empty strings:
    what a Parquet reader with ``"strings": "hash"`` gives for a column of them, for the same ids in
    serving."""
    return torch.tensor([string_id(value) if value else MISSING_ID for value in values], dtype=torch.int64)
