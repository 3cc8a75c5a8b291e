"""Exporting the trained model of a checkpoint as plain files that need no cluster, nor paramserver, to load.

Owns writing an export directory from a committed checkpoint (given by
its directory, or by a root: its newest valid checkpoint), or from a live
cluster (a checkpoint asked for and waited for, then exported).  The
checkpoint's files are verified against its manifest first (sha256); the
model's description in its dense part (``model``) says which tables to
take and how to rebuild the dense module.  An export holds::

    export.json           the manifest, written last (a directory without it holds no export)
    dense.pt              the dense module's state_dict
    table-<i>-<name>.pt   a fixed table: {"weight": (rows, dim)}, whole however the shards split it;
                          a dynamic table: {"ids": (n,) int64, sorted; "rows": (n, dim)}

The directory may be any path or fsspec URL (``s3://bucket/models/ctr``):
its files are written first and ``export.json`` last, so that on an object
store (no rename) a reader never takes a half-written export for one; an
earlier export's manifest there is removed before its files are replaced.
Every ``.pt`` file loads with ``torch.load(path, weights_only=True)``;
``export.json`` gives the step, every table's kind, dim, mode and rows,
the dense module's class (``module:qualname``) and constructor keyword
arguments, and every file's size and sha256.  Each file is written
atomically (``storage``).  Loading an export as a module is
``paramserver.serving``'s business.
"""

import datetime
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

import torch

from ..filesystems import Location, failures_named, locate
from .model import ModelDescription, NotExportable, dtype_name
from .shard_part import CheckpointSource
from .storage import Checkpoint, PathLike, atomic_write, open_checkpoint, range_name, save_tensors
from .dense_part import read_dense_part

logger = logging.getLogger(__name__)

EXPORT_MANIFEST = "export.json"
EXPORT_FORMAT = 1
DENSE_FILE = "dense.pt"
#: How long ``export_from_cluster`` waits for the checkpoint it asks for, unless told.
CHECKPOINT_TIMEOUT = datetime.timedelta(seconds=120)

__all__ = ["CHECKPOINT_TIMEOUT", "DENSE_FILE", "EXPORT_FORMAT", "EXPORT_MANIFEST", "NotExportable",
           "export_checkpoint", "export_from_cluster", "table_file"]


def table_file(index: int, table: str) -> str:
    """The file of the ``index``-th table of an export (any character of its name unfit for a file name is
    written ``_``; the index keeps names apart)."""
    return f"table-{index}-{re.sub(r'[^A-Za-z0-9_.-]', '_', table)}.pt"


def export_checkpoint(checkpoint: PathLike, out: PathLike,
                      storage_options: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Export the model of ``checkpoint`` (a checkpoint directory, or a root: its newest valid checkpoint) into
    the directory ``out`` (made if missing; an earlier export there is replaced); returns the manifest.  Either
    may be a path or an fsspec URL; ``storage_options`` configure the filesystem of both (a ``Location`` for
    either brings its own).

    ``FileNotFoundError`` when there is no committed checkpoint there, ``CorruptCheckpoint`` naming a file that
    does not verify, ``NotExportable`` when the checkpoint has no model description or lacks a table's rows,
    ``FileExistsError`` when ``out`` holds other files and no export, ``StorageUnavailable`` naming the URL of
    storage that cannot be reached.
    """
    read = read_model(checkpoint, storage_options)
    source, model = read.checkpoint, read.description
    out = _export_directory(locate(out, storage_options))
    records = [save_tensors(out / DENSE_FILE, read.dense_state)]
    described = {}
    for index, (name, content) in enumerate(read.tables.items()):
        shape = model.tables[name]
        records.append(save_tensors(out / table_file(index, name), content))
        rows = content["ids"].numel() if shape.dynamic else shape.num_embeddings
        described[name] = {"kind": "dynamic" if shape.dynamic else "fixed", "dim": shape.embedding_dim,
                           "mode": shape.mode, "rows": rows, "dtype": dtype_name(shape.dtype),
                           "file": records[-1].name}
    manifest = {"format": EXPORT_FORMAT, "step": source.step, "checkpoint": str(source.path),
                "created_unix": time.time(),
                "dense": {"class": model.dense_class, "kwargs": model.dense_kwargs, "file": DENSE_FILE},
                "tables": described, "files": [record.to_json() for record in records]}
    atomic_write(out / EXPORT_MANIFEST, lambda file: file.write(json.dumps(manifest, indent=1).encode()))
    logger.info("exported checkpoint %s (step %d) to %s: %d tables, %.1f MB", source.path, source.step, out,
                len(described), sum(record.bytes for record in records) / 1e6)
    return manifest


@dataclass(frozen=True)
class CheckpointModel:
    """A committed checkpoint's model, read whole: its description, its dense state_dict, and every table's
    rows as an export holds them (a fixed table: ``{"weight"}``; a dynamic one: ``{"ids"}`` sorted and
    ``{"rows"}``), in the description's order."""

    checkpoint: Checkpoint
    description: ModelDescription
    #: The description as the checkpoint recorded it (``model.describe_model``'s dict).
    record: Dict[str, Any]
    dense_state: Dict[str, Any]
    tables: Dict[str, Dict[str, torch.Tensor]]


def read_model(checkpoint: PathLike, storage_options: Optional[Mapping[str, Any]] = None) -> CheckpointModel:
    """The model of ``checkpoint`` (a checkpoint directory, or a root: its newest valid checkpoint), its files
    verified first; ``NotExportable`` when it has no model description or lacks a table's rows."""
    source = open_checkpoint(locate(checkpoint, storage_options))
    dense = read_dense_part(source)
    model = ModelDescription.from_dense_part(dense, str(source.path))
    parts = CheckpointSource(source, verified=True)
    held = parts.table_names()
    missing = [name for name in model.tables if model.shard_name(name) not in held]
    if missing:
        raise NotExportable(f"checkpoint {source.path} holds no rows of table{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(map(repr, missing))} (named {', '.join(model.shard_name(n) for n in missing)}"
                            f" on the shards) that its model describes")
    tables = {}
    for name, shape in model.tables.items():
        if shape.dynamic:
            part = parts.dynamic_part(model.shard_name(name), 0, 1)  # every shard's rows, as one shard's
            ids, order = torch.sort(part["ids"])
            tables[name] = {"ids": ids, "rows": part["values"].index_select(0, order)}
        else:
            tables[name] = {"weight": parts.rows(range_name(model.shard_name(name), 0, shape.num_embeddings),
                                                 shape.num_embeddings, shape.embedding_dim, shape.dtype)}
    return CheckpointModel(source, model, dict(dense["model"]), dense["module"], tables)


def export_from_cluster(client, out: PathLike, timeout: datetime.timedelta = CHECKPOINT_TIMEOUT,
                        storage_options: Optional[Mapping[str, Any]] = None,
                        write: Optional[Callable[..., Dict[str, Any]]] = None) -> Dict[str, Any]:
    """Ask the cluster ``client`` (a ``paramserver.control.CoordinatorClient``) talks to for a checkpoint, wait
    until it is committed (up to ``timeout``: ``CoordinatorError`` when it is not), and export it into ``out``
    (``write(checkpoint, out, storage_options)``: ``export_checkpoint``, or ``chain_append.append_checkpoint``).

    The checkpoint is read where the cluster wrote it: its ``--checkpoint-dir`` must be reachable from here at
    the same path or URL (this host, a shared file system, or the same object store: ``storage_options``)."""
    written = client.checkpoint(timeout.total_seconds())
    return (write or export_checkpoint)(written.directory, out, storage_options)


def _export_directory(out: Location) -> Location:
    """``out``, made if missing, with an earlier export's manifest removed (until the new one is written)."""
    fs, manifest = out.fs, out.join(EXPORT_MANIFEST)
    if not out.is_local:
        fs.invalidate_cache()
    with failures_named(out, "export"):
        if fs.isfile(out.path):
            raise NotADirectoryError(f"cannot export to {out}: not a directory")
        if out.is_local:
            fs.makedirs(out.path, exist_ok=True)
        held = fs.ls(out.path, detail=False) if fs.isdir(out.path) else []
        if not manifest.exists() and held:
            raise FileExistsError(f"cannot export to {out}: it holds other files and no export ({EXPORT_MANIFEST}); "
                                  "give a new or empty directory, or an earlier export's")
        if manifest.exists():
            fs.rm(manifest.path)
    return out
