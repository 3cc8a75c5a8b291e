"""Serving an export: ``load(DIR)`` turns what ``ps-ctl export`` wrote into a local module that scores batches.

Owns reading an export (``paramserver.checkpoint.export`` writes one), from
a local directory or any fsspec URL (``s3://bucket/models/ctr``; a remote
file is read into memory once, checked, then loaded): its manifest (a
directory without one holds no export), every file checked against the size and sha256 recorded
there, the tables as local modules, and the dense module, rebuilt from
its recorded class and keyword arguments (the class is imported) or
given.  The tables pool exactly as the cluster's evaluation does (rows
read without admitting any id, then ``F.embedding_bag`` with the table's
mode): a fixed table's rows by id; a dynamic table's found by a binary
search over its sorted ids, an id without a row reading zeros, which a
``mean`` counts like any other id.  A local export's tables are
memory-mapped, not read into memory: a table larger than memory is served
from its file, its rows read as lookups need them (the page cache keeps
the hot ones).  Needs no cluster: no RPC, no process
group, no shard.

A root of live exports (``paramserver.checkpoint.live_export``: a base and deltas that a training job writes
every few steps, ``Trainer(..., export_to=URL)``) loads as its newest export; ``ServedModel.refresh()``
applies the exports written since, in place (only their changed rows are read), and ``follow(URL, every)``
keeps a model refreshed in a background thread.
"""

import datetime
import importlib
import json
import logging
import threading
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checkpoint import live_export
from .checkpoint.export import EXPORT_FORMAT, EXPORT_MANIFEST
from .checkpoint.model import EXPORT_KWARGS, ModelDescription, NotExportable
from .checkpoint.storage import FileRecord, load_tensors
from .filesystems import Location, PathOrUrl, failures_named, locate

__all__ = ["DynamicTable", "FixedTable", "Follower", "NotServable", "ServedModel", "follow", "load"]

logger = logging.getLogger(__name__)


class NotServable(ValueError):
    """An export that cannot be loaded as asked: no export there, a format this version does not read, a dense
    module that cannot be rebuilt (its class not importable here, or no keyword arguments recorded) and none
    given, or weights that do not fit the module given; the message names the export and what to do."""


def _check_ids(table: str, ids: Tensor) -> Tensor:
    """A batch's ``(bags, ids per bag)`` ids of ``table``, as int64."""
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 2:
        raise ValueError(f"table {table!r}: ids must be a (batch, bag) int64 tensor, got {ids.dtype} of shape "
                         f"{list(ids.shape)}")
    return ids.long()


class FixedTable(nn.Module):
    """A fixed table's rows (``weight``: rows x dim), pooled like ``nn.EmbeddingBag`` with ``mode``."""

    def __init__(self, name: str, weight: Tensor, mode: str):
        super().__init__()
        self.name, self.mode = name, mode
        self.register_buffer("weight", weight)

    def forward(self, ids: Tensor) -> Tensor:
        ids = _check_ids(self.name, ids)
        if ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.weight.size(0):
                raise IndexError(f"table {self.name!r}: id {low if low < 0 else high} is out of range for a table "
                                 f"of {self.weight.size(0)} rows")
        return pooled(ids, self.weight, self.mode)


def pooled(ids: Tensor, rows: Tensor, mode: str) -> Tensor:
    """The bags of ``ids`` (batch, bag) over ``rows``, pooled with ``mode``, in float32: half-precision rows
    are upcast as they are gathered (as a worker upcasts them), so the bag sums in float32."""
    if rows.dtype == torch.float16 or rows.dtype == torch.bfloat16:
        gathered = F.embedding(ids, rows).to(torch.float32)
        return gathered.sum(1) if mode == "sum" else gathered.mean(1)
    return F.embedding_bag(ids, rows, mode=mode)


class DynamicTable(nn.Module):
    """A dynamic table's rows by id (``ids`` sorted, ``rows`` in their order); an id without a row reads zeros.

    A batch's distinct ids have their rows gathered into a tensor of their own, which its bags are pooled
    over, as the cluster's evaluation pools the rows it reads: the table's tensors are only read, so they may
    be memory-mapped files (``load``: a table larger than memory stays on disk)."""

    def __init__(self, name: str, ids: Tensor, rows: Tensor, mode: str):
        super().__init__()
        self.name, self.mode = name, mode
        self.register_buffer("ids", ids)
        self.register_buffer("rows", rows)

    def replace(self, ids: Tensor, rows: Tensor) -> None:
        """Hold ``ids`` (sorted) with ``rows`` from now on."""
        self.ids, self.rows = ids, rows

    def forward(self, ids: Tensor) -> Tensor:
        ids = _check_ids(self.name, ids)
        distinct, bags = torch.unique(ids, return_inverse=True)
        gathered = self.rows.new_zeros(distinct.numel(), self.rows.size(1))
        held = self.ids.numel()
        if held and distinct.numel():
            found = torch.searchsorted(self.ids, distinct).clamp_(max=held - 1)
            hit = (self.ids[found] == distinct).nonzero().view(-1)
            gathered[hit] = self.rows.index_select(0, found[hit])
        return pooled(bags.view(ids.shape), gathered, self.mode)


class ServedModel(nn.Module):
    """An exported model: ``model(batch)`` is the logits, shape ``(batch,)``, of a ``paramserver.Batch`` (or
    anything with its ``sparse`` and ``dense``), as the trained model scored it on the cluster."""

    def __init__(self, table_names: Sequence[str], tables: Sequence[nn.Module], dense: nn.Module, step: int):
        super().__init__()
        self.table_names: List[str] = list(table_names)
        self.tables = nn.ModuleList(tables)  # a list: table names may hold characters a submodule's name may not
        self.dense = dense
        #: The training step of the checkpoint exported.
        self.step = step
        #: Where a model loaded from live exports finds newer ones (``refresh``).
        self._live: Optional["_LiveSource"] = None
        self._refresh_lock = threading.Lock()

    def refresh(self) -> bool:
        """Apply the live exports written since this model's (in place: only their changed rows are read);
        True when there were any.  A model loaded from one export directory has nothing to refresh from."""
        if self._live is None:
            raise NotServable("this model was loaded from one export, not from a root of live exports: there is "
                              "nothing to refresh it from")
        with self._refresh_lock:
            newer = live_export.chain(self._live.root, after=self._live.applied)
            if not newer:
                return False
            if newer[0].kind == "base":  # a new base: start again from it
                self._live.reset()
            for export in newer:
                dense_state = live_export.apply_export(export, self._live.rows, self._live.prefix)
                self._live.applied = export.name
            self._live.publish(self)
            self.dense.load_state_dict(dense_state)
            self.step = newer[-1].step
            return True


    def table(self, name: str) -> nn.Module:
        """The table ``name`` (``KeyError`` naming the tables there are)."""
        if name not in self.table_names:
            raise KeyError(f"no table {name!r}; the tables are {', '.join(self.table_names)}")
        return self.tables[self.table_names.index(name)]

    def pool(self, sparse: Mapping[str, Tensor]) -> Dict[str, Tensor]:
        """Every table's pooled rows, ``(batch, dim)``, for ``sparse[name]``'s ``(batch, bag)`` ids."""
        missing = [name for name in self.table_names if name not in sparse]
        if missing:
            raise ValueError(f"the batch has no ids for table{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(map(repr, missing))}; the model has {', '.join(self.table_names)}")
        return {name: table(sparse[name]) for name, table in zip(self.table_names, self.tables)}

    def forward(self, batch) -> Tensor:
        return self.dense(self.pool(batch.sparse), batch.dense)


def load(directory: PathOrUrl, dense: Optional[nn.Module] = None,
         storage_options: Optional[Mapping[str, Any]] = None) -> ServedModel:
    """The model exported into ``directory`` (a path or fsspec URL), in eval mode, on the CPU.

    A root of live exports loads as its newest export, and ``refresh()`` follows it.

    ``dense``: a module to load the dense weights into, needed when the
    export cannot rebuild one itself (its class not importable here, or
    recorded without ``export_kwargs()``).  ``storage_options``: fsspec
    options for the directory's filesystem.  ``FileNotFoundError`` when
    there is no export there, ``CorruptCheckpoint`` naming a file that
    does not match the manifest, ``StorageUnavailable`` naming the URL of
    storage that cannot be reached, ``NotServable`` for the rest.
    """
    directory = locate(directory, storage_options)
    if live_export.is_chain(directory):
        return _load_live(directory, dense)
    manifest = _manifest(directory)
    try:
        records = {entry["name"]: FileRecord.from_json(entry) for entry in manifest["files"]}
        tables = manifest["tables"]
        described_dense, step = manifest["dense"], int(manifest["step"])
        kinds = {name: (table["kind"], table["mode"], table["file"]) for name, table in tables.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise NotServable(f"{directory.join(EXPORT_MANIFEST)}: not a valid export manifest: "
                          f"{type(error).__name__}: {error}") from None

    def read(name: str, mmap: bool = False) -> Any:
        if name not in records:
            raise NotServable(f"{directory.join(EXPORT_MANIFEST)} names {name} without its size and sha256")
        return load_tensors(directory.join(name), records[name], mmap=mmap)

    modules = []
    for name, (kind, mode, file) in kinds.items():
        content = read(file, mmap=True)  # a local file's rows stay on disk, read as lookups need them
        modules.append(FixedTable(name, content["weight"], mode) if kind == "fixed"
                       else DynamicTable(name, content["ids"], content["rows"], mode))
    module = dense if dense is not None else _rebuild_dense(directory, described_dense)
    try:
        module.load_state_dict(read(described_dense["file"]))
    except RuntimeError as error:
        raise NotServable(f"{directory}: the exported dense weights do not fit the {type(module).__name__} "
                          f"{'given' if dense is not None else 'rebuilt'}: {error}") from None
    return ServedModel(list(kinds), modules, module, step).eval()


class _LiveSource:
    """Where a model loaded from live exports refreshes from: the root, the last export applied, and every
    table's rows as the exports left them."""

    def __init__(self, root: Location, model: ModelDescription):
        self.root, self.model, self.prefix = root, model, model.prefix
        self.applied: Optional[str] = None
        self.reset()

    def reset(self) -> None:
        self.rows = {name: live_export.TableRows(name, shape.embedding_dim, shape.num_embeddings, shape.dtype)
                     for name, shape in self.model.tables.items()}

    def modules(self) -> List[nn.Module]:
        return [FixedTable(name, rows.weight, self.model.tables[name].mode) if not rows.dynamic
                else DynamicTable(name, rows.ids, rows.rows, self.model.tables[name].mode)
                for name, rows in self.rows.items()]

    def publish(self, served: ServedModel) -> None:
        """Hand the tables' rows to ``served``'s modules."""
        for name, rows in self.rows.items():
            table = served.table(name)
            if rows.dynamic:
                table.replace(rows.ids, rows.rows)
            else:
                table.weight = rows.weight


def _load_live(root: Location, dense: Optional[nn.Module]) -> ServedModel:
    exports = live_export.chain(root)
    if not exports:
        raise FileNotFoundError(f"no committed live export in {root}: it has no base export with its "
                                f"{live_export.MANIFEST}")
    try:
        model = ModelDescription.from_dense_part(exports[0].manifest, str(exports[0].directory))
    except NotExportable as error:
        raise NotServable(str(error)) from None
    source = _LiveSource(root, model)
    dense_state = None
    for export in exports:
        dense_state = live_export.apply_export(export, source.rows, source.prefix)
        source.applied = export.name
    module = dense if dense is not None else _rebuild_dense(root, {"class": model.dense_class,
                                                                  "kwargs": model.dense_kwargs})
    try:
        module.load_state_dict(dense_state)
    except RuntimeError as error:
        raise NotServable(f"{root}: the exported dense weights do not fit the {type(module).__name__} "
                          f"{'given' if dense is not None else 'rebuilt'}: {error}") from None
    served = ServedModel(list(source.rows), source.modules(), module, exports[-1].step).eval()
    served._live = source
    return served


class Follower:
    """Refreshes ``model`` from its live exports every ``every`` in a background thread until ``stop()``; a
    refresh that fails is logged and tried again next time."""

    def __init__(self, model: ServedModel, every: datetime.timedelta):
        if every.total_seconds() <= 0:
            raise ValueError(f"every must be positive, got {every}")
        self.model, self.every = model, every
        self.refreshes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serving-follow", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every.total_seconds()):
            try:
                if self.model.refresh():
                    self.refreshes += 1
                    logger.info("serving model refreshed to step %d", self.model.step)
            except Exception as error:  # noqa: BLE001 - serving goes on with the model it has
                logger.warning("serving model not refreshed (tried again in %.0f s): %s: %s",
                               self.every.total_seconds(), type(error).__name__, error)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def follow(root: PathOrUrl, every: datetime.timedelta = datetime.timedelta(minutes=1),
           dense: Optional[nn.Module] = None, storage_options: Optional[Mapping[str, Any]] = None) -> Follower:
    """``load(root)`` kept refreshed every ``every`` (``Follower``: its ``model`` is the one to serve with)."""
    return Follower(load(root, dense, storage_options), every)


def _manifest(directory: Location) -> Dict[str, Any]:
    path = directory.join(EXPORT_MANIFEST)
    if not directory.is_local:
        directory.fs.invalidate_cache()  # an export written since this process last looked
    try:
        with failures_named(path, "read the export"):
            text = path.fs.cat_file(path.path)
    except (FileNotFoundError, IsADirectoryError):
        raise FileNotFoundError(f"no export in {directory}: it has no {EXPORT_MANIFEST} (ps-ctl export writes one, "
                                "last)") from None
    try:
        manifest = json.loads(text)
        version = manifest["format"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise NotServable(f"{path}: not a valid export manifest: {type(error).__name__}: {error}") from None
    if version != EXPORT_FORMAT:
        raise NotServable(f"{path}: export format {version}; this version of paramserver reads {EXPORT_FORMAT}")
    return manifest


def _rebuild_dense(directory: Location, described: Mapping[str, Any]) -> nn.Module:
    """The dense module built again from its recorded class and keyword arguments."""
    reference, kwargs = described["class"], described["kwargs"]
    module_name, _, qualname = reference.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as error:
        raise NotServable(f"{directory}: the dense module's class {reference} cannot be imported here "
                          f"({type(error).__name__}: {error}); pass dense=<a {qualname} built as in training> "
                          "to serving.load") from None
    if kwargs is None:
        raise NotServable(f"{directory}: the dense module {reference} was exported without its constructor's "
                          f"arguments (it has no {EXPORT_KWARGS}() method); pass dense=<a {qualname} built as in "
                          "training> to serving.load")
    return found(**kwargs)
