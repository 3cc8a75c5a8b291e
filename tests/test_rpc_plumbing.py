"""Data-plane plumbing without processes: which RPC targets are TorchScript
calls and peer options."""

import datetime

import pytest
import torch

from paramserver.shards import PeerOptions
from paramserver.shards.server import service


def test_the_step_rpc_and_the_lookups_are_torchscript_calls():
    # No pickling and no Python on the way in or out of these RPCs.
    for function in (service.optimizer_step, service.lookup_rows, service.gather, service.lookup, service.push):
        assert isinstance(function, torch.jit.ScriptFunction), function


def test_peer_options_reject_nonsense():
    with pytest.raises(ValueError, match="rpc_timeout must be positive"):
        PeerOptions(rpc_timeout=datetime.timedelta(0))
    with pytest.raises(ValueError, match="num_worker_threads"):
        PeerOptions(num_worker_threads=0)
    with pytest.raises(ValueError, match="intra_op_threads"):
        PeerOptions(intra_op_threads=0)
