"""Live exports: a chain of a base and deltas under one root (local or any fsspec URL) that serving follows.

Owns the format and its reading and writing, none of the cluster: a training job writes an export every
few steps (``paramserver.train.live_exports``), each shard its own part (``shards.server.export_part``),
and serving reads the chain (``paramserver.serving``).  Under ``root``::

    <step, 12 digits>-<writer>/   one export (``writer``: a token of the process that wrote it)
        part-<shard>.pt     what that shard hosts: per table range or dynamic table part, either all of it
                            ("whole") or the rows changed since the export before (and a dynamic part's
                            evicted ids)
        dense.pt            the dense module's state_dict
        export.json         the manifest, written LAST: an export without one is not there (object stores
                            have no atomic rename, so nothing else commits it); it names its kind ("base":
                            every part whole; "delta"), its step, the export before it ("previous") and
                            its base, the model (tables and dense class, as ``model.describe_model``), and
                            every file's size and sha256

A delta's size grows with the rows changed, not with the tables.  ``chain(root)`` is the newest base and
the deltas that follow it link by link; ``TableRows`` applies parts to a table's rows as serving holds
them.  A file that does not match its manifest is a ``CorruptCheckpoint`` naming it.

``prune(root, keep, grace)`` keeps the newest ``keep`` bases with their deltas and removes older chains
(``--keep-exports``), each one ``grace`` after the base that superseded it was committed at the earliest:
serving reads only the newest chain, so a reader that began loading a chain before it was superseded has
``grace`` to finish; the newest chain, which serving follows, is never removed.  An export's manifest is
removed first, so a reader meanwhile finds it uncommitted, never committed with files missing.
"""

import datetime
import json
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import torch

from ..filesystems import Location, failures_named
from ..tables import parse_part_name
from ..tables.id_hash import shard_of
from .storage import (CorruptCheckpoint, FileRecord, atomic_write, load_tensors, parse_range_name, remove_tree,
                      save_tensors)

logger = logging.getLogger(__name__)

LIVE_FORMAT = 2
MANIFEST = "export.json"
DENSE_FILE = "dense.pt"
PART_PREFIX = "part-"
KINDS = ("base", "delta")
#: How long a chain outside the newest ``keep`` stays after the base that superseded it was committed: a reader
#: that began loading it before then has this long to finish (``prune``).
READ_GRACE = datetime.timedelta(minutes=5)
_EXPORT_NAME = re.compile(r"^\d{12}-[0-9a-z]+$")


def export_name(step: int, writer: str) -> str:
    """The directory of the export at ``step`` by ``writer`` (a token of the process writing the chain: a job
    restarted from a checkpoint exports the same steps again, into directories of its own)."""
    return f"{step:012d}-{writer}"


def part_file(shard: str) -> str:
    return f"{PART_PREFIX}{shard}.pt"


def write_tensors(location: Location, obj: Any) -> FileRecord:
    """``torch.save(obj)`` into the file ``location`` (``storage.save_tensors``: whole or not at all), its
    directory made first where the filesystem has directories."""
    if location.is_local:
        location.fs.makedirs(location.parent().path, exist_ok=True)
    return save_tensors(location, obj)


def commit(directory: Location, *, kind: str, step: int, previous: Optional[str], base: str,
           model: Mapping[str, Any], files: Sequence[FileRecord]) -> Dict[str, Any]:
    """Write ``directory``'s manifest (last: the export exists from here on); returns it."""
    if kind not in KINDS:
        raise ValueError(f"an export's kind is one of {KINDS}, got {kind!r}")
    manifest = {"format": LIVE_FORMAT, "kind": kind, "step": step, "previous": previous, "base": base,
                "created_unix": time.time(), "model": dict(model), "files": [record.to_json() for record in files]}
    atomic_write(directory.join(MANIFEST), lambda file: file.write(json.dumps(manifest, indent=1).encode()))
    return manifest


@dataclass(frozen=True)
class LiveExport:
    """One committed export of a chain: its directory and manifest."""

    directory: Location
    manifest: Dict[str, Any]

    @property
    def name(self) -> str:
        return self.directory.name

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    def records(self) -> Dict[str, FileRecord]:
        return {entry["name"]: FileRecord.from_json(entry) for entry in self.manifest["files"]}

    def read(self, name: str) -> Any:
        records = self.records()
        if name not in records:
            raise CorruptCheckpoint(f"{self.directory.join(MANIFEST)} names no file {name}")
        return load_tensors(self.directory.join(name), records[name])

    def parts(self) -> List[str]:
        return sorted(name for name in self.records() if name.startswith(PART_PREFIX))


def is_chain(root: Location) -> bool:
    """Whether ``root`` holds live exports (directories of 12 digits) rather than being one export."""
    manifest = root.join(MANIFEST)
    with failures_named(manifest, "read the export"):
        if manifest.exists():
            return False
    return bool(_committed(root))


def _committed(root: Location) -> List[LiveExport]:
    """Every export under ``root`` with a readable manifest, in the order they were committed."""
    found = []
    try:
        with failures_named(root, "list live exports"):
            entries = root.fs.ls(root.path, detail=False)
    except FileNotFoundError:
        return []
    for path in entries:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if not _EXPORT_NAME.match(name):
            continue
        directory = root.join(name)
        try:
            with directory.join(MANIFEST).open("rb") as file:
                manifest = json.loads(file.read())
            if manifest.get("format") == LIVE_FORMAT:
                found.append(LiveExport(directory, manifest))
        except FileNotFoundError:
            continue  # not committed (being written, or its writer failed)
        except (OSError, ValueError) as error:
            logger.warning("%s: an unreadable export manifest is skipped: %s", directory.join(MANIFEST), error)
    return sorted(found, key=lambda export: (float(export.manifest.get("created_unix", 0.0)), export.step))


def chain(root: Location, after: Optional[str] = None) -> List[LiveExport]:
    """The newest base under ``root`` (the last committed: a job restarted from an older checkpoint writes a
    base of an older step, and serving follows it) and the deltas that follow it, in order (``[]``: none).

    ``after``: the name of an export already applied: only what follows it (its own chain's deltas; a newer
    base and its deltas when one was written since)."""
    if not root.is_local:
        root.fs.invalidate_cache()
    committed = _committed(root)
    bases = [export for export in committed if export.kind == "base"]
    if not bases:
        return []
    links = [bases[-1]]
    by_previous = {export.manifest.get("previous"): export for export in committed if export.kind == "delta"}
    while links[-1].name in by_previous:
        links.append(by_previous[links[-1].name])
    if after is not None:
        names = [export.name for export in links]
        if after in names:
            return links[names.index(after) + 1:]
    return links


def prune(root: Location, keep: int, grace: datetime.timedelta = READ_GRACE,
          uncommitted: Iterable[str] = (), now: Optional[float] = None) -> List[str]:
    """Keep the newest ``keep`` bases under ``root`` with their deltas (see the module's text); remove every
    older export whose base is not kept (and ``uncommitted``: names of exports whose writer failed before the
    commit), each logged in one line.  A chain is kept until ``grace`` after the base that superseded it
    was committed (``now``: this time, by default ``time.time()``).  Returns the names removed."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    if not root.is_local:
        root.fs.invalidate_cache()
    now = time.time() if now is None else now
    committed = _committed(root)
    bases = [export for export in committed if export.kind == "base"]
    kept = {export.name for export in bases[-keep:]}
    # An older base stays while the base after it is younger than the grace (a reader may be loading it).
    for older, newer in zip(bases, bases[1:]):
        if now - float(newer.manifest.get("created_unix", now)) < grace.total_seconds():
            kept.add(older.name)
    if not bases or len(kept) == len(bases):
        doomed = []
    else:
        oldest_kept = min(index for index, export in enumerate(committed) if export.name in kept)
        # (only exports committed before the oldest chain kept: one committed later is of a chain being written)
        doomed = [export for export in committed[:oldest_kept] if export.manifest.get("base") not in kept]
    removed = []
    for export in doomed:
        remove_tree(export.directory, first=MANIFEST)
        logger.info("removed live export %s (%s at step %d): its base is not among the newest %d", export.directory,
                    export.kind, export.step, keep)
        removed.append(export.name)
    for name in uncommitted:
        directory = root.join(name)
        remove_tree(directory)
        logger.info("removed live export %s: its writing failed before the commit", directory)
        removed.append(name)
    return removed


class TableRows:
    """A table's rows as serving holds them, changed by export parts: a fixed table's ``weight`` (rows x dim),
    or a dynamic table's ``ids`` (sorted) and ``rows``, in the type the table's rows are stored in."""

    def __init__(self, name: str, dim: int, num_embeddings: Optional[int], dtype: torch.dtype = torch.float32):
        self.name, self.dim = name, dim
        self.dynamic = num_embeddings is None
        self.weight = torch.zeros(0 if num_embeddings is None else num_embeddings, dim, dtype=dtype)
        self.ids = torch.zeros(0, dtype=torch.int64)
        self.rows = torch.zeros(0, dim, dtype=dtype)

    def apply(self, shard_name: str, entry: Mapping[str, Any]) -> None:
        """One part's entry (``shard_name``: the range or dynamic part it was hosted as)."""
        if not self.dynamic:
            parsed = parse_range_name(shard_name)
            if parsed is None:
                raise CorruptCheckpoint(f"table {self.name!r}: a fixed table's part is named {shard_name!r}, no "
                                        "row range")
            _, start, stop = parsed
            values = entry["values"].to(self.weight.dtype)
            if entry["whole"]:
                self.weight[start:stop] = values
            else:
                self.weight.index_copy_(0, entry["rows"] + start, values)
            return
        parsed = parse_part_name(shard_name)
        if parsed is None:
            raise CorruptCheckpoint(f"table {self.name!r}: a dynamic table's part is named {shard_name!r}")
        _, index, count = parsed
        new_ids = entry["ids"]
        drop = (shard_of(self.ids, count) == index) if entry["whole"] else \
            torch.isin(self.ids, torch.cat((entry["evicted"], new_ids)))
        keep = (~drop).nonzero().view(-1)
        ids = torch.cat((self.ids.index_select(0, keep), new_ids))
        rows = torch.cat((self.rows.index_select(0, keep), entry["values"].to(self.rows.dtype)))
        self.ids, order = torch.sort(ids)
        self.rows = rows.index_select(0, order)


def apply_export(export: LiveExport, tables: Mapping[str, TableRows], prefix: str) -> Dict[str, Any]:
    """Apply every part of ``export`` to ``tables`` (by table name; ``prefix``: how they are named on the
    shards); returns its dense state_dict."""
    for part in export.parts():
        content = export.read(part)
        for shard_name, entry in content["tables"].items():
            table = _table_of(shard_name, prefix)
            if table in tables:
                tables[table].apply(shard_name, entry)
    return export.read(DENSE_FILE)


def _table_of(shard_name: str, prefix: str) -> Optional[str]:
    parsed = parse_range_name(shard_name) or parse_part_name(shard_name)
    name = parsed[0] if parsed else shard_name
    return name[len(prefix) + 1:] if name.startswith(prefix + ".") else None
