"""The dense part of a model, replicated in a trainer group and kept in step.

Owns one worker's replica of the dense layers: the module on the group's
device wrapped in ``DistributedDataParallel`` with the chosen comm hook,
its local optimizer, and the step counter, and keeping all of them equal
across the group's members when the group (re-)forms: DDP's constructor
copies rank 0's parameters and buffers to everyone, and ``_share_state``
copies rank 0's optimizer state and step (rank 0 of a new view is a member
that trained in the last one, whenever one did).  A re-formed group starts
a fresh comm-hook state: PowerSGD's error memory belongs to one rank's
gradients and its Q memory must be equal on every rank, so neither can be
carried over to a group with other members.

The training loop calls ``sync_point()`` at the start of every step; every
``agree_every`` steps it is where the group agrees to re-form or to stop.
All members hold the same step count (a newcomer takes rank 0's), so they
agree on the same steps, and a change takes effect within ``agree_every``
steps.
"""

import gc
import logging
from typing import Any, Callable, Dict, Iterable, Optional

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .group import TrainerGroup
from .hooks import comm_hook

logger = logging.getLogger(__name__)


class HookMismatch(ValueError):
    """Members of one trainer group were configured with different comm hooks."""


class DenseReplica:
    """``module`` trained by ``make_optimizer(parameters)`` in ``group``, all-reduced through ``hook``.

    Call it like the module (it runs the DDP wrapper).  ``step`` counts the
    group's completed steps (advance it with ``finish_step()``);
    ``bytes_per_step`` is what the hook measured in the last backward pass.
    """

    def __init__(self, group: TrainerGroup, module: nn.Module,
                 make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 hook: str = "allreduce", hook_options: Optional[Dict[str, Any]] = None,
                 agree_every: int = 10):
        if agree_every < 1:
            raise ValueError(f"agree_every must be at least 1, got {agree_every}")
        self.group = group
        self.module = module.to(group.device)
        self.optimizer = make_optimizer(self.module.parameters())
        self.hook = hook
        self.hook_options = dict(hook_options or {})
        self.step = 0
        self.agree_every = agree_every
        self.reformations = 0
        self._form()

    def _form(self) -> None:
        device_ids = [self.group.device] if self.group.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(self.module, device_ids=device_ids)
        self.hook_state, hook = comm_hook(self.hook, None, **self.hook_options)
        self.ddp.register_comm_hook(self.hook_state, hook)
        self._share_state()
        logger.info("dense replica in %s at step %d, comm hook %s", self.group.describe(), self.step, self.hook)

    def _share_state(self) -> None:
        mine = {"hook": self.hook, "hook_options": self.hook_options, "rpc_name": self.group.members[self.group.rank]}
        hooks = [None] * self.group.world_size
        dist.all_gather_object(hooks, mine)
        differing = [h for h in hooks if (h["hook"], h["hook_options"]) != (hooks[0]["hook"], hooks[0]["hook_options"])]
        if differing:
            raise HookMismatch("trainer group members use different comm hooks: " + "; ".join(
                f"{h['rpc_name']}: {h['hook']} {h['hook_options'] or ''}".strip() for h in hooks))
        state = [{"step": self.step, "optimizer": self.optimizer.state_dict()}]
        dist.broadcast_object_list(state, src=0, device=self.group.device)
        if self.group.rank != 0:
            self.step = state[0]["step"]
            self.optimizer.load_state_dict(state[0]["optimizer"])

    def __call__(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def sync_point(self, want_stop: bool = False) -> bool:
        """Start of a step, on every member: re-form if the group changed; False when the group stops.

        After re-forming it agrees again, in the new group: a member that
        just joined starts with this agreement, so everyone must.
        """
        if self.step % self.agree_every:
            return True
        while True:
            newer, stop = self.group.agree(want_stop)
            if stop:
                return False
            if not newer:
                return True
            self.group.reform()
            self.reformations += 1
            self._form()

    def finish_step(self, context_id: Optional[int] = None) -> None:
        """Apply the local optimizer to the averaged gradients and count the step.

        After ``dist_autograd.backward(context_id, ...)`` pass ``context_id``:
        DDP then leaves the averaged gradients in that context, not in ``.grad``.
        """
        if context_id is not None:
            gradients = dist_autograd.get_gradients(context_id)
            for param in self.module.parameters():
                param.grad = gradients.get(param)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

    def close(self) -> None:
        """Leave the group: DDP (its reducer and hook) goes first, while its process group still exists."""
        self._bytes_when_closed = self.bytes_per_step
        self.ddp = None
        self.hook_state = None
        gc.collect()
        self.group.close()

    @property
    def bytes_per_step(self) -> int:
        if self.hook_state is None:  # closed
            return self._bytes_when_closed
        return int(self.hook_state.last_step_bytes)
