"""Writing a shard's part of a live export (``paramserver.checkpoint.live_export``) from its ``ShardState``.

Owns copying what changed of every shared table hosted here since the last export took it (``changes``:
the rows marked by pushes and steps, a dynamic part's new rows and evicted ids), or all of it for a base
export, into ``part-<shard>.pt`` at an export's directory (local or any fsspec URL).  Each table is copied
under its own lock, so pushes go on between tables; a row updated while the part is written is in this
export and, marked again, in the next.  When writing fails, what was taken is given back: the next export
carries it.  A trainer asks for it by RPC (``service.write_export_part``).  Plain functions of a state.
"""

import logging
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ...checkpoint.live_export import part_file, write_tensors
from ...checkpoint.storage import FileRecord
from ...filesystems import locate
from .changes import Changes
from .state import ShardState

logger = logging.getLogger(__name__)


def write_export_part(shard_state: ShardState, directory: str, storage_options: Optional[Mapping[str, Any]],
                      shard: str, whole: bool) -> FileRecord:
    """Every shared table hosted in ``shard_state``, whole or as changed since the last export, into
    ``directory/part-<shard>.pt``."""
    entries: Dict[str, Dict] = {}
    taken: List[Tuple[torch.Tensor, Changes]] = []
    try:
        for name, table in shard_state.shared_tables().items():
            with shard_state.lock_for(table)[1]:
                marks = shard_state.row_marks(table)
                changes = marks.take()
                taken.append((table, changes))
                if whole:
                    changes.whole = True
                dynamic = shard_state.dynamic_rows(table)
                if dynamic is not None:
                    entries[name] = dynamic.export_entry_locked(changes)
                elif changes.whole:
                    entries[name] = {"whole": True, "rows": torch.zeros(0, dtype=torch.int64),
                                     "values": table.detach().clone()}
                else:
                    entries[name] = {"whole": False, "rows": changes.rows,
                                     "values": table.detach().index_select(0, changes.rows)}
        location = locate(directory, storage_options).join(part_file(shard))
        record = write_tensors(location, {"format": 1, "shard": shard, "tables": entries})
    except BaseException:
        for table, changes in taken:
            with shard_state.lock_for(table)[1]:
                shard_state.row_marks(table).give_back(changes)
        raise
    rows = sum(int(entry["values"].size(0)) for entry in entries.values())
    logger.info("export part %s written: %d table ranges, %d rows%s, %.1f MB", record.name, len(entries), rows,
                " (whole)" if whole else "", record.bytes / 1e6)
    return record
