"""Pins every private torch API and every piece of torch's error text that
``paramserver._torch_compat`` relies on, against the real torch: a torch
release that changes one fails here, by name, instead of deep in a cluster.

This process joins an open RPC group of its own (the coordinator's store
hosted here too); one case adds a child peer that dies, the case the group
upkeep exists for."""

import datetime
import gc
import multiprocessing
import os
import threading

import pytest
import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from paramserver import _torch_compat as compat
from paramserver.control.rendezvous import RendezvousStore
from paramserver.shards.peer import join, leave

SELF = "compat0"
CHILD = "compat1"
JOIN_WITHIN = datetime.timedelta(seconds=60)


@pytest.fixture(scope="module")
def open_group():
    """(the store, its init_method) with this process joined as SELF, rank 1."""
    store = RendezvousStore("127.0.0.1")
    init_method = f"tcp://127.0.0.1:{store.port}"
    assert compat.current_rpc_agent() is None
    join(SELF, 1, None, init_method)
    try:
        yield store, init_method
    finally:
        if compat.current_rpc_agent() is not None:
            leave(graceful=True)
        store.close()


def _member_list(store: RendezvousStore) -> str:
    rpc_store = dist.PrefixStore(compat.RPC_STORE_PREFIX, store.store)
    names = dist.PrefixStore(compat.RPC_NAMES_PREFIX, rpc_store)
    return names.get(compat.RPC_MEMBER_LIST_KEY).decode()


def test_the_open_groups_store_keys_are_where_the_coordinator_looks(open_group):
    store, _ = open_group
    assert compat.rpc_member_entry(SELF, 1) in _member_list(store)
    rpc_store = dist.PrefixStore(compat.RPC_STORE_PREFIX, store.store)
    assert rpc_store.get(compat.RPC_TOKEN_KEY) == b""  # free once the join finished
    assert rpc_store.get(compat.rpc_token(SELF, "join")) == compat.RPC_TOKEN_DONE.encode()


def test_the_agent_is_found_and_knows_its_group_is_open(open_group):
    agent = compat.current_rpc_agent()
    assert agent is not None and agent.get_worker_info().name == SELF
    assert compat.is_open_rpc_group(agent)
    compat.rpc_barrier([SELF])


def test_a_second_join_of_the_process_uses_the_first_prefix(open_group):
    store, init_method = open_group
    leave(graceful=True)
    assert compat.current_rpc_agent() is None
    assert compat.rpc_member_entry(SELF, 1) not in _member_list(store)
    join(SELF, 1, None, init_method)  # init_rpc's second call: its keys would go under rpc_prefix_1
    assert compat.rpc_member_entry(SELF, 1) in _member_list(store)


def test_tensorpipe_options_take_the_transports():
    options = compat.tensorpipe_options("tcp://127.0.0.1:1", 4, datetime.timedelta(seconds=3), ["uv"])
    assert options.rpc_timeout == 3 and options.num_worker_threads == 4
    with pytest.raises(RuntimeError, match="Unknown transport: shm2"):  # the option reaches TensorPipe
        compat.tensorpipe_options("tcp://127.0.0.1:1", 4, datetime.timedelta(seconds=3), ["shm2"])


def test_an_autograd_context_names_its_creator_and_is_checked(open_group):
    agent = compat.current_rpc_agent()
    with dist_autograd.context() as context_id:
        assert compat.autograd_context_creator(context_id) == agent.get_worker_info().id
        compat.check_autograd_context(context_id)
    with pytest.raises(RuntimeError):
        compat.check_autograd_context(context_id)


def _raise_value_error(message: str):
    raise ValueError(message)


@torch.jit.script
def _scripted_raise(flag: bool) -> int:
    if flag:
        raise ValueError("lr must be positive, got -1.0")
    return 0


def test_an_rpc_targets_error_is_reduced_to_its_cause(open_group):
    with pytest.raises(Exception) as python_error:
        rpc.rpc_sync(SELF, _raise_value_error, args=("gradient for 'w' has shape [3]",))
    assert compat.remote_error_cause(python_error.value) == "ValueError: gradient for 'w' has shape [3]"
    with pytest.raises(Exception) as script_error:
        rpc.rpc_sync(SELF, _scripted_raise, args=(True,))
    assert compat.remote_error_cause(script_error.value) == "ValueError: lr must be positive, got -1.0"


@pytest.mark.parametrize("text, expected", [
    ("eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)",
     "eof (this error originated at tensorpipe/transport/shm/connection_impl.cc:259)"),
    ("", "RuntimeError"),
])
def test_an_error_without_a_type_line_keeps_its_first_line(text, expected):
    assert compat.remote_error_cause(RuntimeError(text)) == expected


def test_a_torchscript_error_gives_back_the_builtin_it_wraps():
    with pytest.raises(torch.jit.Error) as caught:
        _scripted_raise(True)
    wrapped = compat.builtin_error_in_script_error(caught.value)
    assert type(wrapped) is ValueError and str(wrapped) == "lr must be positive, got -1.0"
    assert compat.builtin_error_in_script_error(RuntimeError("no builtin here")) is None


def test_torchscript_is_on_and_the_private_ops_exist():
    assert compat.torchscript_enabled()
    for name in compat.TORCHSCRIPT_PRIVATE_OPS:
        assert callable(getattr(torch, name, None)), f"torch.{name} is gone"
    for name in compat.TORCHSCRIPT_PRIVATE_TENSOR_METHODS:
        assert callable(getattr(torch.Tensor, name, None)), f"Tensor.{name} is gone"
    # A row sent twice stays two entries: _values/_nnz read the uncoalesced gradient.
    gradient = torch.sparse_coo_tensor([[1, 1]], torch.ones(2, 3), (4, 3))
    assert gradient._nnz() == 2 and gradient._values().shape == (2, 3)


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


def _child_peer(init_method: str, joined, die) -> None:
    join(CHILD, 2, None, init_method)
    joined.set()
    die.wait(60)
    os._exit(0)  # dies without leaving


def test_a_dead_peer_is_forgotten_and_its_rrefs_released(open_group):
    store, init_method = open_group
    context = multiprocessing.get_context("spawn")
    joined, die = context.Event(), context.Event()
    child = context.Process(target=_child_peer, args=(init_method, joined, die), name=CHILD)
    child.start()
    try:
        assert joined.wait(JOIN_WITHIN.total_seconds()), "the child peer did not join"
        remote = rpc.remote(CHILD, torch.add, args=(torch.ones(2), 0))
        assert remote.to_here().tolist() == [1.0, 1.0]
        die.set()
        child.join(30)
        assert child.exitcode == 0
        agent = compat.current_rpc_agent()
        compat.forget_rpc_peer(agent, agent.get_worker_info(CHILD))
        assert CHILD not in [info.name for info in agent.get_worker_infos()]
        assert store.remove_rpc_peer(CHILD, 2)
        del remote
        compat.release_rrefs(datetime.timedelta(seconds=1))  # the owner is gone: bounded, no error
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)
