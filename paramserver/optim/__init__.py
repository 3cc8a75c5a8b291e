"""Optimizers for parameter servers.

Owns the optimizer side of paramserver: the local optimizers of its own (``QHM``, ``RowWiseAdagrad``,
``FTRL``), the functional optimizers that shard servers run over the rows they hold (``FunctionalQHM``,
``FunctionalSGD``, ``FunctionalAdagrad``, ``FunctionalAdam``, ``FunctionalRowWiseAdagrad``,
``FunctionalFTRL``: TorchScript classes, eager where TorchScript is off), the one row-sparse driver they
all run on (``RowState``, ``RowStep``), one record per row-wise optimizer (``records``: its state, checks,
refusals on rows, capabilities, row update, read by the shard, the job, the docs and the tests), the
``functional_optim_map`` registry, ``ScriptedOptimizer`` to run
a functional optimizer compiled from Python, and ``DistributedOptimizer``, which runs them where the
parameters live (its RPC side in ``distributed``; the shard's side is ``paramserver.shards.server.optimizers``).

The functional classes are TorchScript-compatible Python classes, compiled where they are first used (a
shard's step module, ``ScriptedOptimizer``, ``register_functional_optim``), not at import: every process of
a cluster imports this package, and most never run them.
"""

from .distributed import DistributedOptimizer, OwnerFailedError
from .ftrl import FTRL, FunctionalFTRL
from .functional_adagrad import FunctionalAdagrad
from .functional_adam import FunctionalAdam
from .functional_qhm import FunctionalQHM
from .functional_sgd import FunctionalSGD
from .qhm import QHM
from .records import JobChoice, RowOptimizer, RowRefusal, StateKind
from .registry import check_functional_contract, functional_optim_map, register_functional_optim
from .row_sparse import RowState, RowStep
from .rowwise_adagrad import FunctionalRowWiseAdagrad, RowWiseAdagrad
from .scripted import ScriptedOptimizer

__all__ = [
    "QHM",
    "RowWiseAdagrad",
    "FTRL",
    "DistributedOptimizer",
    "OwnerFailedError",
    "FunctionalQHM",
    "FunctionalSGD",
    "FunctionalAdagrad",
    "FunctionalAdam",
    "FunctionalRowWiseAdagrad",
    "FunctionalFTRL",
    "RowState",
    "RowStep",
    "RowOptimizer",
    "StateKind",
    "RowRefusal",
    "JobChoice",
    "ScriptedOptimizer",
    "functional_optim_map",
    "register_functional_optim",
    "check_functional_contract",
]
