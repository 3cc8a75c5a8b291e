"""Validation of optimizer hyperparameters.

Owns the checks shared by the local optimizers (Python) and the functional
ones (TorchScript), so both reject the same values with the same message.
Every function here compiles under TorchScript when a script class calls it
and runs as plain Python (raising a plain ``ValueError``) otherwise.
"""

import math


def check_qhm_hyperparameters(
    lr: float, momentum: float, nu: float, weight_decay: float, weight_decay_type: str
) -> None:
    """Raise ``ValueError`` naming the first invalid QHM hyperparameter.

    Accepts what the reference implementation (qhoptim) accepts, and
    additionally refuses NaN and infinite values, which it lets through.
    """
    if not math.isfinite(lr) or lr < 0.0:
        raise ValueError("Invalid learning rate: lr={} (must be finite and >= 0)".format(lr))
    if not math.isfinite(momentum) or momentum < 0.0:
        raise ValueError("Invalid momentum value: momentum={} (must be finite and >= 0)".format(momentum))
    if not math.isfinite(nu):
        raise ValueError("Invalid nu value: nu={} (must be finite)".format(nu))
    if not math.isfinite(weight_decay) or weight_decay < 0.0:
        raise ValueError(
            "Invalid weight_decay value: weight_decay={} (must be finite and >= 0)".format(weight_decay)
        )
    if weight_decay_type != "grad" and weight_decay_type != "direct":
        raise ValueError(
            "Invalid weight_decay_type value: weight_decay_type='{}' (must be 'grad' or 'direct')".format(
                weight_decay_type
            )
        )


def check_sgd_hyperparameters(
    lr: float, momentum: float, dampening: float, weight_decay: float, nesterov: bool
) -> None:
    """Raise ``ValueError`` for what ``torch.optim.SGD`` refuses (and NaN/inf)."""
    if not math.isfinite(lr) or lr < 0.0:
        raise ValueError("Invalid learning rate: lr={} (must be finite and >= 0)".format(lr))
    if not math.isfinite(momentum) or momentum < 0.0:
        raise ValueError("Invalid momentum value: momentum={} (must be finite and >= 0)".format(momentum))
    if not math.isfinite(dampening):
        raise ValueError("Invalid dampening value: dampening={} (must be finite)".format(dampening))
    if not math.isfinite(weight_decay) or weight_decay < 0.0:
        raise ValueError(
            "Invalid weight_decay value: weight_decay={} (must be finite and >= 0)".format(weight_decay)
        )
    if nesterov and (momentum <= 0.0 or dampening != 0.0):
        raise ValueError(
            "Nesterov momentum requires a momentum > 0 and zero dampening (got momentum={}, dampening={})".format(
                momentum, dampening
            )
        )
