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


def check_finite_at_least(optimizer: str, name: str, value: float, least: float) -> None:
    """``ValueError`` naming ``optimizer``, ``name`` and ``value`` unless it is finite and >= ``least``."""
    if not math.isfinite(value) or value < least:
        raise ValueError("{}: invalid {}={} (must be finite and >= {})".format(optimizer, name, value, least))


def check_adagrad_hyperparameters(optimizer: str, lr: float, lr_decay: float, weight_decay: float,
                                  initial_accumulator_value: float, eps: float) -> None:
    """Raise ``ValueError`` for what ``torch.optim.Adagrad`` refuses, ``eps <= 0``, and NaN/inf."""
    check_finite_at_least(optimizer, "lr", lr, 0.0)
    check_finite_at_least(optimizer, "lr_decay", lr_decay, 0.0)
    check_finite_at_least(optimizer, "weight_decay", weight_decay, 0.0)
    check_finite_at_least(optimizer, "initial_accumulator_value", initial_accumulator_value, 0.0)
    if not math.isfinite(eps) or eps <= 0.0:
        raise ValueError("{}: invalid eps={} (must be finite and > 0)".format(optimizer, eps))


def check_rowwise_adagrad_hyperparameters(lr: float, eps: float, weight_decay: float) -> None:
    """Raise ``ValueError`` for a negative ``lr`` or ``weight_decay``, ``eps <= 0``, and NaN/inf."""
    check_finite_at_least("RowWiseAdagrad", "lr", lr, 0.0)
    if not math.isfinite(eps) or eps <= 0.0:
        raise ValueError("RowWiseAdagrad: invalid eps={} (must be finite and > 0)".format(eps))
    check_finite_at_least("RowWiseAdagrad", "weight_decay", weight_decay, 0.0)


def check_adam_hyperparameters(optimizer: str, lr: float, beta1: float, beta2: float, eps: float,
                               weight_decay: float) -> None:
    """Raise ``ValueError`` for what ``torch.optim.Adam`` refuses, ``eps <= 0``, and NaN/inf."""
    check_finite_at_least(optimizer, "lr", lr, 0.0)
    if not 0.0 <= beta1 < 1.0:
        raise ValueError("{}: invalid betas[0]={} (must be in [0, 1))".format(optimizer, beta1))
    if not 0.0 <= beta2 < 1.0:
        raise ValueError("{}: invalid betas[1]={} (must be in [0, 1))".format(optimizer, beta2))
    if not math.isfinite(eps) or eps <= 0.0:
        raise ValueError("{}: invalid eps={} (must be finite and > 0)".format(optimizer, eps))
    check_finite_at_least(optimizer, "weight_decay", weight_decay, 0.0)


def check_ftrl_hyperparameters(lr: float, lr_power: float, initial_accumulator_value: float, l1: float, l2: float,
                               beta: float) -> None:
    """Raise ``ValueError`` for FTRL values that TensorFlow/Keras refuse (``lr <= 0``, ``lr_power > 0``,
    negative ``initial_accumulator_value``, ``l1``, ``l2`` or ``beta``), and NaN/inf."""
    if not math.isfinite(lr) or lr <= 0.0:
        raise ValueError("FTRL: invalid lr={} (must be finite and > 0)".format(lr))
    if not math.isfinite(lr_power) or lr_power > 0.0:
        raise ValueError("FTRL: invalid lr_power={} (must be finite and <= 0)".format(lr_power))
    check_finite_at_least("FTRL", "initial_accumulator_value", initial_accumulator_value, 0.0)
    check_finite_at_least("FTRL", "l1", l1, 0.0)
    check_finite_at_least("FTRL", "l2", l2, 0.0)
    check_finite_at_least("FTRL", "beta", beta, 0.0)
