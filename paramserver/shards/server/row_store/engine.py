"""What a row store's engine is: records of one size, keyed by int64 ids, in files under one folder.

Owns the contract every engine keeps (``RowStoreEngine``) and nothing an
engine does.  A record is the bytes of one row and its optimizer state, laid
out by its table's optimizer record; the engine never reads inside one.

- ``put(ids, records)``: ``ids`` int64 ``[n]``, distinct; ``records`` uint8
  ``[n, record_bytes]``, contiguous.  Each id's record replaces the one it had.
  A record put is seen by every later ``get`` at once, though the engine may
  write it to its files in the background.
- ``get(ids, out)``: ``out`` uint8 ``[n, record_bytes]``, contiguous; each id
  held has its record copied into its row of ``out``; returns a bool ``[n]``
  tensor, True where an id was held (the other rows of ``out`` are left as
  they were).  Reads in parallel, without the GIL.
- ``delete(ids)``: the ids are no longer held (ids not held are ignored).
- ``scan(batch)``: every id held and its record, in batches of at most
  ``batch`` rows (memory bounded by one batch), as ``(ids, records)`` pairs.
- ``flush()``: every record put is in the files.
- ``stats()``: counters (``ENGINE_STATS``), since the engine was opened.
- ``close(remove=False)``: closes the files; ``remove`` deletes the folder.

Disk space stays bounded: records replaced or deleted are reclaimed by the
engine's compaction.
"""

import pathlib
from typing import Dict, Iterator, Protocol, Tuple

from torch import Tensor

#: The counters every engine's ``stats()`` gives: rows held, bytes of its files on disk, records and bytes
#: read (``get``: found ones) and written (``put``), compactions run.
ENGINE_STATS = ("rows", "disk_bytes", "reads", "read_bytes", "writes", "written_bytes", "compactions")


class RowStoreEngine(Protocol):
    """Records of ``record_bytes`` bytes keyed by int64 ids, in files under ``folder``."""

    folder: pathlib.Path
    record_bytes: int

    def put(self, ids: Tensor, records: Tensor) -> None: ...

    def get(self, ids: Tensor, out: Tensor) -> Tensor: ...

    def delete(self, ids: Tensor) -> None: ...

    def scan(self, batch: int) -> Iterator[Tuple[Tensor, Tensor]]: ...

    def flush(self) -> None: ...

    def stats(self) -> Dict[str, int]: ...

    def close(self, remove: bool = False) -> None: ...
