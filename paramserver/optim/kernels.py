"""TorchScript building blocks shared by the functional optimizers.

Owns: validating a gradient against its parameter, the one-pass update of
the momentum-SGD family (PyTorch's fused multi-tensor kernel,
``torch._fused_sgd_``: reads parameter, gradient and buffer once and writes
parameter and buffer once), and turning a row-sparse COO gradient into
(row indices, row values).  It owns no optimizer state.

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


def check_gradient(optimizer: str, index: int, param: Tensor, grad: Optional[Tensor]) -> None:
    """Raise ``ValueError`` if ``grad`` cannot be applied to ``param``.

    ``None`` is fine (the parameter is skipped).  A sparse gradient must be a
    COO tensor indexed on the first dimension only (one index per row), as
    ``nn.Embedding(sparse=True)`` and ``embedding_bag(sparse=True)`` produce.
    """
    if grad is None:
        return
    if grad.shape != param.shape:
        raise ValueError(
            "{}: gradient {} has shape {} but parameter {} has shape {}".format(
                optimizer, index, list(grad.shape), index, list(param.shape)))
    if grad.dtype != param.dtype:
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


def fused_momentum_step(
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
) -> None:
    """One pass of momentum SGD over every tensor, with ``torch.optim.SGD``'s math.

    ``g = (-grad if maximize else grad) + weight_decay * p``;
    ``buf = g`` on the first step, else ``momentum * buf + (1 - dampening) * g``;
    ``p -= lr * (g + momentum * buf if nesterov else buf)``.
    Gradients are read, never written.  With ``momentum == 0`` the buffers are
    ignored (pass an empty list).
    """
    torch._fused_sgd_(
        params, grads, buffers,
        weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
        nesterov=nesterov, maximize=maximize, is_first_step=is_first_step)


def sparse_rows(grad: Tensor) -> Tuple[Tensor, Tensor]:
    """(row indices, row values) of a row-sparse COO gradient, duplicates summed."""
    coalesced = grad.coalesce()
    return coalesced.indices()[0], coalesced.values()
