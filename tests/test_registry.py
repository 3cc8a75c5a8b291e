"""functional_optim_map and register_functional_optim: every mapped class runs
compiled and matches its local optimizer; the contract check refuses bad classes."""

from typing import List, Optional

import pytest
import torch
from torch import Tensor

from paramserver.optim import (QHM, FunctionalQHM, FunctionalSGD, ScriptedOptimizer, functional_optim_map,
                               register_functional_optim)

HYPERPARAMETERS = {
    QHM: dict(lr=0.05, momentum=0.9, nu=0.7),
    torch.optim.SGD: dict(lr=0.05, momentum=0.9),
    torch.optim.Adam: dict(lr=0.01),
    torch.optim.AdamW: dict(lr=0.01),
    torch.optim.Adagrad: dict(lr=0.01),
    torch.optim.RMSprop: dict(lr=0.01),
    torch.optim.Rprop: dict(lr=0.01),
    torch.optim.Adamax: dict(lr=0.01),
    torch.optim.Adadelta: dict(lr=0.5),
}


def test_map_holds_ours_and_pytorch_functional_optimizers():
    assert functional_optim_map[QHM] is FunctionalQHM
    assert functional_optim_map[torch.optim.SGD] is FunctionalSGD
    for local_cls in HYPERPARAMETERS:
        assert local_cls in functional_optim_map


@pytest.mark.parametrize("local_cls", list(HYPERPARAMETERS), ids=lambda c: c.__name__)
def test_every_mapped_class_runs_compiled_and_matches_local(local_cls):
    config = HYPERPARAMETERS[local_cls]
    local_params = [torch.nn.Parameter(torch.randn(8, 3, dtype=torch.float64)) for _ in range(2)]
    params = [p.detach().clone() for p in local_params]
    local = local_cls(local_params, **config)
    functional = ScriptedOptimizer(functional_optim_map[local_cls], params, **config)
    for _ in range(100):
        grads = [torch.randn(8, 3, dtype=torch.float64) for _ in range(2)]
        for p, g in zip(local_params, grads):
            p.grad = g.clone()
        local.step()
        functional.step(grads)
    # Ours agree to float64 rounding; PyTorch's _FunctionalRprop differs from
    # torch.optim.Rprop by ~3e-8 (its own implementation), inside 1e-6.
    for p, q in zip(local_params, params):
        torch.testing.assert_close(q, p.detach(), rtol=0, atol=1e-6)


@torch.jit.script
class FunctionalSignSGD:
    def __init__(self, params: List[Tensor], lr: float):
        self.params = params
        self.lr = lr

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        for i in range(len(self.params)):
            grad = gradients[i]
            if grad is not None:
                self.params[i].add_(grad.sign(), alpha=-self.lr)


class SignSGD(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))


def test_register_a_valid_class(restore_map):
    register_functional_optim(SignSGD, FunctionalSignSGD, rows=False)
    assert functional_optim_map[SignSGD] is FunctionalSignSGD
    param = torch.zeros(3)
    optimizer = ScriptedOptimizer(FunctionalSignSGD, [param], lr=0.5)
    optimizer.step([torch.tensor([2.0, -3.0, 0.0])])
    assert param.tolist() == [-0.5, 0.5, 0.0]


class UntypedParams:
    def __init__(self, params, lr: float):
        self.params = params

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        pass


class DenseOnlyStep:
    def __init__(self, params: List[Tensor], lr: float):
        self.params = params

    def step(self, gradients: List[Tensor]) -> None:
        pass


class NotScriptable:
    def __init__(self, params: List[Tensor], lr: float):
        self.params = params
        self.seen = {1, 2}

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        pass


class NoStep:
    def __init__(self, params: List[Tensor], lr: float):
        self.params = params


@pytest.mark.parametrize("local_cls, functional_cls, message", [
    (object, FunctionalSignSGD, "torch.optim.Optimizer subclass"),
    (SignSGD, "FunctionalSignSGD", "must be a class"),
    (SignSGD, UntypedParams, "parameters first, annotated List"),
    (SignSGD, NoStep, "no step"),
    (SignSGD, NotScriptable, "does not compile under TorchScript"),
    (SignSGD, DenseOnlyStep, r"step must accept a List\[Optional\[Tensor\]\]"),
    (SignSGD, FunctionalSignSGD, r"no per-row state that can follow a table's rows: it needs a 'state' attribute "
                                 r"of type paramserver.optim.RowState"),
])
def test_register_refuses_classes_that_break_the_contract(restore_map, local_cls, functional_cls, message):
    with pytest.raises(TypeError, match=message):
        register_functional_optim(local_cls, functional_cls)
    assert SignSGD not in functional_optim_map
