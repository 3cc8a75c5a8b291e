"""Writing a shard's part of a checkpoint from its ``ShardState``.

Owns copying what a shard serves into ``shard-<name>.pt`` (the format is
``paramserver.checkpoint.shard_part``'s): every shared table hosted in the
state, each parameter with an optimizer copied together with its state
between two steps (under its locks), a dynamic table's part as its entry
(the rows held, by id, with their state), and each optimizer's ledger (the
last step applied per pusher).  Under the same locks each optimizer's mark
goes into the shard's push log (which begins a new segment first), and
the log is cut when the checkpoint commits (``committed``).  A trainer asks
for it by RPC (``service.write_checkpoint_part``) while its trainer group is
paused at a step boundary.  Plain functions of a state: nothing here knows
of RPC.
"""

import logging
from typing import Dict

from ...checkpoint.shard_part import FORMAT, part_name
from ...checkpoint.storage import FileRecord, save_tensors
from ...filesystems import Location
from .push_log import checkpoint_key
from .state import ShardState

logger = logging.getLogger(__name__)


def write_part(shard_state: ShardState, directory: Location, shard: str) -> FileRecord:
    """Every shared table hosted in ``shard_state``, with its optimizer state, into ``directory/shard-<shard>.pt``."""
    tables = shard_state.shared_tables()
    entries: Dict[str, Dict] = {}
    ledgers: Dict[str, Dict[str, int]] = {}
    log = shard_state.push_log
    key = checkpoint_key(directory.path)
    if log is not None:
        log.rotate()
    # Parameters with an optimizer: value and state copied together, under its locks (a dynamic table's come
    # as its entry: the rows held, by id, with their state).
    for optimizer in shard_state.optimizers():
        def at_the_copy(optimizer=optimizer) -> None:  # under the optimizer's locks
            if log is not None:
                log.append_mark(optimizer.tag, key)
            ledgers[str(optimizer.tag)] = {str(pusher): step for pusher, step in optimizer.ledger_locked().items()}
        values, state = optimizer.snapshot(at_the_copy)
        for index, (param, value) in enumerate(zip(optimizer.params, values)):
            name = shard_state.name_of(param)
            if name in tables and name not in entries:
                entries[name] = value if isinstance(value, dict) else \
                    {"value": value, "optimizer": optimizer.class_name, "state": state.get(index, {})}
    shard_state.flush_log()
    for name, table in tables.items():  # no optimizer (yet): the values alone
        if name not in entries:
            dynamic = shard_state.dynamic_rows(table)
            entries[name] = dynamic.checkpoint_entry() if dynamic is not None else \
                {"value": table.detach().clone(), "optimizer": "", "state": {}}
    record = save_tensors(directory / part_name(shard), {"format": FORMAT, "shard": shard, "tables": entries,
                                                         "ledgers": ledgers})
    logger.info("checkpoint part %s written: %d table ranges, %.1f MB", record.name, len(entries), record.bytes / 1e6)
    return record


def committed(shard_state: ShardState, checkpoint: str) -> None:
    """Checkpoint ``checkpoint`` (its directory or URL) committed: the push log keeps only what came after it."""
    if shard_state.push_log is not None:
        shard_state.push_log.committed(checkpoint_key(checkpoint))
