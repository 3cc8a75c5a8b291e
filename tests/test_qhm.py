"""The local QHM optimizer against the reference implementation (qhoptim)."""

import math

import pytest
import torch
from qhoptim.pyt import QHM as ReferenceQHM

from paramserver.optim import QHM

CONFIGS = [
    dict(lr=0.1, momentum=0.9, nu=0.7),
    dict(lr=0.1, momentum=0.9, nu=1.0),
    dict(lr=0.1, momentum=0.9, nu=0.0),
    dict(lr=0.1, momentum=0.0, nu=0.7),
    dict(lr=0.1, momentum=0.999, nu=0.7, weight_decay=0.01),
    dict(lr=0.1, momentum=0.9, nu=0.7, weight_decay=0.05, weight_decay_type="direct"),
]


def twin_params(count=3, shape=(20, 5)):
    ours = [torch.nn.Parameter(torch.randn(shape)) for _ in range(count)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs


def run_twins(ours, theirs, optimizer, reference, steps=100, skip_every=0):
    for step in range(steps):
        for index, (p, q) in enumerate(zip(ours, theirs)):
            skip = skip_every and (step + index) % skip_every == 0
            grad = None if skip else torch.randn_like(p)
            p.grad = None if grad is None else grad.clone()
            q.grad = None if grad is None else grad.clone()
        optimizer.step()
        reference.step()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_matches_reference_bit_for_bit(config):
    ours, theirs = twin_params()
    optimizer, reference = QHM(ours, **config), ReferenceQHM(theirs, **config)
    run_twins(ours, theirs, optimizer, reference, skip_every=4)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)
        assert torch.equal(optimizer.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"])


def test_param_groups_use_their_own_hyperparameters():
    ours, theirs = twin_params(count=4)

    def groups(params):
        return [{"params": params[:2]},
                {"params": params[2:], "lr": 0.01, "nu": 0.3, "weight_decay": 0.1, "weight_decay_type": "direct"}]

    optimizer = QHM(groups(ours), lr=0.1, momentum=0.9, nu=0.7)
    reference = ReferenceQHM(groups(theirs), lr=0.1, momentum=0.9, nu=0.7)
    run_twins(ours, theirs, optimizer, reference, steps=30)
    for p, q in zip(ours, theirs):
        assert torch.equal(p, q)


def test_momentum_buffer_is_created_once_and_persists():
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = QHM([param], lr=1.0, momentum=0.5, nu=1.0)
    param.grad = torch.ones(3)
    optimizer.step()  # b = 0.5 * 0 + 0.5 * 1 = 0.5; p = -0.5
    buffer = optimizer.state[param]["momentum_buffer"]
    param.grad = torch.zeros(3)
    optimizer.step()  # b = 0.25; p = -0.75: the momentum carried over
    assert optimizer.state[param]["momentum_buffer"] is buffer
    torch.testing.assert_close(buffer, torch.full((3,), 0.25))
    torch.testing.assert_close(param.detach(), torch.full((3,), -0.75))


def test_state_dict_round_trip_continues_the_same_trajectory():
    straight, resumed = twin_params()
    config = dict(lr=0.1, momentum=0.9, nu=0.7)
    first = QHM(straight, **config)
    grads = [[torch.randn_like(p) for p in straight] for _ in range(20)]
    second = QHM(resumed, **config)
    for step, step_grads in enumerate(grads):
        if step == 10:
            saved = second.state_dict()
            second = QHM(resumed, lr=0.5, momentum=0.1, nu=0.1)
            second.load_state_dict(saved)
        for opt, params in ((first, straight), (second, resumed)):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
    for p, q in zip(straight, resumed):
        assert torch.equal(p, q)


def test_weight_decay_leaves_the_gradient_untouched():
    param = torch.nn.Parameter(torch.randn(5))
    grad = torch.randn(5)
    param.grad = grad.clone()
    QHM([param], lr=0.1, momentum=0.9, nu=0.7, weight_decay=0.5).step()
    assert torch.equal(param.grad, grad)


@pytest.mark.parametrize("bad, name", [
    (dict(lr=-1.0), "lr=-1"),
    (dict(momentum=-0.5), "momentum=-0.5"),
    (dict(nu=math.nan), "nu=nan"),
    (dict(lr=math.inf), "lr=inf"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1"),
    (dict(weight_decay_type="l1"), "weight_decay_type='l1'"),
])
def test_invalid_hyperparameters_name_the_value(bad, name):
    config = dict(lr=0.1, momentum=0.9, nu=0.7)
    config.update(bad)
    with pytest.raises(ValueError, match=name.replace("(", r"\(")):
        QHM([torch.nn.Parameter(torch.zeros(1))], **config)


def test_invalid_group_hyperparameters_are_refused():
    with pytest.raises(ValueError, match="momentum=-1"):
        QHM([{"params": [torch.nn.Parameter(torch.zeros(1))], "momentum": -1.0}], lr=0.1, momentum=0.9, nu=0.7)


def test_sparse_gradient_points_to_the_functional_optimizer():
    param = torch.nn.Parameter(torch.zeros(4, 2))
    param.grad = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.ones(1, 2), (4, 2))
    with pytest.raises(RuntimeError, match="FunctionalQHM"):
        QHM([param], lr=0.1, momentum=0.9, nu=0.7).step()
