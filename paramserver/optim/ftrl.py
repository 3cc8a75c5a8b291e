"""FTRL-Proximal (McMahan et al., "Ad Click Prediction: a View from the Trenches", KDD 2013).

Owns ``FunctionalFTRL`` (the TorchScript class shards run, on the row-sparse driver) and ``FTRL`` (the
same update as a local ``torch.optim.Optimizer``), as TensorFlow/Keras define it, per coordinate, with
``n`` the accumulator and ``z`` the linear term::

    n'    = n + g^2
    sigma = (n'^(-lr_power) - n^(-lr_power)) / lr
    z     = z + g - sigma * w
    w     = (sign(z) * l1 - z) / ((beta + n'^(-lr_power)) / lr + 2 * l2)    where |z| > l1, else 0
    n     = n'

State: ``accumulator`` (``n``, starting at ``initial_accumulator_value``, 0.1 by default: a dynamic
table's new rows too) and ``linear`` (``z``, starting at zero), both shaped like the parameter.  The
weights are a function of the state: a row that ``|z| <= l1`` keeps at zero is exactly zero (FTRL's
sparsity).  A row-sparse gradient (duplicates summed) updates only the touched rows and their state.
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from .hyperparameters import check_ftrl_hyperparameters
from .kernels import check_gradients, rounded_sqrt
from .local import FunctionalBackedOptimizer
from .records import JobChoice, RowOptimizer, StateKind
from .row_sparse import RowState, RowStep


class FunctionalFTRL:
    def __init__(self, params: List[Tensor], lr: float, lr_power: float = -0.5,
                 initial_accumulator_value: float = 0.1, l1: float = 0.0, l2: float = 0.0, beta: float = 0.0,
                 _allow_empty_param_list: bool = False):
        check_ftrl_hyperparameters(lr, lr_power, initial_accumulator_value, l1, l2, beta)
        if len(params) == 0 and not _allow_empty_param_list:
            raise ValueError("FunctionalFTRL: optimizer got an empty parameter list")
        self.params = params
        self.lr = lr
        self.lr_power = lr_power
        self.l1 = l1
        self.l2 = l2
        self.beta = beta
        self.state = RowState("FunctionalFTRL", params, ["accumulator", "linear"], ["element", "element"],
                              [initial_accumulator_value, 0.0])

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply one step; ``gradients[i]`` belongs to ``params[i]`` (``None`` skips it), validated first."""
        check_gradients("FunctionalFTRL", self.params, gradients)
        with torch.no_grad():
            self.prepare_step(gradients)
            self.step_rows(gradients)

    def step_rows(self, gradients: List[Optional[Tensor]]) -> List[Tensor]:
        """Update the rows' weights, ``accumulator`` and ``linear`` (``prepare_step`` done), and nothing else;
        returns the rows written."""
        with torch.no_grad():  # (in parts, on threads of their own)
            batch = RowStep(self.state, gradients, True)
            self._update(batch.row_params, batch.row_grads, batch.row_state)
            batch.scatter()
            self._update(batch.dense_params, batch.dense_grads, batch.dense_state)
        return batch.row_params + batch.dense_params

    def prepare_step(self, gradients: List[Optional[Tensor]]) -> None:
        self.state.begin_step(gradients)  # (once a step; then ``step_rows``, maybe on runs of rows at once)

    def _root(self, accumulator: Tensor) -> Tensor:
        """``accumulator ** -lr_power``; float32's square root (``lr_power`` -0.5, the default) correctly rounded,
        as float64's rounded to float32 is (a float32's root is never within two units in float64's last place
        of a midpoint of two float32s): torch's float32 ``sqrt`` is vectorised to within one unit in the last
        place, which ``sigma``'s difference of two roots would magnify (and the native row kernel's rows would
        then differ from these)."""
        if self.lr_power == -0.5:
            return rounded_sqrt(accumulator)
        return accumulator.pow(-self.lr_power)

    def _update(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]]) -> None:
        for j in range(len(params)):
            param = params[j]
            grad = grads[j]
            accumulator = state[0][j]
            linear = state[1][j]
            # (g * g rounded, then added: addcmul fuses the two on some processors, not on others)
            new_accumulator = accumulator.add(grad * grad)
            new_root = self._root(new_accumulator)
            sigma = new_root.sub(self._root(accumulator)).div_(self.lr)
            linear.add_(grad).sub_(sigma.mul_(param))
            denominator = new_root.add_(self.beta).div_(self.lr).add_(2.0 * self.l2)
            shrunk = linear.sign().mul_(self.l1).sub_(linear).div_(denominator)
            param.copy_(torch.where(linear.abs() > self.l1, shrunk, torch.zeros_like(shrunk)))
            accumulator.copy_(new_accumulator)

    def state_dict(self) -> Dict[int, Dict[str, Tensor]]:  # {index: {"accumulator": n, "linear": z}}
        return self.state.state_dict()

    def load_state_dict(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        self.state.load_state_dict(state)


class FTRL(FunctionalBackedOptimizer):
    """FTRL-Proximal over ``params``: dense or row-sparse gradients (``nn.Embedding(sparse=True)``).

    Args:
        lr: learning rate (alpha), > 0.
        lr_power: the accumulator's power in the per-coordinate rate, <= 0 (-0.5: AdaGrad-style).
        initial_accumulator_value: where every accumulator starts, >= 0.
        l1, l2: the L1 and L2 regularization strengths, >= 0.
        beta: added to the accumulator's root in the denominator, >= 0.
    """

    functional_cls = FunctionalFTRL

    def __init__(self, params, lr: float, lr_power: float = -0.5, initial_accumulator_value: float = 0.1,
                 l1: float = 0.0, l2: float = 0.0, beta: float = 0.0):
        check_ftrl_hyperparameters(float(lr), float(lr_power), float(initial_accumulator_value), float(l1),
                                   float(l2), float(beta))
        super().__init__(params, dict(lr=lr, lr_power=lr_power, initial_accumulator_value=initial_accumulator_value,
                                      l1=l1, l2=l2, beta=beta))


#: FTRL's record.  The job's rate looks large because the accumulator starts at 0.1, far above a batch mean's
#: squared gradients: a step is about lr / sqrt(0.1) times the gradient, as SGD's.
ROW_OPTIMIZER = RowOptimizer(
    name="FTRL", functional=FunctionalFTRL, local=(FTRL,),
    state=(StateKind("accumulator", "element", "initial_accumulator_value"), StateKind("linear", "element")),
    check=lambda h: check_ftrl_hyperparameters(h["lr"], h["lr_power"], h["initial_accumulator_value"], h["l1"],
                                               h["l2"], h["beta"]),
    refusals=(), rows_independent=True, half_rows=True, native="ftrl",
    example=dict(lr=0.5, l1=0.001),
    job=JobChoice("ftrl", FTRL, dict(lr=40.0)),
    rank=50, state_doc="accumulator and linear term, `2 * dim` floats (accumulator from 0.1)",
    update_doc="FTRL-Proximal as TensorFlow/Keras")
