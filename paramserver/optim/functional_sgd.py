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
with dampening, a per-row "initialized" mask (one bool per row) is kept
until a dense step touches every row.
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from .hyperparameters import check_sgd_hyperparameters
from .kernels import (check_gradients, check_state_entry, momentum_step, resize_rows_, row_slice_fused_min_elements,
                      sparse_rows)


@torch.jit.script
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
        self.momentum_buffers: List[Optional[Tensor]] = [None for _ in params]
        self.rows_initialized: List[Optional[Tensor]] = [None for _ in params]
        # Tensors written by the last in-place list kernel; see _fused.
        self.last_updated: List[Tensor] = []

    def _fused(self, params: List[Tensor], grads: List[Tensor], buffers: List[Tensor], first: bool,
               fused_min_elements: int) -> None:
        written = momentum_step(params, grads, buffers, self.lr, self.momentum, self.dampening,
                                self.weight_decay, self.nesterov, self.maximize, first, fused_min_elements)
        # TorchScript's dead-code elimination drops in-place list kernels whose
        # lists were built inside the graph unless the lists stay live; storing
        # them in an attribute (a side effect) keeps every update.
        self.last_updated = written

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply one step; ``gradients[i]`` belongs to ``params[i]`` (``None`` skips it).

        Every gradient is validated before any parameter changes.  Runs
        without autograd recording, so parameters may require grad.
        """
        check_gradients("FunctionalSGD", self.params, gradients)
        with torch.no_grad():
            self._step(gradients)

    def _step(self, gradients: List[Optional[Tensor]]) -> None:
        use_momentum = self.momentum != 0.0
        first_params: List[Tensor] = []
        first_grads: List[Tensor] = []
        first_buffers: List[Tensor] = []
        params: List[Tensor] = []
        grads: List[Tensor] = []
        buffers: List[Tensor] = []
        for i in range(len(self.params)):
            grad = gradients[i]
            if grad is not None:
                param = self.params[i]
                if grad.is_sparse:
                    rows, values = sparse_rows(grad)
                    self._rows_step(i, rows, values)
                elif not use_momentum:
                    params.append(param)
                    grads.append(grad)
                elif self.rows_initialized[i] is not None:
                    # Buffer made by row-sparse steps, some rows never touched.
                    self._rows_step(i, torch.arange(param.size(0), device=param.device), grad)
                    self.rows_initialized[i] = None
                else:
                    buf = self.momentum_buffers[i]
                    if buf is None:
                        created = torch.empty_like(param, memory_format=torch.preserve_format)
                        self.momentum_buffers[i] = created
                        first_params.append(param)
                        first_grads.append(grad)
                        first_buffers.append(created)
                    else:
                        params.append(param)
                        grads.append(grad)
                        buffers.append(buf)
        if len(first_params) > 0:
            self._fused(first_params, first_grads, first_buffers, True, 0)
        if len(params) > 0:
            self._fused(params, grads, buffers, False, 0)

    def _rows_step(self, i: int, rows: Tensor, values: Tensor) -> None:
        """Step only ``rows`` of parameter ``i`` with gradient rows ``values``."""
        if rows.numel() == 0:
            return
        param = self.params[i]
        param_rows = param.index_select(0, rows)
        if self.momentum == 0.0:
            self._fused([param_rows], [values], [], False, row_slice_fused_min_elements())
            param.index_copy_(0, rows, param_rows)
            return
        buf = self.momentum_buffers[i]
        if buf is None:
            buf = torch.zeros_like(param, memory_format=torch.preserve_format)
            self.momentum_buffers[i] = buf
            if self.dampening != 0.0:
                self.rows_initialized[i] = torch.zeros(param.size(0), dtype=torch.bool, device=param.device)
        buf_rows = buf.index_select(0, rows)
        initialized = self.rows_initialized[i]
        if initialized is None:
            self._fused([param_rows], [values], [buf_rows], False, row_slice_fused_min_elements())
        else:
            seen = initialized.index_select(0, rows)
            self._subset_step(param_rows, values, buf_rows, seen.nonzero().view(-1), False)
            self._subset_step(param_rows, values, buf_rows, seen.logical_not().nonzero().view(-1), True)
            initialized.index_fill_(0, rows, True)
        param.index_copy_(0, rows, param_rows)
        buf.index_copy_(0, rows, buf_rows)

    def _subset_step(self, param_rows: Tensor, values: Tensor, buf_rows: Tensor, subset: Tensor, first: bool) -> None:
        if subset.numel() == 0:
            return
        p = param_rows.index_select(0, subset)
        b = buf_rows.index_select(0, subset)
        self._fused([p], [values.index_select(0, subset)], [b], first, row_slice_fused_min_elements())
        param_rows.index_copy_(0, subset, p)
        buf_rows.index_copy_(0, subset, b)

    def resize_rows(self, i: int, rows: int) -> None:
        """Parameter ``i`` now has ``rows`` rows (it grew in place): so does its state, new rows fresh."""
        resize_rows_(self.momentum_buffers[i], rows)
        resize_rows_(self.rows_initialized[i], rows)

    def reset_rows(self, i: int, rows: Tensor) -> None:
        """Rows ``rows`` of parameter ``i`` start afresh (a new id took them): their state is as never stepped."""
        buf = self.momentum_buffers[i]
        if buf is not None:
            buf.index_fill_(0, rows, 0.0)
        initialized = self.rows_initialized[i]
        if initialized is not None:
            initialized.index_fill_(0, rows, False)

    def state_dict(self) -> Dict[int, Dict[str, Tensor]]:
        """A snapshot: ``{param index: {"momentum_buffer": ..., ["rows_initialized": ...]}}`` (copies)."""
        state: Dict[int, Dict[str, Tensor]] = {}
        for i in range(len(self.params)):
            buf = self.momentum_buffers[i]
            if buf is not None:
                entry: Dict[str, Tensor] = {"momentum_buffer": buf.clone()}
                initialized = self.rows_initialized[i]
                if initialized is not None:
                    entry["rows_initialized"] = initialized.clone()
                state[i] = entry
        return state

    def load_state_dict(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Restore a ``state_dict()``; validated whole before anything changes."""
        for i, entry in state.items():
            check_state_entry("FunctionalSGD", self.params, i, entry)
            param = self.params[i]
            if "rows_initialized" in entry and list(entry["rows_initialized"].shape) != [param.size(0)]:
                raise ValueError("FunctionalSGD.load_state_dict: rows_initialized {} has shape {}, expected [{}]"
                                 .format(i, list(entry["rows_initialized"].shape), param.size(0)))
        buffers: List[Optional[Tensor]] = [None for _ in self.params]
        masks: List[Optional[Tensor]] = [None for _ in self.params]
        for i, entry in state.items():
            param = self.params[i]
            restored = torch.empty_like(param, memory_format=torch.preserve_format)
            restored.copy_(entry["momentum_buffer"])
            buffers[i] = restored
            if "rows_initialized" in entry:
                masks[i] = entry["rows_initialized"].to(device=param.device, dtype=torch.bool).clone()
        self.momentum_buffers = buffers
        self.rows_initialized = masks
