"""``FunctionalAdam``: ``torch.optim.Adam`` and ``torch.optim.SparseAdam`` as one TorchScript class.

Owns the server-side Adam.  Dense gradients take ``torch.optim.Adam``'s own functional update
(``torch.optim._functional.adam``: weight decay, ``amsgrad``, ``maximize``), so a dense step equals
``torch.optim.Adam``'s.  Row-sparse gradients (COO, one index per row, duplicates summed) take lazy Adam,
``torch.optim.SparseAdam``'s update, with the same operations in the same order: only the touched rows
and their moments change, and the bias correction counts the parameter's steps::

    step += 1;  g = -grad if maximize else grad
    m += (1 - beta1) * (g - m);  v += (1 - beta2) * (g * g - v)       (touched rows only)
    p -= lr * sqrt(1 - beta2^step) / (1 - beta1^step) * m / (sqrt(v) + eps)

``amsgrad`` and ``weight_decay`` have no lazy form in torch (``SparseAdam`` has neither): they are
refused for row-sparse gradients.  State: ``step`` per parameter, ``exp_avg``, ``exp_avg_sq`` (and
``max_exp_avg_sq`` with ``amsgrad``) shaped like the parameter, all starting at zero, as torch names
them.  It knows nothing of RPC.
"""

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.optim._functional as F
from torch import Tensor

from .hyperparameters import check_adam_hyperparameters
from .kernels import check_gradients, rounded_sqrt
from .records import JobChoice, RowOptimizer, RowRefusal, StateKind
from .row_sparse import RowState, RowStep


class FunctionalAdam:
    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        foreach: Optional[bool] = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        _allow_empty_param_list: bool = False,
    ):
        check_adam_hyperparameters("Adam", lr, betas[0], betas[1], eps, weight_decay)
        if len(params) == 0 and not _allow_empty_param_list:
            raise ValueError("FunctionalAdam: optimizer got an empty parameter list")
        self.params = params
        self.lr = lr
        self.beta1 = betas[0]
        self.beta2 = betas[1]
        self.eps = eps
        self.weight_decay = weight_decay
        self.amsgrad = amsgrad
        self.maximize = maximize
        names = ["step", "exp_avg", "exp_avg_sq"]
        layouts = ["scalar", "element", "element"]
        if amsgrad:
            names.append("max_exp_avg_sq")
            layouts.append("element")
        self.state = RowState("FunctionalAdam", params, names, layouts, [0.0 for _ in names])

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply one step; ``gradients[i]`` belongs to ``params[i]`` (``None`` skips it), validated first."""
        check_gradients("FunctionalAdam", self.params, gradients)
        with torch.no_grad():
            self.prepare_step(gradients)
            self.step_rows(gradients)

    def prepare_step(self, gradients: List[Optional[Tensor]]) -> None:
        """What a step does once, before its rows (``step_rows``, which may run in parts at once): the state
        made and each parameter with a gradient counts one more step (the table's, not a row's: as
        ``torch.optim.SparseAdam`` counts it, a gradient without rows too)."""
        self.state.begin_step(gradients)
        self.state.count_table_step(gradients, 0)

    def step_rows(self, gradients: List[Optional[Tensor]]) -> List[Tensor]:
        """Update the rows' parameters and their moments (``prepare_step`` done: the step counted), and nothing
        else; returns the rows written."""
        with torch.no_grad():  # (in parts, on threads of their own)
            batch = RowStep(self.state, gradients, True)
            self._lazy(batch.row_params, batch.row_grads, batch.row_state)
            batch.scatter()
            if batch.has_dense():
                state = batch.dense_state
                for step_t in state[0]:  # (torch's adam counts the step itself: the count made above undone)
                    step_t.sub_(1)
                F.adam(batch.dense_params, batch.dense_grads, state[1], state[2], state[3] if self.amsgrad else [],
                       state[0], amsgrad=self.amsgrad, has_complex=False, maximize=self.maximize, beta1=self.beta1,
                       beta2=self.beta2, lr=self.lr, weight_decay=self.weight_decay, eps=self.eps, foreach=False,
                       fused=False, grad_scale=None, found_inf=None)
        return batch.row_params + batch.dense_params

    def _lazy(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]]) -> None:
        """``torch.optim.SparseAdam``'s update of the touched rows (``sparse_adam``'s operations), the step
        counted already."""
        if len(params) > 0 and (self.amsgrad or self.weight_decay != 0.0):
            raise ValueError("FunctionalAdam: amsgrad={} and weight_decay={} have no lazy form for row-sparse "
                             "gradients (torch.optim.SparseAdam has neither)".format(self.amsgrad, self.weight_decay))
        for j in range(len(params)):
            exp_avg = state[1][j]
            exp_avg_sq = state[2][j]
            step = float(state[0][j].item())
            grad = grads[j] if not self.maximize else -grads[j]
            exp_avg.add_(grad.sub(exp_avg).mul_(1 - self.beta1))
            exp_avg_sq.add_(grad.pow(2).sub_(exp_avg_sq).mul_(1 - self.beta2))
            denom = rounded_sqrt(exp_avg_sq).add_(self.eps)  # (correctly rounded: the native kernel's)
            bias_correction1 = 1 - self.beta1 ** step
            bias_correction2 = 1 - self.beta2 ** step
            step_size = self.lr * math.sqrt(bias_correction2) / bias_correction1
            params[j].add_(exp_avg.div(denom).mul_(-step_size))

    def state_dict(self) -> Dict[int, Dict[str, Tensor]]:  # {index: {"step", "exp_avg", ...}}, torch's names
        return self.state.state_dict()

    def load_state_dict(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        self.state.load_state_dict(state)


#: Adam's record (``Adam`` and ``SparseAdam``): its step count is the table's, counted once a step
#: (``prepare_step``), so its rows update independently.
ROW_OPTIMIZER = RowOptimizer(
    name="Adam", functional=FunctionalAdam, local=(torch.optim.Adam, torch.optim.SparseAdam),
    state=(StateKind("step", "scalar"), StateKind("exp_avg", "element"), StateKind("exp_avg_sq", "element"),
           StateKind("max_exp_avg_sq", "element", kept=lambda h: bool(h["amsgrad"]), kept_doc="amsgrad")),
    check=lambda h: check_adam_hyperparameters("Adam", h["lr"], h["betas"][0], h["betas"][1], h["eps"],
                                               h["weight_decay"]),
    refusals=(RowRefusal(("amsgrad", "weight_decay"), lambda h: bool(h["amsgrad"]) or h["weight_decay"] != 0.0,
                         "no lazy form for row-sparse gradients (torch.optim.SparseAdam has neither)"),),
    rows_independent=True, half_rows=True, native="adam",
    example=dict(lr=0.01),
    job=JobChoice("adam", torch.optim.SparseAdam, dict(lr=0.03)),  # lazy Adam: only the rows a step touched move
    rank=40, state_doc="two moments, `2 * dim` floats; a step count per table",
    update_doc="lazy Adam: `torch.optim.SparseAdam`'s")
