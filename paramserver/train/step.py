"""One training step of a Trainer, in three phases, and what each phase's failure means.

Owns ``train_step``: the lookups on the shards, the dense forward and
backward under DDP (the comm hook all-reduces the dense gradients), then
the sparse backward (row gradients to the shards) and the shards'
optimizer step, then the dense optimizer step.  Its phases decide what a
failure means, so that no update is applied twice:

1. Lookups fail (a lost shard) -> ``ShardStepFailed``: nothing of the
   step happened in the group yet, so the step can be redone.
2. The dense backward fails -> a collective of the group failed (a lost
   member): the error propagates; the group re-forms and the step is
   redone (``DenseReplica.recover``).  Nothing of it was applied.
3. The sparse update fails against a shard after the all-reduce -> the
   dense step goes on (the group took it together); this worker's sparse
   update of the step is lost (some shards may have applied their part),
   never applied twice.  Returned, not raised.
"""

from typing import Callable, Dict, Optional, Tuple

import torch
import torch.distributed.autograd as dist_autograd
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
    with dist_autograd.context() as context_id:
        try:
            pooled = sparse.pool(batch)
        except (RuntimeError, TimeoutError) as error:
            raise ShardStepFailed(error) from error
        # The dense part trains on leaves: its backward (and all-reduce) ends at them, and their gradients
        # start the sparse backward, to the shards, in phase 3.
        leaves: Dict[str, Tensor] = {name: rows.detach().to(device).requires_grad_() for name, rows in pooled.items()}
        logits = replica(leaves, batch.dense.to(device))
        loss = loss_fn(logits, batch.labels.to(device))
        loss.backward()
        sparse_failure = None
        try:
            roots = [(pooled[name] * leaf.grad.to(pooled[name].device)).sum()
                     for name, leaf in leaves.items() if leaf.grad is not None]
            if roots:
                dist_autograd.backward(context_id, [torch.stack(roots).sum()])
            sparse.optimizer.step(context_id)
        except (RuntimeError, TimeoutError) as error:
            sparse_failure = error
    replica.finish_step()
    return loss.item(), sparse_failure
