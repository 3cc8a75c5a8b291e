"""The child-process launcher: exit codes checked, hangs killed, nothing left behind;
and how owners' errors are reported after crossing an RPC boundary."""

import datetime
import os

import pytest

from child_targets import exit_with, sleep_for
from paramserver.optim.distributed import _cause_message
from paramserver.processes import Child, ChildProcessesFailed, free_port, run_children
from paramserver.shards import PeerOptions

SHORT = datetime.timedelta(seconds=20)


def test_exit_codes_are_returned_and_checked():
    codes = run_children([Child("ok", exit_with, (0,)), Child("three", exit_with, (3,))], SHORT,
                         expected_exit_codes={"three": 3})
    assert codes == {"ok": 0, "three": 3}
    with pytest.raises(ChildProcessesFailed, match="bad exited with 2, expected 0") as raised:
        run_children([Child("good", exit_with, (0,)), Child("bad", exit_with, (2,))], SHORT)
    assert raised.value.exit_codes == {"good": 0, "bad": 2}


def test_a_child_past_the_deadline_is_killed_and_reaped():
    with pytest.raises(ChildProcessesFailed, match="sleeper did not finish within 1 s") as raised:
        run_children([Child("sleeper", sleep_for, (60,)), Child("quick", exit_with, (0,))],
                     datetime.timedelta(seconds=1))
    assert raised.value.exit_codes["sleeper"] == -9
    assert raised.value.exit_codes["quick"] == 0
    # Reaped: neither is left, not even as a zombie.
    for pid in raised.value.pids.values():
        assert not os.path.exists(f"/proc/{pid}"), pid


def test_child_names_must_be_unique_and_ports_are_free():
    with pytest.raises(ValueError, match="unique"):
        run_children([Child("a", exit_with, (0,)), Child("a", exit_with, (0,))], SHORT)
    assert 0 < free_port() < 65536


def test_the_step_rpc_and_the_lookups_are_torchscript_calls():
    # No pickling and no Python on the way in or out of these RPCs.
    import torch

    from paramserver.optim import owner
    from paramserver.shards import hosted
    for function in (owner.remote_step, hosted.lookup_rows, hosted.gather):
        assert isinstance(function, torch.jit.ScriptFunction), function


def test_peer_options_reject_nonsense():
    with pytest.raises(ValueError, match="rpc_timeout must be positive"):
        PeerOptions(rpc_timeout=datetime.timedelta(0))
    with pytest.raises(ValueError, match="num_worker_threads"):
        PeerOptions(num_worker_threads=0)
    with pytest.raises(ValueError, match="intra_op_threads"):
        PeerOptions(intra_op_threads=0)


@pytest.mark.parametrize("text, expected", [
    # A Python RPC target's exception, as torch delivers it.
    ("On WorkerInfo(id=1, name=shard0):\nValueError('gradient for parameter \\'w\\' has shape [3]')\n"
     "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: gradient",
     "ValueError: gradient for parameter 'w' has shape [3]"),
    # A Python error raised under TorchScript (our step RPC).
    ("The following operation failed in the TorchScript interpreter.\nTraceback of TorchScript:\n"
     "    return torch.ops.paramserver.owner_step(handle, context_id)\n"
     "RuntimeError: ValueError: gradient for parameter 'w' has shape [3] but the parameter has shape [2]\n\nAt:\n",
     "ValueError: gradient for parameter 'w' has shape [3] but the parameter has shape [2]"),
    # A transport error.
    ("eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)",
     "eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)"),
])
def test_owner_errors_are_reduced_to_their_cause(text, expected):
    assert _cause_message(RuntimeError(text)) == expected
