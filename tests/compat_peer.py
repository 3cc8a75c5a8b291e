"""The RPC half of ``tests/test_torch_compat.py``, run in a child process of its own.

A process's dist_autograd container keeps the worker id of its first RPC
join for good, so the test process itself (which other tests join as rank 0
of a group of one) cannot also be rank 1 of an open group.  ``run_checks``
hosts the coordinator's store, joins it as rank 1, runs every check and
puts ``(name, None or the traceback)`` on a queue, then ``DONE``."""

import contextlib
import datetime
import faulthandler
import gc
import os
import signal
import tempfile
import threading
import traceback

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from paramserver import _torch_compat as compat
from paramserver.control.rendezvous import RendezvousStore
from paramserver.processes import PRELOAD, child_context, start_fork_server
from paramserver.shards.group_store import store_of
from paramserver.shards.peer import join, leave, leave_together, republish

SELF = "compat0"
CHILD = "compat1"
DONE = "done"
JOIN_WITHIN = datetime.timedelta(seconds=60)
#: A join past a dead member either ends in seconds or hangs for good: the checks' fixture must not wait 60 s.
DEAD_PEER_JOIN_WITHIN = datetime.timedelta(seconds=30)


def _member_list(store: RendezvousStore) -> str:
    rpc_store = dist.PrefixStore(compat.RPC_STORE_PREFIX, store.store)
    names = dist.PrefixStore(compat.RPC_NAMES_PREFIX, rpc_store)
    return names.get(compat.RPC_MEMBER_LIST_KEY).decode()


def store_keys(store, init_method):
    assert compat.rpc_member_entry(SELF, 1) in _member_list(store)
    rpc_store = dist.PrefixStore(compat.RPC_STORE_PREFIX, store.store)
    assert rpc_store.get(compat.RPC_TOKEN_KEY) == b"", "the token is free once a join finished"
    assert rpc_store.get(compat.rpc_token(SELF, "join")) == compat.RPC_TOKEN_DONE.encode()


def agent_of_an_open_group(store, init_method):
    agent = compat.current_rpc_agent()
    assert agent is not None and agent.get_worker_info().name == SELF
    assert compat.is_open_rpc_group(agent)
    compat.rpc_barrier([SELF])


def second_join_uses_the_first_prefix(store, init_method):
    leave(graceful=True)
    assert compat.current_rpc_agent() is None
    assert compat.rpc_member_entry(SELF, 1) not in _member_list(store)
    join(SELF, 1, None, init_method)  # init_rpc's second call: its keys would go under rpc_prefix_1
    assert compat.rpc_member_entry(SELF, 1) in _member_list(store)


def _child_joins_then_leaves(init_method, joined, leave_now, name: str, rank: int) -> None:
    join(name, rank, None, init_method)
    joined.set()
    leave_now.wait(60)
    leave(graceful=True)


@contextlib.contextmanager
def _member_joining(init_method, name: str, rank: int):
    """A child process that joins the group as ``name`` and leaves when told: yields ``(joined, leave_now,
    child)``; killed on the way out if it still runs."""
    context = child_context()  # forked by a fork server that imported torch once
    joined, leave_now = context.Event(), context.Event()
    child = context.Process(target=_child_joins_then_leaves, args=(init_method, joined, leave_now, name, rank),
                            name=name)
    child.start()
    try:
        yield joined, leave_now, child
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


def a_member_joins_while_another_waits_to_leave(store, init_method):
    """A member that joins while another waits for the group's token to leave (its own join holds the token and
    asks every member for its devices and to record it) joins at once, and the other leaves right after: the
    leaving member polls for the token instead of blocking its store connection, which a member's reply to the
    joining one needs (torch's own graceful leave keeps both waiting until the store's 60 s timeout)."""
    name, rank = "compat3", 4
    rpc_store = dist.PrefixStore(compat.RPC_STORE_PREFIX, store.store)
    rpc_store.set(compat.RPC_TOKEN_KEY, compat.rpc_token(name, "join"))  # the joining member holds the token
    leaving = threading.Thread(target=leave, kwargs={"graceful": True, "timeout": JOIN_WITHIN}, daemon=True)
    leaving.start()
    with _member_joining(init_method, name, rank) as (joined, leave_now, child):
        assert joined.wait(30), "the member did not join while another waited to leave"
        leaving.join(30)
        assert not leaving.is_alive(), "the waiting member did not leave once the join ended"
        assert compat.current_rpc_agent() is None
        assert _member_list(store) == compat.rpc_member_entry(name, rank)
        leave_now.set()
        child.join(30)
        assert child.exitcode == 0, child.exitcode
    join(SELF, 1, None, init_method)  # for the checks after this one


def a_failed_graceful_leave_gives_the_token_back(store, init_method):
    """A graceful leave that fails midway (a member it must tell died without leaving, and this process was not
    told) gives the group's membership token back: torch's keeps it, and every later join would wait for it."""
    name, rank = "compat4", 5
    with _peer_that_dies(init_method, name, rank) as kill_it:
        kill_it()
        try:
            leave(graceful=True, timeout=datetime.timedelta(seconds=10))
        except RuntimeError:  # telling the dead member failed: what this check is about
            pass
        else:
            raise AssertionError("leaving told a dead member without an error")
        rpc_store = dist.PrefixStore(compat.RPC_STORE_PREFIX, store.store)
        assert rpc_store.get(compat.RPC_TOKEN_KEY) == b"", rpc_store.get(compat.RPC_TOKEN_KEY)
        assert rpc_store.get(compat.rpc_token(SELF, "leave")) == compat.RPC_TOKEN_DONE.encode()
    store.remove_rpc_peer(name, rank)  # the coordinator's upkeep of a member that died
    if compat.rpc_member_entry(SELF, 1) in _member_list(store):  # torch left it listed: it failed midway
        store.remove_rpc_peer(SELF, 1)
    join(SELF, 1, None, init_method)  # for the checks after this one


def a_graceful_leave_after_the_store_is_gone_still_leaves(store, init_method):
    """A graceful leave whose group's store is gone (its host, the coordinator, ended first) leaves all the same:
    it cannot take the membership token, so it leaves without telling the others, and raises nothing."""
    leave(graceful=True)
    gone = RendezvousStore("127.0.0.1")
    join(SELF, 1, None, f"tcp://127.0.0.1:{gone.port}")
    store_of(compat.current_rpc_agent()).reconnect_within = datetime.timedelta(seconds=0.5)  # gone for good
    gone.close()
    del gone
    gc.collect()  # the store's last reference: its server stops
    leave(graceful=True, timeout=datetime.timedelta(seconds=5))
    assert compat.current_rpc_agent() is None
    join(SELF, 1, None, init_method)  # for the checks after this one


def autograd_context_layout(store, init_method):
    agent = compat.current_rpc_agent()
    with dist_autograd.context() as context_id:
        assert compat.autograd_context_creator(context_id) == agent.get_worker_info().id
        compat.check_autograd_context(context_id)
    try:
        compat.check_autograd_context(context_id)
    except RuntimeError:
        return
    raise AssertionError("a finished context was accepted")


def raise_value_error(message: str):
    raise ValueError(message)


@torch.jit.script
def scripted_raise(flag: bool) -> int:
    if flag:
        raise ValueError("lr must be positive, got -1.0")
    return 0


def remote_errors_reduced_to_their_cause(store, init_method):
    for function, args, expected in (
            (raise_value_error, ("gradient for 'w' has shape [3]",), "ValueError: gradient for 'w' has shape [3]"),
            (scripted_raise, (True,), "ValueError: lr must be positive, got -1.0")):
        try:
            rpc.rpc_sync(SELF, function, args=args)
        except Exception as error:  # noqa: BLE001 - what torch raises is the point
            assert compat.remote_error_cause(error) == expected, (compat.remote_error_cause(error), str(error))
        else:
            raise AssertionError(f"{function.__name__} raised nothing")


def _child_peer(init_method: str, joined, die, name: str = CHILD, rank: int = 2) -> None:
    join(name, rank, None, init_method)
    joined.set()
    die.wait(60)
    os._exit(0)  # dies without leaving


@contextlib.contextmanager
def _peer_that_dies(init_method: str, name: str, rank: int):
    """A child peer ``name`` that joined the group; the function yielded makes it die without leaving and waits
    for that.  Killed on the way out if it still runs."""
    context = child_context()  # forked by a fork server that imported torch once
    joined, die = context.Event(), context.Event()
    child = context.Process(target=_child_peer, args=(init_method, joined, die, name, rank), name=name)
    child.start()

    def kill_it():
        die.set()
        child.join(30)
        assert child.exitcode == 0, child.exitcode

    try:
        assert joined.wait(JOIN_WITHIN.total_seconds()), "the child peer did not join"
        yield kill_it
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


def dead_peer_forgotten_and_rrefs_released(store, init_method):
    with _peer_that_dies(init_method, CHILD, 2) as kill_it:
        remote = rpc.remote(CHILD, torch.add, args=(torch.ones(2), 0))
        assert remote.to_here().tolist() == [1.0, 1.0]
        kill_it()
        agent = compat.current_rpc_agent()
        compat.forget_rpc_peer(agent, agent.get_worker_info(CHILD))
        assert CHILD not in [info.name for info in agent.get_worker_infos()]
        assert store.remove_rpc_peer(CHILD, 2), "the coordinator's upkeep found the dead peer listed"
        del remote
        compat.release_rrefs(datetime.timedelta(seconds=1))  # the owner is gone: bounded, no error


def a_member_joins_while_another_lies_dead(store, init_method):
    """``forget_dead_peers_when_joining``: a member that died without leaving is still listed in the store (until
    the coordinator declares it dead); one that joins then forgets it and joins, where torch's own join, its
    connection refused, calls ``rpc.shutdown()`` inside the membership token that shutdown waits for, and hangs."""
    dead, dead_rank, name, rank = "compat5", 6, "compat6", 7
    with _peer_that_dies(init_method, dead, dead_rank) as kill_it:
        kill_it()
    assert compat.rpc_member_entry(dead, dead_rank) in _member_list(store)
    try:
        with _member_joining(init_method, name, rank) as (joined, leave_now, child):
            assert joined.wait(DEAD_PEER_JOIN_WITHIN.total_seconds()), "the member did not join while another lay dead"
            leave_now.set()
            child.join(30)
            assert child.exitcode == 0, child.exitcode
    finally:
        rpc_store = dist.PrefixStore(compat.RPC_STORE_PREFIX, store.store)
        if rpc_store.get(compat.RPC_TOKEN_KEY) == compat.rpc_token(name, "join").encode():
            rpc_store.set(compat.RPC_TOKEN_KEY, "")  # a hung join (killed) holds the token: the checks after go on
        agent = compat.current_rpc_agent()
        compat.forget_rpc_peer(agent, agent.get_worker_info(dead))
        store.remove_rpc_peer(dead, dead_rank)


@contextlib.contextmanager
def _native_stderr(into: list):
    """What this process writes to its stderr file (torch's C++ logging included) meanwhile, appended to ``into``."""
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            into.append(captured.read().decode(errors="replace"))


def _owned_by_the_callee(value):
    return rpc.RRef(value)


def rrefs_of_a_dead_owner_dropped_without_telling_it(store, init_method):
    """``forsake_rref_owners``: an RRef whose owner died, dropped after it, is not reported to the owner (one
    dropped before is, and torch logs an error with a C++ stack trace), whether this process made it
    (``rpc.remote``) or the owner did and returned it (as a shard returns a table's rows); the RRef context stays
    torn down."""
    name, rank = "compat2", 3
    with _peer_that_dies(init_method, name, rank) as kill_it:
        told, kept = (rpc.remote(name, torch.add, args=(torch.ones(2), 0)) for _ in range(2))
        assert told.to_here().tolist() == kept.to_here().tolist() == [1.0, 1.0]
        returned = rpc.rpc_sync(name, _owned_by_the_callee, args=(torch.ones(2),))
        assert returned.owner().name == name and returned.to_here().tolist() == [1.0, 1.0]
        kill_it()
        agent = compat.current_rpc_agent()
        compat.forget_rpc_peer(agent, agent.get_worker_info(name))
        logged = []
        with _native_stderr(logged):
            del told  # torch tells the owner, which is gone: an error with a C++ stack trace
            gc.collect()
        assert "could not find destination id" in logged[0], logged[0][-2000:]
        compat.forsake_rref_owners()
        with _native_stderr(logged):
            del kept, returned
            gc.collect()
        assert "deletingUserRRef" not in logged[1], logged[1][-2000:]
        store.remove_rpc_peer(name, rank)


def leaving_together_marks_the_agent_leaving_before_it_closes(store, init_method):
    """``mark_leaving`` (``agent.join(shutdown=True)``, through ``peer.leave_together``): this member leaves the
    group's member list and the group's token is free again; the agent closes after, without a word of
    TensorPipe's on stderr.  Runs last but one: it ends this process's membership (the last joins again)."""
    logged = []
    with _native_stderr(logged):
        assert leave_together(datetime.timedelta(seconds=5))
    assert compat.current_rpc_agent() is None
    assert compat.rpc_member_entry(SELF, 1) not in _member_list(store)
    rpc_store = dist.PrefixStore(compat.RPC_STORE_PREFIX, store.store)
    assert rpc_store.get(compat.RPC_TOKEN_KEY) == b""
    assert "pipe closed" not in logged[0] and "EOF" not in logged[0], logged[0][-2000:]


def _call_peer(name: str) -> int:
    return rpc.rpc_sync(name, os.getpid)


def a_member_joins_after_the_store_was_made_anew(store, init_method):
    """The coordinator's store lost and made anew on its port (a coordinator started again): the group's
    members and addresses, read from the old store (``rpc_group``, for the journal) and written into the new
    one (``restore_rpc_group``), or put back by a member itself (``republish``), are what a later join needs:
    a member joining then reaches every member there before, and they reach it (their agents' store
    connections connect again).  Pins the store keys torch's agent reads: the member list, the ``addrs``
    prefix and the names by rank."""
    before, after = "compat5", "compat6"
    join(SELF, 1, None, init_method)  # the check before this one left
    with _member_joining(init_method, before, 6) as (joined, leave_before, child_before):
        assert joined.wait(30), f"{before} did not join"
        group = store.rpc_group()
        assert [(name, rank) for name, rank, _ in group] == [(SELF, 1), (before, 6)], group
        assert all(address.startswith("uv://") for _, _, address in group), group
        port = store.port
        store.close()
        anew = RendezvousStore("127.0.0.1", port)
        try:
            anew.restore_rpc_group([entry for entry in group if entry[0] != SELF])  # as if SELF was not journaled
            assert compat.rpc_member_entry(SELF, 1) not in _member_list(anew)
            assert republish() is True  # connects again, and puts SELF back
            assert _member_list(anew) == compat.rpc_member_entry(before, 6) + compat.rpc_member_entry(SELF, 1)
            assert republish() is False  # listed already: the list unchanged
            with _member_joining(init_method, after, 7) as (joined_after, leave_after, child_after):
                assert joined_after.wait(30), f"{after} did not join the store made anew"
                assert rpc.rpc_sync(after, os.getpid) == child_after.pid
                assert rpc.rpc_sync(before, _call_peer, args=(after,)) == child_after.pid
                assert rpc.rpc_sync(after, _call_peer, args=(before,)) == child_before.pid
                assert store_of(compat.current_rpc_agent()).reconnections == 2  # once per republish
                leave_after.set()
                child_after.join(30)
                assert child_after.exitcode == 0, child_after.exitcode
            leave_before.set()
            child_before.join(30)
            assert child_before.exitcode == 0, child_before.exitcode
        finally:
            leave(graceful=True)  # the last check: leaves the store made here, then closes it
            anew.close()


# rrefs_of_a_dead_owner_dropped_without_telling_it runs before the first leave: once a process left the group,
# torch's RRef context stays torn down (a second join does not set it up again), and no drop is reported.
CHECKS = (store_keys, agent_of_an_open_group, rrefs_of_a_dead_owner_dropped_without_telling_it,
          second_join_uses_the_first_prefix, a_member_joins_while_another_waits_to_leave,
          a_failed_graceful_leave_gives_the_token_back, a_graceful_leave_after_the_store_is_gone_still_leaves,
          autograd_context_layout, remote_errors_reduced_to_their_cause, dead_peer_forgotten_and_rrefs_released,
          a_member_joins_while_another_lies_dead, leaving_together_marks_the_agent_leaving_before_it_closes,
          a_member_joins_after_the_store_was_made_anew)


def run_checks(results) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks where it waits, if it waits too long
    start_fork_server(PRELOAD)  # its imports beside the first checks, which start no child
    store = RendezvousStore("127.0.0.1")
    init_method = f"tcp://127.0.0.1:{store.port}"
    try:
        join(SELF, 1, None, init_method)
        for check in CHECKS:
            try:
                check(store, init_method)
                results.put((check.__name__, None))
            except BaseException:  # noqa: BLE001 - reported to the test, by name
                results.put((check.__name__, traceback.format_exc()))
    finally:
        if compat.current_rpc_agent() is not None:
            leave(graceful=True)
        store.close()
        results.put((DONE, None))
