"""Shared pytest fixtures for paramserver's tests: deterministic seeds, the
two ways a functional optimizer runs (eager Python, compiled TorchScript),
and a guard that no test leaves a child process behind."""

import multiprocessing
import os
import shutil
import subprocess

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


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs mounted for the test (root and mount(8) needed: skipped with the reason elsewhere)."""
    mount = shutil.which("mount")
    if os.geteuid() != 0 or mount is None:
        pytest.skip("a full disk needs a tiny tmpfs: root and mount(8)")
    point = tmp_path / "tiny"
    point.mkdir()
    made = subprocess.run([mount, "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(point)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"could not mount a tmpfs: {made.stderr.strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=True)
