"""``DistributedOptimizer``: the trainer's handle on optimizers that run where the parameters live.

Owns the client side: grouping parameter RRefs by owner, asking each owner
(concurrently) for its ``OwnerOptimizer``, one step RPC per owner per step
(all owners at once, sent by one TorchScript call: no Python per owner on
a step's way out), gathering and restoring optimizer state, and turning
owners' failures into one error that names them.  The owner side, where the
math runs, is ``paramserver.shards.server.optimizers``, reached through the
shard service (``paramserver.shards.server.service``).  Step RPCs are counted per owner
by its ``recorder`` when it was handed one (a ``StepRequestRecorder``: the
worker's data-plane metrics, when it serves them).

Same call shape and semantics as ``torch.distributed.optim.DistributedOptimizer``
(a drop-in with plain ``torch.distributed.rpc``), plus ``state_dict()`` /
``load_state_dict()``.
"""

import warnings
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Protocol

import torch
import torch.distributed.rpc as rpc
from torch.distributed.rpc import RRef

from .._torch_compat import check_autograd_context, remote_error_cause
from ..shards.peer import creation_timeout, settle
from ..shards.server import service
from ..torchscript import script
from .registry import class_name


class StepRequestRecorder(Protocol):
    """What ``DistributedOptimizer`` records of its step RPCs (``paramserver.metrics.data_plane.DataPlaneMetrics``
    has it): ``client_request(owner, "step")`` per owner, per step."""

    def client_request(self, peer: str, rpc: str, sent_bytes: int = 0, received_bytes: int = 0) -> None: ...


class OwnerFailedError(RuntimeError):
    """An owner could not do what was asked (it went away, timed out, or failed)."""


# Errors that mean "bad input" keep their type across the RPC boundary.
_INPUT_ERRORS = {cls.__name__: cls for cls in (ValueError, TypeError, IndexError, KeyError, NotImplementedError)}


def _raise_for_failures(failures: List[tuple], action: str) -> None:
    if not failures:
        return
    causes = [(name, remote_error_cause(error)) for name, error in failures]
    message = "; ".join(f"{action} failed on owner {name!r}: {cause}" for name, cause in causes)
    first = failures[0][1]
    # Bad input keeps its type (ValueError...); a lost or broken owner is an
    # OwnerFailedError.  (TorchScript RPCs deliver every error as a
    # RuntimeError whose text starts with the original type.)
    kind = type(first).__name__ if type(first).__name__ in _INPUT_ERRORS else causes[0][1].split(":", 1)[0]
    if kind in _INPUT_ERRORS:
        raise _INPUT_ERRORS[kind](message) from first
    raise OwnerFailedError(message) from first


def _wait_all(futures: Mapping[str, Any], action: str) -> Dict[str, Any]:
    results, failures = settle(futures)
    _raise_for_failures(failures, action)
    return results


def _send_steps(owners: List[str], handles: List[int], context_id: int) -> List[torch.futures.Future[int]]:
    """One ``service.optimizer_step`` RPC to each owner, for optimizer ``handles[i]`` on ``owners[i]``.

    Called compiled (``torch.jit.script``, which compiles it once per process
    and caches it; not at import, where ``service`` is still being imported):
    the Python way (``rpc.rpc_async`` per owner) spends tens of microseconds
    of the trainer's CPU per owner before the last request leaves, and on a
    busy machine the owners wait for that CPU.
    """
    futures: List[torch.futures.Future[int]] = []
    for i in range(len(owners)):
        futures.append(rpc.rpc_async(owners[i], service.optimizer_step, (handles[i], context_id)))
    return futures


class DistributedOptimizer:
    """Apply ``optimizer_class`` on every owner of ``params_rref``, from dist_autograd gradients.

    ``DistributedOptimizer(QHM, remote_params, lr=1.0, momentum=0.9, nu=0.7)``
    then ``step(context_id)`` inside ``dist_autograd.context()``, exactly as
    with ``torch.distributed.optim.DistributedOptimizer``.  Each owner looks
    the class up in its ``functional_optim_map``, builds the functional
    (TorchScript) form and steps it without the GIL; a class with no
    functional form runs as a Python optimizer on the owner (with a
    warning).  Trainers asking for the same optimizer over the same
    parameters share one owner-side optimizer and its state.  ``recorder``
    (keyword only, not passed to the optimizer): where its step RPCs are
    counted (``None``: nowhere).
    """

    def __init__(self, optimizer_class, params_rref: List[RRef], *args,
                 recorder: Optional[StepRequestRecorder] = None, **kwargs):
        if not params_rref:
            raise ValueError("DistributedOptimizer got an empty parameter list")
        self.optimizer_class = optimizer_class
        self.recorder = recorder
        # owner name -> [(index in params_rref, rref)], in first-seen order.
        self._by_owner: "OrderedDict[str, List[tuple]]" = OrderedDict()
        for index, rref in enumerate(params_rref):
            self._by_owner.setdefault(rref.owner().name, []).append((index, rref))
        self.num_params = len(params_rref)
        futures = {
            name: rpc.rpc_async(name, service.new_owner_optimizer,
                                args=(optimizer_class, [r for _, r in entries], [i for i, _ in entries], args, kwargs),
                                timeout=creation_timeout())
            for name, entries in self._by_owner.items()
        }
        created = _wait_all(futures, "creating the optimizer")
        # An RRef per owner keeps its optimizer alive; the handle names it in RPCs.
        self._owner_optimizers: Dict[str, RRef] = {name: created[name][0] for name in self._by_owner}
        self._handles: Dict[str, int] = {name: created[name][1] for name in self._by_owner}
        # What ``_send_steps`` takes, made once: owner names and their handles, in the same order.
        self._owner_names: List[str] = list(self._handles)
        self._owner_handles: List[int] = [self._handles[name] for name in self._owner_names]
        self._step_sender = script(_send_steps)
        python_owners = [name for name in self._by_owner if not created[name][2]]
        # torch's DistributedOptimizer's name (kept for drop-in use): every owner runs the optimizer scripted.
        self.is_functional_optim = not python_owners
        if python_owners:
            name = getattr(optimizer_class, "__qualname__", repr(optimizer_class))
            warnings.warn(
                f"{name} has no functional (TorchScript) form on {', '.join(map(repr, python_owners))}, so "
                f"DistributedOptimizer runs it there as a Python optimizer, holding the GIL and serialized by "
                f"a lock. Give it one with paramserver.optim.register_functional_optim({name}, "
                f"<TorchScript class>) in a module the owners import (the optimizer class's own module is "
                f"imported there).",
                stacklevel=2)

    @property
    def remote_optimizers(self) -> List[RRef]:
        """RRefs to the owner-side optimizers, one per owner."""
        return list(self._owner_optimizers.values())

    def owner_layout(self) -> Dict[str, tuple]:
        """Per owner: ``(handle, [index in params_rref of its local parameter 0, 1, ...])``, what a fused push
        (``paramserver.shards.server.service.push``) names its optimizer and parameters by."""
        return {name: (self._handles[name], [index for index, _ in entries])
                for name, entries in self._by_owner.items()}

    def _on_every_owner(self, function, action: str, extra_args=None) -> Dict[str, Any]:
        """Call ``function(handle, *extra_args[owner])`` on every owner at once; results by owner."""
        futures = {name: rpc.rpc_async(name, function, args=(handle,) + tuple((extra_args or {}).get(name, ())))
                   for name, handle in self._handles.items()}
        return _wait_all(futures, action)

    def step(self, context_id: int) -> None:
        """Apply one step on every owner, concurrently, with the gradients of ``context_id``.

        Blocks until every owner is done.  If any fails (bad gradient, owner
        gone, RPC timeout), raises after all have answered, naming each
        failed owner; an owner that refused a gradient changed nothing.
        """
        check_autograd_context(context_id)
        recorder = self.recorder
        if recorder is not None:
            for name in self._owner_names:
                recorder.client_request(name, "step")
        futures = self._step_sender(self._owner_names, self._owner_handles, context_id)
        try:
            # One wait (one wake-up of this thread) for all the answers, instead of one per owner; it raises
            # when one failed, and ``_wait_all`` then names every owner that did.
            torch.futures.collect_all(futures).wait()
        except Exception:  # noqa: BLE001 - reported below, owner by owner
            pass
        _wait_all(dict(zip(self._owner_names, futures)), "DistributedOptimizer.step")

    def owner_step_stats(self) -> Dict[str, Dict[str, float]]:
        """Per owner: steps applied there and the seconds they took on the owner
        (``steps``, ``total_seconds``, ``last_seconds``), and when the last one
        began and ended there (``last_began``, ``last_ended``: the owner's
        ``time.monotonic()``, which on Linux a trainer on the same host shares),
        to tell the owners' work from the network's share of a step's latency."""
        return self._on_every_owner(service.optimizer_step_stats, "reading step statistics")

    def state_dict(self) -> Dict[str, Any]:
        """Every owner's optimizer state: ``{"optimizer": name, "state": {index: {name: tensor}}}``.

        Indices are positions in the ``params_rref`` list this optimizer was
        built with, as in ``torch.optim.Optimizer.state_dict``.
        """
        per_owner = self._on_every_owner(service.optimizer_state_dict, "gathering optimizer state")
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        for name, local_state in per_owner.items():
            entries = self._by_owner[name]
            for local_index, entry in local_state.items():
                state[entries[local_index][0]] = entry
        return {"optimizer": class_name(self.optimizer_class), "state": dict(sorted(state.items()))}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a ``state_dict()`` on every owner; all or nothing.

        An owner that refuses its part (a shape that does not fit, ...) makes
        every owner return to the state it had before, and the error names it.
        """
        expected = class_name(self.optimizer_class)
        if state_dict.get("optimizer") != expected:
            raise ValueError(f"state dict is for optimizer {state_dict.get('optimizer')!r}, not {expected!r}")
        state = state_dict.get("state", {})
        unknown = [i for i in state if not (isinstance(i, int) and 0 <= i < self.num_params)]
        if unknown:
            raise ValueError(f"state dict has entries for parameter indices {unknown}, "
                             f"but this optimizer has {self.num_params} parameters")
        previous = self.state_dict()["state"]
        try:
            self._load_per_owner(state)
        except Exception:
            self._load_per_owner(previous)
            raise

    def _load_per_owner(self, state: Mapping[int, Dict[str, torch.Tensor]]) -> None:
        per_owner = {name: ({local_index: state[index] for local_index, (index, _) in enumerate(entries)
                             if index in state},)
                     for name, entries in self._by_owner.items()}
        self._on_every_owner(service.optimizer_load_state_dict, "restoring optimizer state", per_owner)
