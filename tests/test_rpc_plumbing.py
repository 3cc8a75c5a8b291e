"""Data-plane plumbing without processes: which RPC targets are TorchScript
calls, peer options, and how owners' errors read after crossing an RPC boundary."""

import datetime

import pytest
import torch

from paramserver.optim import owner
from paramserver.optim.distributed import _cause_message
from paramserver.shards import PeerOptions, hosted


def test_the_step_rpc_and_the_lookups_are_torchscript_calls():
    # No pickling and no Python on the way in or out of these RPCs.
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
