"""Local optimizers that run the math of a functional optimizer: one update for one process and for shards.

Owns ``FunctionalBackedOptimizer``, a ``torch.optim.Optimizer`` whose step applies, for each parameter
group, the functional class it names (``functional_cls``, built with the group's hyperparameters) to the
parameters' gradients, dense or row-sparse, with the state kept in ``self.state`` as ``torch.optim``
optimizers keep theirs: a model trained in one process and the same model on shards give the same rows.
It owns no math.
"""

from typing import Any, Dict, List

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

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every group; ``closure`` re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            functional = self._functional(group, params)
            names = functional.state.names
            for i, param in enumerate(params):
                held = self.state[param]
                if held:
                    functional.state.tensors[i] = [held[name] for name in names]
            functional.step([param.grad for param in params])
            for i, param in enumerate(params):
                tensors = functional.state.tensors[i]
                self.state[param] = dict(zip(names, tensors))
        return loss
