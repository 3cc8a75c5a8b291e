"""Trainer groups on the worker side, without a coordinator (``replica_workers``
plays its part through the store): a DDP replica trained in a group equals
local training on every member's batches, a member arriving mid-run is
taken in at the next generation with rank 0's state and step, and members
configured with different comm hooks are refused with a message naming them."""

import datetime
import pickle

import pytest
import torch
import torch.distributed as dist

import replica_workers as rw
from paramserver.processes import Child, ChildProcessesFailed, run_children

TIMEOUT = datetime.timedelta(seconds=90)
# Spawned members import torch (seconds each on 2 loaded cores).
pytestmark = pytest.mark.timeout(150)


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master
    del master


def results(tmp_path, names):
    return {name: pickle.loads((tmp_path / f"{name}.pkl").read_bytes()) for name in names}


def local_training(names, steps):
    """The same training in one process: the mean of every member's batch gradient per step."""
    module = rw.model()
    optimizer = rw.make_optimizer(module.parameters())
    for step in range(steps):
        optimizer.zero_grad()
        loss = sum((module(x) - y).pow(2).mean() for x, y in (rw.batch(n, step) for n in names)) / len(names)
        loss.backward()
        optimizer.step()
    return module.state_dict()


@pytest.mark.parametrize("hook", ["allreduce", "bf16"])
def test_a_group_trains_like_one_process_on_all_batches(tmp_path, store, hook):
    names, steps = ["worker0", "worker1"], 8
    children = [Child(name, rw.train, (name, index, store.port, steps, hook, str(tmp_path / f"{name}.pkl"),
                                       (1, names) if index == 0 else None))
                for index, name in enumerate(names)]
    run_children(children, TIMEOUT)
    got = results(tmp_path, names)
    expected = local_training(names, steps)
    tolerance = 1e-6 if hook == "allreduce" else 2e-2
    for name in names:
        assert got[name]["step"] == steps
        for key, value in expected.items():
            torch.testing.assert_close(got[name]["state"][key], value, atol=tolerance, rtol=tolerance)
    for key in expected:  # replicas are identical to each other, whatever the hook's precision
        assert torch.equal(got["worker0"]["state"][key], got["worker1"]["state"][key])
    full_bytes = sum(v.numel() * 4 for v in expected.values())
    assert got["worker0"]["bytes_per_step"] == (full_bytes if hook == "allreduce" else full_bytes // 2)


def test_a_late_member_joins_at_the_next_generation_with_rank_0s_state(tmp_path, store):
    first, steps, late_at = ["worker0", "worker1"], 30, 10
    children = [Child(name, rw.train, (name, index, store.port, steps, "powersgd", str(tmp_path / f"{name}.pkl"),
                                       (1, first) if index == 0 else None, late_at))
                for index, name in enumerate(first)]
    children.append(Child("worker2", rw.train, ("worker2", 2, store.port, steps, "powersgd",
                                                str(tmp_path / "worker2.pkl"), (2, first + ["worker2"]), late_at, True)))
    run_children(children, TIMEOUT)
    got = results(tmp_path, first + ["worker2"])
    assert [got[n]["step"] for n in got] == [steps] * 3  # the newcomer took rank 0's step
    assert [got[n]["reformations"] for n in got] == [1, 1, 0]
    for key, value in got["worker0"]["state"].items():
        assert torch.equal(got["worker1"]["state"][key], value)
        assert torch.equal(got["worker2"]["state"][key], value)


def test_members_with_different_hooks_are_refused_naming_them(tmp_path, store):
    names = ["worker0", "worker1"]
    children = [Child(name, rw.train, (name, index, store.port, 3, hook, str(tmp_path / f"{name}.pkl"),
                                       (1, names) if index == 0 else None))
                for index, (name, hook) in enumerate(zip(names, ["allreduce", "fp16"]))]
    with pytest.raises(ChildProcessesFailed) as failed:
        run_children(children, TIMEOUT)
    assert failed.value.exit_codes == {"worker0": 1, "worker1": 1}
