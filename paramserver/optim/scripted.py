"""Running a functional optimizer as compiled TorchScript from Python.

Owns ``ScriptedOptimizer``: builds a functional optimizer (``FunctionalQHM``,
``FunctionalSGD`` or any registered class) over a list of tensors, converts
the instance into a TorchScript object so every ``step`` runs in the
TorchScript interpreter (which releases the GIL), and turns errors raised
inside TorchScript back into the Python exceptions they were
(``torch.jit.Error`` wrapping "builtins.ValueError: ..." becomes a
``ValueError``).  It owns no math and no state of its own.
"""

from typing import Dict, List, Optional

import torch
from torch import Tensor

from .._torch_compat import builtin_error_in_script_error
from ..torchscript import script

def reraise_script_error(error: Exception) -> None:
    """Re-raise a TorchScript error as the builtin exception it wraps, if any."""
    wrapped = builtin_error_in_script_error(error)
    if wrapped is not None:
        raise wrapped from error
    raise error


class ScriptedOptimizer:
    """A functional optimizer instance compiled with TorchScript.

    ``ScriptedOptimizer(FunctionalQHM, params, lr=1.0, momentum=0.9, nu=0.7)``
    validates the hyperparameters (raising ``ValueError``), compiles the
    instance, and exposes ``step(gradients)``, ``state_dict()`` and
    ``load_state_dict(state)`` of the compiled object.
    """

    def __init__(self, functional_cls, params: List[Tensor], *args, **kwargs):
        self.functional_cls = functional_cls
        self.params = list(params)
        instance = functional_cls(self.params, *args, **kwargs)
        self.script_object = script(instance)

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        try:
            self.script_object.step(list(gradients))
        except torch.jit.Error as error:
            reraise_script_error(error)

    def state_dict(self) -> Dict[int, Dict[str, Tensor]]:
        return self.script_object.state_dict()

    def load_state_dict(self, state: Dict[int, Dict[str, Tensor]]) -> None:
        try:
            self.script_object.load_state_dict(state)
        except torch.jit.Error as error:
            reraise_script_error(error)

    def __getattr__(self, name):
        # Hyperparameters (lr, momentum, ...) read through to the compiled object.
        return getattr(self.__dict__["script_object"], name)
