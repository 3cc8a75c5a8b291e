"""Local optimizers that run the math of a functional optimizer: one update for one process and for shards.

Owns ``FunctionalBackedOptimizer``, a ``torch.optim.Optimizer`` whose step applies, for each parameter
group, the functional class it names (``functional_cls``, built with the group's hyperparameters) to the
parameters' gradients, dense or row-sparse, with the state kept in ``self.state`` as ``torch.optim``
optimizers keep theirs: a model trained in one process and the same model on shards give the same rows.
Each group keeps one functional instance from step to step (made again only when the group's parameters or
hyperparameters change, and then its rounding steps carry over), so half-precision parameters round with a
new step's bits at every step, as on a shard.  It owns no math.
"""

from typing import Any, Dict, List, Tuple

import torch
from torch.optim.optimizer import Optimizer


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
        parameters or hyperparameters changed since (a new one then, counting on from the old one's rounding
        steps where a parameter stayed)."""
        functionals: Dict[int, Tuple[tuple, Any]] = self.__dict__.setdefault("_functionals", {})
        key = (tuple(id(param) for param in group["params"]),
               repr(sorted((name, value) for name, value in group.items() if name != "params")))
        kept = functionals.get(index)
        if kept is not None and kept[0] == key:
            return kept[1]
        functional = self._functional(group, list(group["params"]))
        if kept is not None:
            before = {id(param): step for param, step in zip(kept[1].params, kept[1].state.rounding_steps)}
            functional.state.rounding_steps = [before.get(id(param), 0) for param in functional.params]
        functionals[index] = (key, functional)
        return functional

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
            functional.step([param.grad for param in params])
            for i, param in enumerate(params):
                tensors = functional.state.tensors[i]
                if tensors is not None:
                    self.state[param] = dict(zip(names, tensors))
        return loss
