"""Pins every private torch API and every piece of torch's error text that
``paramserver._torch_compat`` relies on, against the real torch: a torch
release that changes one fails here, by name, instead of deep in a cluster.

The RPC items need this process to be a member of an open RPC group, which
a test process that is also a group of one (``JobContext.local``) cannot be:
they run in one child process (``tests/compat_peer.py``, which adds a peer
that dies, the case the group upkeep exists for) and report each check by
name."""

import datetime
import gc
import multiprocessing
import os
import queue
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import compat_peer
from paramserver import _torch_compat as compat

RPC_CHECKS_WITHIN = datetime.timedelta(seconds=120)
# The RPC checks run in the module fixture's set-up (about 20 s), and one that fails may wait out its bound first.
pytestmark = pytest.mark.timeout(RPC_CHECKS_WITHIN.total_seconds() + 30)


@pytest.fixture(scope="module")
def rpc_checks():
    """{check name: None, or its traceback}, from one child process that ran every RPC check."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=compat_peer.run_checks, args=(results,), name="compat-peer")
    child.start()
    outcomes = {}
    try:
        while True:
            name, failure = results.get(timeout=RPC_CHECKS_WITHIN.total_seconds())
            if name == compat_peer.DONE:
                break
            outcomes[name] = failure
        child.join(30)
        assert child.exitcode == 0, f"the RPC checks' process exited {child.exitcode}"
    except queue.Empty:
        # Where it waits: the child writes every thread's stack to its stderr (captured with this test's output).
        os.kill(child.pid, signal.SIGUSR1)
        time.sleep(1)
        done = ", ".join(sorted(outcomes)) or "none"
        pytest.fail(f"the RPC checks did not finish within {RPC_CHECKS_WITHIN} (finished: {done}); the checks' "
                    "process wrote its threads' stacks above")
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)
    return outcomes


@pytest.mark.parametrize("check", [check.__name__ for check in compat_peer.CHECKS])
def test_rpc_internals(rpc_checks, check):
    assert check in rpc_checks, f"{check} did not run"
    assert rpc_checks[check] is None, rpc_checks[check]


def test_tensorpipe_options_take_the_transports():
    options = compat.tensorpipe_options("tcp://127.0.0.1:1", 4, datetime.timedelta(seconds=3), ["uv"])
    assert options.rpc_timeout == 3 and options.num_worker_threads == 4
    with pytest.raises(RuntimeError, match="Unknown transport: shm2"):  # the option reaches TensorPipe
        compat.tensorpipe_options("tcp://127.0.0.1:1", 4, datetime.timedelta(seconds=3), ["shm2"])


@pytest.mark.parametrize("text, expected", [
    ("eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)",
     "eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)"),
    ("", "RuntimeError"),
])
def test_an_error_without_a_type_line_keeps_its_first_line(text, expected):
    assert compat.remote_error_cause(RuntimeError(text)) == expected


def test_a_torchscript_error_gives_back_the_builtin_it_wraps():
    with pytest.raises(torch.jit.Error) as caught:
        compat_peer.scripted_raise(True)
    wrapped = compat.builtin_error_in_script_error(caught.value)
    assert type(wrapped) is ValueError and str(wrapped) == "lr must be positive, got -1.0"
    assert compat.builtin_error_in_script_error(RuntimeError("no builtin here")) is None


def test_torchscript_is_on_and_the_private_ops_exist():
    assert compat.torchscript_enabled()
    for name in compat.TORCHSCRIPT_PRIVATE_OPS:  # as torch.NAME or torch.ops.aten.NAME
        assert callable(getattr(torch, name, None)) or hasattr(torch.ops.aten, name), f"torch.{name} is gone"
    for name in compat.TORCHSCRIPT_PRIVATE_TENSOR_METHODS:
        assert callable(getattr(torch.Tensor, name, None)), f"Tensor.{name} is gone"
    # A row sent twice stays two entries: _values/_nnz read the uncoalesced gradient.
    gradient = torch.sparse_coo_tensor([[1, 1]], torch.ones(2, 3), (4, 3))
    assert gradient._nnz() == 2 and gradient._values().shape == (2, 3)


def _doubled(value: float) -> float:
    return 2.0 * value


class _UsesItsModulesHelper:
    def __init__(self, value: float):
        self.value = _doubled(value)


def test_a_class_is_scripted_with_its_own_modules_names():
    """``torch.jit.script(cls)`` resolves a class's globals in the caller's frame; ``script_class`` in the class's
    own module (``_doubled`` is not a name of ``_torch_compat``)."""
    assert compat.script_class(_UsesItsModulesHelper)(1.5).value == 3.0


def _gloo_pair() -> list:
    store = dist.HashStore()
    members = [None, None]

    def make(rank):
        members[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=2))

    threads = [threading.Thread(target=make, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return members


def test_a_collective_whose_peer_died_is_recognised():
    members = _gloo_pair()
    works = [member.allreduce([torch.ones(2)]) for member in members]
    for work in works:
        work.wait()
    del works
    members.pop()
    gc.collect()  # the peer's connections close, as when its process dies
    with pytest.raises(RuntimeError) as caught:
        members[0].allreduce([torch.ones(2)]).wait()
    assert compat.is_collective_failure(caught.value)


def test_a_collective_that_timed_out_is_recognised():
    members = _gloo_pair()
    with pytest.raises(RuntimeError) as caught:
        members[0].allreduce([torch.ones(2)]).wait()  # the peer never joins in
    assert compat.is_collective_failure(caught.value)
    assert not compat.is_collective_failure(ValueError("bad input"))
