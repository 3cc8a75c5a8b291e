"""The coordinator's pure logic: request validation and the membership table
(generations, heartbeats in and out of order, failure detection, commands)."""

import datetime

import grpc
import pytest

from paramserver.control.membership import DEAD, EXITED, LEFT, Membership
from paramserver.logs import one_line
from paramserver.control.protocol import pb
from paramserver.control.validation import RequestError, validate_heartbeat, validate_join, validate_leave


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def join_request(role=pb.ROLE_WORKER, name="host-a", host="127.0.0.1"):
    return pb.JoinRequest(role=role, name=name, host=host, capabilities=pb.Capabilities(pid=42))


@pytest.fixture
def table():
    clock = Clock()
    lost = []
    membership = Membership(datetime.timedelta(seconds=5), on_gone=lost.append, clock=clock)
    membership.clock, membership.lost = clock, lost
    return membership


def beat(membership, member, sequence, step=0, ready=False, **metrics):
    return membership.heartbeat(pb.HeartbeatRequest(member_id=member.member_id, sequence=sequence, step=step,
                                                    ready=ready, metrics=metrics))


@pytest.mark.parametrize("request_, field", [
    (join_request(role=pb.ROLE_UNSPECIFIED), "role"),
    (join_request(name=""), "name is empty"),
    (join_request(name="x" * 65), "name has 65 characters"),
    (join_request(name="bad name"), "name 'bad name'"),
    (join_request(host=""), "host is empty"),
    (join_request(host="not a host!"), "host 'not a host!'"),
])
def test_malformed_join_names_the_field(request_, field):
    with pytest.raises(RequestError) as error:
        validate_join(request_)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.message


def test_join_accepts_ip_addresses_and_host_names():
    for host in ("127.0.0.1", "::1", "node-3.cluster.local"):
        validate_join(join_request(host=host))


@pytest.mark.parametrize("request_, field", [
    (pb.HeartbeatRequest(sequence=1), "member_id is empty"),
    (pb.HeartbeatRequest(member_id="m", sequence=0), "sequence"),
    (pb.HeartbeatRequest(member_id="m", sequence=1, metrics={"loss": float("nan")}), "metrics['loss'] is nan"),
    (pb.HeartbeatRequest(member_id="m", sequence=1, metrics={f"m{i}": 1.0 for i in range(65)}), "65 entries"),
    (pb.HeartbeatRequest(member_id="m", sequence=1, metrics={"a b": 1.0}), "metrics key 'a b'"),
])
def test_malformed_heartbeat_names_the_field(request_, field):
    with pytest.raises(RequestError) as error:
        validate_heartbeat(request_)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.message


def test_oversized_leave_reason_is_refused():
    with pytest.raises(RequestError, match="reason has 600 characters"):
        validate_leave(pb.LeaveRequest(member_id="m", reason="x" * 600))


def test_join_assigns_unique_names_ranks_and_a_new_generation(table):
    shard = table.join(join_request(pb.ROLE_SHARD, name="shard0"))
    first = table.join(join_request())
    second = table.join(join_request())
    assert (shard.rpc_name, first.rpc_name, second.rpc_name) == ("shard0", "worker0", "worker1")
    assert [m.rpc_rank for m in (shard, first, second)] == [1, 2, 3]
    assert [m.joined_generation for m in (shard, first, second)] == [1, 2, 3]
    assert table.generation == 3
    with pytest.raises(RequestError) as error:
        table.join(join_request(pb.ROLE_SHARD, name="shard0"))
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_shards_count_as_serving_once_their_heartbeat_says_ready(table):
    shard = table.join(join_request(pb.ROLE_SHARD, name="shard0"))
    beat(table, shard, 1)
    assert table.live_shard_names() == []
    beat(table, shard, 2, ready=True)
    beat(table, shard, 3)
    assert table.live_shard_names() == ["shard0"]


def test_heartbeats_out_of_order_or_from_strangers_are_refused(table):
    member = table.join(join_request())
    generation, commands, _, _ = beat(table, member, 1, step=5, loss=0.5)
    assert generation == 1 and commands == []
    for stale in (1, 0):
        with pytest.raises(RequestError, match="out of order") as error:
            beat(table, member, stale) if stale else table.heartbeat(
                pb.HeartbeatRequest(member_id=member.member_id, sequence=1))
        assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    beat(table, member, 3, step=7)  # gaps are fine
    with pytest.raises(RequestError, match="unknown member_id") as error:
        table.heartbeat(pb.HeartbeatRequest(member_id="nobody", sequence=1))
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
    status = table.status()
    assert status.workers[0].step == 7


def test_silent_member_is_declared_dead_and_survivors_told_to_forget_it(table):
    shard = table.join(join_request(pb.ROLE_SHARD, name="shard0"))
    worker = table.join(join_request())
    table.clock.now += 4.9
    beat(table, shard, 1)
    assert table.sweep() == []
    table.clock.now += 0.2  # the worker: 5.1 s silent
    lost = table.sweep()
    assert [m.rpc_name for m in lost] == ["worker0"] and table.lost == lost
    assert worker.state == DEAD and "no heartbeat for 5.1 s" in worker.end_reason
    assert table.generation == 3
    _, commands, _, _ = beat(table, shard, 2)
    assert [(c.kind, c.peer) for c in commands] == [(pb.Command.KIND_FORGET_PEER, "worker0")]
    with pytest.raises(RequestError, match="is dead"):
        beat(table, worker, 1)
    rejoined = table.join(join_request())
    assert rejoined.rpc_name == "worker1" and rejoined.joined_generation == 4
    status = table.status()
    assert [(w.name, w.alive, w.state) for w in status.workers] == [("worker0", False, DEAD),
                                                                       ("worker1", True, "alive")]


def test_a_worker_joining_while_no_worker_is_alive_starts_a_new_run_of_the_job(table):
    first = table.join(join_request())
    second = table.join(join_request())
    shard = table.join(join_request(pb.ROLE_SHARD, name="shard0"))
    assert (first.job_run, second.job_run, shard.job_run) == (1, 1, 0)
    table.leave(pb.LeaveRequest(member_id=first.member_id, reason="done"))
    assert table.join(join_request()).job_run == 1  # the second worker is still alive: the same run
    table.leave(pb.LeaveRequest(member_id=second.member_id, reason="done"))
    table.clock.now += 6  # the worker that joined last is lost too: no worker alive
    assert [m.rpc_name for m in table.sweep() if m.role == pb.ROLE_WORKER] == ["worker2"]
    assert table.join(join_request()).job_run == 2


def test_exited_process_is_gone_at_once(table):
    shard = table.join(join_request(pb.ROLE_SHARD, name="shard3"))
    assert table.process_exited("shard3", -9) is shard
    assert shard.state == EXITED and "code -9" in shard.end_reason and table.lost == [shard]
    assert table.process_exited("shard3", -9) is None


def test_a_shard_not_restarted_is_gone_for_good_until_one_joins_under_its_name(table):
    table.join(join_request(pb.ROLE_SHARD, name="shard0"))
    remote = table.join(join_request(pb.ROLE_SHARD, name="shard1", host="10.0.0.2"))
    table.process_exited("shard0", -9, "it exited 4 times (at most 3 restarts)")
    assert table.shards_gone() == {
        "shard0": "process exited with code -9; not restarted: it exited 4 times (at most 3 restarts)"}
    # A --join host reports its shard's exit with a final Leave.
    table.leave(pb.LeaveRequest(member_id=remote.member_id, reason="process exited with code -9\n(on 10.0.0.2)",
                                final=True))
    assert table.shards_gone()["shard1"] == "process exited with code -9 (on 10.0.0.2); not restarted"
    table.sweep()  # (nothing else changes it)
    table.join(join_request(pb.ROLE_SHARD, name="shard1", host="10.0.0.2"))
    assert list(table.shards_gone()) == ["shard0"]


def test_reasons_are_one_line_whatever_a_member_sends(table):
    worker = table.join(join_request())
    table.leave(pb.LeaveRequest(member_id=worker.member_id, reason="job failed: ValueError: bad\n  File 'x'\r\n\tline"))
    (status,) = table.status().workers
    assert status.reason == "job failed: ValueError: bad File 'x' line"
    assert one_line(ValueError("a\nb")) == "ValueError: a" and one_line(RuntimeError()) == "RuntimeError"
    assert one_line("x" * 400) == "x" * 297 + "..."


def test_leave_and_stop(table):
    worker = table.join(join_request())
    other = table.join(join_request())
    table.leave(pb.LeaveRequest(member_id=worker.member_id, reason="done", step=9, metrics={"loss": 0.1}))
    assert worker.state == LEFT and worker.step == 9 and worker.metrics == {"loss": 0.1}
    assert table.lost == [worker]  # the store's list is checked for it all the same
    _, commands, _, _ = beat(table, other, 1)
    assert [(c.kind, c.peer) for c in commands] == [(pb.Command.KIND_FORGET_PEER, "worker0")]
    shard = table.join(join_request(pb.ROLE_SHARD, name="shard0"))
    assert table.stop_members([pb.ROLE_WORKER, pb.ROLE_CLIENT]) == [other]
    _, commands, _, _ = beat(table, other, 2)
    assert [c.kind for c in commands] == [pb.Command.KIND_STOP]
    assert beat(table, shard, 1)[1] == []  # shards are stopped last, separately
    with pytest.raises(RequestError, match="shutting down"):
        table.join(join_request())


def test_a_restarted_shard_joins_once_every_survivor_dropped_the_lost_one(table):
    worker = table.join(join_request())
    table.join(join_request(pb.ROLE_SHARD, name="shard1"))
    table.process_exited("shard1", -9)
    with pytest.raises(RequestError) as refused:  # the worker has not heard FORGET_PEER yet
        table.join(join_request(pb.ROLE_SHARD, name="shard1"))
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE and "previous shard1" in refused.value.message
    _, commands, _, _ = beat(table, worker, 1)
    assert [(c.kind, c.peer) for c in commands] == [(pb.Command.KIND_FORGET_PEER, "shard1")]
    again = table.join(join_request(pb.ROLE_SHARD, name="shard1"))
    assert again.rpc_name == "shard1" and again.state == "alive"


def test_checkpoint_requests_reach_live_workers_only(table):
    workers = [table.join(join_request()) for _ in range(2)]
    table.join(join_request(pb.ROLE_SHARD, name="shard0"))
    table.leave(pb.LeaveRequest(member_id=workers[1].member_id))
    assert table.command(pb.ROLE_WORKER, pb.Command(kind=pb.Command.KIND_CHECKPOINT, checkpoint_id="1")) == 1
    _, commands, _, _ = beat(table, workers[0], 1)
    assert [(c.kind, c.checkpoint_id) for c in commands if c.kind != pb.Command.KIND_FORGET_PEER] == [
        (pb.Command.KIND_CHECKPOINT, "1")]
    with pytest.raises(RequestError, match="is left"):
        table.live_member(workers[1].member_id)


def test_a_shard_name_in_use_waits_for_a_restart_on_the_same_host_and_is_refused_elsewhere(table):
    table.join(join_request(role=pb.ROLE_SHARD, name="shard_h2_0", host="10.0.0.2"))
    restarted = pb.JoinRequest(role=pb.ROLE_SHARD, name="shard_h2_0", host="10.0.0.2",
                               capabilities=pb.Capabilities(pid=43))
    with pytest.raises(RequestError) as again:  # its old process not declared dead yet: retried by the joiner
        table.join(restarted)
    assert again.value.code == grpc.StatusCode.UNAVAILABLE and "join again once it is gone" in again.value.message
    with pytest.raises(RequestError) as clash:  # another host's shard with the same name is a mistake
        table.join(join_request(role=pb.ROLE_SHARD, name="shard_h2_0", host="10.0.0.3"))
    assert clash.value.code == grpc.StatusCode.FAILED_PRECONDITION
    table.clock.now += 6
    table.sweep()  # the old one declared dead; its survivors (none here) told to forget it
    assert table.join(restarted).rpc_name == "shard_h2_0"


def test_members_are_told_how_many_of_the_clusters_processes_share_their_machine():
    table = Membership(datetime.timedelta(seconds=5), machine="box-a")

    def on(machine, role=pb.ROLE_WORKER, name="host-a"):
        return table.join(pb.JoinRequest(role=role, name=name, host="127.0.0.1",
                                         capabilities=pb.Capabilities(pid=42, machine=machine)))
    shard = on("box-a", pb.ROLE_SHARD, "shard0")
    assert table.host_processes(shard.member_id) == 2  # the coordinator runs there too
    first, elsewhere, second = on("box-a"), on("box-b"), on("box-a")
    assert [table.host_processes(m.member_id) for m in (shard, first, elsewhere, second)] == [4, 4, 1, 4]
    table.leave(pb.LeaveRequest(member_id=second.member_id, reason="done"))
    assert table.host_processes(first.member_id) == 3  # members that left share nothing
    assert table.host_processes(on("").member_id) == 0  # a member that says no machine: unknown
    restored = Membership(datetime.timedelta(seconds=5), machine="box-c")
    restored.restore(table.snapshot())
    assert restored.host_processes(first.member_id) == 2  # the machines come back with the journal
