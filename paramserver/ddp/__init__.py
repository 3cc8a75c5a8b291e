"""DDP plumbing of trainer groups: the gradient-compression comm hooks a group
all-reduces its replicated (dense) layers with (``hooks``), and the formation
of the groups themselves (``group``).

Owns nothing of the parameter servers' data plane nor of the control plane;
they meet in the worker runtime.
"""

from paramserver.ddp.hooks import (HOOK_NAMES, POWERSGD_ALIASES, CommHook, CommHookState, PowerSGDOptions,
                                   PowerSGDState, canonical_hook_options, comm_hook)
from paramserver.ddp.group import GroupStopped, TrainerGroup
from paramserver.ddp.replica import DenseReplica, HookMismatch

__all__ = ["HOOK_NAMES", "POWERSGD_ALIASES", "CommHook", "CommHookState", "PowerSGDOptions", "PowerSGDState",
           "canonical_hook_options", "comm_hook",
           "GroupStopped", "TrainerGroup", "DenseReplica", "HookMismatch"]
