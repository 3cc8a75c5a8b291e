"""``FunctionalAdagrad``: ``torch.optim.Adagrad`` as a TorchScript class on the row-sparse driver.

Owns the server-side Adagrad with ``torch.optim.Adagrad``'s arguments and results (its single-tensor
path, the one it takes on CPU and for sparse gradients)::

    step += 1;  clr = lr / (1 + (step - 1) * lr_decay)
    g = -grad if maximize else grad;  g += weight_decay * p   (dense gradients only, as torch)
    sum += g * g;  p -= clr * g / (sqrt(sum) + eps)

State: ``sum`` shaped like the parameter, starting at ``initial_accumulator_value`` (a dynamic table's
new rows too), and ``step`` per parameter.  A row-sparse gradient (duplicates summed) updates only the
touched rows and their sums, as ``torch.optim.Adagrad`` does with a sparse gradient; like torch it
refuses ``weight_decay`` there.  It knows nothing of RPC.
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from .hyperparameters import check_adagrad_hyperparameters
from .kernels import check_gradients, rounded_sqrt
from .records import JobChoice, RowOptimizer, RowRefusal, StateKind
from .row_sparse import RowState, RowStep


class FunctionalAdagrad:
    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-2,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        _allow_empty_param_list: bool = False,
    ):
        check_adagrad_hyperparameters("Adagrad", lr, lr_decay, weight_decay, initial_accumulator_value, eps)
        if len(params) == 0 and not _allow_empty_param_list:
            raise ValueError("FunctionalAdagrad: optimizer got an empty parameter list")
        self.params = params
        self.lr = lr
        self.lr_decay = lr_decay
        self.weight_decay = weight_decay
        self.eps = eps
        self.maximize = maximize
        self.state = RowState("FunctionalAdagrad", params, ["step", "sum"], ["scalar", "element"],
                              [0.0, initial_accumulator_value])

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply one step; ``gradients[i]`` belongs to ``params[i]`` (``None`` skips it), validated first."""
        check_gradients("FunctionalAdagrad", self.params, gradients)
        with torch.no_grad():
            self.prepare_step(gradients)
            self.step_rows(gradients)

    def prepare_step(self, gradients: List[Optional[Tensor]]) -> None:
        """What a step does once, before its rows (``step_rows``, which may run in parts at once): the state
        made and each parameter with a gradient counts one more step (the table's, not a row's)."""
        self.state.begin_step(gradients)
        self.state.count_table_step(gradients, 0)

    def step_rows(self, gradients: List[Optional[Tensor]]) -> List[Tensor]:
        """Update the rows' parameters and their ``sum`` (``prepare_step`` done: the step counted), and nothing
        else; returns the rows written."""
        with torch.no_grad():  # (in parts, on threads of their own)
            batch = RowStep(self.state, gradients, True)
            self._update(batch.row_params, batch.row_grads, batch.row_state, True)
            batch.scatter()
            self._update(batch.dense_params, batch.dense_grads, batch.dense_state, False)
        return batch.row_params + batch.dense_params

    def _update(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]], rows: bool) -> None:
        if rows and self.weight_decay != 0.0 and len(params) > 0:
            raise ValueError("FunctionalAdagrad: weight_decay={} is not compatible with row-sparse gradients "
                             "(torch.optim.Adagrad refuses it too)".format(self.weight_decay))
        for j in range(len(params)):
            param = params[j]
            state_sum = state[1][j]
            step = float(state[0][j].item())
            grad = grads[j] if not self.maximize else -grads[j]
            clr = self.lr / (1 + (step - 1) * self.lr_decay)
            if rows:  # torch's sparse path: sum += g^2 on the rows; p += -clr * (g / std)
                state_sum.add_(grad.pow(2))
                std = rounded_sqrt(state_sum).add_(self.eps)  # (correctly rounded: the native kernel's)
                param.add_(grad / std, alpha=-clr)
            else:
                if self.weight_decay != 0.0:
                    grad = grad.add(param, alpha=self.weight_decay)
                state_sum.addcmul_(grad, grad, value=1)
                std = state_sum.sqrt().add_(self.eps)
                param.addcdiv_(grad, std, value=-clr)

    def state_dict(self) -> Dict[int, Dict[str, Tensor]]:  # {index: {"step", "sum"}}, as torch names them
        return self.state.state_dict()

    def load_state_dict(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        self.state.load_state_dict(state)


#: Adagrad's record: its step count is the table's, counted once a step (``prepare_step``), so its rows update
#: independently.
ROW_OPTIMIZER = RowOptimizer(
    name="Adagrad", functional=FunctionalAdagrad, local=(torch.optim.Adagrad,),
    state=(StateKind("step", "scalar"), StateKind("sum", "element", "initial_accumulator_value")),
    check=lambda h: check_adagrad_hyperparameters("Adagrad", h["lr"], h["lr_decay"], h["weight_decay"],
                                                  h["initial_accumulator_value"], h["eps"]),
    refusals=(RowRefusal(("weight_decay",), lambda h: h["weight_decay"] != 0.0,
                         "not compatible with row-sparse gradients (torch.optim.Adagrad refuses it too)"),),
    rows_independent=True, half_rows=True, native="adagrad",
    example=dict(lr=0.1, initial_accumulator_value=0.1),
    job=JobChoice("adagrad", torch.optim.Adagrad, dict(lr=0.5)),
    rank=20, state_doc="sum, `dim` floats (from `initial_accumulator_value`); a step count per table",
    update_doc="`torch.optim.Adagrad`'s sparse update")
