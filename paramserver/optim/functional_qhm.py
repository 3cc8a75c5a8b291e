"""``FunctionalQHM``: quasi-hyperbolic momentum as a TorchScript class.

Owns the server-side QHM: the optimizer a parameter server builds over the
parameters it owns and steps with a list of gradients, compiled with
``torch.jit.script`` so it runs in RPC threads without the GIL.  It holds
the momentum state (which persists across steps) and knows nothing of RPC.

Math (same trajectory as ``paramserver.optim.QHM`` / ``qhoptim``)::

    b     = beta * b + (1 - beta) * g
    theta = theta - lr * ((1 - nu) * g + nu * b)

Speed: the dense step is one pass over the data (row slices of a sparse
step below 32768 elements use multi-tensor ops, see ``kernels``).  QHM is Nesterov momentum
SGD on a rescaled buffer ``B = k * b`` with ``k = nu / ((1 - nu) * beta)``::

    B     = beta * B + (1 - d) * g,          1 - d = k * (1 - beta)
    theta = theta - lr' * (g + beta * B),    lr' = lr * (1 - nu)

which PyTorch's fused SGD kernel applies in a single read/write of each
tensor (``nu == 1`` is plain momentum on ``b`` itself, ``k = 1``).  The
rescaling is internal: ``state_dict()`` returns ``b``.  When ``beta == 0``
or ``nu == 0`` the rescaling does not exist and the step falls back to the
reference's four multi-tensor operations.

Row-sparse gradients (COO, one index per row, duplicates summed) update only
the rows they touch and those rows' momentum: a step costs time in
proportion to the rows touched.  Momentum is lazy: the buffer rows of
untouched rows do not decay, and "direct" weight decay only shrinks touched
rows.  On the touched rows the update equals a dense step of the sub-table
made of those rows; a step's row slices of every parameter are updated in
one pass over their lists, then written back.
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from .hyperparameters import check_qhm_hyperparameters
from .kernels import check_gradients, momentum_step, row_slice_fused_min_elements
from .qhm import QHM
from .records import JobChoice, RowOptimizer, StateKind
from .row_sparse import RowState, RowStep


class FunctionalQHM:
    def __init__(
        self,
        params: List[Tensor],
        lr: float,
        momentum: float,
        nu: float,
        weight_decay: float = 0.0,
        weight_decay_type: str = "grad",
        _allow_empty_param_list: bool = False,
    ):
        check_qhm_hyperparameters(lr, momentum, nu, weight_decay, weight_decay_type)
        if len(params) == 0 and not _allow_empty_param_list:
            raise ValueError("FunctionalQHM: optimizer got an empty parameter list")
        self.params = params
        self.lr = lr
        self.momentum = momentum
        self.nu = nu
        self.weight_decay = weight_decay
        self.weight_decay_type = weight_decay_type
        # Momentum buffers are stored multiplied by ``buffer_scale`` (k above).
        self.state = RowState("FunctionalQHM", params, ["momentum_buffer"], ["element"], [0.0])
        self.buffer_scale: float = 1.0
        # Tensors written by the last step's in-place list kernels; see step.
        self.last_updated: List[Tensor] = []

    def _target_scale(self) -> float:
        # 0 means: no fused form, use the reference's operations on b.
        if self.momentum == 0.0 or self.nu == 0.0:
            return 0.0
        if self.nu == 1.0:
            return 1.0
        return self.nu / ((1.0 - self.nu) * self.momentum)

    def _rescale_buffers(self, scale: float) -> None:
        stored = self.buffer_scale
        new = scale if scale != 0.0 else 1.0
        if new != stored:
            for i in range(len(self.params)):
                if self.state.has(i):
                    self.state.of(i)[0].mul_(new / stored)
            self.buffer_scale = new

    def _apply(self, params: List[Tensor], grads: List[Tensor], buffers: List[Tensor], scale: float,
               fused_min_elements: int) -> List[Tensor]:
        """The dense QHM update of ``params`` (buffers already at ``scale``); returns every tensor written (see
        ``step``)."""
        lr = self.lr
        beta = self.momentum
        nu = self.nu
        decay = self.weight_decay
        grad_decay = 0.0
        if decay != 0.0:
            if self.weight_decay_type == "direct":
                torch._foreach_mul_(params, 1.0 - lr * decay)
            else:
                grad_decay = decay
        if scale == 0.0:
            # Reference order of operations; never writes the gradients.
            if grad_decay != 0.0:
                grads = torch._foreach_add(grads, params, alpha=grad_decay)
            torch._foreach_mul_(buffers, beta)
            torch._foreach_add_(buffers, grads, alpha=1.0 - beta)
            torch._foreach_add_(params, buffers, alpha=-lr * nu)
            torch._foreach_add_(params, grads, alpha=-lr * (1.0 - nu))
            written = params + buffers
        elif nu == 1.0:
            written = momentum_step(params, grads, buffers, lr, beta, beta, grad_decay, False, False, False,
                                    fused_min_elements)
        else:
            written = momentum_step(params, grads, buffers, lr * (1.0 - nu), beta, 1.0 - scale * (1.0 - beta),
                                    grad_decay, True, False, False, fused_min_elements)
        return written

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply one step; ``gradients[i]`` belongs to ``params[i]`` (``None`` skips it).

        Every gradient is validated before any parameter changes.  Runs
        without autograd recording, so parameters may require grad.
        """
        check_gradients("FunctionalQHM", self.params, gradients)
        with torch.no_grad():
            self.prepare_step(gradients)
            # TorchScript's dead-code elimination drops in-place list kernels (_fused_sgd_, _foreach_*_) whose
            # lists were built inside the graph unless the lists stay live; storing them in an attribute (a side
            # effect) keeps every update.  Tested in scripted mode.
            self.last_updated = self.step_rows(gradients)

    def prepare_step(self, gradients: List[Optional[Tensor]]) -> None:
        """What a step does once, before its rows (``step_rows``, which may run in parts at once): the buffers
        brought to the scale the update takes (after a restore, from 1), the rows' state made, the step
        counted."""
        self._rescale_buffers(self._target_scale())
        self.state.begin_step(gradients)

    def step_rows(self, gradients: List[Optional[Tensor]]) -> List[Tensor]:
        """The update of the rows of ``gradients`` (validated; ``prepare_step`` done), writing only those rows of
        the parameters and their state and nothing of this object: runs of one step's rows may be stepped at
        once.  Returns every tensor written (the caller keeps them live, see ``step``).

        Row-sparse gradients: every parameter's touched rows stepped together, in one update of the lists of
        their row slices (the same arithmetic per element as one parameter at a time), then written back."""
        scale = self._target_scale()
        written: List[Tensor] = []
        with torch.no_grad():  # (in parts, on threads of their own)
            batch = RowStep(self.state, gradients, True)
            if batch.has_rows():
                written = self._apply(batch.row_params, batch.row_grads, batch.row_state[0], scale,
                                      row_slice_fused_min_elements())
                batch.scatter()
            if batch.has_dense():
                written = written + self._apply(batch.dense_params, batch.dense_grads, batch.dense_state[0], scale, 0)
        return written

    def state_dict(self) -> Dict[int, Dict[str, Tensor]]:
        """A snapshot of the state: ``{param index: {"momentum_buffer": b}}``.

        Tensors are copies (a consistent snapshot while training goes on);
        parameters that never had a gradient have no entry.
        """
        state = self.state.state_dict()
        for entry in state.values():
            entry["momentum_buffer"].div_(self.buffer_scale)
        return state

    def settle_buffers(self) -> None:
        """Round the buffers kept to what a restore of ``state_dict()`` holds (b / k, rounded, then x k, rounded:
        within one unit of the last place), so that a run restored from a checkpoint goes on bit for bit as the
        one that wrote it (a shard calls it as it writes its checkpoint part)."""
        if self.buffer_scale != 1.0:
            for i in range(len(self.params)):
                if self.state.has(i):
                    buffer = self.state.of(i)[0]
                    buffer.copy_(buffer.div(self.buffer_scale).mul_(self.buffer_scale))

    def load_state_dict(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        """Restore a ``state_dict()``; validated whole before anything changes."""
        self.state.load_state_dict(state)
        for i in range(len(self.params)):
            if self.state.has(i):
                self.state.of(i)[0].mul_(self.buffer_scale)


#: QHM's record: the default of the CTR job (its ``momentum`` and ``nu`` are the job's own).
ROW_OPTIMIZER = RowOptimizer(
    name="QHM", functional=FunctionalQHM, local=(QHM,),
    state=(StateKind("momentum_buffer", "element"),),
    check=lambda h: check_qhm_hyperparameters(h["lr"], h["momentum"], h["nu"], h["weight_decay"],
                                              h["weight_decay_type"]),
    refusals=(), rows_independent=True, half_rows=True, native="qhm",
    example=dict(lr=0.1, momentum=0.9, nu=0.7),
    job=JobChoice("qhm", QHM, dict(lr=128.0, momentum=0.9, nu=0.7)),
    rank=0, state_doc="momentum, `dim` floats", update_doc="quasi-hyperbolic momentum, lazy")
