"""The coordinator's trainer-group policy (pure): assigning workers to groups,
publishing views (settling, full groups at once), rank order across
generations, backends; and the views reaching workers through membership."""

import datetime

import pytest

from paramserver.control.groups import TrainerGroups
from paramserver.control.membership import Membership
from paramserver.control.protocol import pb

SETTLE = datetime.timedelta(seconds=2)


def members(view):
    return list(view.members) if view is not None else None


def test_one_group_of_everyone_forms_after_settling():
    groups = TrainerGroups(0, SETTLE)
    for t, name in [(0.0, "worker0"), (1.0, "worker1")]:
        assert groups.assign() == 0
        groups.add(0, name, gpus=0, now=t)
    assert groups.view(0, now=2.9) is None  # changed 1.9 s ago: still settling
    view = groups.view(0, now=3.0)
    assert (view.generation, members(view), view.backend) == (1, ["worker0", "worker1"], "gloo")
    assert groups.view(0, now=100.0).generation == 1  # nothing changed: no new generation


def test_full_groups_form_at_once_and_newcomers_fill_the_next():
    groups = TrainerGroups(2, SETTLE)
    assert [groups.assign() for _ in range(1)] == [0]
    groups.add(0, "worker0", 0, 0.0)
    assert groups.view(0, 0.1) is None
    groups.add(groups.assign(), "worker1", 0, 0.2)
    assert members(groups.view(0, 0.2)) == ["worker0", "worker1"]  # full: no settling
    assert groups.assign() == 1
    groups.add(1, "worker2", 0, 0.3)
    assert groups.view(1, 0.3) is None
    assert members(groups.view(1, 2.4)) == ["worker2"]  # not full: after settling
    assert [v.group for v in groups.views(3.0)] == [0, 1]


def test_survivors_keep_their_order_and_newcomers_come_last():
    groups = TrainerGroups(0, SETTLE)
    for name in ("worker0", "worker1", "worker2"):
        groups.add(0, name, 0, 0.0)
    assert members(groups.view(0, 5.0)) == ["worker0", "worker1", "worker2"]
    groups.remove(0, "worker0", 6.0)
    groups.add(0, "worker3", 0, 6.5)
    view = groups.view(0, 9.0)
    assert (view.generation, members(view)) == (2, ["worker1", "worker2", "worker3"])


def test_nccl_only_when_every_member_has_a_gpu():
    groups = TrainerGroups(2, SETTLE)
    groups.add(0, "worker0", 1, 0.0)
    groups.add(0, "worker1", 2, 0.0)
    assert groups.view(0, 0.0).backend == "nccl"
    groups.remove(0, "worker1", 1.0)
    groups.add(0, "worker2", 0, 1.0)
    assert groups.view(0, 1.0).backend == "gloo"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="group_size"):
        TrainerGroups(-1)
    with pytest.raises(ValueError, match="settle"):
        TrainerGroups(0, datetime.timedelta(seconds=-1))
    with pytest.raises(ValueError, match="gone_after"):
        TrainerGroups(0, SETTLE, datetime.timedelta(seconds=-1))


def test_a_group_left_without_workers_is_gone_after_its_grace_until_one_rejoins_it():
    groups = TrainerGroups(1, SETTLE, gone_after=datetime.timedelta(seconds=60))
    for name in ("worker0", "worker1"):
        groups.add(groups.assign(), name, 0, 0.0)
    groups.remove(1, "worker1", 10.0)
    assert groups.gone(69.9) == [] and groups.newly_gone(69.9) == []  # a restarted worker would rejoin in time
    assert groups.gone(70.0) == [1] and groups.gone(80.0) == [1]  # asking says nothing new
    assert groups.newly_gone(80.0) == [(1, 70.0)] and groups.newly_gone(90.0) == []  # said once
    assert groups.assign() == 1
    groups.add(1, "worker2", 0, 90.0)  # someone joins it again: not gone
    assert groups.gone(1000.0) == [] and groups.newly_gone(1000.0) == []
    groups.remove(1, "worker2", 100.0)
    groups.remove(0, "worker0", 100.0)
    assert groups.gone(160.0) == [0, 1]
    assert groups.newly_gone(160.0) == [(0, 60.0), (1, 60.0)]  # gone again: said again
    groups.new_run()  # the job starts again: the groups of the run before are no run's
    assert groups.gone(1000.0) == [] and groups.newly_gone(1000.0) == []


class Clock:
    now = 100.0

    def __call__(self):
        return self.now


def test_workers_hear_their_group_view_in_heartbeats_and_status_lists_it(caplog):
    clock = Clock()
    table = Membership(datetime.timedelta(seconds=5), clock=clock, groups=TrainerGroups(2, SETTLE))
    join = lambda gpus=0: table.join(pb.JoinRequest(role=pb.ROLE_WORKER, name="h", host="127.0.0.1",  # noqa: E731
                                                    capabilities=pb.Capabilities(pid=1, gpus=gpus)))
    a, b, c = join(), join(), join()
    assert (a.trainer_group, b.trainer_group, c.trainer_group) == (0, 0, 1)
    view = table.heartbeat(pb.HeartbeatRequest(member_id=a.member_id, sequence=1))[3]
    assert (view.group, view.generation, members(view)) == (0, 1, ["worker0", "worker1"])
    shard = table.join(pb.JoinRequest(role=pb.ROLE_SHARD, name="shard0", host="127.0.0.1"))
    assert table.heartbeat(pb.HeartbeatRequest(member_id=shard.member_id, sequence=1))[3] is None
    # worker1 leaves: its group re-forms (after settling) without it.
    table.leave(pb.LeaveRequest(member_id=b.member_id, reason="done"))
    clock.now += 3
    view = table.heartbeat(pb.HeartbeatRequest(member_id=a.member_id, sequence=2))[3]
    assert (view.generation, members(view)) == (2, ["worker0"])
    assert [(v.group, list(v.members)) for v in table.status().groups] == [(0, ["worker0"]), (1, ["worker2"])]
    # The next worker fills the free place in group 0.
    assert join().trainer_group == 0
    # Group 1's only worker is lost: gone once no worker rejoined it for its grace (60 s by default).
    table.leave(pb.LeaveRequest(member_id=c.member_id, reason="killed"))
    assert table.trainer_groups_gone() == []
    clock.now += 60
    assert table.trainer_groups_gone() == [1] and list(table.status().trainer_groups_gone) == [1]
    # The coordinator's sweep says so, once, in one line (asking, as above, says nothing).
    assert not [r for r in caplog.records if "is gone" in r.getMessage()]
    with caplog.at_level("WARNING", logger="paramserver.control.membership"):
        table.sweep()
        clock.now += 10
        table.sweep()
    assert [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()] == [
        "trainer group 1 is gone: no live worker for 60 s; other groups may take over what it had under way"]


def test_a_broken_generation_is_replaced_at_once_by_the_same_members():
    groups = TrainerGroups(0, SETTLE)
    for name in ("worker0", "worker1"):
        groups.add(0, name, 0, 0.0)
    assert groups.view(0, 5.0).generation == 1
    groups.regroup(0, 1, 6.0)
    groups.regroup(0, 1, 6.1)  # the other member says so too: still one new generation
    view = groups.view(0, 6.1)
    assert (view.generation, members(view)) == (2, ["worker0", "worker1"])
    groups.regroup(0, 1, 7.0)  # a late report about generation 1 changes nothing
    assert groups.view(0, 7.0).generation == 2


def test_the_groups_of_a_job_run_before_are_not_gone_in_the_next():
    clock = Clock()
    table = Membership(datetime.timedelta(seconds=5), clock=clock, groups=TrainerGroups(1, SETTLE))
    join = lambda: table.join(pb.JoinRequest(role=pb.ROLE_WORKER, name="h", host="127.0.0.1",  # noqa: E731
                                             capabilities=pb.Capabilities(pid=1)))
    workers = [join(), join()]
    for worker in workers:
        table.leave(pb.LeaveRequest(member_id=worker.member_id, reason="killed"))
    clock.now += 60
    assert table.trainer_groups_gone() == [0, 1]
    assert join().job_run == 2  # no worker was alive: the job starts again, and group 1 is no longer gone
    assert table.trainer_groups_gone() == []
