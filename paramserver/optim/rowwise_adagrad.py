"""Row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``, TorchRec's default for embedding tables).

Owns ``FunctionalRowWiseAdagrad`` (the TorchScript class shards run, on the row-sparse driver) and
``RowWiseAdagrad`` (the same update as a local ``torch.optim.Optimizer``).  One float of state per row
of a 2-D parameter::

    g = grad + weight_decay * row                      (a row's gradients summed first)
    state[row] += mean(g ** 2)                         (over the row's columns)
    row -= lr * g / (sqrt(state[row]) + eps)

On parameters that are not 2-D it is element-wise Adagrad (the state shaped like the parameter, no
mean).  State ``sum`` starts at zero, as FBGEMM's.  A row-sparse gradient (duplicates summed) updates
only the touched rows and their state; a dense gradient is every row touched.
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from .hyperparameters import check_rowwise_adagrad_hyperparameters
from .kernels import check_gradients, rounded_sqrt
from .local import FunctionalBackedOptimizer
from .records import JobChoice, RowOptimizer, StateKind
from .row_sparse import RowState, RowStep


class FunctionalRowWiseAdagrad:
    def __init__(self, params: List[Tensor], lr: float, eps: float = 1e-8, weight_decay: float = 0.0,
                 _allow_empty_param_list: bool = False):
        check_rowwise_adagrad_hyperparameters(lr, eps, weight_decay)
        if len(params) == 0 and not _allow_empty_param_list:
            raise ValueError("FunctionalRowWiseAdagrad: optimizer got an empty parameter list")
        self.params = params
        self.lr = lr
        self.eps = eps
        self.weight_decay = weight_decay
        self.state = RowState("FunctionalRowWiseAdagrad", params, ["sum"], ["row"], [0.0])

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply one step; ``gradients[i]`` belongs to ``params[i]`` (``None`` skips it), validated first."""
        check_gradients("FunctionalRowWiseAdagrad", self.params, gradients)
        with torch.no_grad():
            self.prepare_step(gradients)
            self.step_rows(gradients)

    def prepare_step(self, gradients: List[Optional[Tensor]]) -> None:
        self.state.begin_step(gradients)  # (once a step; then ``step_rows``, maybe on runs of rows at once)

    def step_rows(self, gradients: List[Optional[Tensor]]) -> List[Tensor]:
        """Update the rows' parameters and their ``sum`` (``prepare_step`` done), and nothing else; returns the rows
        written."""
        with torch.no_grad():  # (in parts, on threads of their own)
            batch = RowStep(self.state, gradients, True)
            self._update(batch.row_params, batch.row_grads, batch.row_state[0])
            batch.scatter()
            self._update(batch.dense_params, batch.dense_grads, batch.dense_state[0])
        return batch.row_params + batch.dense_params

    def _update(self, params: List[Tensor], grads: List[Tensor], sums: List[Tensor]) -> None:
        for j in range(len(params)):
            param = params[j]
            grad = grads[j]
            if self.weight_decay != 0.0:
                grad = grad.add(param, alpha=self.weight_decay)
            state_sum = sums[j]
            if param.dim() == 2:
                # A row's mean square summed in double and rounded once, and its root correctly rounded: the
                # same floats whatever order a reduction takes, so the native kernel's rows equal these.
                state_sum.add_(grad.double().pow(2).mean(1).to(state_sum.dtype))
                std = rounded_sqrt(state_sum).add_(self.eps).unsqueeze(1)
            else:
                state_sum.addcmul_(grad, grad)
                std = state_sum.sqrt().add_(self.eps)
            param.addcdiv_(grad, std, value=-self.lr)

    def state_dict(self) -> Dict[int, Dict[str, Tensor]]:  # {index: {"sum": one float per row}}
        return self.state.state_dict()

    def load_state_dict(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        self.state.load_state_dict(state)


class RowWiseAdagrad(FunctionalBackedOptimizer):
    """Row-wise Adagrad over ``params``: dense or row-sparse gradients (``nn.Embedding(sparse=True)``).

    Args:
        lr: learning rate.
        eps: added to the root of a row's accumulated squared gradient.
        weight_decay: L2 coefficient, added to the gradient.
    """

    functional_cls = FunctionalRowWiseAdagrad

    def __init__(self, params, lr: float, eps: float = 1e-8, weight_decay: float = 0.0):
        check_rowwise_adagrad_hyperparameters(float(lr), float(eps), float(weight_decay))
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay))


#: Row-wise Adagrad's record: one float of state per row.
ROW_OPTIMIZER = RowOptimizer(
    name="RowWiseAdagrad", functional=FunctionalRowWiseAdagrad, local=(RowWiseAdagrad,),
    state=(StateKind("sum", "row"),),
    check=lambda h: check_rowwise_adagrad_hyperparameters(h["lr"], h["eps"], h["weight_decay"]),
    refusals=(), rows_independent=True, half_rows=True, native="rowwise_adagrad",
    example=dict(lr=0.1),
    job=JobChoice("rowwise_adagrad", RowWiseAdagrad, dict(lr=0.5)),
    rank=30, state_doc="**one float**", update_doc="FBGEMM's `EXACT_ROWWISE_ADAGRAD`")
