"""One training step of a Trainer, in three phases, and what each phase's failure means.

Owns ``train_step``: the rows (read ahead by an earlier step's push, or
looked up now: one RPC per shard for every table it serves; see
``pipeline.RowPipeline``), the forward and one backward pass under DDP
(the comm hook all-reduces the dense gradients; the looked-up rows get
theirs), during which the push leaves (one RPC per shard: the row
gradients, applied there on arrival by the shard's optimizer, carrying a
later step's lookups) as soon as the rows' gradients are computed,
overlapping the all-reduce, then the dense optimizer's step while the
push is applied, then the wait for the push the staleness bound names
(this step's, with the default staleness 0).  Its phases decide what a
failure means, so that no update is applied twice:

1. Lookups fail (a lost shard) -> ``ShardStepFailed``: nothing of the
   step happened in the group yet, so the step can be redone.
2. The dense backward fails -> a collective of the group failed (a lost
   member): the error propagates; the group re-forms and the step is
   redone (``DenseReplica.recover``).  Nothing of its dense part was
   applied; its push may have been: pushes are idempotent per (pusher,
   step) on the shards, so the redone step's push is not applied again
   (and when the group takes another member's state and skips the step,
   this worker's push of it, if it left, counts once).
3. The push fails against a shard after the all-reduce -> the dense step
   goes on (the group took it together).  Returned, not raised (with
   staleness, by the step that waits for it).  Failed against a lost
   shard, the push is kept and sent again to that shard once the sparse
   part is rebuilt (the shard skips it if it applied it already: a
   restarted shard replays its push log); refused by a shard, or still
   failing when the worker ends or gives up, the step's sparse update is
   lost (some shards may have applied their part), never applied twice.
"""

import time
from typing import Callable, Dict, List, Optional, Tuple

from torch import Tensor

from ..ddp import DenseReplica
from ..logs import one_line
from .contract import Batch
from .pipeline import RowPipeline
from .sparse import SparseTables


class ShardStepFailed(RuntimeError):
    """A step's lookups failed against a shard, before any collective of the trainer group: it can be redone
    (so can an evaluation's, which has no collective)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"embedding lookups failed: {one_line(cause)}")
        self.cause = cause


#: Where a step's time goes, in order (``StepTimes``): name -> what it covers.
PHASES = {"data": "data (the step's batch)", "lookups": "lookups", "forward": "dense forward + loss",
          "backward": "backward (DDP allreduce; the push leaves)", "dense_step": "dense step",
          "push_wait": "push wait"}


class StepTimes:
    """Seconds spent in each of ``PHASES`` over the steps timed, for the job's figures and benchmarks."""

    def __init__(self):
        self.seconds: Dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._last = 0.0

    def start(self) -> None:
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """``phase`` ended now (it began at the last mark or ``start``)."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def ms_per_step(self) -> Dict[str, float]:
        return {phase: 1e3 * seconds / max(1, self.steps) for phase, seconds in self.seconds.items()}


def train_step(sparse: SparseTables, pipeline: RowPipeline, replica: DenseReplica, batch: Batch,
               loss_fn: Callable[[Tensor, Tensor], Tensor],
               times: Optional[StepTimes] = None, alone: bool = False) -> Tuple[float, List[Tuple[int, BaseException]]]:
    """One step; returns the loss and the steps whose sparse updates failed against a shard (phase 3), with
    why: this step's, or with staleness an earlier one's, found as the pipeline waited for it.
    ``times``: where the step's time went is added there (from its last mark).  ``alone``: an uneven step
    (``DenseReplica.uneven_step``): the dense part runs without DDP and its gradients are averaged over the
    members that have a batch."""
    times = times or StepTimes()
    device = replica.group.device
    step, collection = replica.step, sparse.collection
    try:
        lookup = pipeline.rows(collection, step, batch)
        pooled = lookup.pooled()
    except (RuntimeError, TimeoutError) as error:
        raise ShardStepFailed(error) from error
    times.mark("lookups")
    forward = replica.module if alone else replica  # (an uneven step: no DDP, so no collective in it)
    logits = forward({name: rows.to(device) for name, rows in pooled.items()}, batch.dense.to(device))
    loss = loss_fn(logits, batch.labels.to(device))
    times.mark("forward")
    # The push leaves as soon as the backward pass has the rows' gradients, while DDP's last all-reduce is in
    # flight, carrying a later step's lookups; it is idempotent per step, so a step redone after that
    # all-reduce failed is not applied twice.
    push = pipeline.push(lookup, step)
    loss.backward()
    if alone:
        replica.average_over_present(True)
    times.mark("backward")
    replica.finish_step()  # the dense optimizer's step, while the push travels and is applied
    times.mark("dense_step")
    sparse_failures = pipeline.pushed(step, push)
    times.mark("push_wait")
    times.steps += 1
    return loss.item(), sparse_failures
