"""DistributedOptimizer across processes on loopback: drop-in use with plain
torch RPC, equality with local optimizers, state, bad input, lost owners,
concurrent trainers."""

import datetime
import os
import signal
import threading
import time
import warnings

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

from dataplane import make_param, owner_pid, param_value, run_cluster
from paramserver._torch_compat import rpc_barrier
from paramserver.optim import QHM, DistributedOptimizer, OwnerFailedError
from paramserver.processes import ChildProcessesFailed
from paramserver.shards import PeerOptions, fetch, leave, place_parameters, stop_shards

pytestmark = pytest.mark.timeout(150)


def model_loss(params, x):
    w1, w2, b = params
    return ((x @ w1).tanh() @ w2 + b).pow(2).sum()


class SGDWithoutFunctionalForm(torch.optim.SGD):
    """Same math as SGD, but not in functional_optim_map: takes the Python path."""


CONFIGS = [
    (QHM, dict(lr=0.1, momentum=0.9, nu=0.7)),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.Adam, dict(lr=0.01)),
    (SGDWithoutFunctionalForm, dict(lr=0.1, momentum=0.9)),
]


def _train_drop_in(optimizer_cls, config, steps=5, dist_cls=DistributedOptimizer):
    """Plain torch RPC parameters (float64, so that only real differences show);
    returns (distributed result, local result, warnings, optimizer)."""
    init = [torch.randn(5, 4, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64),
            torch.randn(3, dtype=torch.float64)]
    rrefs = [rpc.remote(owner, make_param, args=(value,))
             for owner, value in zip(["shard0", "shard1", "shard0"], init)]
    local = [value.clone().requires_grad_(True) for value in init]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist_opt = dist_cls(optimizer_cls, rrefs, **config)
    local_opt = optimizer_cls(local, **config)
    for _ in range(steps):
        x = torch.randn(6, 5, dtype=torch.float64)
        with dist_autograd.context() as context_id:
            remote = [rpc.rpc_sync(r.owner(), param_value, args=(r,)) for r in rrefs]
            dist_autograd.backward(context_id, [model_loss(remote, x)])
            dist_opt.step(context_id)
        local_opt.zero_grad()
        model_loss(local, x).backward()
        local_opt.step()
    return [r.to_here() for r in rrefs], [p.detach() for p in local], caught, dist_opt


def trainer_matches_local_optimizers():
    for optimizer_cls, config in CONFIGS:
        started = time.monotonic()
        distributed, local, caught, dist_opt = _train_drop_in(optimizer_cls, config)
        ended = time.monotonic()
        for got, expected in zip(distributed, local):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=lambda m: f"{optimizer_cls.__name__}: {m}")
        messages = [str(w.message) for w in caught if "functional" in str(w.message)]
        stats = dist_opt.owner_step_stats()
        assert sorted(stats) == ["shard0", "shard1"]
        assert all(s["steps"] == 5 and s["total_seconds"] > 0 for s in stats.values()), stats
        # The owners' last step, on the clock this host's processes share, lies within this trainer's steps.
        assert all(started < s["last_began"] <= s["last_ended"] < ended for s in stats.values()), (started, stats)
        if optimizer_cls is SGDWithoutFunctionalForm:
            assert not dist_opt.is_functional_optim
            assert messages and "SGDWithoutFunctionalForm" in messages[0]
            assert "register_functional_optim" in messages[0]
        else:
            assert dist_opt.is_functional_optim and not messages, messages
    # Same optimizer class through torch's own DistributedOptimizer: same result.
    from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer
    torch.manual_seed(1)
    ours, _, _, _ = _train_drop_in(torch.optim.SGD, dict(lr=0.1, momentum=0.9))
    torch.manual_seed(1)
    theirs, _, _, _ = _train_drop_in(torch.optim.SGD, dict(lr=0.1, momentum=0.9), dist_cls=TorchDistributedOptimizer)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_drop_in_with_plain_torch_rpc_matches_local_optimizers():
    run_cluster([(trainer_matches_local_optimizers, ())], num_shards=2)


def _owner_context_gradients(context_id, rrefs):
    """RPC target: the gradients dist_autograd context ``context_id`` holds here for ``rrefs``' parameters."""
    gradients = dist_autograd.get_gradients(context_id)
    return [gradients[r.local_value()].clone() for r in rrefs]


def trainer_context_step_equals_functional_step():
    """An owner's step from a context (the gradients looked up and checked in one pass, then the functional
    optimizer's fused update) lands on the same bits as the functional optimizer stepped with those very
    gradients as a list: parameters and momentum, over several steps (momentum state carried), QHM and SGD."""
    from paramserver.optim import FunctionalQHM, FunctionalSGD, ScriptedOptimizer
    for optimizer_cls, functional_cls, config in [
            (QHM, FunctionalQHM, dict(lr=0.1, momentum=0.9, nu=0.7)),
            (torch.optim.SGD, FunctionalSGD, dict(lr=0.1, momentum=0.9)),
            (torch.optim.SGD, FunctionalSGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01))]:
        init = [torch.randn(64, 32), torch.randn(32, 8), torch.randn(8), torch.randn(300, 200)]
        rrefs = [rpc.remote("shard0", make_param, args=(value,)) for value in init]
        dist_opt = DistributedOptimizer(optimizer_cls, rrefs, **config)
        local = [value.clone() for value in init]
        reference = ScriptedOptimizer(functional_cls, local, **config)
        for _ in range(4):
            x = torch.randn(6, 64)
            with dist_autograd.context() as context_id:
                remote = [rpc.rpc_sync("shard0", param_value, args=(r,)) for r in rrefs]
                w1, w2, b, big = remote
                loss = ((x @ w1).tanh() @ w2 + b).pow(2).sum() + (big * big).sum()
                dist_autograd.backward(context_id, [loss])
                gradients = rpc.rpc_sync("shard0", _owner_context_gradients, args=(context_id, rrefs))
                dist_opt.step(context_id)
            reference.step(gradients)
            for got, expected in zip(fetch(rrefs), local):
                assert torch.equal(got, expected), optimizer_cls
        state, expected_state = dist_opt.state_dict()["state"], reference.state_dict()
        assert sorted(state) == sorted(expected_state) == [0, 1, 2, 3]
        for index, entry in expected_state.items():
            for key, value in entry.items():
                assert torch.equal(state[index][key], value), (optimizer_cls, index, key)


def test_a_step_from_a_context_equals_the_functional_step_bit_for_bit():
    run_cluster([(trainer_context_step_equals_functional_step, ())], num_shards=1)


def _step_on(dist_opt, rrefs, x):
    with dist_autograd.context() as context_id:
        remote = [rpc.rpc_sync(r.owner(), param_value, args=(r,)) for r in rrefs]
        dist_autograd.backward(context_id, [model_loss(remote, x)])
        dist_opt.step(context_id)


def trainer_state_dict_round_trip():
    for optimizer_cls, config in CONFIGS:
        # float64: a state round trip of FunctionalQHM rescales its buffer (rounding only).
        init = [torch.randn(5, 4).double(), torch.randn(4, 3).double(), torch.randn(3).double()]
        rrefs = [rpc.remote(o, make_param, args=(v,)) for o, v in zip(["shard0", "shard1", "shard1"], init)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist_opt = DistributedOptimizer(optimizer_cls, rrefs, **config)
        batches = [torch.randn(6, 5).double() for _ in range(4)]
        for x in batches[:2]:
            _step_on(dist_opt, rrefs, x)
        saved_state = dist_opt.state_dict()
        saved_params = [r.to_here() for r in rrefs]
        assert sorted(saved_state["state"]) == [0, 1, 2], optimizer_cls
        for x in batches[2:]:
            _step_on(dist_opt, rrefs, x)
        after = [r.to_here() for r in rrefs]
        # Rewind parameters and state, replay: the same trajectory.
        for r, value in zip(rrefs, saved_params):
            rpc.rpc_sync(r.owner(), _assign, args=(r, value))
        dist_opt.load_state_dict(saved_state)
        for x in batches[2:]:
            _step_on(dist_opt, rrefs, x)
        for got, expected in zip([r.to_here() for r in rrefs], after):
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12,
                                       msg=lambda m: f"{optimizer_cls.__name__}: {m}")
        # A state that does not fit is refused whole: nothing changes on any owner.
        bad = {"optimizer": saved_state["optimizer"], "state": dict(saved_state["state"])}
        bad["state"][2] = {k: torch.zeros(7) if v.dim() else v for k, v in bad["state"][2].items()}
        before = dist_opt.state_dict()
        with pytest.raises((ValueError, RuntimeError), match="shard1"):
            dist_opt.load_state_dict(bad)
        for index, entry in dist_opt.state_dict()["state"].items():
            for key, value in entry.items():
                torch.testing.assert_close(value, before["state"][index][key], rtol=0, atol=0)
        with pytest.raises(ValueError, match="indices \\[9\\]"):
            dist_opt.load_state_dict({"optimizer": saved_state["optimizer"], "state": {9: {}}})


def _assign(rref, value):
    with torch.no_grad():
        rref.local_value().copy_(value)


def test_state_dict_gathers_and_restores_every_owner():
    run_cluster([(trainer_state_dict_round_trip, ())], num_shards=2)


def _resize(rref, shape):
    rref.local_value().data = torch.zeros(shape)


def trainer_bad_gradient_changes_nothing():
    rrefs = place_parameters([("w", torch.randn(3, 2)), ("v", torch.randn(4))], ["shard0"], prefix="model.")
    w, v = rrefs["w"], rrefs["v"]
    dist_opt = DistributedOptimizer(QHM, [v, w], lr=0.1, momentum=0.9, nu=0.7)
    with dist_autograd.context() as context_id:
        pw, pv = [rpc.rpc_sync("shard0", param_value, args=(r,)) for r in (w, v)]
        dist_autograd.backward(context_id, [(pw.sum(0) * pv[:2]).sum()])
        # The parameter changes shape between backward and step (as if re-placed).
        rpc.rpc_sync("shard0", _resize, args=(w, (2, 3)))
        before = fetch([v, w])
        with pytest.raises(ValueError) as raised:
            dist_opt.step(context_id)
        message = str(raised.value)
        assert "'shard0'" in message and "'model.w'" in message, message
        assert "[3, 2]" in message and "[2, 3]" in message, message
        for got, expected in zip(fetch([v, w]), before):
            assert torch.equal(got, expected)
    assert dist_opt.state_dict()["state"] == {}


def test_a_gradient_of_the_wrong_shape_fails_the_step_and_changes_nothing():
    run_cluster([(trainer_bad_gradient_changes_nothing, ())], num_shards=1)


def trainer_lost_owner(how, rpc_timeout_s):
    rrefs = [rpc.remote(owner, make_param, args=(torch.ones(4),)) for owner in ("shard0", "shard1")]
    dist_opt = DistributedOptimizer(torch.optim.SGD, rrefs, lr=0.5)
    pid = rpc.rpc_sync("shard1", owner_pid)
    os.kill(pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    time.sleep(0.2)
    started = time.monotonic()
    with dist_autograd.context() as context_id:
        value = rpc.rpc_sync("shard0", param_value, args=(rrefs[0],))
        dist_autograd.backward(context_id, [value.sum()])
        with pytest.raises(OwnerFailedError, match="owner 'shard1'"):
            dist_opt.step(context_id)
    assert time.monotonic() - started < rpc_timeout_s + 5
    # The surviving owner applied its step.
    assert torch.equal(rpc.rpc_sync("shard0", param_value, args=(rrefs[0],)), torch.full((4,), 0.5))
    if how == "stopped":
        os.kill(pid, signal.SIGKILL)
    stop_shards(["shard0"], graceful=False)
    leave(graceful=False)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_lost_owner_fails_the_step_naming_it_within_the_rpc_timeout(how):
    run_cluster([(trainer_lost_owner, (how, 3))], num_shards=2,
                trainer_options=PeerOptions(rpc_timeout=datetime.timedelta(seconds=3)),
                expected_exit_codes={"shard1": -signal.SIGKILL})


#: How long ``SlowToBuild`` takes to create, against a step's RPC timeout of ``STEP_TIMEOUT``: the step (a
#: Python optimizer's, on a machine the rest of the suite may keep busy) must fit its timeout.
CREATION_SECONDS, STEP_TIMEOUT = 5.0, datetime.timedelta(seconds=3)


class SlowToBuild(torch.optim.SGD):
    """SGD whose creation on the owner takes longer than a step's RPC timeout (as a first TorchScript compile
    can on a fresh machine)."""

    def __init__(self, *args, **kwargs):
        time.sleep(CREATION_SECONDS)
        super().__init__(*args, **kwargs)


def trainer_slow_creation():
    rref = rpc.remote("shard0", make_param, args=(torch.ones(4),))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no functional form": the Python path
        dist_opt = DistributedOptimizer(SlowToBuild, [rref], lr=0.5)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [rpc.rpc_sync("shard0", param_value, args=(rref,)).sum()])
        dist_opt.step(context_id)
    assert torch.equal(rpc.rpc_sync("shard0", param_value, args=(rref,)), torch.full((4,), 0.5))


def test_creating_an_optimizer_has_its_own_timeout_longer_than_a_steps():
    run_cluster([(trainer_slow_creation, ())], num_shards=1, trainer_options=PeerOptions(rpc_timeout=STEP_TIMEOUT))


def trainer_concurrent(rank, num_trainers, steps):
    trainers = [f"trainer{i}" for i in range(num_trainers)]
    for optimizer_cls in (torch.optim.SGD, SGDWithoutFunctionalForm):  # scripted path, Python path
        # Every trainer creates the same optimizer over the same parameters: they share it.
        key = optimizer_cls.__name__
        rrefs = [rpc.remote(owner, _shared_param, args=(key,)) for owner in ("shard0", "shard1")]
        dist_opt = DistributedOptimizer(optimizer_cls, rrefs, lr=1.0)
        rpc_barrier(trainers)  # all start together
        for _ in range(steps):
            with dist_autograd.context() as context_id:
                values = [rpc.rpc_sync(r.owner(), param_value, args=(r,)) for r in rrefs]
                # d loss / d p = rank + 1, everywhere.
                dist_autograd.backward(context_id, [sum(v.sum() for v in values) * (rank + 1)])
                dist_opt.step(context_id)
        rpc_barrier(trainers)  # all done
        expected = torch.full((256, 256), -float(steps * sum(range(1, num_trainers + 1))))
        for r in rrefs:
            assert torch.equal(r.to_here(), expected), (key, r.to_here()[0, :4])


_SHARED = {}
_SHARED_LOCK = threading.Lock()


def _shared_param(key):
    """RPC target: one zero-initialized parameter per key on this owner, the same for every caller
    (callers arrive concurrently, in several RPC threads)."""
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = torch.zeros(256, 256, requires_grad=True)
        return _SHARED[key]


def test_concurrent_trainers_lose_no_update():
    trainers, steps = 4, 20
    run_cluster([(trainer_concurrent, (rank, trainers, steps)) for rank in range(trainers)], num_shards=2)


def test_a_failing_trainer_fails_the_run():
    with pytest.raises(ChildProcessesFailed, match="trainer0 exited with 1"):
        run_cluster([(_fail, ())], num_shards=1, timeout=datetime.timedelta(seconds=60))


def _fail():
    raise AssertionError("this trainer fails on purpose")
