"""The training step, owned by the framework: ``Trainer``, and the ``Table`` and ``Batch`` a job hands it.

Where the planes meet for a job: the Trainer drives the data plane
(tables on the shards, ``paramserver.shards``), the trainer group
(``paramserver.ddp``) and the cluster's checkpoints
(``paramserver.checkpoint``) through the job's ``JobContext``, and owns
what happens when any of them fails.  Modules: ``contract`` (Table,
Batch), ``sparse`` (tables on the shards, lost shards), ``step`` (one
step), ``data`` (the data position), ``evaluation`` (AUC, log loss),
``checkpoints`` (the trainers' checkpoint protocol: when group 0 writes
one, its collectives and the RPC to every shard, the restore point),
``shares`` and ``claims`` (a followed input read by a group's members,
and by several groups), ``trainer`` (the loop).
"""

from .contract import Batch, Table
from .evaluation import auc, log_loss
from .trainer import Trainer

__all__ = ["Batch", "Table", "Trainer", "auc", "log_loss"]
