"""TorchScript building blocks shared by the functional optimizers.

Owns: validating a gradient against its parameter, the update of the
momentum-SGD family (for large tensors PyTorch's fused multi-tensor kernel,
``torch._fused_sgd_``, which reads parameter, gradient and buffer once and
writes parameter and buffer once; for small ones multi-tensor ops), and turning a row-sparse COO
gradient into (row indices, row values).  It owns no optimizer state.

Everything here compiles under TorchScript (compiled where a script class
calls it; plain Python when called from Python).  A caution that shaped this
module: TorchScript's dead-code elimination can drop an in-place list op
(``_fused_sgd_``, ``_foreach_*``) whose list was built inside the graph from
views or slices.  Callers pass lists whose elements are the parameter and
buffer tensors themselves, and the trajectory tests prove every update lands.
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..tables.row_types import is_half


def check_gradient(optimizer: str, index: int, param: Tensor, grad: Optional[Tensor]) -> None:
    """Raise ``ValueError`` if ``grad`` cannot be applied to ``param``.

    ``None`` is fine (the parameter is skipped).  A half-precision parameter also takes float32 gradients
    (its update is computed in float32).  A sparse gradient must be a
    COO tensor indexed on the first dimension only (one index per row), as
    ``nn.Embedding(sparse=True)`` and ``embedding_bag(sparse=True)`` produce.
    """
    if grad is None:
        return
    if grad.shape != param.shape:
        raise ValueError(
            "{}: gradient {} has shape {} but parameter {} has shape {}".format(
                optimizer, index, list(grad.shape), index, list(param.shape)))
    if grad.dtype != param.dtype and not (is_half(param.dtype) and grad.dtype == torch.float32):
        raise ValueError("{}: gradient {} has dtype {} but parameter {} has dtype {}".format(
            optimizer, index, grad.dtype, index, param.dtype))
    if grad.device != param.device:
        raise ValueError("{}: gradient {} is on {} but parameter {} is on {}".format(
            optimizer, index, grad.device, index, param.device))
    if grad.is_sparse:
        if param.dim() < 1 or grad.sparse_dim() != 1:
            raise ValueError(
                "{}: sparse gradient {} must be row-sparse (sparse_dim 1, as nn.Embedding(sparse=True) "
                "produces); got sparse_dim {} for a parameter of {} dimensions".format(
                    optimizer, index, grad.sparse_dim(), param.dim()))
    elif grad.layout != torch.strided:
        raise ValueError("{}: gradient {} has unsupported layout {}".format(optimizer, index, grad.layout))


# The fused CPU kernel starts its OpenMP threads for every tensor, however
# small.  For many dense tensors that is still the fastest (measured); for the
# small row slices of a sparse step it makes the step wait whenever the other
# core is busy (milliseconds instead of microseconds), so callers with small
# slices pass ``fused_min_elements=ROW_SLICE_FUSED_MIN_ELEMENTS`` and those
# slices take multi-tensor ops, which stay on one thread below PyTorch's grain.
# (A function, not a global: TorchScript cannot read module-level ints.)
def rounded_sqrt(values: Tensor) -> Tensor:
    """The square root of float32 ``values`` correctly rounded, as float64's rounded to float32 is (a float32's
    root never lies within two units of float64's last place of a midpoint of two float32s); other types as
    ``sqrt`` gives them.  torch's float32 ``sqrt`` is vectorised to within one unit in the last place on some
    processors: the row-wise optimizers take this one, as the native row kernel's ``sqrtf`` is, so that both
    paths give the same rows."""
    if values.dtype == torch.float32:
        return values.double().sqrt().float()
    return values.sqrt()


def row_slice_fused_min_elements() -> int:
    return 32768


def check_gradients(optimizer: str, params: List[Tensor], gradients: List[Optional[Tensor]]) -> None:
    """Validate a whole gradient list (length, then each gradient) before any update."""
    if len(gradients) != len(params):
        raise ValueError("{}.step: got {} gradients for {} parameters; the lengths must be equal".format(
            optimizer, len(gradients), len(params)))
    for i in range(len(params)):
        check_gradient(optimizer, i, params[i], gradients[i])


def momentum_step(
    params: List[Tensor],
    grads: List[Tensor],
    buffers: List[Tensor],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    is_first_step: bool,
    fused_min_elements: int = 0,
) -> List[Tensor]:
    """One step of momentum SGD over every tensor, with ``torch.optim.SGD``'s math.

    ``g = (-grad if maximize else grad) + weight_decay * p``;
    ``buf = g`` on the first step, else ``momentum * buf + (1 - dampening) * g``;
    ``p -= lr * (g + momentum * buf if nesterov else buf)``.
    Tensors of at least ``fused_min_elements`` go through the fused kernel
    (one pass), smaller ones through multi-tensor ops.  Gradients are read, never written.  With
    ``momentum == 0`` pass an empty ``buffers`` list.

    Returns every tensor written; the caller must keep the result (see the
    module docstring: otherwise TorchScript may drop the update).
    """
    use_buffers = momentum != 0.0
    if fused_min_elements <= 0:  # every tensor takes the fused kernel: the lists as given, no split
        torch._fused_sgd_(
            params, grads, buffers if use_buffers else [],
            weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
            nesterov=nesterov, maximize=maximize, is_first_step=is_first_step)
        return params + buffers if use_buffers else params
    large_params: List[Tensor] = []
    large_grads: List[Tensor] = []
    large_buffers: List[Tensor] = []
    small_params: List[Tensor] = []
    small_grads: List[Tensor] = []
    small_buffers: List[Tensor] = []
    for i in range(len(params)):
        if params[i].numel() >= fused_min_elements:
            large_params.append(params[i])
            large_grads.append(grads[i])
            if use_buffers:
                large_buffers.append(buffers[i])
        else:
            small_params.append(params[i])
            small_grads.append(grads[i])
            if use_buffers:
                small_buffers.append(buffers[i])
    if len(large_params) > 0:
        torch._fused_sgd_(
            large_params, large_grads, large_buffers,
            weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
            nesterov=nesterov, maximize=maximize, is_first_step=is_first_step)
    if len(small_params) > 0:
        effective = small_grads
        if maximize:
            effective = torch._foreach_neg(effective)
        if weight_decay != 0.0:
            effective = torch._foreach_add(effective, small_params, alpha=weight_decay)
        if not use_buffers:
            torch._foreach_add_(small_params, effective, alpha=-lr)
        else:
            if is_first_step:
                torch._foreach_copy_(small_buffers, effective)
            else:
                torch._foreach_mul_(small_buffers, momentum)
                torch._foreach_add_(small_buffers, effective, alpha=1.0 - dampening)
            if nesterov:
                torch._foreach_add_(small_params, effective, alpha=-lr)
                torch._foreach_add_(small_params, small_buffers, alpha=-lr * momentum)
            else:
                torch._foreach_add_(small_params, small_buffers, alpha=-lr)
    return large_params + large_buffers + small_params + small_buffers


def sparse_rows(grad: Tensor) -> Tuple[Tensor, Tensor]:
    """(row indices, row values) of a row-sparse COO gradient, duplicates summed."""
    coalesced = grad.coalesce()
    return coalesced.indices()[0], coalesced.values()
