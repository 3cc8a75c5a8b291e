"""Checkpoints: sharded, atomic, verified; their files, formats and records, and exports.

A leaf: it imports nothing of the package but ``filesystems``, ``logs``,
``tables`` and ``_torch_compat``, and knows no process, collective nor
RPC.  Every path it takes may be an fsspec URL (``s3://bucket/prefix``).
Modules: ``storage`` (files written whole with sizes and sha256s, the
manifest written last as the commit, the store of checkpoints, refusing corrupt ones by file name,
cutting row ranges for resharding), ``records`` (the plain records
checkpoints are exchanged in: ``CheckpointSettings``,
``CheckpointCommit``, ``CheckpointFailure``), ``shard_part`` (a shard's
part: its format; and ``CheckpointSource``, what a restarted or resharded
shard or an export reads from), ``dense_part`` (the trainers' part: its
format, writing and reading it), ``model`` (the model's description in
the dense part), ``export`` (a checkpoint's model as plain files), ``live_export`` (the chain of a base and
deltas that serving follows) and ``chain_append`` (a checkpoint appended to such a chain).
Who writes when: the shard service (``paramserver.shards.server``),
trainer group 0 (``paramserver.train.checkpoints``), and the coordinator,
which commits (``paramserver.control.checkpoints``).
"""

from .records import CheckpointCommit, CheckpointFailure, CheckpointSettings
from .storage import (CHECKPOINT_PREFIX, MANIFEST, Checkpoint, CheckpointStore, CorruptCheckpoint, FileRecord,
                      StorageUnavailable, assemble_rows, atomic_write, load_tensors, open_checkpoint,
                      parse_range_name, range_name, read_manifest, save_tensors, tensors_on_cpu,
                      verify_file)

__all__ = ["CHECKPOINT_PREFIX", "MANIFEST", "Checkpoint", "CheckpointCommit", "CheckpointFailure",
           "CheckpointSettings", "CheckpointStore", "CorruptCheckpoint", "FileRecord", "StorageUnavailable",
           "assemble_rows", "atomic_write", "load_tensors", "open_checkpoint", "parse_range_name", "range_name",
           "read_manifest", "save_tensors", "tensors_on_cpu", "verify_file"]
