"""Helpers for the multi-process data-plane tests.

Trainer functions given to ``run_cluster`` run in spawned children, after
joining the RPC group with the shards; they report by asserting (a failed
assertion is a non-zero exit code, which ``run_cluster`` turns into a test
failure, with the child's traceback on stderr).
"""

import datetime
import warnings

import torch

from paramserver.shards.local import run_local_cluster, shard_names  # noqa: F401 - re-exported

CLUSTER_TIMEOUT = datetime.timedelta(seconds=90)


def quiet_warnings():
    """Silence the deprecation chatter of TorchScript in a child process."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message="You are using a Backend")


def run_cluster(trainers, num_shards, **kwargs):
    kwargs.setdefault("timeout", CLUSTER_TIMEOUT)
    return run_local_cluster([(_quietly, (target, tuple(args))) for target, args in trainers], num_shards, **kwargs)


def _quietly(target, args):
    quiet_warnings()
    torch.manual_seed(0)
    target(*args)


def make_param(value: torch.Tensor) -> torch.Tensor:
    """RPC target: a parameter owned by the callee, created with plain torch RPC."""
    return value.clone().requires_grad_(True)


def param_value(rref) -> torch.Tensor:
    """RPC target: the parameter itself (differentiable inside a dist_autograd context)."""
    return rref.local_value()


def owner_pid() -> int:
    import os
    return os.getpid()
