"""Shared pytest fixtures for paramserver's tests: deterministic seeds, the
two ways a functional optimizer runs (eager Python, compiled TorchScript),
and a guard that no test leaves a child process behind."""

import multiprocessing

import pytest
import torch

from commands import Commands

from paramserver.optim import ScriptedOptimizer


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_child_left_behind():
    """Fail a test that leaves a child process running (and end that child, by pid)."""
    yield
    leftovers = multiprocessing.active_children()
    for child in leftovers:
        child.kill()
        child.join(10)
    assert not leftovers, f"child processes left running: {[c.name for c in leftovers]}"


@pytest.fixture
def commands(tmp_path):
    """Run the real console scripts; whatever is still running at the end is killed and fails the test."""
    runner = Commands(tmp_path)
    yield runner
    leftovers = runner.reap()
    assert not leftovers, f"processes left running: {leftovers}"


@pytest.fixture(params=["eager", "scripted"])
def build_functional(request):
    """Build a functional optimizer either as a plain Python object or compiled."""
    def build(functional_cls, params, **hyperparameters):
        if request.param == "scripted":
            return ScriptedOptimizer(functional_cls, params, **hyperparameters)
        return functional_cls(params, **hyperparameters)
    build.mode = request.param
    return build
