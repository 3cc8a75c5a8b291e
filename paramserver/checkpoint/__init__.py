"""Checkpoints: sharded, atomic, verified; what each role writes into one, and starting again from one.

Modules: ``storage`` (atomic files with sizes and sha256s, the manifest
written last, the store of checkpoints, refusing corrupt ones by file
name, cutting row ranges for resharding; it knows no process nor
protocol), ``shard_part`` (a shard's part: its tables' rows with their
optimizer state, written from the shard's ``ShardState``; and
``CheckpointSource``, what a restarted or resharded shard restores from)
and ``trainer`` (trainer group 0's side: when it writes, the dense part
and data positions, committing at the coordinator; the restore point).
The coordinator's side is ``paramserver.control.checkpoints``.
"""

from .storage import (CHECKPOINT_PREFIX, MANIFEST, Checkpoint, CheckpointStore, CorruptCheckpoint, FileRecord,
                      assemble_rows, atomic_write, load_tensors, open_checkpoint, parse_range_name, range_name,
                      read_manifest, save_tensors, verify_file)

__all__ = ["CHECKPOINT_PREFIX", "MANIFEST", "Checkpoint", "CheckpointStore", "CorruptCheckpoint", "FileRecord",
           "assemble_rows", "atomic_write", "load_tensors", "open_checkpoint", "parse_range_name", "range_name",
           "read_manifest", "save_tensors", "verify_file"]
