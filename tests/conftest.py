"""Shared pytest fixtures for paramserver's tests: deterministic seeds and
the two ways a functional optimizer runs (eager Python, compiled TorchScript)."""

import pytest
import torch

from paramserver.optim import ScriptedOptimizer


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(params=["eager", "scripted"])
def build_functional(request):
    """Build a functional optimizer either as a plain Python object or compiled."""
    def build(functional_cls, params, **hyperparameters):
        if request.param == "scripted":
            return ScriptedOptimizer(functional_cls, params, **hyperparameters)
        return functional_cls(params, **hyperparameters)
    build.mode = request.param
    return build
