"""``RowLayout``: how one row, its last touch and its optimizer state are laid out as one record of bytes.

Owns packing rows into records and records back into rows, for a row store's
engine (``engine``), which never reads inside a record.  A record is the row's
last touch (int64), then its values (the table's type), then one row of each
of the optimizer's state tensors that has rows (its record's declared state:
``element`` rows of the width, ``row`` values, ``row_flag`` bytes; ``scalar``
state is the table's, never a row's), in the optimizer's order.  A record
written before the table had optimizer state has none (``has_state`` False in
the layout it was written with): its rows' state starts at its initial values.
"""

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch
from torch import Tensor

_TOUCH_BYTES = 8


def _own(columns: Tensor) -> Tensor:
    """``columns`` (uint8 ``[n, k]``, some bytes of each record) copied into memory of their own, where a wider type
    may view them.  ``contiguous()`` would not do: the bytes of one record are contiguous to torch already,
    however long the record, so they stay a view whose stride and offset the wider type may not divide."""
    return torch.empty(columns.shape, dtype=torch.uint8).copy_(columns)


@dataclass(frozen=True)
class RowPart:
    """One tensor's row in a record: its shape past the first dimension and its type."""

    shape: Tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty(0, dtype=self.dtype).element_size()

    @classmethod
    def of(cls, tensor: Tensor) -> "RowPart":
        return cls(tuple(tensor.shape[1:]), tensor.dtype)


@dataclass(frozen=True)
class RowLayout:
    """A record: last touch, then ``value`` (the row), then each of ``state`` (the optimizer's rows)."""

    value: RowPart
    state: Tuple[RowPart, ...] = ()
    #: What the first state kind's rows are kept multiplied by (an optimizer that keeps its state scaled:
    #: ``FunctionalQHM.buffer_scale``; 1 for the others).
    scale: float = 1.0

    @property
    def has_state(self) -> bool:
        return bool(self.state)

    @property
    def record_bytes(self) -> int:
        return _TOUCH_BYTES + self.value.nbytes + sum(part.nbytes for part in self.state)

    @classmethod
    def of(cls, value: Tensor, state: Sequence[Tensor] = (), scale: float = 1.0) -> "RowLayout":
        """The layout of rows of ``value`` (a table's rows) and ``state`` (the state tensors with rows, the
        first kept multiplied by ``scale``)."""
        return cls(RowPart.of(value), tuple(RowPart.of(tensor) for tensor in state), scale)

    def pack(self, touches: Tensor, values: Tensor, state: Sequence[Tensor]) -> Tensor:
        """Records (uint8 ``[n, record_bytes]``) of ``n`` rows: ``touches`` (any integer type), ``values`` and
        ``state`` (rows of this layout's parts, in order)."""
        if len(state) != len(self.state):
            raise ValueError(f"a record holds {len(self.state)} state rows; {len(state)} given")
        count = values.size(0)
        pieces = [touches.to(torch.int64).contiguous().view(torch.uint8).view(count, _TOUCH_BYTES)]
        for part, rows in zip((self.value, *self.state), (values, *state)):
            if tuple(rows.shape[1:]) != part.shape or rows.dtype != part.dtype or rows.size(0) != count:
                raise ValueError(f"rows of shape {list(rows.shape)} {rows.dtype} do not fit a record's part of "
                                 f"{list(part.shape)} {part.dtype} for {count} rows")
            pieces.append(rows.contiguous().view(torch.uint8).view(count, part.nbytes) if part.nbytes else
                          torch.empty(count, 0, dtype=torch.uint8))
        return torch.cat(pieces, dim=1)

    def unpack(self, records: Tensor) -> Tuple[Tensor, Tensor, List[Tensor]]:
        """``(touches int64 [n], values, state rows)`` of ``records`` (uint8 ``[n, record_bytes]``)."""
        if records.dim() != 2 or records.size(1) != self.record_bytes or records.dtype != torch.uint8:
            raise ValueError(f"records of shape {list(records.shape)} {records.dtype}; this layout's are "
                             f"[n, {self.record_bytes}] uint8")
        count = records.size(0)
        touches = _own(records[:, :_TOUCH_BYTES]).view(torch.int64).view(count)
        start, rows = _TOUCH_BYTES, []
        for part in (self.value, *self.state):
            stop = start + part.nbytes
            rows.append(_own(records[:, start:stop]).view(part.dtype).view(count, *part.shape))
            start = stop
        return touches, rows[0], rows[1:]
