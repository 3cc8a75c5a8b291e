"""The default job: a CTR-style hybrid model, the classic parameter-server workload.

Sparse part: one ``ShardedEmbeddingBag`` per categorical feature, living on
the shards and shared by every worker (tables whole on one shard, placed by
size, unless they have ``row_wise_min_rows`` or more: those are split by
rows over all shards; splitting a small table only adds messages),
updated there by ``DistributedOptimizer(QHM)``.  Dense part: an MLP over
the pooled embeddings and the dense features, replicated in the worker's
trainer group (``DenseReplica``: DDP with the chosen comm hook) and
updated by a local QHM.  Data: ``ctr_data.PlantedCTR``, every worker
reading its own stream; the held-out AUC is reported next to the planted
model's (the best any model can do).

Each worker logs a plain line every ``log_every`` steps and reports its
figures to the coordinator (``ps-ctl status`` and ``ps-demo`` show them).
Returns the final figures: steps, loss (and first_loss: the first log
window's), auc and oracle_auc (rank 0 of the group evaluates),
samples_per_s, bytes_per_step, a checksum of the dense replica, equal
on every member of a group, and the job's history: reformations,
recoveries (re-formations after a lost member), sparse_steps (steps whose
sparse update this worker applied), sparse_steps_lost (steps whose sparse
update failed against a lost shard after the group's all-reduce),
steps_skipped (steps it took from the group instead of training them),
shard_rebuilds and checkpoints; from ``start_step`` (0, or the restored
checkpoint's step), sparse_steps + sparse_steps_lost + steps_skipped =
steps - start_step.

Faults (see ``train_step`` for why no update is applied twice): a failed
collective (a member of the trainer group was lost) re-forms the group and
the step is done again (``DenseReplica.recover``); a shard lost during the
lookups makes the worker wait for ``ps-server`` to restart it from the
newest checkpoint, rebuild its handles (``SparsePart``) and do the step
again; any other error ends the job.  Trainer group 0 writes checkpoints
(``TrainerCheckpoints``) and a restored cluster starts from one.

The sparse learning rate looks large because the loss is a batch mean: a
row's gradient is its samples' share of 1/batch_size.  The defaults were
tuned on the planted data (1500 steps of 2 x 1024 samples reach about
0.015 below the oracle AUC in a single-process simulation of this update).
"""

import logging
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.autograd as dist_autograd
from torch import nn

from paramserver.ddp import DenseReplica, GroupStopped
from paramserver.optim import QHM, DistributedOptimizer
from paramserver.runtime.checkpointing import TrainerCheckpoints, restore_point
from paramserver.runtime.shard_loss import SparsePart
from paramserver.shards import ShardedEmbeddingBag, plan_dense
from workers.ctr_data import Batch, CTRSpec, PlantedCTR, auc

logger = logging.getLogger("workers.ctr")


def build_tables(spec: CTRSpec, shards: Sequence[str], embedding_dim: int, row_wise_min_rows: int,
                 name: str, seed: int, init_std: float) -> List[ShardedEmbeddingBag]:
    """One shared table per feature: small ones placed whole by size, big ones split by rows."""
    names = [f"{name}.feature{i}" for i in range(len(spec.vocab_sizes))]
    whole = {n: rows * embedding_dim for n, rows in zip(names, spec.vocab_sizes) if rows < row_wise_min_rows}
    plan = plan_dense(whole, list(shards)) if whole else {}
    return [ShardedEmbeddingBag(rows, embedding_dim, "sum" if bag == 1 else "mean",
                                shards=[plan[n]] if n in plan else shards, name=n, seed=seed + i,
                                shared=True, init_std=init_std)
            for i, (n, rows, bag) in enumerate(zip(names, spec.vocab_sizes, spec.bag_sizes))]


def dense_tower(num_inputs: int, hidden: Sequence[int]) -> nn.Module:
    layers: List[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(num_inputs, width), nn.ReLU()]
        num_inputs = width
    layers.append(nn.Linear(num_inputs, 1))
    return nn.Sequential(*layers)


def pooled_features(tables: Sequence[ShardedEmbeddingBag], batch: Batch, device: torch.device) -> torch.Tensor:
    """Every table's pooled embeddings and the dense features, side by side (lookups overlap)."""
    pending = [table.start(ids) for table, ids in zip(tables, batch.ids)]
    return torch.cat([finish() for finish in pending] + [batch.dense], 1).to(device, non_blocking=True)


@torch.no_grad()
def held_out_auc(tables, tower: nn.Module, holdout: List[Batch], device: torch.device) -> float:
    was_training = tower.training
    tower.eval()
    scores = torch.cat([tower(pooled_features(tables, batch, device)).squeeze(1).cpu() for batch in holdout])
    tower.train(was_training)
    return auc(scores, torch.cat([batch.labels for batch in holdout]))


#: PowerSGD options of this job unless given: compress from step 10 (torch's
#: default, 1000, would leave most of a short run uncompressed).
POWERSGD_DEFAULTS = {"start_iter": 10}


def main(ctx, steps: int = 1500, batch_size: int = 1024, hook: str = "powersgd",
         hook_options: Optional[Dict] = None, embedding_dim: int = 16, hidden: Sequence[int] = (128, 64),
         sparse_lr: float = 128.0, dense_lr: float = 0.5, momentum: float = 0.9, nu: float = 0.7,
         init_std: float = 0.01, row_wise_min_rows: int = 1_000_000, holdout_size: int = 20_000,
         eval_every: int = 500, log_every: int = 100, seed: int = 0, spec: Optional[Dict] = None,
         table_name: str = "ctr") -> dict:
    data = PlantedCTR(CTRSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in (spec or {}).items()}),
                      seed=seed)
    holdout = data.holdout(holdout_size)
    oracle_auc = auc(torch.cat([b.true_logits for b in holdout]), torch.cat([b.labels for b in holdout]))
    try:
        group = ctx.join_trainer_group()
    except GroupStopped:  # asked to stop before the group formed: nothing trained, nothing to report
        logger.info("%s: stopped before its trainer group formed", ctx.rpc_name)
        return {"steps": 0, "oracle_auc": oracle_auc}

    def build_sparse(shards: Sequence[str]) -> Tuple[List[ShardedEmbeddingBag], DistributedOptimizer]:
        tables = build_tables(data.spec, shards, embedding_dim, row_wise_min_rows, table_name, seed, init_std)
        return tables, DistributedOptimizer(QHM, [r for t in tables for r in t.remote_parameters()],
                                            lr=sparse_lr, momentum=momentum, nu=nu)

    sparse = SparsePart(build_sparse, ctx.shards, ctx.live_shards, ctx.refresh)
    torch.manual_seed(seed)  # every replica starts equal (DDP copies rank 0's anyway)
    tower = dense_tower(len(sparse.built[0]) * embedding_dim + data.spec.num_dense, hidden)
    hook_options = dict(POWERSGD_DEFAULTS if "powersgd" in hook else {}, **(hook_options or {}))
    replica = DenseReplica(group, tower, lambda params: QHM(params, lr=dense_lr, momentum=momentum, nu=nu),
                           hook=hook, hook_options=hook_options, initial=restore_point(ctx))
    checkpoints = TrainerCheckpoints(ctx, replica)
    loss_fn = nn.BCEWithLogitsLoss()
    figures = {"oracle_auc": oracle_auc}
    losses: List[float] = []
    samples = sparse_steps = sparse_steps_lost = 0
    started, start_step = time.monotonic(), replica.step
    logger.info("%s: %d tables on %s, %s from step %d; oracle held-out AUC %.4f", ctx.rpc_name,
                len(sparse.built[0]), ", ".join(ctx.shards), group.describe(), replica.step, oracle_auc)
    redo = False  # the step again after its lookups failed: its sync point was passed already
    while replica.step < steps and (redo or replica.sync_point(want_stop=ctx.should_stop())):
        redo = False
        batch = data.batch(ctx.worker_index, replica.step, batch_size)
        try:
            loss, sparse_failure = train_step(sparse, replica, batch, loss_fn)
        except Exception as error:  # noqa: BLE001 - failed collectives and lost shards are recovered from
            if replica.collective_failed(error):
                if replica.recover(error):
                    continue  # the step again, from its sync point, in the re-formed group
                break
            if not isinstance(error, ShardStepFailed):
                raise
            # Before any collective of the step: done again, while the group's other members wait for it
            # in the step's all-reduce (up to the collective timeout).
            sparse.rebuild(error.cause)
            redo = True
            continue
        if sparse_failure is None:
            sparse_steps += 1
            sparse.step_succeeded()
        else:  # failed against a shard after the group's all-reduce: the step is not redone
            sparse_steps_lost += 1
            sparse.rebuild(sparse_failure)
        try:
            checkpoints.after_step()  # a collective on some steps: a member lost there is recovered from too
        except Exception as error:  # noqa: BLE001 - only a failed collective; the checkpoint is skipped
            if not replica.collective_failed(error):
                raise
            if not replica.recover(error):
                break
        samples += len(batch)
        losses.append(loss)
        step = replica.step
        reporting = step % log_every == 0 or step == steps
        if reporting:  # throughput before this step's evaluation, so that the last one is not counted
            figures.update(loss=sum(losses) / len(losses), samples_per_s=samples / (time.monotonic() - started),
                           bytes_per_step=replica.bytes_per_step, shard_rebuilds=sparse.rebuilds)
            figures.setdefault("first_loss", figures["loss"])
            losses.clear()
        if group.rank == 0 and (step % eval_every == 0 or step == steps):
            figures["auc"] = held_out_auc(sparse.built[0], tower, holdout, group.device)
        if reporting:
            ctx.report(step, **figures)
            logger.info("%s step %d/%d: loss %.4f%s, %.0f samples/s, %s %d bytes/step", ctx.rpc_name, step, steps,
                        figures["loss"], f", held-out AUC {figures['auc']:.4f} (oracle {oracle_auc:.4f})"
                        if "auc" in figures else "", figures["samples_per_s"], hook, replica.bytes_per_step)
    replica.close()
    # Equal on every member of the group: DDP keeps the replicas identical.
    checksum = sum(float(p.detach().double().sum()) for p in tower.parameters())
    return dict(figures, steps=replica.step, start_step=start_step, group_rank=group.rank,
                group_size=group.world_size, reformations=replica.reformations, recoveries=replica.recoveries,
                sparse_steps=sparse_steps, sparse_steps_lost=sparse_steps_lost, steps_skipped=replica.steps_skipped,
                shard_rebuilds=sparse.rebuilds, checkpoints=len(checkpoints.written), replica_checksum=checksum)


class ShardStepFailed(RuntimeError):
    """A step's lookups failed against a shard, before any collective of the trainer group: it can be redone."""

    def __init__(self, cause: BaseException):
        super().__init__(f"embedding lookups failed: {type(cause).__name__}: {cause}")
        self.cause = cause


def train_step(sparse: SparsePart, replica: DenseReplica, batch: Batch, loss_fn) -> Tuple[float, Optional[Exception]]:
    """One step in three phases; returns the loss and, if the sparse update failed against a shard, its error.

    1. Lookups on the shards: a failure raises ``ShardStepFailed`` (nothing
       happened in the group yet: the step can be redone).
    2. The dense part's forward and backward: DDP all-reduces its gradients
       through the comm hook; a failure there is the group's (``DenseReplica.recover``).
    3. The sparse backward (the pooled embeddings' gradients, sent to their
       shards) and the shards' optimizer step, then the dense optimizer step.
       A shard failing here does not stop the dense step, which the group
       took together: that worker's sparse update of the step is lost (some
       shards may have applied their part), never applied twice.

    No update of the step is applied before its all-reduce completed.
    """
    tables, sparse_optimizer = sparse.built
    device = replica.group.device
    with dist_autograd.context() as context_id:
        try:
            pooled = pooled_features(tables, batch, torch.device("cpu"))
        except (RuntimeError, TimeoutError) as error:
            raise ShardStepFailed(error) from error
        inputs = pooled.detach().to(device).requires_grad_()
        loss = loss_fn(replica(inputs).squeeze(1), batch.labels.to(device))
        loss.backward()
        sparse_failure = None
        try:
            dist_autograd.backward(context_id, [(pooled * inputs.grad.to(pooled.device)).sum()])
            sparse_optimizer.step(context_id)
        except (RuntimeError, TimeoutError) as error:
            logger.warning("the sparse update of step %d failed against the shards; the dense one goes on: %s",
                           replica.step, str(error).strip().splitlines()[0] if str(error).strip() else error)
            sparse_failure = error
    replica.finish_step()
    return loss.item(), sparse_failure
