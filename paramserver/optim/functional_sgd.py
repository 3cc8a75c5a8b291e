"""``FunctionalSGD``: ``torch.optim.SGD`` as a TorchScript class.

Owns the server-side SGD (momentum, dampening, weight decay, Nesterov,
maximize) and its momentum state.  Dense gradients are applied with
PyTorch's fused multi-tensor SGD kernel (one pass over parameter, gradient
and buffer; multi-tensor ops for small row slices of sparse steps), the same math
as ``torch.optim.SGD``.  It knows nothing of RPC.

Row-sparse gradients (COO, one index per row, duplicates summed) update only
the touched rows and their momentum rows (lazy momentum: untouched rows do
not decay).  ``torch.optim.SGD`` sets a buffer to the gradient on its first
step; row-wise, that is the first time a row is touched.  With zero
dampening a zero buffer gives the same result, so nothing extra is kept;
with dampening, a per-row "initialized" flag (one bool per row) is kept.
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from .hyperparameters import check_sgd_hyperparameters
from .kernels import check_gradients, momentum_step, row_slice_fused_min_elements
from .records import JobChoice, RowOptimizer, StateKind
from .row_sparse import RowState, RowStep


class FunctionalSGD:
    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        _allow_empty_param_list: bool = False,
    ):
        check_sgd_hyperparameters(lr, momentum, dampening, weight_decay, nesterov)
        if len(params) == 0 and not _allow_empty_param_list:
            raise ValueError("FunctionalSGD: optimizer got an empty parameter list")
        self.params = params
        self.lr = lr
        self.momentum = momentum
        self.dampening = dampening
        self.weight_decay = weight_decay
        self.nesterov = nesterov
        self.maximize = maximize
        names: List[str] = []
        layouts: List[str] = []
        if momentum != 0.0:  # a zero buffer's first update is the gradient, as torch.optim.SGD sets it
            names.append("momentum_buffer")
            layouts.append("element")
            if dampening != 0.0:  # where that does not hold: which rows had their first step
                names.append("rows_initialized")
                layouts.append("row_flag")
        self.state = RowState("FunctionalSGD", params, names, layouts, [0.0 for _ in names])
        # Tensors written by the last step's in-place list kernels; see step.
        self.last_updated: List[Tensor] = []

    def _fused(self, params: List[Tensor], grads: List[Tensor], buffers: List[Tensor], first: bool,
               fused_min_elements: int) -> List[Tensor]:
        """``momentum_step`` with this optimizer's settings; returns every tensor written (see ``step``)."""
        return momentum_step(params, grads, buffers, self.lr, self.momentum, self.dampening, self.weight_decay,
                             self.nesterov, self.maximize, first, fused_min_elements)

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply one step; ``gradients[i]`` belongs to ``params[i]`` (``None`` skips it).

        Every gradient is validated before any parameter changes.  Runs
        without autograd recording, so parameters may require grad.
        """
        check_gradients("FunctionalSGD", self.params, gradients)
        with torch.no_grad():
            self.prepare_step(gradients)
            # TorchScript's dead-code elimination drops in-place list kernels whose lists were built inside the
            # graph unless the lists stay live; storing them in an attribute (a side effect) keeps every update.
            self.last_updated = self.step_rows(gradients)

    def prepare_step(self, gradients: List[Optional[Tensor]]) -> None:
        """What a step does once, before its rows (``step_rows``, which may run in parts at once)."""
        self.state.begin_step(gradients)

    def step_rows(self, gradients: List[Optional[Tensor]]) -> List[Tensor]:
        """The update of the rows of ``gradients`` (validated; ``prepare_step`` done), writing only those rows of
        the parameters and their state and nothing of this object; returns every tensor written."""
        written: List[Tensor] = []
        with torch.no_grad():  # (in parts, on threads of their own)
            batch = RowStep(self.state, gradients, True)
            if batch.has_rows():
                written = self._update(batch.row_params, batch.row_grads, batch.row_state,
                                       row_slice_fused_min_elements())
                batch.scatter()
            if batch.has_dense():
                written = written + self._update(batch.dense_params, batch.dense_grads, batch.dense_state, 0)
        return written

    def _update(self, params: List[Tensor], grads: List[Tensor], state: List[List[Tensor]],
                fused_min_elements: int) -> List[Tensor]:
        """SGD's update of ``params`` (whole tensors, or a step's row slices) and their state."""
        if self.momentum == 0.0:
            return self._fused(params, grads, [], False, fused_min_elements)
        if self.dampening == 0.0:
            return self._fused(params, grads, state[0], False, fused_min_elements)
        written: List[Tensor] = []
        for j in range(len(params)):
            seen = state[1][j]
            if bool(seen.all()):
                written = written + self._fused([params[j]], [grads[j]], [state[0][j]], False, fused_min_elements)
            elif not bool(seen.any()):
                written = written + self._fused([params[j]], [grads[j]], [state[0][j]], True, fused_min_elements)
            else:
                written = written + self._subset_step(params[j], grads[j], state[0][j], seen.nonzero().view(-1),
                                                      False)
                written = written + self._subset_step(params[j], grads[j], state[0][j],
                                                      seen.logical_not().nonzero().view(-1), True)
            seen.fill_(True)
        return written

    def _subset_step(self, param_rows: Tensor, values: Tensor, buf_rows: Tensor, subset: Tensor,
                     first: bool) -> List[Tensor]:
        written: List[Tensor] = []
        if subset.numel() == 0:
            return written
        p = param_rows.index_select(0, subset)
        b = buf_rows.index_select(0, subset)
        written = self._fused([p], [values.index_select(0, subset)], [b], first, row_slice_fused_min_elements())
        param_rows.index_copy_(0, subset, p)
        buf_rows.index_copy_(0, subset, b)
        return written

    def state_dict(self) -> Dict[int, Dict[str, Tensor]]:
        """A snapshot: ``{param index: {"momentum_buffer": ..., ["rows_initialized": ...]}}`` (copies)."""
        return self.state.state_dict()

    def load_state_dict(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Restore a ``state_dict()``; validated whole before anything changes."""
        self.state.load_state_dict(state)


#: SGD's record: a momentum buffer only with momentum, and with dampening a flag per row (its first step).
ROW_OPTIMIZER = RowOptimizer(
    name="SGD", functional=FunctionalSGD, local=(torch.optim.SGD,),
    state=(StateKind("momentum_buffer", "element", kept=lambda h: h["momentum"] != 0.0, kept_doc="momentum"),
           StateKind("rows_initialized", "row_flag", kept=lambda h: h["momentum"] != 0.0 and h["dampening"] != 0.0,
                     kept_doc="momentum and dampening")),
    check=lambda h: check_sgd_hyperparameters(h["lr"], h["momentum"], h["dampening"], h["weight_decay"],
                                              h["nesterov"]),
    refusals=(), rows_independent=True, half_rows=True, native="sgd",
    example=dict(lr=0.1, momentum=0.9, dampening=0.1),
    job=JobChoice("sgd", torch.optim.SGD, dict(lr=512.0)),  # no momentum
    rank=10, state_doc="momentum (if any), `dim` floats", update_doc="`torch.optim.SGD`'s, lazy momentum")
