"""The floor of ``benchmarks/end_to_end.py``: the default CTR job trained in one process, no RPC, no DDP.

Owns the single-process training loop that sets how fast the default job
can go on this host with no distribution at all: what a parameter server
costs is measured against it.  The same model as the job (``paramserver/jobs/ctr.py``):
the tables of ``CTRSpec()`` (dimension 16, rows N(0, 0.01), "sum" for one id
per sample, "mean" for bags; rows drawn as ``reference_hybrid.CTREmbeddingBag``
draws them), each step's distinct rows read once and pooled as the workers
pool them (``LocalCTR``), the job's ``Tower`` built after
``torch.manual_seed(seed)``, ``BCEWithLogitsLoss``; the same batches, as the
job's two workers draw them (step ``s`` trains on
``PlantedCTR(seed=0).batch(w, s, batch)`` of every worker ``w``, joined: the
global batch, 2 x 1024 samples by default, made inside the timed loop, the
next step's in a background thread while a step trains, as the job's
Trainer reads ahead; ``--no-read-ahead`` makes it when its step starts);
the same update, QHM with the job's defaults (momentum 0.9, nu 0.7):

* the tower: ``paramserver.optim.QHM`` at the dense lr 0.5 on the global
  batch's mean loss, as the job's DDP all-reduce (a mean over the workers)
  followed by its local QHM;
* the tables: row-sparse, as the shards: ``FunctionalQHM`` (scripted, as the
  shards run it) steps only the rows the step touched and their momentum
  (the distinct rows' gradients, row-sparse).  On the
  shards every worker's push (the gradient of its own 1024-sample mean
  loss) is applied at the sparse lr 128; here the rows get one step with
  the sum of the workers' gradients at lr 128 (implemented as lr 128 x
  workers on the global mean's gradient, the same update since QHM is
  linear in the gradient): each row moves as far per step as in the job,
  in one momentum step instead of one per worker.

Run alone: ``python benchmarks/local_floor.py [--steps N] [--batch N]
[--workers N] [--threads T] [--no-read-ahead]`` (``--threads``: intra-op threads, default
every core of the host, ``paramserver.runtime.threads.host_cores``); it
prints one line of JSON.  ``train`` is the contestant ``end_to_end.py``
runs (in a child process of its own).  Throughput is measured as
end_to_end measures the others: samples over the wall time from the start
of the first step to the end of the last, batch generation included
(tables' creation excluded); CPU seconds are this process's (every thread)
over the same window.
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # reference_hybrid, also in spawned children

from reference_hybrid import CTREmbeddingBag  # noqa: E402

from paramserver.optim import QHM, FunctionalQHM, ScriptedOptimizer  # noqa: E402
from paramserver.runtime.threads import host_cores  # noqa: E402
from paramserver.jobs.ctr import Tower  # noqa: E402
from paramserver.jobs.ctr_data import Batch, CTRSpec, PlantedCTR, feature_names  # noqa: E402

#: The job's defaults (paramserver/jobs/ctr.py main) that the floor and the reference copy.
JOB_DEFAULTS = dict(embedding_dim=16, hidden=[128, 64], sparse_lr=128.0, dense_lr=0.5, momentum=0.9, nu=0.7,
                    init_std=0.01, seed=0)
#: The job's shape in end_to_end: workers, each reading batches of this size.
WORKERS, WORKER_BATCH = 2, 1024
#: Phases of a floor step whose mean time ``train`` reports.
PHASES = ("data", "forward + loss", "backward", "sparse step", "dense step")


def global_batch(data: PlantedCTR, workers: int, step: int, batch_size: int) -> Batch:
    """Step ``step``'s batches of every worker (worker ``w`` reads stream ``w``, as the job's do), joined."""
    parts = [data.batch(worker, step, batch_size) for worker in range(workers)]
    return Batch(ids=[torch.cat(feature) for feature in zip(*(part.ids for part in parts))],
                 dense=torch.cat([part.dense for part in parts]), labels=torch.cat([part.labels for part in parts]),
                 true_logits=torch.cat([part.true_logits for part in parts]))


class LocalCTR(nn.Module):
    """The job's model in one process: a table per feature and the job's ``Tower``.

    A step reads each table's distinct rows once (``torch.unique``), pools
    them with a gather and a reduction (what the workers' ``Route.pool``
    does: its backward is one ``index_add``, several times faster on CPU than
    ``EmbeddingBag``'s), and hands back the row-sparse gradient of the rows
    it read (``sparse_gradients``), as a worker pushes them.
    """

    def __init__(self, spec: CTRSpec, embedding_dim: int, hidden: Sequence[int], init_std: float, seed: int):
        super().__init__()
        self.features = feature_names(spec)
        self.modes = ["sum" if bag == 1 else "mean" for bag in spec.bag_sizes]
        # The rows the reference's tables start from (CTREmbeddingBag draws them), held as plain tensors.
        self.weights = [CTREmbeddingBag(rows, embedding_dim, mode, True, init_std, seed + index).weight.detach()
                        for index, (rows, mode) in enumerate(zip(spec.vocab_sizes, self.modes))]
        torch.manual_seed(seed)  # the job's tower initialisation
        self.tower = Tower(self.features, embedding_dim, spec.num_dense, hidden)
        self._read: List[tuple] = []

    def forward(self, ids: List[torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        pooled, self._read = {}, []
        for name, weight, mode, feature_ids in zip(self.features, self.weights, self.modes, ids):
            distinct, inverse = torch.unique(feature_ids.reshape(-1), return_inverse=True)
            rows = weight.index_select(0, distinct).requires_grad_()
            if feature_ids.size(1) == 1:  # bags of one id are their row (as Route.pool takes them)
                pooled[name] = rows.index_select(0, inverse)
            else:
                bags = rows.index_select(0, inverse).view(feature_ids.size(0), feature_ids.size(1), rows.size(1))
                pooled[name] = bags.sum(1) if mode == "sum" else bags.mean(1)
            self._read.append((distinct, rows))
        return self.tower(pooled, dense)

    def sparse_gradients(self) -> List[torch.Tensor]:
        """The last backward pass's gradients of the rows it read, row-sparse, one per table."""
        return [torch.sparse_coo_tensor(distinct.unsqueeze(0), rows.grad, weight.shape, check_invariants=False)
                for (distinct, rows), weight in zip(self._read, self.weights)]


def train(steps: int, batch_size: int = WORKER_BATCH, workers: int = WORKERS, threads: Optional[int] = None,
          loss_window: int = 50, config: Optional[Dict] = None, read_ahead: bool = True, warmup: int = 0) -> Dict:
    """Train the floor for ``steps`` steps of ``workers`` x ``batch_size`` samples with ``threads`` intra-op
    threads (default: every core); with ``read_ahead`` the next step's batch is made in a background thread
    while a step trains (as the job's Trainer reads ahead).  The first ``warmup`` steps are trained but not
    timed (the sparse optimizer's TorchScript compile at its first step, the allocator's and the caches'
    first passes): the window runs from the start of step ``warmup`` to the end of the last.  Returns
    samples_per_s, loss (mean of the last ``loss_window`` steps), cpu_seconds (this process, over the timed
    window), seconds, threads, warmup, samples_per_s_with_warmup (every step timed) and phase_ms (mean per
    timed step; "data": waiting for the batch)."""
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup must be at least 0 and under steps ({steps}), got {warmup}")
    config = dict(JOB_DEFAULTS, **(config or {}))
    threads = threads or host_cores()[0]
    torch.set_num_threads(threads)
    spec = CTRSpec()
    data = PlantedCTR(spec, seed=config["seed"])
    model = LocalCTR(spec, config["embedding_dim"], config["hidden"], config["init_std"], config["seed"])
    qhm = dict(momentum=config["momentum"], nu=config["nu"])
    table_weights = model.weights
    sparse_optimizer = ScriptedOptimizer(FunctionalQHM, table_weights, config["sparse_lr"] * workers, **qhm)
    dense_optimizer = QHM(model.tower.parameters(), lr=config["dense_lr"], **qhm)
    loss_fn = nn.BCEWithLogitsLoss()
    losses: List[float] = []
    phases = {phase: 0.0 for phase in PHASES}
    reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="floor-data") if read_ahead else None
    first_started = time.monotonic()
    started, cpu_started = first_started, time.process_time()
    ahead = reader.submit(global_batch, data, workers, 0, batch_size) if reader else None
    for step in range(steps):
        if step == warmup and step:  # the timed window starts here
            started, cpu_started = time.monotonic(), time.process_time()
            phases = {phase: 0.0 for phase in PHASES}
        t0 = time.perf_counter()
        if ahead is None:
            batch = global_batch(data, workers, step, batch_size)
        else:
            batch = ahead.result()
            if step + 1 < steps:
                ahead = reader.submit(global_batch, data, workers, step + 1, batch_size)
        t1 = time.perf_counter()
        loss = loss_fn(model(batch.ids, batch.dense), batch.labels)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        sparse_optimizer.step(model.sparse_gradients())
        t4 = time.perf_counter()
        dense_optimizer.step()
        t5 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
        for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            phases[phase] += seconds
    ended = time.monotonic()
    elapsed, cpu = ended - started, time.process_time() - cpu_started
    if reader is not None:
        reader.shutdown()
    timed = steps - warmup
    return {"samples_per_s": timed * workers * batch_size / elapsed, "loss": statistics.mean(losses[-loss_window:]),
            "cpu_seconds": cpu, "seconds": elapsed, "threads": threads, "warmup": warmup,
            "samples_per_s_with_warmup": steps * workers * batch_size / (ended - first_started),
            "phase_ms": {phase: 1e3 * seconds / timed for phase, seconds in phases.items()}}


def train_to_file(results_path: str, *args, **kwargs) -> None:
    """Process body for end_to_end: ``train(*args, **kwargs)``, its figures written to ``results_path``."""
    result = train(*args, **kwargs)
    with open(results_path, "w") as out:
        json.dump(result, out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="The default job trained in one process: the floor of end_to_end.")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument("--batch", type=int, default=WORKER_BATCH,
                        help=f"samples per worker per step (default {WORKER_BATCH})")
    parser.add_argument("--workers", type=int, default=WORKERS,
                        help=f"workers whose batches make the global batch (default {WORKERS})")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: every core)")
    parser.add_argument("--log-every", type=int, default=50, help="window of the final loss (default 50)")
    parser.add_argument("--warmup", type=int, default=0,
                        help="steps trained before the timed window starts (default 0: every step timed)")
    parser.add_argument("--no-read-ahead", action="store_true",
                        help="make each step's batch when the step starts, not in a background thread")
    args = parser.parse_args(argv)
    if min(args.steps, args.batch, args.workers, args.log_every, args.threads or 1) < 1:
        parser.error("--steps, --batch, --workers, --threads and --log-every must be at least 1")
    if not 0 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 0 and under --steps")
    print(json.dumps(train(args.steps, args.batch, args.workers, args.threads, args.log_every,
                           read_ahead=not args.no_read_ahead, warmup=args.warmup)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
