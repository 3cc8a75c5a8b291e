"""``Trainer``: the training loop the framework owns, so that every job gets its guarantees.

Owns a job's training from start to end: forming and re-forming the
trainer group, the step (``step.train_step``: lookups on the shards, the
dense part under DDP with the comm hook, the sparse update on the
shards), stop requests, checkpoints and restore, recovery from a lost
worker and from a lost shard with no update applied twice, progress
reports to the coordinator and log lines, and periodic evaluation.  A job
supplies the model (``Table``s and a dense module), the optimizers, the
loss and the data; see ``Trainer.fit``.

The loop, on every member of a group: at the start of a step the group
may agree (one all-reduce every ``agree_every`` steps, and sooner when a
member's data did not come for all of them) to re-form, stop or
checkpoint (``DenseReplica.sync_point``); a checkpoint is written at
that step boundary; then the step.  A step whose lookups failed is done
again once the lost shard serves again (skipping the agreement it
passed already); a failed collective re-forms the group and the step is
done again from its agreement, in the new group; every other error ends
the job.  Data the group shares (a followed input) is dealt to its members
at every formation and re-formation (``shares.GroupShares``); with several
trainer groups, each part of it is read by the group that claims it first
(``claims.PartClaims``).

Metrics: the context's recorders (``JobContext.recorders``, set when the
worker serves metrics) are handed down here: the data-plane one to the
sparse part (its collection and optimizer), the training one to the
trainer group and the dense replica (which hands it to its comm hook).
"""

import datetime
import logging
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..checkpoint.model import describe_model
from ..ddp import DenseReplica, GroupStopped, TrainerGroup, canonical_hook_options
from ..ddp.group import GenerationAborted
from ..logs import RateLimitedLog, one_line
from ..shards.client.collection import ShardRefused, ShardRequestFailed, check_push_dtype
from .checkpoints import TrainerCheckpoints, restore_point
from .claims import PartClaims
from .contract import Batch, Table, is_count
from .data import BatchStream
from .evaluation import evaluate
from .live_exports import LiveExports
from .pipeline import RowPipeline, default_window
from .positions import PublishedPositions
from .shares import GroupShares
from .sparse import RebuildStopped, SparseTables, check_placement
from .step import ShardStepFailed, StepTimes, train_step

logger = logging.getLogger(__name__)

#: PowerSGD options unless given: compress from step 10 (torch's default, 1000, would leave most of a
#: short run uncompressed).
POWERSGD_DEFAULTS = {"start_powerSGD_iter": 10}
#: Prefix of the figures saying where a step's time goes (``phase_ms.lookups``...: ms per step, see
#: ``step.PHASES``).
PHASE_FIGURE = "phase_ms."
#: The figure of how long a step's all-reduce was in flight, within its backward phase (``DenseReplica.allreduce_ms``).
ALLREDUCE_FIGURE = "allreduce_ms"
#: The prefix of the row cache's figures (``pipeline.RowCacheFigures``).
ROW_CACHE_FIGURE = "row_cache."
#: Batches read ahead in the background while steps run.
PREFETCH_BATCHES = 2
#: How long the other members of a group wait for rank 0's held-out evaluation (in the store: not in their next
#: collective, whose timeout, a minute, the evaluation of a large held-out set would outlast).
EVALUATED_WITHIN = datetime.timedelta(minutes=30)
#: How long a member waits for its batches up to the next agreement before the group agrees to wait (and
#: agrees again after as long): data that follows files as they land has none while none landed.
DATA_PATIENCE = datetime.timedelta(seconds=2)
#: With some of those batches in hand, how long a member waits for the next one before the group takes the
#: steps it has data for (the rest of a file that landed is trained on before the next file lands).
DATA_LULL = datetime.timedelta(milliseconds=100)
#: Tables of this many rows or more are split by rows over every shard; smaller ones are placed whole.
ROW_WISE_MIN_ROWS = 1_000_000


class Trainer:
    """Trains ``tables`` (on the shards) and ``dense`` (replicated in the worker's trainer group) for a job.

    ``dense`` is any module called as ``dense(pooled, dense_features)``
    with ``pooled[name]`` the ``(batch, embedding_dim)`` pooled embeddings
    of table ``name``, returning logits of shape ``(batch,)``.
    ``sparse_optimizer``: ``(optimizer class, its keyword arguments)``,
    run on the shards (``DistributedOptimizer``); ``dense_optimizer``:
    ``parameters -> torch.optim.Optimizer``.  ``loss(logits, labels)``.
    ``comm_hook``/``hook_options``: how the group all-reduces the dense
    gradients (``paramserver.ddp.HOOK_NAMES``).  ``name`` prefixes the
    tables' names on the shards (workers naming the same tables share
    them); ``seed`` draws their initial rows.  ``table_placement``: the
    tables placed whole (under ``row_wise_min_rows`` rows) go ``"packed"``
    onto as few shards as keep them balanced (the fewest messages), or
    ``"spread"`` over every shard, as many on each as can be (more
    messages, fewer tables for each shard to update per push).  Every
    checkpoint records the model's description, so that it can be exported
    (``paramserver.export``): the tables, and ``dense``'s class with its
    ``export_kwargs()`` when it has that method (``TypeError`` here when it
    returns values that are not JSON).

    ``staleness``: how many steps of sparse updates a step may read rows
    without (``paramserver.train.pipeline``).  0 (the default) gives the
    same results as looking every step's rows up after the previous step's
    update, with one message per shard per step for both; ``k >= 1`` applies
    pushes in the background, at most ``k`` steps behind.  ``read_ahead``:
    False looks every step's rows up when it starts and waits for its push
    (the step without its pipeline, for comparisons).

    ``cache_rows``: the worker's row cache (``paramserver.shards.client.row_cache``), at most this many rows
    held at once; ``cache_mib``: at most this many MiB of rows (either or both; ``None`` for both: no
    cache).  With ``staleness = k >= 1`` the rows of ``cache_steps`` consecutive steps (1 to ``k + 1``;
    by default ``k`` where the host has more cores than the cluster's processes on it, else ``k + 1``:
    ``pipeline.default_window``) are read in one lookup, each row once however many of those steps need
    it, and those steps' pushes leave together in one message per shard carrying the next window's
    reads: a shard handles one message per worker every ``cache_steps`` steps, every row still within
    the staleness bound.  A ``Table(..., cache_rows=N)`` also bounds that table's rows alone (and turns
    the cache on by itself).  With staleness 0 a window is one step and results are unchanged.  Its
    figures are the job's ``row_cache.*`` (hit rate, rows read, bytes saved, evictions, rows held).

    ``export_to``: a root (local path or fsspec URL, with ``export_storage_options``) where trainer group 0
    writes a live export every ``export_every`` steps and when it stops (``paramserver.train.live_exports``):
    a base, then deltas holding the rows changed since the export before, a new base every
    ``export_base_every`` exports; ``paramserver.serving.load(root)`` serves the newest and ``refresh()``
    follows.  Without ``export_to``, the cluster's ``ps-server --export-dir`` (``ctx.exports``) applies.
    ``keep_exports=N`` keeps the newest N bases with their deltas and removes older chains (a superseded
    chain stays a grace period for its readers; see docs/serving.md); 0, the default, keeps every export.
    With ``export_to`` it applies to those exports; without, ``ps-server --keep-exports`` does.

    ``push_dtype``: the type row gradients travel to the shards in: ``None`` (float32, the default) or
    ``torch.bfloat16`` (half a push's bytes; the shards apply them in float32).
    """

    def __init__(self, ctx, tables: Dict[str, Table], dense: nn.Module, sparse_optimizer: Tuple[type, Dict[str, Any]],
                 dense_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 loss: Callable[[Tensor, Tensor], Tensor], comm_hook: str = "allreduce",
                 hook_options: Optional[Dict[str, Any]] = None, *, name: str = "model", seed: int = 0,
                 row_wise_min_rows: int = ROW_WISE_MIN_ROWS, agree_every: int = 10, staleness: int = 0,
                 read_ahead: bool = True, cache_rows: Optional[int] = None, cache_steps: Optional[int] = None,
                 cache_mib: Optional[float] = None, export_to: Optional[str] = None, export_every: int = 100,
                 export_base_every: int = 24, export_storage_options: Optional[Dict[str, Any]] = None,
                 table_placement: str = "packed", push_dtype: Optional[torch.dtype] = None, keep_exports: int = 0):
        if not tables:
            raise ValueError("a Trainer needs at least one table")
        for table_name, table in tables.items():
            if not isinstance(table, Table):
                raise TypeError(f"table {table_name!r} must be a paramserver.Table, got {type(table).__name__}")
        if not is_count(staleness, least=0):
            raise ValueError(f"staleness must be a whole number of steps, 0 or more; got {staleness!r}")
        if staleness > 0 and not read_ahead:
            raise ValueError(f"staleness {staleness} needs read_ahead=True (its rows are read ahead)")
        if cache_rows is not None and not is_count(cache_rows):
            raise ValueError(f"cache_rows must be a whole number of rows, 1 or more (or None: no cache); "
                             f"got {cache_rows!r}")
        if cache_mib is not None and (isinstance(cache_mib, bool) or not isinstance(cache_mib, (int, float))
                                      or not cache_mib > 0 or cache_mib == float("inf")):
            raise ValueError(f"cache_mib must be a positive number of MiB (or None); got {cache_mib!r}")
        #: Whether the worker keeps a row cache (bounded in rows, bytes or both, over every table or per table).
        self.caches_rows = cache_rows is not None or cache_mib is not None or \
            any(table.cache_rows is not None for table in tables.values())
        if cache_steps is not None and (not self.caches_rows or not is_count(cache_steps)
                                        or cache_steps > staleness + 1):
            raise ValueError(f"cache_steps must be 1 to staleness + 1 ({staleness + 1}) steps, with cache_rows "
                             f"or cache_mib set (the Trainer's or a Table's cache_rows); got {cache_steps!r} "
                             f"(cache_rows {cache_rows!r}, cache_mib {cache_mib!r})")
        check_placement(table_placement)
        check_push_dtype(push_dtype)
        #: The type row gradients travel to the shards in (``None``: float32).
        self.push_dtype = push_dtype
        optimizer_class, optimizer_options = sparse_optimizer
        self.ctx = ctx
        self.tables = dict(tables)
        self.dense = dense
        self.sparse_optimizer = (optimizer_class, dict(optimizer_options))
        self.dense_optimizer = dense_optimizer
        self.loss = loss
        self.comm_hook = comm_hook
        self.hook_options = dict(POWERSGD_DEFAULTS if "powersgd" in comm_hook else {},
                                 **canonical_hook_options(comm_hook, hook_options or {}))
        self.name = name
        self.seed = seed
        self.row_wise_min_rows, self.table_placement = row_wise_min_rows, table_placement
        self.agree_every = agree_every
        self.staleness, self.read_ahead = staleness, read_ahead
        self.cache_rows = cache_rows
        #: The row cache's bound in bytes (``cache_mib``), ``None``: none.
        self.cache_bytes = None if cache_mib is None else max(1, int(cache_mib * 2 ** 20))
        self.cache_steps = ((cache_steps or default_window(staleness, ctx.cores_to_spare)) if self.caches_rows
                            else 1)
        #: What every checkpoint records of the model (``paramserver.checkpoint.model``).
        self.model_description = describe_model(name, self.tables, dense)
        if export_to is not None and (isinstance(export_every, bool) or not isinstance(export_every, int)
                                      or export_every < 1 or isinstance(export_base_every, bool)
                                      or not isinstance(export_base_every, int) or export_base_every < 1):
            raise ValueError(f"export_every and export_base_every must be whole numbers, 1 or more; got "
                             f"{export_every!r} and {export_base_every!r}")
        self.export_to, self.export_every, self.export_base_every = export_to, export_every, export_base_every
        self.export_storage_options = dict(export_storage_options or {})
        if isinstance(keep_exports, bool) or not isinstance(keep_exports, int) or keep_exports < 0:
            raise ValueError(f"keep_exports must be a whole number, 0 (every export stays) or more; got "
                             f"{keep_exports!r}")
        self.keep_exports = keep_exports

    def fit(self, data: Iterable[Batch], steps: int, eval_data: Optional[Iterable[Batch]] = None,
            eval_every: int = 500, log_every: int = 100, figures: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
        """Train until the group reaches step ``steps`` (or is asked to stop, or a worker's data ends).

        ``data``: this worker's batches; if it has ``state_dict()``/
        ``load_state_dict()`` its position is saved in checkpoints, else it
        is re-created by skipping batches.  Data the group shares (``data.shared``: a
        followed ``FileReader``) is dealt to the group's members by their place in it, and dealt again
        whenever the group re-forms (``paramserver.train.shares``); the job's other trainer groups read
        the same input, each part by the group that claims it (``paramserver.train.claims``).
        ``eval_data`` (a re-iterable of batches): rank 0 reports held-out ``auc`` and ``log_loss`` every
        ``eval_every`` steps and at the end.  ``figures``: fixed figures of
        the job reported with the Trainer's (a reference AUC...).

        Returns the figures: steps, start_step, loss (the last log window's
        mean), first_loss (the loss of the first step this run took),
        samples_per_s, bytes_per_step, allreduce_ms (``DenseReplica.allreduce_ms``:
        within the backward phase, how long its all-reduce was in flight),
        ``phase_ms.<phase>`` (ms per step in each of ``step.PHASES``), auc and log_loss (rank 0), the group
        (group_rank, group_size) and the faults survived: reformations,
        recoveries, shard_rebuilds, checkpoints, and every step accounted
        for once: sparse_steps (sparse update applied) + sparse_steps_lost
        (refused by a shard, failed against a shard that did not serve again
        before the worker ended or gave up, or rolled back on a shard process
        that came back without it) + steps_skipped (taken from another
        member) + steps_sat_out = steps - start_step.  A push that failed
        against a lost shard is sent again once it serves, and counts applied;
        replayed_pushes: this worker's pushes that restarted shard processes
        replayed from their push logs.
        """
        if steps < 0 or eval_every < 1 or log_every < 1:
            raise ValueError(f"steps must be >= 0 and eval_every, log_every >= 1; got {steps}, {eval_every}, "
                             f"{log_every}")
        try:
            group = TrainerGroup.join(self.ctx.group, recorder=self.ctx.recorders.training)
        except GroupStopped:  # asked to stop before the group formed: nothing trained
            logger.info("%s: stopped before its trainer group formed", self.ctx.rpc_name)
            return dict(figures or {}, steps=0)
        try:
            run = _Run(self, group, data, steps, eval_data, eval_every, log_every, figures or {})
        except (RebuildStopped, GroupStopped) as stopped:
            # Asked to stop while waiting for a shard lost as the job started, or as the group first re-formed.
            group.close()
            logger.info("%s: stopped before its first step (%s)", self.ctx.rpc_name, stopped)
            return dict(figures or {}, steps=0)
        return run.run()


class _Run:
    """One ``fit``: the loop and its counters."""

    def __init__(self, trainer: Trainer, group: TrainerGroup, data, steps: int, eval_data, eval_every: int,
                 log_every: int, figures: Dict[str, float]):
        ctx = trainer.ctx
        shared = bool(getattr(data, "shared", False))
        #: Every trainer group of the job reads a shared input: each part by the group that claims it.
        self.claims = PartClaims.of_job(group, ctx.job_run, ctx.trainer_group, ctx.trainer_groups_gone) \
            if shared else None
        if shared:
            data.claims = self.claims
        self.trainer, self.ctx, self.steps = trainer, ctx, steps
        self.eval_data, self.eval_every, self.log_every = eval_data, eval_every, log_every
        restored = restore_point(ctx)
        self.sparse = SparseTables(trainer.tables, trainer.sparse_optimizer, ctx.shards, trainer.name, trainer.seed,
                                   trainer.row_wise_min_rows, ctx.live_shards, ctx.refresh, ctx.should_stop,
                                   shards_gone=ctx.shards_gone, retire=ctx.retire_handles,
                                   recorder=ctx.recorders.data_plane, placement=trainer.table_placement,
                                   push_dtype=trainer.push_dtype)
        positions = (restored or {}).get("data_positions", {})
        # Data the group shares starts once the group dealt it (``GroupShares.formed``).
        self.batches = BatchStream(data, None if shared else _position(positions.get(ctx.worker_index)),
                                   prefetch=PREFETCH_BATCHES + trainer.staleness, started=not shared)
        #: The first step of the window this member has no batch for, as it told at the group's agreement
        #: (``_say_at_agreement``; an uneven step from there on is sat out: ``_loop``).
        self._own_until = 0
        self.shares = GroupShares(data, self.batches, positions, until=lambda: self._own_until) if shared else None
        self.pipeline = RowPipeline(trainer.staleness, self._upcoming, trainer.tables,
                                    lambda: self.replica.next_agreement, steps,
                                    read_ahead=trainer.read_ahead, cache_steps=trainer.cache_steps,
                                    cache_rows=trainer.cache_rows, cache_bytes=trainer.cache_bytes,
                                    recorder=ctx.recorders.data_plane)
        #: ``replica.steps_skipped`` when this member's batches last caught up with it (``None``: not formed yet).
        self._skips_taken: Optional[int] = None
        try:
            self.replica = DenseReplica(group, trainer.dense, trainer.dense_optimizer, hook=trainer.comm_hook,
                                        hook_options=trainer.hook_options, agree_every=trainer.agree_every,
                                        initial=restored, recorder=ctx.recorders.training, on_formed=self._formed,
                                        on_agreed=self._agreed if shared else None, uneven_steps=shared)
        except BaseException:  # (asked to stop as the group first formed, or it could not form)
            self.pipeline.close()
            self.batches.close()
            self.sparse.close()  # what the tables hold on the shards is released now
            raise
        published = (PublishedPositions.of_job(group, trainer.staleness, ctx.job_run) if ctx.checkpoint.directory
                     else None)
        self.checkpoints = TrainerCheckpoints(ctx, self.replica, self.batches.position,
                                              model=trainer.model_description, positions=published,
                                              restored=positions)
        self.exports = _live_exports(trainer, ctx, self.replica)
        self.figures: Dict[str, Any] = dict(figures)
        self.losses: List[float] = []
        self.samples = 0
        #: Uneven steps this member took no batch in (``_step_without_batch``): with ``sparse_steps``,
        #: ``sparse_steps_lost`` and ``steps_skipped`` they add up to the steps.
        self.steps_sat_out = 0
        self.times = StepTimes()
        self.start_step = self.replica.step
        self.evaluated_at: Optional[int] = None
        self._waiting_for_data = RateLimitedLog(logger, "waited {count} time{s} for data")
        self._short_of_data = RateLimitedLog(logger, "took {count} window{s} short of data")
        self._sat_out_log = RateLimitedLog(logger, "sat out {count} step{s} with no batch")

    def run(self) -> Dict[str, Any]:
        replica, ctx = self.replica, self.ctx
        logger.info("%s: tables %s; %s; %s from step %d", ctx.rpc_name, self.sparse.describe(),
                    self.pipeline.describe(), replica.group.describe(), replica.step)
        self.started = time.monotonic()
        try:
            self._loop()
            self._after_pushes_settled(self.pipeline.drain())  # the pushes of the last steps, when the loop ended early
            if self.exports is not None:
                self.exports.at_boundary(final=True)  # serving gets the model as training left it
            self._evaluate_at_the_end()
        finally:
            self.pipeline.abandon()  # pushes still kept from a lost shard (the worker stopped or gave up): lost
            self.pipeline.close()
            self.batches.close()
            replica.close()
            self.sparse.close()  # what the tables hold on the shards is released now, not whenever this is collected
        # Equal on every member of the group: DDP keeps the replicas identical.
        checksum = sum(float(p.detach().double().sum()) for p in replica.module.parameters())
        return dict(self.figures, steps=replica.step, start_step=self.start_step, group_rank=replica.group.rank,
                    group_size=replica.group.world_size, reformations=replica.reformations,
                    recoveries=replica.recoveries, sparse_steps=self.pipeline.applied,
                    sparse_steps_lost=self.pipeline.lost, replayed_pushes=self.pipeline.replayed,
                    steps_skipped=replica.steps_skipped,
                    steps_sat_out=self.steps_sat_out,
                    shard_rebuilds=self.sparse.rebuilds, checkpoints=len(self.checkpoints.written),
                    live_exports=len(self.exports.written) if self.exports is not None else 0,
                    replica_checksum=checksum)

    def _loop(self) -> None:
        replica, sparse = self.replica, self.sparse
        redo = False  # the step again after its lookups failed: its agreement was passed already
        while replica.step < self.steps:
            if not redo and not self._boundary():
                return
            redo = False
            self.times.start()
            if replica.uneven_step() and replica.step >= self._own_until:
                # Another member has a batch for this step, this one none: it counts zero in the mean.
                if not self._step_without_batch():
                    return
                continue
            batch = self.batches.current()
            batch.check(self.trainer.tables)  # bad input ends the job, naming the table and the shape
            self.times.mark("data")
            try:
                loss, sparse_failures = train_step(sparse, self.pipeline, replica, batch, self.trainer.loss,
                                                   self.times, alone=replica.uneven_step())
            except Exception as error:  # noqa: BLE001 - failed collectives and lost shards are recovered from
                if isinstance(error, ShardStepFailed):
                    # Before any collective of the step: done again, while the group's other members wait
                    # for it in the step's all-reduce (up to the collective timeout).
                    if not self._after_pushes_settled([], rebuild_for=error.cause):
                        return
                    redo = True
                    continue
                if not self._recovered(error):
                    return
                continue
            self.batches.finished()
            if not sparse_failures:
                sparse.step_succeeded()
            elif not self._after_pushes_settled(sparse_failures):
                return
            self.samples += len(batch)
            self.losses.append(loss)
            self.figures.setdefault("first_loss", loss)  # the first step this run took
            self._after_step()
        self._boundary(final=True)

    def _step_without_batch(self) -> bool:
        """An uneven step this member has no batch for: its pushes settle and its reads ahead go (its next batch
        is for a later step), and it takes part in the step's mean with nothing.  False when the group stops."""
        replica = self.replica
        if not self._after_pushes_settled(self.pipeline.drain()):
            return False
        self.pipeline.drop_reads()
        try:
            replica.average_over_present(False)
        except Exception as error:  # noqa: BLE001 - a failed collective is recovered from
            return self._recovered(error)
        replica.finish_step()
        self.steps_sat_out += 1
        self._sat_out_log.record("sat out", f"{self.ctx.rpc_name}: steps from {replica.step - 1} go on without a "
                                           f"batch of this member: another member's data came, its own not yet")
        self._after_step()
        return True

    def _after_pushes_settled(self, failures: List[Tuple[int, BaseException]],
                 rebuild_for: Optional[BaseException] = None) -> bool:
        """After pushes settled: when some failed against the shards (the dense steps went on), or a step's
        lookups failed (``rebuild_for``), every push still in flight is waited for, the reads ahead are dropped
        and the sparse part is rebuilt; then the pushes kept from lost shards are sent again
        (``RowPipeline.rebuilt``), and rebuilt again while they fail (within the rebuilds' bound).  False when
        the worker was asked to stop meanwhile."""
        if failures or rebuild_for is not None:
            failures = failures + self.pipeline.drain()
        self._log_failed_pushes(failures)
        cause = rebuild_for if rebuild_for is not None else (failures[-1][1] if failures else None)
        while cause is not None:
            refusal = _refusal_in(cause)
            if refusal is not None:  # the request's own fault (bad rows, an optimizer that cannot apply them)
                raise refusal from cause
            self.pipeline.drop_reads()
            before = self.sparse.collection
            try:
                self.sparse.rebuild(cause)
            except RebuildStopped:
                return False
            try:
                failures = self.pipeline.rebuilt(before, self.sparse.collection)
            except (RuntimeError, TimeoutError) as error:  # a shard lost again before it told its ledger
                failures, cause = [], error
            else:
                self._log_failed_pushes(failures)
                cause = failures[-1][1] if failures else None
        return True

    def _log_failed_pushes(self, failures: List[Tuple[int, BaseException]]) -> None:
        """One line per step whose push failed: kept to be sent again once the shards serve, or lost."""
        for step, failure in failures:
            logger.warning("the sparse update of step %d failed against the shards; the dense one goes on: %s; %s",
                           step, one_line(failure), "it is sent again once they serve" if self.pipeline.kept(step)
                           else "it is lost")

    def _boundary(self, final: bool = False) -> bool:
        """A step boundary: agree with the group (on some steps), then write a checkpoint if one is due and a
        live export if the group agreed on one.

        False when the group stops here.  ``final``: after the last step
        (no agreement).  A member lost in the checkpoint's collectives (or the
        export's barrier) is recovered from like one lost in a step; that
        checkpoint (export) is skipped.
        While a member's batches up to the next agreement have not come (data
        that follows files as they land), the group agrees again every
        ``_patience()`` (serving checkpoint requests and stops meanwhile).
        """
        replica = self.replica
        # Every push is applied (drained) before what takes the model as of this step: the end, a live export
        # and a checkpoint (every member drains before the export's barrier or the checkpoint's first collective).
        # Otherwise pushes in flight cross the agreement.
        agreeing = final or replica.agreement_due()
        if final and not self._after_pushes_settled(self.pipeline.drain()):
            return False
        while True:
            try:
                if not final:
                    want_stop, short = self._say_at_agreement() if agreeing else self._agreement_flags()
                    # (asked again after a re-formation: the group may have dealt this member other data)
                    going_on = replica.sync_point(want_stop, self.checkpoints.pending(), short,
                                                  retell=self._say_at_agreement,
                                                  export=self.exports is not None and self.exports.due())
                    if self._catch_up(replica):  # the group moved on: the reads ahead are for other steps
                        self.pipeline.drop_reads()
                        if not self._after_pushes_settled(self.pipeline.drain()):
                            return False
                    if not going_on:
                        return False
                    if agreeing and self.claims is not None and replica.group.rank == 0:
                        self.claims.alive()  # (a followed input several groups read: this group is not lost)
                exporting = self.exports is not None and (final or replica.agreed_export)
                if not final and (exporting or self.checkpoints.due(replica.agreed_checkpoint)) and \
                        not self._after_pushes_settled(self.pipeline.drain()):
                    return False  # a checkpoint and an export hold every update up to their step
                if agreeing and not final:
                    self.checkpoints.at_agreement()  # (another group than 0: its data position, for group 0's)
                self.checkpoints.at_boundary(replica.agreed_checkpoint)
                if exporting:
                    self.exports.at_boundary(final)  # every push of this member's up to here is applied
                if final or not replica.agreement_due():  # (still due: the group agreed to wait for data)
                    if agreeing and not final and replica.next_agreement < replica.step + replica.window():
                        why = ("no member's data for the rest of the window has come" if replica.uneven_steps
                               else "a member's data for the rest of the window has not come")
                        self._short_of_data.record(
                            "short", f"{self.ctx.rpc_name}: the group takes steps {replica.step} to "
                                     f"{replica.next_agreement - 1} and agrees again: {why}")
                    return True
                self._waiting_for_data.record("waiting", f"{self.ctx.rpc_name}: step {replica.step} waits for "
                                              f"its group's data (agreeing again every "
                                              f"{self._patience().total_seconds():g} s)")
            except GroupStopped:
                return False
            except Exception as error:  # noqa: BLE001 - only a failed collective is recovered from
                self._catch_up(replica)
                return self._recovered(error)

    def _upcoming(self, offset: int) -> Optional[Batch]:
        """The batch ``offset`` steps ahead, for the pipeline's reads ahead: up to the next agreement it is
        there (the agreement made sure of it); past it only if it is there now, so that a step never waits for
        data that has not landed (a followed input) while its group waits in the step's all-reduce.  A batch
        not read ahead has its rows read when its step starts."""
        later = self.replica.step + offset
        if later < min(self.replica.next_agreement, self._own_until):
            return self.batches.ahead(offset)
        if later < self.replica.next_agreement:  # an uneven step this member sits out: its batch is for a later one
            return None
        return self.batches.ahead_now(offset)

    def _patience(self) -> datetime.timedelta:
        """How long this member waits for its first batch of the window at an agreement: ``DATA_PATIENCE``, or
        ``DATA_LULL`` in a group of several that takes uneven steps, which goes on with the members that have
        data: the member a file went to trains it once the others, waiting for theirs, come to the agreement,
        so their patience would add to the file's lag."""
        if not self.replica.uneven_steps or self.replica.group.world_size == 1:
            return DATA_PATIENCE
        return DATA_LULL

    def _agreement_flags(self) -> Tuple[bool, int]:
        """What this member says at the group's agreement: stop when asked to, or when its data would end
        before the next agreement (all members stop here together, none is left in a collective); and how
        many steps of the window it is short of data for: those whose batches did not come, waiting at most
        ``_patience()`` for the first and ``DATA_LULL`` between two (all of them: wait)."""
        replica = self.replica
        if replica.agreement_due():
            window = replica.window()
            ready = self.batches.ready(min(window, self.steps - replica.step), self._patience().total_seconds(),
                                       DATA_LULL.total_seconds())
            if ready is False:
                logger.warning("%s: the data ends after %d batches; asking the group to stop at step %d",
                               self.ctx.rpc_name, self.batches.used + len(self.batches), replica.step)
                return True, 0
            return self.ctx.should_stop(), 0 if ready else window - min(window, len(self.batches))
        return self.ctx.should_stop(), 0

    def _say_at_agreement(self) -> Tuple[bool, int]:
        """What this member says at an agreement (``_agreement_flags``), noting the first step it has no batch for
        (asked at the step agreed at: after a re-formation a member that caught up with its group is asked again)."""
        want_stop, short = self._agreement_flags()
        self._own_until = self.replica.step + self.replica.window() - short
        return want_stop, short

    def _recovered(self, error: BaseException) -> bool:
        """After a failed step or boundary: re-form the group if a collective failed (else raise again).
        False when the worker was asked to stop meanwhile."""
        replica = self.replica
        if not replica.collective_failed(error):
            raise error
        self.pipeline.drop_reads()  # the group may skip steps; a step redone looks its rows up again
        if not self._after_pushes_settled(self.pipeline.drain()):
            return False
        try:
            recovered = replica.recover(error)
        except GroupStopped:
            return False
        self._catch_up(replica)
        return recovered

    def _catch_up(self, replica: DenseReplica) -> int:
        """Drop the batches of the steps this member took from another since it last caught up; how many."""
        skipped = replica.steps_skipped - self._skips_taken
        self.batches.skip(skipped)
        self._skips_taken = replica.steps_skipped
        return skipped

    def _formed(self, replica: DenseReplica) -> None:
        """The group (re-)formed: the batches catch up with the step taken (a member that joined takes the
        group's step, not its batches), and data the group shares is dealt again to its members."""
        if self._skips_taken is None:
            self._skips_taken = replica.steps_skipped
        if self._catch_up(replica):  # the group moved on: the reads ahead are for other steps
            self.pipeline.drop_reads()
        if self.shares is not None:
            if replica.group.rank == 0:
                self.claims.alive()  # before its members claim parts
            self.shares.formed(replica.group, replica.step)
            self.pipeline.drop_reads()  # the batches ahead are others now

    def _agreed(self, replica: DenseReplica) -> None:
        """An agreement of a group that shares its data: every member's position, for the next re-formation."""
        self.shares.agreed(replica.group, replica.step)

    def _after_step(self) -> None:
        replica, ctx, step = self.replica, self.ctx, self.replica.step
        reporting = step % self.log_every == 0 or step == self.steps
        if reporting:  # throughput before this step's evaluation, so that the last one is not counted
            if self.losses:  # (none when this member sat out every step since: its last figure stands)
                self.figures["loss"] = sum(self.losses) / len(self.losses)
            if self.steps_sat_out:  # (a followed input: how often this member had no batch while others had)
                self.figures["steps_sat_out"] = self.steps_sat_out
            self.figures.update(samples_per_s=self.samples / (time.monotonic() - self.started),
                                bytes_per_step=replica.bytes_per_step, shard_rebuilds=self.sparse.rebuilds)
            self.figures[ALLREDUCE_FIGURE] = replica.allreduce_ms()
            self.figures.update({f"{PHASE_FIGURE}{phase}": ms for phase, ms in self.times.ms_per_step().items()})
            if self.trainer.caches_rows:
                self.figures.update(self.pipeline.cache.figures())
            self.losses.clear()
        if self.eval_data is not None and replica.group.rank == 0 and (step % self.eval_every == 0
                                                                         or step == self.steps):
            self._evaluate()
        if step % self.eval_every == 0 and step < self.steps:  # (at the end no collective follows)
            try:  # every member, whatever data it was handed: rank 0 says it is done, evaluation or not
                replica.group.hand_out(None, 0, EVALUATED_WITHIN)
            except GenerationAborted:
                pass  # rank 0 was lost, or the group re-forms: its next collective fails, and it recovers there
        # Every step: the step reached (a progress bar moves with it), with the figures of the last log window.
        self._report(step)
        if reporting:
            held_out = (f", held-out AUC {self.figures['auc']:.4f} log loss {self.figures['log_loss']:.4f}"
                        if "auc" in self.figures else "")
            logger.info("%s step %d/%d: loss %.4f%s, %.0f samples/s, %s %d bytes/step", ctx.rpc_name, step,
                        self.steps, self.figures.get("loss", float("nan")), held_out, self.figures["samples_per_s"],
                        self.trainer.comm_hook, replica.bytes_per_step)

    def _report(self, step: int) -> None:
        """The figures so far to the coordinator (the numbers among them)."""
        self.ctx.report(step, **{k: v for k, v in self.figures.items() if isinstance(v, (int, float))})

    def _evaluate_at_the_end(self) -> None:
        """When the run ended before ``steps`` (its data ended) without being asked to stop: the held-out
        figures of the model as it ended, once."""
        replica = self.replica
        if self.eval_data is None or replica.group.rank != 0 or self.ctx.should_stop() or \
                replica.step in (self.evaluated_at, self.start_step):
            return
        if not self._evaluate():
            return
        self._report(replica.step)
        logger.info("%s step %d (the end of its data): held-out AUC %.4f log loss %.4f", self.ctx.rpc_name,
                    replica.step, self.figures["auc"], self.figures["log_loss"])

    def _evaluate(self) -> bool:
        """The held-out figures of the model with every update applied, into ``figures`` (``evaluated_at``: this
        step).  A lost shard met by the evaluation's lookups is waited for and the sparse part rebuilt, as for a
        step's, and the evaluation is done again (within the rebuilds' bound: ``ShardLost`` past it).  False
        when the worker was asked to stop meanwhile (no figures)."""
        module, device = self.replica.module, self.replica.group.device

        def score(batch: Batch) -> Tensor:
            batch.check(self.trainer.tables)  # bad held-out input ends the job naming what was wrong, not a rebuild
            try:
                pooled = self.sparse.eval_pool(batch)
            except (RuntimeError, TimeoutError) as error:
                raise ShardStepFailed(error) from error
            return module({name: rows.to(device) for name, rows in pooled.items()}, batch.dense.to(device))

        was_training = module.training
        module.eval()
        try:
            if not self._after_pushes_settled(self.pipeline.drain()):
                return False
            while True:
                try:
                    self.figures.update(evaluate(score, self.eval_data))
                except ShardStepFailed as error:  # (the rebuild drains; its rebuilds count with the steps')
                    if not self._after_pushes_settled([], rebuild_for=error.cause):
                        return False
                    continue
                self.evaluated_at = self.replica.step
                return True
        finally:
            module.train(was_training)


def _refusal_in(cause: Optional[BaseException]) -> Optional[ShardRefused]:
    """The ``ShardRefused`` a failed lookup or push carries when shards refused it (rather than being lost)."""
    while cause is not None:
        if isinstance(cause, ShardRequestFailed):
            return cause.refusal()
        cause = cause.__cause__
    return None


def _live_exports(trainer: Trainer, ctx, replica) -> Optional[LiveExports]:
    """Trainer group 0's live exports: as the Trainer was told (``export_to``), else as the cluster says
    (``ps-server --export-dir``: ``ctx.exports``); ``None`` when there are none or this is another group."""
    if ctx.trainer_group != 0:
        return None
    if trainer.export_to is not None:
        return LiveExports(trainer.export_to, trainer.export_every, trainer.export_base_every, replica,
                           list(ctx.shards), trainer.model_description, trainer.export_storage_options,
                           keep=trainer.keep_exports)
    settings = getattr(ctx, "exports", None)
    if settings is None or not settings.directory:
        return None
    return LiveExports(settings.directory, settings.every_steps, settings.base_every, replica, list(ctx.shards),
                       trainer.model_description, settings.storage_options,
                       keep=trainer.keep_exports or getattr(settings, "keep", 0))


def _position(saved) -> Optional[Dict[str, Any]]:
    """A data position from a checkpoint (older checkpoints saved a plain step count)."""
    if saved is None:
        return None
    return saved if isinstance(saved, dict) else {"used": int(saved), "state": None}
