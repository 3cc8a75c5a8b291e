"""One training step of a Trainer, in three phases, and what each phase's failure means.

Owns ``train_step``: the lookups (one RPC per shard for every table it
serves), the forward and one backward pass under DDP (the comm hook
all-reduces the dense gradients; the looked-up rows get theirs), then the
push (one RPC per shard: the row gradients, applied there on arrival by
the shard's optimizer) while the dense optimizer steps.  Its phases decide
what a failure means, so that no update is applied twice:

1. Lookups fail (a lost shard) -> ``ShardStepFailed``: nothing of the
   step happened in the group yet, so the step can be redone.
2. The dense backward fails -> a collective of the group failed (a lost
   member): the error propagates; the group re-forms and the step is
   redone (``DenseReplica.recover``).  Nothing of it was applied.
3. The push fails against a shard after the all-reduce -> the dense step
   goes on (the group took it together); this worker's sparse update of
   the step is lost (some shards may have applied their part), never
   applied twice.  Returned, not raised.

The push is sent only once the backward pass (and so the all-reduce) has
succeeded: sent earlier, from the rows' gradient hooks while the last
all-reduce buckets are in flight, a push could not be taken back when
that all-reduce failed, and the redone step would apply it again.
"""

import time
from typing import Callable, Dict, Optional, Tuple

from torch import Tensor

from ..ddp import DenseReplica
from ..logs import one_line
from .contract import Batch
from .sparse import SparseTables


class ShardStepFailed(RuntimeError):
    """A step's lookups failed against a shard, before any collective of the trainer group: it can be redone."""

    def __init__(self, cause: BaseException):
        super().__init__(f"embedding lookups failed: {one_line(cause)}")
        self.cause = cause


#: Where a step's time goes, in order (``StepTimes``): name -> what it covers.
PHASES = {"data": "data (the step's batch)", "lookups": "lookups", "forward": "dense forward + loss",
          "backward": "backward (DDP allreduce)", "dense_step": "push sent + dense step", "push_wait": "push wait"}


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


def train_step(sparse: SparseTables, replica: DenseReplica, batch: Batch,
               loss_fn: Callable[[Tensor, Tensor], Tensor],
               times: Optional[StepTimes] = None) -> Tuple[float, Optional[Exception]]:
    """One step; returns the loss and, if the sparse update failed against a shard (phase 3), its error.
    ``times``: where the step's time went is added there (from its last mark)."""
    times = times or StepTimes()
    device = replica.group.device
    try:
        lookup = sparse.lookup(batch)
        pooled = lookup.pooled()
    except (RuntimeError, TimeoutError) as error:
        raise ShardStepFailed(error) from error
    times.mark("lookups")
    logits = replica({name: rows.to(device) for name, rows in pooled.items()}, batch.dense.to(device))
    loss = loss_fn(logits, batch.labels.to(device))
    times.mark("forward")
    loss.backward()
    times.mark("backward")
    sparse_failure = push = None
    try:
        push = lookup.push()
    except (RuntimeError, TimeoutError) as error:
        sparse_failure = error
    replica.finish_step()  # the dense optimizer's step, while the push travels and is applied
    times.mark("dense_step")
    if push is not None:
        try:
            push.wait()
        except (RuntimeError, TimeoutError) as error:
            sparse_failure = error
    times.mark("push_wait")
    times.steps += 1
    return loss.item(), sparse_failure
