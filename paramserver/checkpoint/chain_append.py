"""Appending a committed checkpoint to a chain of live exports: ``ps-ctl export DIR --delta``.

Owns turning a checkpoint into the next link of the chain under a root (``live_export``'s format, which
``serving.load`` and ``refresh()`` read): a base holding every row when the root has no chain yet (or one of
another model), else a delta holding only what differs from what the chain serves now: a fixed table's rows
whose values changed, a dynamic table's ids new or changed and the ids it no longer holds, and the dense
part.  The chain's rows are read back and compared with the checkpoint's (no shard needs to have kept
marks), so the delta's size grows with the rows changed, not with the tables; reading both costs time in
the tables' size.  It writes one part file, naming each table as one shard hosting it whole would
(``live_export.TableRows`` applies it like any shard's part), then the manifest last.

A running job that exports its own chain (``ps-server --export-dir``) links each of its deltas to its own
previous export: append to a root no job exports to live, or a chain would fork.
"""

import logging
import secrets
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from ..filesystems import locate
from ..tables import part_name
from . import live_export
from .export import CheckpointModel, read_model
from .model import ModelDescription, NotExportable
from .storage import PathLike, range_name

logger = logging.getLogger(__name__)

#: The name the part file of an appended export is written under (``part-<this>.pt``).
PART_WRITER = "checkpoint"


def append_checkpoint(checkpoint: PathLike, root: PathLike,
                      storage_options: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Append the model of ``checkpoint`` (a checkpoint directory, or a root of them: its newest valid one) to the
    chain under ``root`` (both paths or fsspec URLs); returns the manifest written, with ``"name"`` (the export's),
    ``"checkpoint"``, ``"changed_rows"`` and ``"rows"`` added (rows written, rows the model holds).  Errors as
    ``export.export_checkpoint``'s."""
    model = read_model(checkpoint, storage_options)
    out = locate(root, storage_options)
    links = live_export.chain(out)
    previous = _served_rows(links, model.description) if links else None
    entries = dict(table_entry(model, name, None if previous is None else previous[name])
                   for name in model.description.tables)
    kind = "base" if previous is None else "delta"
    step = model.checkpoint.step
    name = live_export.export_name(step, secrets.token_hex(4))
    directory = out.join(name)
    files = [live_export.write_tensors(directory.join(live_export.part_file(PART_WRITER)),
                                       {"format": 1, "shard": PART_WRITER, "tables": entries}),
             live_export.write_tensors(directory.join(live_export.DENSE_FILE), model.dense_state)]
    manifest = live_export.commit(directory, kind=kind, step=step,
                                  previous=links[-1].name if kind == "delta" else None,
                                  base=links[0].name if kind == "delta" else name,
                                  model=model.record, files=files)
    changed = sum(int(entry["values"].size(0)) for entry in entries.values())
    held = sum(int(content["ids"].numel() if "ids" in content else content["weight"].size(0))
               for content in model.tables.values())
    logger.info("appended checkpoint %s (step %d) to %s as a %s: %d of %d rows, %.1f MB", model.checkpoint.path,
                step, directory, kind, changed, held, sum(record.bytes for record in files) / 1e6)
    return dict(manifest, name=name, checkpoint=str(model.checkpoint.path), changed_rows=changed, rows=held)


def _served_rows(links, model: ModelDescription) -> Optional[Dict[str, live_export.TableRows]]:
    """Every table's rows as the chain ``links`` serves them, or ``None`` when the chain is of another model
    (its tables differ: the next link is a base)."""
    try:
        served = ModelDescription.from_dense_part(links[0].manifest, str(links[0].directory))
    except NotExportable as error:
        logger.warning("%s; a base is written", error)
        return None
    if served.tables != model.tables or served.prefix != model.prefix:
        logger.warning("the chain under %s is of another model (tables %s, this checkpoint's %s): a base is written",
                       links[0].directory.parent(), sorted(served.tables), sorted(model.tables))
        return None
    rows = {name: live_export.TableRows(name, shape.embedding_dim, shape.num_embeddings, shape.dtype)
            for name, shape in model.tables.items()}
    for link in links:
        live_export.apply_export(link, rows, model.prefix)
    return rows


def table_entry(model: CheckpointModel, name: str,
           served: Optional[live_export.TableRows]) -> Tuple[str, Dict[str, Any]]:
    """Table ``name``'s entry, and the name one shard hosting it whole would file it under: every row
    (``served`` None), or what differs from ``served``."""
    shape, content = model.description.tables[name], model.tables[name]
    shard_name = model.description.shard_name(name)
    nothing = torch.zeros(0, dtype=torch.int64)
    if not shape.dynamic:
        weight, key = content["weight"], range_name(shard_name, 0, shape.num_embeddings)
        if served is None:
            return key, {"whole": True, "rows": nothing, "values": weight}
        rows = (weight != served.weight).any(dim=1).nonzero().view(-1)
        return key, {"whole": False, "rows": rows, "values": weight.index_select(0, rows)}
    ids, values, key = content["ids"], content["rows"], part_name(shard_name, 0, 1)
    if served is None:
        return key, {"dynamic": True, "whole": True, "ids": ids, "values": values, "evicted": nothing}
    # Both sorted: where each id of the checkpoint sits among the served ones.
    at = torch.searchsorted(served.ids, ids).clamp(max=max(served.ids.numel() - 1, 0))
    known = (served.ids.index_select(0, at) == ids) if served.ids.numel() else torch.zeros(ids.shape, dtype=torch.bool)
    same = known.clone()
    same[known] = (served.rows.index_select(0, at[known]) == values[known]).all(dim=1)
    changed = (~same).nonzero().view(-1)
    return key, {"dynamic": True, "whole": False, "ids": ids.index_select(0, changed),
                 "values": values.index_select(0, changed), "evicted": served.ids[~torch.isin(served.ids, ids)]}
