"""The default job: a CTR-style hybrid model, the classic parameter-server workload, on the Trainer.

Sparse part: one table per categorical feature of the planted data
(``ctr_data.PlantedCTR``), living on the shards and shared by every
worker, updated there by QHM (or the ``sparse_optimizer`` named, below).
Dense part: an MLP over the pooled embeddings and the dense features,
replicated in the worker's trainer group with the chosen comm hook and
updated by a local QHM.  Each worker
reads its own stream of the planted data; rank 0 of the group reports the
held-out AUC next to the planted model's (``oracle_auc``: the best any
model can do).  Everything else (the step, faults, checkpoints, reports)
is ``paramserver.Trainer``'s.

``data={...}`` trains on files instead (``FileSource``: Criteo-format
text or Parquet, read with ``paramserver.data``), on dynamic tables, and
reports the held-out AUC and log loss of the ``eval`` files.

``staleness=k`` lets a step read rows missing the sparse updates of at
most the last ``k`` steps, which are applied in the background
(``paramserver.train.pipeline``); 0, the default, is exact.
``cache_rows=N`` adds the worker's row cache (at most N rows held; ``cache_mib=M``: at most M MiB): with
``staleness=k`` the rows of several steps are read at once and their
pushes leave together, one message per shard for them all (``k + 1``
steps on a host short of cores, ``k`` on one with cores to spare;
``cache_steps`` sets it).

``export_to=URL`` writes live exports there every ``export_every`` steps (a base, then deltas of the rows
changed; ``paramserver.serving.load(URL)`` serves the newest and ``refresh()`` follows); ``keep_exports=N``
keeps the newest N bases with their deltas.

``dynamic_tables=True`` trains the same model on dynamic tables
(``Table(None, ...)``) over the ids as raw 64-bit hashes, as real
categorical values come; ``table_options`` passes their admission and
eviction options (``capacity``, ``ttl_steps``, ``admit_after``,
``admit_probability``).

``sparse_optimizer=NAME`` picks the tables' optimizer on the shards by name
(``SPARSE_OPTIMIZERS``: ``qhm``, the default, ``sgd``, ``adagrad``,
``rowwise_adagrad``, ``adam``, ``ftrl``), with its learning rate tuned on
the planted data; ``sparse_lr`` overrides that rate (None, the default:
the tuned one).  QHM's momentum and nu are the job's ``momentum`` and
``nu``, which the dense QHM takes too.

``row_dtype`` (``"float32"``, ``"float16"`` or ``"bfloat16"``) is the
type of the tables' rows on the shards, ``row_rounding`` how updates are
written into half-precision rows (``"stochastic"`` or ``"nearest"``), and
``push_dtype`` (``"float32"`` or ``"bfloat16"``) the type of the row
gradients pushed (``paramserver.Table``, ``Trainer(push_dtype=...)``).

The learning rates of QHM, SGD and FTRL look large because the loss is a
batch mean: a row's gradient is its samples' share of 1/batch_size.  The
defaults were tuned on the planted data (1500 steps of 2 x 1024 samples
reach about 0.015 below the oracle AUC with QHM; every optimizer's figures
are in docs/demo-job.md).
"""

import dataclasses
import logging
import math
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from paramserver import Table, Trainer
from paramserver.optim import QHM
from paramserver.optim.records import job_choices
from paramserver.jobs.ctr_data import CTRSpec, PlantedCTR, PlantedStream, auc, feature_names, to_batch

logger = logging.getLogger(__name__)

#: Samples per batch of the held-out files.
EVAL_BATCH = 4096

#: The tables' optimizers by name (the job's ``sparse_optimizer``): the class the shards run and its keyword
#: arguments, tuned on the planted data (``make demo``'s 1500 steps, fixed and dynamic tables: see
#: docs/demo-job.md), each read from its optimizer's record (``RowOptimizer.job``); the job's ``sparse_lr``
#: replaces the ``lr`` here, and for ``qhm`` the job's ``momentum`` and ``nu`` replace these.
SPARSE_OPTIMIZERS: Dict[str, Tuple[type, Dict[str, Any]]] = {
    name: (choice.local, dict(choice.options)) for name, choice in job_choices().items()}

#: The names ``sparse_optimizer`` takes: a config naming another is refused before the job is shipped.
SparseOptimizerName = Literal[tuple(SPARSE_OPTIMIZERS)]  # type: ignore[valid-type]
#: The tables' row types (``row_dtype``), their rounding (``row_rounding``) and the pushes' type (``push_dtype``).
RowDtypeName = Literal["float32", "float16", "bfloat16"]
RoundingName = Literal["stochastic", "nearest"]
PushDtypeName = Literal["float32", "bfloat16"]


def sparse_optimizer_of(name: str = "qhm", lr: Optional[float] = None, momentum: Optional[float] = None,
                        nu: Optional[float] = None) -> Tuple[type, Dict[str, Any]]:
    """``(optimizer class, keyword arguments)`` of the tables' optimizer ``name`` (``SPARSE_OPTIMIZERS``), with
    ``lr`` instead of its tuned rate unless None, and for ``qhm`` ``momentum`` and ``nu`` instead of its own unless
    None.  A name not in the table, or an ``lr`` that is not a finite positive number, is a ``ValueError`` naming
    the key and the value."""
    if not isinstance(name, str) or name not in SPARSE_OPTIMIZERS:
        raise ValueError(f"sparse_optimizer must be one of {', '.join(SPARSE_OPTIMIZERS)}; got {name!r}")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr)
                           or lr <= 0):
        raise ValueError(f"sparse_lr must be a finite number above 0 (or None: {name}'s tuned "
                         f"{SPARSE_OPTIMIZERS[name][1]['lr']}); got {lr!r}")
    optimizer_class, tuned = SPARSE_OPTIMIZERS[name]
    options = dict(tuned)
    if lr is not None:
        options["lr"] = float(lr)
    if name == "qhm":
        options.update({key: value for key, value in (("momentum", momentum), ("nu", nu)) if value is not None})
    return optimizer_class, options


def dense_tower(num_inputs: int, hidden: Sequence[int]) -> nn.Module:
    """The MLP: ``hidden`` ReLU layers, then one logit (``benchmarks/`` build the reference's from it too)."""
    layers: List[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(num_inputs, width), nn.ReLU()]
        num_inputs = width
    layers.append(nn.Linear(num_inputs, 1))
    return nn.Sequential(*layers)


class Tower(nn.Module):
    """The MLP over every table's pooled embeddings (in ``features`` order) and the dense features."""

    def __init__(self, features: Sequence[str], embedding_dim: int, num_dense: int, hidden: Sequence[int]):
        super().__init__()
        self.features = list(features)
        self.embedding_dim, self.num_dense, self.hidden = embedding_dim, num_dense, list(hidden)
        self.mlp = dense_tower(len(self.features) * embedding_dim + num_dense, hidden)

    def export_kwargs(self) -> Dict:
        """What an export records to build this tower again (``paramserver.serving.load``)."""
        return {"features": self.features, "embedding_dim": self.embedding_dim, "num_dense": self.num_dense,
                "hidden": self.hidden}

    def forward(self, pooled: Dict[str, Tensor], dense: Tensor) -> Tensor:
        return self.mlp(torch.cat([pooled[name] for name in self.features] + [dense], 1)).squeeze(1)


def main(ctx, steps: int = 1500, batch_size: int = 1024, hook: str = "powersgd",
         hook_options: Optional[Dict] = None, embedding_dim: int = 16, hidden: Sequence[int] = (128, 64),
         sparse_optimizer: SparseOptimizerName = "qhm", sparse_lr: Optional[float] = None, dense_lr: float = 0.5,
         momentum: float = 0.9, nu: float = 0.7, init_std: float = 0.01, row_wise_min_rows: int = 1_000_000,
         holdout_size: int = 20_000,
         eval_every: int = 500, log_every: int = 100, seed: int = 0, spec: Optional[Dict] = None,
         table_name: str = "ctr", dynamic_tables: bool = False, table_options: Optional[Dict] = None,
         data: Optional[Dict] = None, staleness: int = 0, cache_rows: Optional[int] = None,
         cache_steps: Optional[int] = None, cache_mib: Optional[float] = None, export_to: Optional[str] = None,
         export_every: int = 100, export_base_every: int = 24, keep_exports: int = 0,
         export_storage_options: Optional[Dict] = None, table_placement: str = "packed",
         row_dtype: RowDtypeName = "float32", row_rounding: RoundingName = "stochastic",
         push_dtype: PushDtypeName = "float32") -> dict:
    """Train the job (``build``) for ``steps`` steps; the Trainer's figures and the source's.  The signature
    names every option, so that a worker refuses a config key the job does not take."""
    options = {name: value for name, value in locals().items()
               if name not in ("ctx", "steps", "eval_every", "log_every")}
    trainer, source = build(ctx, **options)
    try:
        result = trainer.fit(source.train, steps=steps, eval_data=source.eval, eval_every=eval_every,
                             log_every=log_every, figures=source.figures)
    finally:
        source.close()
    return dict(result, **source.final_figures())


def build(ctx, batch_size: int = 1024, hook: str = "powersgd", hook_options: Optional[Dict] = None,
          embedding_dim: int = 16, hidden: Sequence[int] = (128, 64), sparse_optimizer: SparseOptimizerName = "qhm",
          sparse_lr: Optional[float] = None, dense_lr: float = 0.5, momentum: float = 0.9, nu: float = 0.7,
          init_std: float = 0.01,
          row_wise_min_rows: int = 1_000_000, holdout_size: int = 20_000, seed: int = 0,
          spec: Optional[Dict] = None, table_name: str = "ctr", dynamic_tables: bool = False,
          table_options: Optional[Dict] = None, data: Optional[Dict] = None, staleness: int = 0,
          cache_rows: Optional[int] = None, cache_steps: Optional[int] = None, cache_mib: Optional[float] = None,
          export_to: Optional[str] = None, export_every: int = 100, export_base_every: int = 24,
          keep_exports: int = 0, export_storage_options: Optional[Dict] = None, table_placement: str = "packed",
          row_dtype: RowDtypeName = "float32", row_rounding: RoundingName = "stochastic",
          push_dtype: PushDtypeName = "float32") -> Tuple[Trainer, "PlantedSource | FileSource"]:
    """The job's Trainer and its data (``PlantedSource``, or ``FileSource`` with ``data``), not started."""
    sparse = sparse_optimizer_of(sparse_optimizer, sparse_lr, momentum, nu)  # refused before anything is built
    if data is not None:
        source = FileSource(ctx, data, batch_size, embedding_dim, init_std, table_options)
    else:
        source = PlantedSource(ctx, spec, seed, batch_size, holdout_size, embedding_dim, init_std, dynamic_tables,
                               table_options)
    torch.manual_seed(seed)  # every replica starts equal (the group shares one anyway)
    tables = {name: dataclasses.replace(table, dtype=getattr(torch, row_dtype), rounding=row_rounding)
              for name, table in source.tables.items()}
    trainer = Trainer(
        ctx, tables=tables, dense=Tower(list(source.tables), embedding_dim, source.num_dense, hidden),
        sparse_optimizer=sparse,
        dense_optimizer=lambda params: QHM(params, lr=dense_lr, momentum=momentum, nu=nu),
        loss=nn.BCEWithLogitsLoss(), comm_hook=hook, hook_options=hook_options,
        name=table_name, seed=seed, row_wise_min_rows=row_wise_min_rows, staleness=staleness,
        cache_rows=cache_rows, cache_steps=cache_steps, cache_mib=cache_mib, export_to=export_to,
        export_every=export_every, export_base_every=export_base_every, export_storage_options=export_storage_options,
        table_placement=table_placement, push_dtype=None if push_dtype == "float32" else getattr(torch, push_dtype),
        keep_exports=keep_exports)
    return trainer, source


class PlantedSource:
    """The planted data (``ctr_data``): a stream per worker, the held-out set, the oracle AUC."""

    def __init__(self, ctx, spec: Optional[Dict], seed: int, batch_size: int, holdout_size: int,
                 embedding_dim: int, init_std: float, dynamic_tables: bool, table_options: Optional[Dict]):
        spec_ = CTRSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in (spec or {}).items()})
        data = PlantedCTR(spec_, seed=seed)
        planted_holdout = data.holdout(holdout_size)
        oracle_auc = auc(torch.cat([b.true_logits for b in planted_holdout]),
                         torch.cat([b.labels for b in planted_holdout]))
        # dynamic tables read the ids as raw 64-bit hashes, as real categorical values come: no vocabulary needed
        self.tables = {name: Table(None if dynamic_tables else rows, embedding_dim,
                                   mode="sum" if bag == 1 else "mean", init_std=init_std, **(table_options or {}))
                       for name, rows, bag in zip(feature_names(spec_), spec_.vocab_sizes, spec_.bag_sizes)}
        self.num_dense = spec_.num_dense
        self.train = PlantedStream(data, ctx.worker_index, batch_size, hashed=dynamic_tables)
        self.eval = [to_batch(b, dynamic_tables) for b in planted_holdout]
        self.figures = {"oracle_auc": oracle_auc}

    def final_figures(self) -> Dict[str, float]:
        return {}

    def close(self) -> None:
        """Nothing is read in the background."""


class FileSource:
    """Files (``paramserver.data``): ``data`` is ``{"format": "criteo" | "parquet", "train": paths, globs,
    directories or prefixes (local or URLs such as ``s3://bucket/logs/*/part-*.gz``), "eval": the same,
    "schema": {...} (Parquet), "workers": how many workers share fixed train files (worker ``i`` reads share
    ``i % workers``), "epochs" (none: without end), "eval_rows", "skip_malformed", "threads",
    "storage_options": {...} (for URLs), "follow": true (train on files as they land, each once; with
    "poll_seconds" and "ready_marker"; the trainer group deals them to its members, ``workers`` is ignored)}``.
    Every table is dynamic: the ids are raw hashes."""

    def __init__(self, ctx, data: Dict, batch_size: int, embedding_dim: int, init_std: float,
                 table_options: Optional[Dict]):
        from paramserver.data import reader_from_config  # pyarrow is loaded by jobs on files only

        data = dict(data)
        given = data.pop("workers", None)
        epochs = data.pop("epochs", None)
        eval_rows = data.pop("eval_rows", None)
        if data.get("follow"):  # the trainer group deals the shares by its membership (``train.shares``)
            if given is not None:
                logger.warning("%s: data.workers (%s) is ignored for a followed input: the trainer group deals its "
                               "files to its members as they join and leave", ctx.rpc_name, given)
            workers = 1
        else:
            workers = int(given or 1)
        share = ctx.worker_index % workers
        if ctx.worker_index >= workers and not data.get("follow"):
            logger.warning("%s reads share %d of %d of the train files: set data.workers to the number of "
                           "workers, or some files are read by more than one", ctx.rpc_name, share, workers)
        self.train = reader_from_config(data, "train", batch_size, share, workers, epochs)
        self.eval = (reader_from_config(data, "eval", EVAL_BATCH, 0, 1, 1, eval_rows) if "eval" in data
                     else None)
        schema = self.train.schema
        bags = dict(schema.multi_hot) if schema is not None else {}
        self.tables = {name: Table(None, embedding_dim, mode="mean" if name in bags else "sum", init_std=init_std,
                                   **(table_options or {}))
                       for name in self.train.tables}
        self.num_dense = self.train.num_dense
        self.figures: Dict[str, float] = {}
        if self.train.follow:
            logger.info("%s follows %s files; its trainer group deals them to its members", ctx.rpc_name,
                        data.get("format", "criteo"))
        else:
            logger.info("%s reads %s: %d part(s) of share %d of %d", ctx.rpc_name, data.get("format", "criteo"),
                        len(self.train.parts), share, workers)

    def final_figures(self) -> Dict[str, float]:
        return {"malformed_skipped": self.train.malformed}

    def close(self) -> None:
        """Stop the readers' threads (a followed input's waits for files among them)."""
        self.train.close()
        if self.eval is not None:
            self.eval.close()
