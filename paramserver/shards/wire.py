"""How a step's rows travel between a trainer and a shard: packed, a few tensors per message.

Owns the wire format of the fused row traffic (``EmbeddingCollection``
on the trainer's side, ``service.lookup``/``push``/``push_lookup`` on the
shard's).  A message names several tables of a shard.  Their ids travel as
one tensor with a count per table, and their rows or row gradients as one
flat tensor.  They do not travel as a list of tensors: TensorPipe handles
every tensor of a message on its own, at a CPU cost on both sides that
outweighs copying a step's rows once.  The rows of one message share a
dtype (a shard whose tables' rows differ in type sends them as float32).
"""

from typing import List, Sequence

import torch
from torch import Tensor


#: The rows of a message that carries none.
NO_ROWS = torch.empty(0)


def is_compact(piece: Tensor) -> bool:
    """Whether ``piece`` is the whole of its storage, contiguous: sent as it is, it sends nothing more."""
    return piece.is_contiguous() and piece.storage_offset() == 0 and \
        piece.untyped_storage().nbytes() == piece.numel() * piece.element_size()


def pack_ids(ids: Sequence[Tensor]) -> Tensor:
    """``ids`` (1-D int64 pieces) as one tensor; ``counts(ids)`` says where each piece ends."""
    if len(ids) == 1 and is_compact(ids[0]):
        return ids[0]
    return torch.cat(list(ids)) if ids else torch.empty(0, dtype=torch.long)


def counts(pieces: Sequence[Tensor]) -> List[int]:
    """Rows per piece (``size(0)``)."""
    return [piece.size(0) for piece in pieces]


def pack_rows(rows: Sequence[Tensor]) -> Tensor:
    """``rows`` (2-D pieces of one dtype, any widths) as one flat tensor (one compact piece: a view of it)."""
    if len(rows) == 1 and is_compact(rows[0]):
        return rows[0].view(-1)
    return torch.cat([piece.reshape(-1) for piece in rows]) if rows else torch.empty(0)


def unpack_ids(ids: Tensor, row_counts: Sequence[int]) -> List[Tensor]:
    """The pieces of ``pack_ids``; ``ValueError`` when ``row_counts`` do not add up to ``ids``."""
    if ids.dim() != 1 or any(count < 0 for count in row_counts) or sum(row_counts) != ids.numel():
        raise ValueError(f"{ids.numel()} packed ids (shape {list(ids.shape)}) do not split into counts "
                         f"{list(row_counts)}")
    return [ids] if len(row_counts) == 1 else list(ids.split(list(row_counts)))


def unpack_rows(flat: Tensor, row_counts: Sequence[int], widths: Sequence[int]) -> List[Tensor]:
    """The pieces of ``pack_rows``: ``row_counts[i]`` rows of ``widths[i]`` values; ``ValueError`` when they
    do not add up to ``flat``."""
    sizes = [count * width for count, width in zip(row_counts, widths)]
    if flat.dim() != 1 or len(row_counts) != len(widths) or any(count < 0 for count in row_counts) or \
            sum(sizes) != flat.numel():
        raise ValueError(f"{flat.numel()} packed values (shape {list(flat.shape)}) do not split into "
                         f"{list(row_counts)} rows of widths {list(widths)}")
    if len(sizes) == 1:
        return [flat.view(row_counts[0], widths[0])]
    return [piece.view(count, width) for piece, count, width in zip(flat.split(sizes), row_counts, widths)]
