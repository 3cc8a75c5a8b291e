"""Optimizers for parameter servers.

Owns the optimizer side of paramserver: the local ``QHM``, the TorchScript
functional optimizers that shard servers run (``FunctionalQHM``,
``FunctionalSGD``), the ``functional_optim_map`` registry, and
``ScriptedOptimizer`` to run a functional optimizer compiled from Python,
and ``DistributedOptimizer``, which runs them where the parameters live
(its RPC side in ``distributed``, its owner side in ``owner``).
"""

from .distributed import DistributedOptimizer, OwnerFailedError
from .functional_qhm import FunctionalQHM
from .functional_sgd import FunctionalSGD
from .qhm import QHM
from .registry import check_functional_contract, functional_optim_map, register_functional_optim
from .scripted import ScriptedOptimizer

__all__ = [
    "QHM",
    "DistributedOptimizer",
    "OwnerFailedError",
    "FunctionalQHM",
    "FunctionalSGD",
    "ScriptedOptimizer",
    "functional_optim_map",
    "register_functional_optim",
    "check_functional_contract",
]
