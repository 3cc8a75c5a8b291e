"""Shared pytest fixtures for paramserver's tests: deterministic seeds, the
two ways a functional optimizer runs (eager Python, compiled TorchScript),
and guards that no test leaves a child process, or a log handler on its
captured stderr, behind; and the order the test files are handed out in."""

import logging
import multiprocessing
import os
import shutil
import subprocess

import pytest
import torch

from commands import Commands

from paramserver.optim import ScriptedOptimizer, functional_optim_map


#: The test files that take longest (each starts clusters of real commands, one after another), longest first:
#: collected first, so that ``make test``'s test processes (pytest-xdist, ``--no-loadscope-reorder``: files
#: handed out in this order) start them at once instead of ending the run on one of them.  It orders only; a
#: file not named runs after these, in its usual order.
LONGEST_FILES = ("test_checkpoints.py", "test_coordinator_restart.py", "test_trainer_group_commands.py",
                 "test_data_shares_cluster.py", "test_object_store_checkpoints.py", "test_cluster_commands.py",
                 "test_fault_bounds.py", "test_distributed_optimizer.py", "test_dense_replica.py", "test_trainer.py",
                 "test_multihost.py", "test_pipeline.py", "test_trainer_chaos.py", "test_launch.py")


def pytest_collection_modifyitems(items):
    rank = {name: k for k, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: a file's tests keep their order)


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


@pytest.fixture(autouse=True)
def _no_log_handler_left_behind():
    """Remove the root logger's stream handlers a test added (a command's ``main`` run in this process sets
    up logging on the test's captured stderr, which is closed after the test: a later line from any thread
    would meet a closed file)."""
    root = logging.getLogger()
    before = list(root.handlers)
    yield
    for handler in list(root.handlers):
        if handler not in before and type(handler) is logging.StreamHandler:
            root.removeHandler(handler)


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


@pytest.fixture(scope="session")
def _s3_server(tmp_path_factory):
    """SeaweedFS's S3 server on loopback, once a session (a test process), its data in the session's
    temporary folder; ended by its pid."""
    from object_store import S3Store
    store = S3Store(tmp_path_factory.mktemp("seaweedfs"))
    yield store
    store.stop()


@pytest.fixture
def s3(_s3_server, monkeypatch):
    """The session's S3 server on loopback, a bucket of this test's own (``s3.bucket``), and its endpoint and
    credentials in the environment (so spawned children reach it too), and fsspec's configuration in this process."""
    import fsspec.config
    for name, value in _s3_server.environment.items():
        monkeypatch.setenv(name, value)
    # fsspec read its FSSPEC_* variables when imported: this process is told as children will be.
    monkeypatch.setitem(fsspec.config.conf, "s3", {**fsspec.config.conf.get("s3", {}),
                                                   "endpoint_url": _s3_server.endpoint})
    _s3_server.bucket = _s3_server.new_bucket()
    return _s3_server


@pytest.fixture
def restore_map():
    """The registry of functional optimizers as it was before the test, whatever the test registered."""
    saved = dict(functional_optim_map)
    yield
    functional_optim_map.clear()
    functional_optim_map.update(saved)
