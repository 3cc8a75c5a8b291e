"""Local optimizers that run the math of a functional optimizer: one update for one process and for shards.

Owns ``FunctionalBackedOptimizer``, a ``torch.optim.Optimizer`` whose step applies, for each parameter
group, the functional class it names (``functional_cls``, built with the group's hyperparameters) to the
parameters' gradients, dense or row-sparse, with the state kept in ``self.state`` as ``torch.optim``
optimizers keep theirs: a model trained in one process and the same model on shards give the same rows.
Each group keeps one functional instance from step to step (made again only when the group's parameters or
hyperparameters change), and a half-precision parameter's state counts the steps that rounded it
(``ROUNDING_STEP``, saved by ``state_dict``), so it rounds with a new step's bits at every step, as on a shard,
across a new instance and across a reload.  It owns no math.
"""

import itertools
from typing import Any, Dict, List, Tuple

import torch
from torch.optim.optimizer import Optimizer

from ..tables.row_types import is_half
from .row_sparse import state_dtype

#: The entry of a half-precision parameter's state counting the steps that rounded its values (an int): a state
#: dict carries it, so an optimizer loaded from one draws its rounding bits on from the same stream (one without
#: it loads too: its stream starts again at step 1, as before it was saved).
ROUNDING_STEP = "rounding_step"


class FunctionalBackedOptimizer(Optimizer):
    """A ``torch.optim.Optimizer`` stepping ``functional_cls`` (a class attribute) over each parameter group.

    Subclasses set ``functional_cls`` and pass their hyperparameters as ``defaults``; every group's merged
    hyperparameters are checked by building the functional class over it."""

    functional_cls: Any = None

    def _functional(self, group: Dict[str, Any], params: List[torch.Tensor]):
        options = {key: value for key, value in group.items() if key != "params"}
        return self.functional_cls(params, _allow_empty_param_list=True, **options)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        self._functional(self.param_groups[-1], [])  # the merged hyperparameters checked now, not at a step

    def _group_functional(self, index: int, group: Dict[str, Any]):
        """Group ``index``'s functional instance over all its parameters: the one kept, unless the group's
        parameters or hyperparameters changed since (a new one then: the rounding steps are the state's)."""
        functionals: Dict[int, Tuple[tuple, Any]] = self.__dict__.setdefault("_functionals", {})
        key = (tuple(id(param) for param in group["params"]),
               repr(sorted((name, value) for name, value in group.items() if name != "params")))
        kept = functionals.get(index)
        if kept is not None and kept[0] == key:
            return kept[1]
        functional = self._functional(group, list(group["params"]))
        functionals[index] = (key, functional)
        return functional

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """``torch.optim.Optimizer.load_state_dict``, but a half-precision parameter's state keeps its type
        (float32: ``row_sparse.state_dtype``), which torch would cast to the parameter's."""
        super().load_state_dict(state_dict)
        saved = itertools.chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = itertools.chain.from_iterable(group["params"] for group in self.param_groups)
        for saved_index, param in zip(saved, params):
            entry = state_dict["state"].get(saved_index)
            if entry is None or not is_half(param.dtype):
                continue
            for name, value in entry.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[param][name] = value.to(dtype=state_dtype(param), device=param.device, copy=True)

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every group; ``closure`` re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            params = group["params"]
            if all(param.grad is None for param in params):
                continue
            functional = self._group_functional(index, group)
            names = functional.state.names
            for i, param in enumerate(params):  # the state held here (loaded, perhaps) is the one stepped
                held = self.state.get(param)
                functional.state.tensors[i] = [held[name] for name in names] if held else None
                if held and ROUNDING_STEP in held:
                    functional.state.rounding_steps[i] = int(held[ROUNDING_STEP])
            functional.step([param.grad for param in params])
            for i, param in enumerate(params):
                tensors = functional.state.tensors[i]
                if tensors is not None:
                    self.state[param] = dict(zip(names, tensors))
                    if is_half(param.dtype):
                        self.state[param][ROUNDING_STEP] = functional.state.rounding_steps[i]
        return loss
