"""Large tensors of dynamic tables on transparent huge pages, where the system offers them.

Owns asking Linux to back a new, large tensor with 2 MiB pages
(``madvise(MADV_HUGEPAGE)`` on its memory before anything touches it).  A
dynamic table's lookup reads an id's bucket in the index, writes its
touch and reads its row: three or four random places in a gigabyte or
more.  With 4 KiB pages nearly each one also misses the processor's
address translation cache (TLB) and walks the page tables; with 2 MiB
pages a few thousand TLB entries cover the whole table.

Hosts whose transparent huge pages are ``always`` need nothing; those
set to ``madvise`` (common) need this call; ``never``, other systems, or
a refused call leave ordinary pages, with the same results.  Only
tensors of at least ``MIN_BYTES`` are advised: the advice covers whole
2 MiB pages inside the tensor's memory.  A ``HugePages`` object makes
them; its owner (a ``ShardState``) hands it to the tables it hosts.
"""

import ctypes
import ctypes.util
import sys
import threading
from typing import Sequence

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
#: Smaller tensors keep ordinary pages (the TLB covers them well enough).
MIN_BYTES = 8 * HUGE_PAGE
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


class HugePages:
    """Large tensors asked onto huge pages, for one owner (a ``ShardState`` has one); libc's ``madvise`` is
    looked up on first use, once (none off Linux or without it).  Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._looked_up = False
        self._madvise = None

    def _madvise_call(self):
        with self._lock:
            if not self._looked_up:
                self._looked_up = True
                if sys.platform.startswith("linux"):
                    try:
                        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                        self._madvise = libc.madvise
                        self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                        self._madvise.restype = ctypes.c_int
                    except (OSError, AttributeError):
                        self._madvise = None
            return self._madvise

    def advise(self, tensor: Tensor) -> bool:
        """Ask for huge pages under the whole 2 MiB pages of ``tensor``'s memory; whether the system took it.
        Only pages not yet touched get them, so call it on a new tensor before writing to it."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < MIN_BYTES or tensor.device.type != "cpu":
            return False
        madvise = self._madvise_call()
        if madvise is None:
            return False
        start = -(-tensor.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        length = (tensor.data_ptr() + nbytes - start) // HUGE_PAGE * HUGE_PAGE
        return length > 0 and madvise(start, length, _MADV_HUGEPAGE) == 0

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """``torch.empty(shape, dtype=dtype)``, advised onto huge pages (see ``advise``)."""
        tensor = torch.empty(tuple(shape), dtype=dtype)
        self.advise(tensor)
        return tensor

    def grown(self, tensor: Tensor, rows: int) -> Tensor:
        """A new tensor of ``rows`` rows (at least ``tensor``'s), advised onto huge pages, holding ``tensor``'s
        rows first (the rows after them are left as they are)."""
        result = self.empty((rows,) + tuple(tensor.shape[1:]), tensor.dtype)
        result[:tensor.size(0)].copy_(tensor)
        return result
