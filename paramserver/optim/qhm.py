"""The local quasi-hyperbolic momentum optimizer (QHM).

Owns ``QHM``, a ``torch.optim.Optimizer`` with exactly the update of the
reference implementation (Ma & Yarats, ICLR 2019; ``qhoptim.pyt.QHM``):

    g_{t+1}     = beta * g_t + (1 - beta) * grad          (dampened momentum)
    theta_{t+1} = theta_t - lr * ((1 - nu) * grad + nu * g_{t+1})

with the momentum buffer created as zeros on a parameter's first step.  The
arithmetic is done in the reference's order, so trajectories agree bit for
bit.  One deliberate difference: the reference adds "grad"-type weight decay
into ``p.grad`` in place; this class leaves ``p.grad`` untouched.

The server-side, TorchScript version is ``FunctionalQHM``
(``paramserver.optim.functional_qhm``); this module does not depend on it.
"""

from typing import List

import torch
from torch.optim.optimizer import Optimizer

from .hyperparameters import check_qhm_hyperparameters


class QHM(Optimizer):
    """Quasi-hyperbolic momentum.

    Args:
        params: iterable of parameters or parameter-group dicts.
        lr: learning rate (alpha in the paper).
        momentum: momentum factor (beta), dampened: the buffer averages grads.
        nu: immediate discount factor; 0 is plain SGD, 1 is (dampened) momentum.
        weight_decay: L2 coefficient.
        weight_decay_type: ``"grad"`` adds ``weight_decay * p`` to the gradient
            (as ``torch.optim.SGD`` does); ``"direct"`` multiplies the
            parameter by ``1 - lr * weight_decay`` before the step.

    Because the momentum is dampened, plain momentum with ``lr=0.1,
    momentum=0.9`` corresponds to QHM with ``lr=1.0, momentum=0.9, nu=1``.
    """

    def __init__(self, params, lr: float, momentum: float, nu: float,
                 weight_decay: float = 0.0, weight_decay_type: str = "grad"):
        check_qhm_hyperparameters(float(lr), float(momentum), float(nu),
                                  float(weight_decay), str(weight_decay_type))
        defaults = dict(lr=lr, momentum=momentum, nu=nu,
                        weight_decay=weight_decay, weight_decay_type=weight_decay_type)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        # Groups may override any hyperparameter; validate the merged result.
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_qhm_hyperparameters(float(group["lr"]), float(group["momentum"]), float(group["nu"]),
                                  float(group["weight_decay"]), str(group["weight_decay_type"]))

    @torch.no_grad()
    def step(self, closure=None):
        """Performs one optimization step; ``closure`` re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            lr, nu, momentum = group["lr"], group["nu"], group["momentum"]
            weight_decay, weight_decay_type = group["weight_decay"], group["weight_decay_type"]
            params: List[torch.Tensor] = []
            grads: List[torch.Tensor] = []
            buffers: List[torch.Tensor] = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        "QHM does not support sparse gradients; FunctionalQHM (paramserver.optim) "
                        "applies row-sparse gradients on parameter servers")
                grad = p.grad
                if weight_decay != 0 and weight_decay_type == "direct":
                    p.mul_(1.0 - lr * weight_decay)
                elif weight_decay != 0:
                    grad = grad.add(p, alpha=weight_decay)
                state = self.state[p]
                if len(state) == 0:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(grad)
                buffers.append(state["momentum_buffer"])
            if not params:
                continue
            # Same operations and order as the reference, one multi-tensor kernel each.
            torch._foreach_mul_(buffers, momentum)
            torch._foreach_add_(buffers, grads, alpha=1.0 - momentum)
            torch._foreach_add_(params, buffers, alpha=-lr * nu)
            torch._foreach_add_(params, grads, alpha=-lr * (1.0 - nu))
        return loss
