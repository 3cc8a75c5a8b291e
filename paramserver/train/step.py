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

from typing import Callable, Optional, Tuple

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


def train_step(sparse: SparseTables, replica: DenseReplica, batch: Batch,
               loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Tuple[float, Optional[Exception]]:
    """One step; returns the loss and, if the sparse update failed against a shard (phase 3), its error."""
    device = replica.group.device
    try:
        lookup = sparse.lookup(batch)
        pooled = lookup.pooled()
    except (RuntimeError, TimeoutError) as error:
        raise ShardStepFailed(error) from error
    logits = replica({name: rows.to(device) for name, rows in pooled.items()}, batch.dense.to(device))
    loss = loss_fn(logits, batch.labels.to(device))
    loss.backward()
    sparse_failure = push = None
    try:
        push = lookup.push()
    except (RuntimeError, TimeoutError) as error:
        sparse_failure = error
    replica.finish_step()  # the dense optimizer's step, while the push travels and is applied
    if push is not None:
        try:
            push.wait()
        except (RuntimeError, TimeoutError) as error:
            sparse_failure = error
    return loss.item(), sparse_failure
