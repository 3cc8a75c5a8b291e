"""The dense part of a model, replicated in a trainer group and kept in step.

Owns one worker's replica of the dense layers: the module on the group's
device wrapped in ``DistributedDataParallel`` with the chosen comm hook,
its local optimizer, and the step counter, and keeping all of them equal
across the group's members when the group (re-)forms: ``_share_state``
copies the parameters, buffers, optimizer state and step of the member
furthest ahead (ties: the lowest rank; a newcomer is at step 0, so in a
group that only grew that is rank 0) to everyone, through collectives the
group abandons when a newer view drops a member (a member that hangs while
the group forms holds the others no longer than in a step), and DDP's
constructor copies nothing more (``DDP_INIT_SYNC_OFF``; before torch 2.6 it
copies rank 0's, equal by then).  A re-formed group starts a fresh
comm-hook state: PowerSGD's error memory belongs to one rank's gradients
and its Q memory must be equal on every rank, so neither can be carried
over to a group with other members.  The coordinator chooses each
generation's backend afresh (nccl only when every member holds a GPU of its
own), so a re-formed group may train on another device than the last: a
GPU holder left alone after its CPU peer was lost goes from gloo on the CPU
to nccl on its GPU, and back when a CPU worker joins; the module and its
optimizer's state move to the new generation's device as it forms.

The training loop calls ``sync_point()`` at the start of every step; at
the steps of its agreements it is where the group agrees, in one
all-reduce, to re-form, to stop, or to write a checkpoint.  Agreements
come every ``agree_every`` steps (at its multiples), and sooner where a
member's data had not come for the whole window (a followed input): the
group then takes the steps every member has data for and agrees again
after them (``next_agreement``), so that a file's last batches are not
held back until the next file lands.  With ``uneven_steps`` (a followed
input: a file goes to one member) it takes the steps *some* member has
data for: in such an ``uneven_step`` the members with a batch run the
module without DDP, those without one sit out, and
``average_over_present`` makes every gradient the mean over the members
present, in one all-reduce (and the buffers the lowest present member's,
as DDP makes them rank 0's).  Every member sees the same
agreements, and at each (re-)forming all take the step of the member
furthest ahead and agree at it, so they agree on the same steps, and a
change takes effect within ``agree_every`` steps.  Finished steps are
counted by the replica's ``recorder`` when it was handed one (a
``ReplicaRecorder``: the worker's training metrics, when it serves them),
and so is every backward pass through the comm hook (the replica hands it
to each hook state it makes).

Surviving a lost member: its peers' next collective fails (in DDP's
all-reduce during backward, or in the agreement).  The training loop asks
``collective_failed(error)`` and calls ``recover(error)``: the broken
process group goes, the coordinator's next view (without the lost member)
is formed, and state is shared again.  No dense update is applied twice:
it is applied only after its backward pass, so a member whose step failed
applied nothing of it and redoes it with the same batch (the training
loop's sparse pushes are idempotent per step: ``paramserver.train.step``);
a member whose all-reduce had completed before the loss finished its
step, and is then one step ahead: the others take its state (its dense
update already averaged their gradients of that step) and skip that
batch (counted in ``steps_skipped``).
"""

import functools
import gc
import inspect
import itertools
import logging
import pickle
import time
import traceback
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Tuple

import torch
import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._torch_compat import is_collective_failure
from ..checkpoint import tensors_on_cpu
from .group import GenerationAborted, GroupStopped, TrainerGroup
from .hooks import HookRecorder, canonical_hook_options, comm_hook

logger = logging.getLogger(__name__)

#: Re-formations after failed collectives in a row (no step completed between
#: them) before the replica gives up.
MAX_RECOVERIES = 3

#: DDP's constructor is told not to verify and broadcast the module again where it can be (torch 2.6 on:
#: ``init_sync``): ``_share_state`` made every member's equal already, through collectives the group abandons
#: when a newer view drops a member, where DDP's own would wait for a hung one until the collective timeout.
DDP_INIT_SYNC_OFF = ({"init_sync": False} if "init_sync" in inspect.signature(DistributedDataParallel).parameters
                    else {})


class ReplicaRecorder(HookRecorder, Protocol):
    """What a dense replica records (``paramserver.metrics.training.TrainingMetrics`` has it): every finished
    step, and (through each comm-hook state it makes) every backward pass's all-reduced bytes."""

    def step_finished(self) -> None: ...


class HookMismatch(ValueError):
    """Members of one trainer group were configured with different comm hooks."""


class GroupLost(RuntimeError):
    """The trainer group could not be re-formed after a failed collective."""


def state_source(steps: List[int]) -> int:
    """The rank whose state a (re-)formed group takes: the member furthest ahead, ties to the lowest rank."""
    return max(range(len(steps)), key=lambda rank: (steps[rank], -rank))


class DenseReplica:
    """``module`` trained by ``make_optimizer(parameters)`` in ``group``, all-reduced through ``hook``.

    Call it like the module (it runs the DDP wrapper).  ``step`` counts the
    group's completed steps (advance it with ``finish_step()``);
    ``bytes_per_step`` is what the hook measured in the last backward pass;
    ``allreduce_ms()`` the mean time a backward pass's last bucket was in
    flight, from this member handing it to the hook to its all-reduce's end
    (the wait for the group's slowest member, then the transfer).
    ``reformations`` counts agreed re-formations, ``recoveries`` those after
    a failed collective, ``steps_skipped`` the steps this member took from
    another instead of training them (on joining, or after a failure).
    ``recorder``: where finished steps and the hook's bytes are counted
    (``None``: nowhere).  ``on_formed(replica)``: called on every member
    each time the group (re-)formed, once the state is shared (the first
    time from this constructor); ``on_agreed(replica)``: after every
    agreement that goes on with the step (not one that waits).  Their
    collectives are the group's like any other: one that fails is
    recovered from (``recover``), and the agreement is taken again.  So is
    one of the first forming, in this constructor (a member lost or hung as
    the group first formed: the others re-form without it); it raises
    ``GroupStopped`` when the worker is asked to stop meanwhile.
    """

    def __init__(self, group: TrainerGroup, module: nn.Module,
                 make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
                 hook: str = "allreduce", hook_options: Optional[Dict[str, Any]] = None,
                 agree_every: int = 10, initial: Optional[Dict[str, Any]] = None, *,
                 recorder: Optional[ReplicaRecorder] = None,
                 on_formed: Optional[Callable[["DenseReplica"], None]] = None,
                 on_agreed: Optional[Callable[["DenseReplica"], None]] = None,
                 uneven_steps: bool = False):
        if agree_every < 1:
            raise ValueError(f"agree_every must be at least 1, got {agree_every}")
        self.group = group
        self.recorder = recorder
        self.on_formed, self.on_agreed = on_formed, on_agreed
        self.module = module.to(group.device)
        self._make_optimizer = make_optimizer
        self.optimizer = make_optimizer(self.module.parameters())
        self.hook = hook
        self.hook_options = canonical_hook_options(hook, hook_options or {})
        self.step = 0
        self.agree_every = agree_every
        self.reformations = 0
        self.recoveries = 0
        self.steps_skipped = 0
        #: The step of the group's next agreement (every member holds the same; set at each forming and agreement).
        self.next_agreement = 0
        #: Whether the group takes the steps that only some members have data for (``uneven_step``).
        self.uneven_steps = uneven_steps
        #: The first step of the window that a member may have no batch for (``next_agreement``: none).
        self.even_until = 0
        #: The checkpoint request the last ``sync_point`` agreed on (0: none), and whether it agreed on a live export.
        self.agreed_checkpoint, self.agreed_export = 0, False
        self._failures_in_a_row = 0
        self._hook_failure: Optional[str] = None
        #: Seconds the last bucket of each backward pass was in flight, and how many such buckets (``allreduce_ms``).
        self._in_flight_seconds, self._in_flight_buckets = 0.0, 0
        self._restored_hook_states: Optional[List[bytes]] = None
        if initial:
            self._restore(initial)
        try:
            self._form()
        except HookMismatch:
            # Every member refuses alike: leave the process group now, not in the interpreter's teardown
            # (destroyed there, under load a member aborted: "terminate called without an active exception").
            self._drop_ddp()
            self.group.close()
            raise
        except RuntimeError as error:  # a member lost (or hung) as the group first formed: re-form without it
            if not self.collective_failed(error):
                raise
            if not self.recover(error):
                raise GroupStopped(f"{self.group.members[self.group.rank]} was asked to stop while its trainer "
                                   f"group re-formed") from error

    def _restore(self, initial: Dict[str, Any]) -> None:
        """Start from a checkpoint's dense part: module, optimizer and step now, the hook state at forming."""
        self.module.load_state_dict(initial["module"])
        self.optimizer.load_state_dict(initial["optimizer"])
        self.step = int(initial["step"])
        recorded = canonical_hook_options(initial.get("hook"), initial.get("hook_options") or {})  # older names too
        if (initial.get("hook"), recorded) == (self.hook, self.hook_options):
            self._restored_hook_states = list(initial.get("hook_states") or [])
        else:
            logger.warning("the checkpoint's comm hook was %s %s, this run's is %s %s: the hook starts afresh",
                           initial.get("hook"), initial.get("hook_options") or "", self.hook, self.hook_options or "")

    def _form(self) -> None:
        self._move_to(self.group.device)
        source = self._share_state()
        self.next_agreement = self.even_until = self.step  # every member at the shared step: all agree there
        device_ids = [self.group.device] if self.group.device.type == "cuda" else None
        # The gradients are views of DDP's buckets: after the all-reduce they are not copied back from them (the
        # values are the same; the optimizer sets them to None after each step).
        self.ddp = DistributedDataParallel(self.module, device_ids=device_ids, gradient_as_bucket_view=True,
                                           **DDP_INIT_SYNC_OFF)
        self.hook_state, hook = comm_hook(self.hook, None, recorder=self.recorder, **self.hook_options)
        self._restore_hook_state()
        self.ddp.register_comm_hook(self.hook_state, self._watched(hook))
        self._hook_failure = None
        logger.info("dense replica in %s at step %d (state of %s), comm hook %s", self.group.describe(), self.step,
                    source, self.hook)
        if self.on_formed is not None:
            self.on_formed(self)

    def _move_to(self, device: torch.device) -> None:
        """The module and its optimizer's state onto ``device`` (where this generation's collectives run).  The
        module moves in place; its optimizer's state is loaded again, which puts each tensor where torch's own
        rule says (by its parameter; a scalar step of most optimizers stays on the CPU).  Between the CPU and a
        GPU the parameters stay the objects the optimizer holds (and a scheduler on it goes on); where a device
        needs new ones, the optimizer is made again for them (``make_optimizer``) with the same state."""
        if all(tensor.device == device for tensor in itertools.chain(self.module.parameters(), self.module.buffers())):
            return
        held = [id(param) for group in self.optimizer.param_groups for param in group["params"]]
        state = self.optimizer.state_dict()
        self.module.to(device)
        if held != [id(param) for param in self.module.parameters()]:
            self.optimizer = self._make_optimizer(self.module.parameters())
        self.optimizer.load_state_dict(state)

    def _restore_hook_state(self) -> None:
        """At the first forming after a restore: this rank's hook state, when the group has the checkpoint's size
        (a hook's memory belongs to one rank's gradients: with another number of members it starts afresh)."""
        states, self._restored_hook_states = self._restored_hook_states, None
        if not states:
            return
        if len(states) != self.group.world_size:
            logger.warning("the checkpoint's trainer group had %d members, this one %d: the comm hook starts afresh",
                           len(states), self.group.world_size)
            return
        self.hook_state.load_state_dict(pickle.loads(states[self.group.rank]).state_dict())

    def _share_state(self) -> str:
        """Every member takes the state of the one furthest ahead (``state_source``); returns its name."""
        mine = {"hook": self.hook, "hook_options": self.hook_options, "rpc_name": self.group.members[self.group.rank],
                "step": self.step}
        members = self.group.gather_objects(mine)
        differing = [m for m in members
                     if (m["hook"], m["hook_options"]) != (members[0]["hook"], members[0]["hook_options"])]
        if differing:
            raise HookMismatch("trainer group members use different comm hooks: " + "; ".join(
                f"{m['rpc_name']}: {m['hook']} {m['hook_options'] or ''}".strip() for m in members))
        source = state_source([m["step"] for m in members])
        # On the CPU: a pickled tensor unpickles onto the device it was on, which on a member with a GPU of
        # its own would be the source's GPU (another worker's, on a host of several), not its own.
        state = self.group.broadcast_object(
            {"step": self.step, "module": tensors_on_cpu(self.module.state_dict()),
             "optimizer": tensors_on_cpu(self.optimizer.state_dict())} if self.group.rank == source else None, source)
        if self.group.rank != source:
            self.steps_skipped += max(0, state["step"] - self.step)
            self.step = state["step"]
            self.module.load_state_dict(state["module"])
            self.optimizer.load_state_dict(state["optimizer"])
        return members[source]["rpc_name"]

    def _watched(self, hook):
        """``hook``, noting when its collectives fail (``collective_failed`` reads the note), and abandoned at
        once when the group's generation is (``TrainerGroup.abortable``)."""
        generation = self.group.generation

        @functools.wraps(hook)
        def watched(state, bucket):
            handed, last = time.perf_counter(), bucket.is_last()

            def check_reduced(future):
                try:
                    reduced = future.value()
                except Exception as error:  # noqa: BLE001 - noted, then raised again
                    if self.group.generation == generation:  # not an abandoned generation's late failure
                        # Only the message is kept: the error's frames hold the broken group's work.
                        self._hook_failure = str(error)
                    raise
                if last:  # (runs where the all-reduce ended; the step's own thread reads the sums)
                    self._in_flight_seconds += time.perf_counter() - handed
                    self._in_flight_buckets += 1
                return reduced

            try:
                return self.group.abortable(hook(state, bucket).then(check_reduced))
            except Exception as error:  # noqa: BLE001 - noted, then raised again
                self._hook_failure = str(error)
                raise
        return watched

    def allreduce_ms(self) -> float:
        """Mean milliseconds a backward pass's last bucket was in flight (see the class docstring; 0 before any)."""
        return 1e3 * self._in_flight_seconds / self._in_flight_buckets if self._in_flight_buckets else 0.0

    def __call__(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def agreement_due(self) -> bool:
        """Whether the group agrees at the start of this step."""
        return self.step >= self.next_agreement

    def window(self) -> int:
        """The steps from this one to the next multiple of ``agree_every``: what an agreement here plans for."""
        return (self.step // self.agree_every + 1) * self.agree_every - self.step

    def sync_point(self, want_stop: bool = False, checkpoint_request: int = 0, short: int = 0, *,
                   retell: Optional[Callable[[], Tuple[bool, int]]] = None, export: bool = False) -> bool:
        """Start of a step, on every member: re-form if the group changed; False when the group stops.

        At an agreement (``agreement_due``) the members agree (one
        all-reduce) on re-forming, stopping, the checkpoint request to serve
        (``agreed_checkpoint``: 0 on other steps, or none), whether a live
        export is due (``agreed_export``: some member said ``export``) and the steps to
        take before the next agreement: the ``window()`` less the most steps
        a member is ``short`` of data for, or with ``uneven_steps`` the
        fewest (the steps from ``even_until`` on are then uneven steps,
        ``uneven_step``; at the first of them every member takes rank 0's
        buffers, as DDP's forward pass would give them).
        None: the step is not taken (``agreement_due()`` still holds after
        ``sync_point``), and the members agree again once they waited.  After
        re-forming they agree again, in the new group: a member that just
        joined starts with this agreement, so everyone must.  A failed
        agreement is recovered from (``recover``) like a failed step.
        ``retell()``: ``(want_stop, short)`` anew, for the agreements after a
        re-formation (``on_formed`` may have dealt this member other data);
        without it, what was passed holds.
        """
        self.agreed_checkpoint, self.agreed_export = 0, False
        while True:
            try:
                if self.agreement_due():
                    agreement = self.group.agree(want_stop, checkpoint_request, short, export)
                    if agreement.stop:
                        return False
                    if agreement.reform:
                        self._drop_ddp()
                        self.group.reform()
                        self.reformations += 1
                        self._form()
                        if retell is not None:
                            want_stop, short = retell()
                        continue  # the new group agrees at once
                    self._agreed(agreement)
                if self.step == self.even_until < self.next_agreement:
                    # The first uneven step of the window: its forward passes run without DDP, so the buffers
                    # DDP would have given every member (rank 0's) are given here.
                    self._broadcast_buffers(source=0)
                return True
            except GroupStopped:
                raise
            except RuntimeError as error:  # a collective (or forming the next generation) failed
                if not self.recover(error):
                    return False
                if retell is not None:
                    want_stop, short = retell()

    def _agreed(self, agreement) -> None:
        """Take what the group agreed on that goes on at this step (not a re-formation or a stop)."""
        self.agreed_checkpoint, self.agreed_export = agreement.checkpoint_request, agreement.export
        even = max(0, self.window() - agreement.short)
        steps = max(0, self.window() - agreement.least_short) if self.uneven_steps else even
        self.next_agreement = self.step + steps
        self.even_until = self.step + even
        if self.on_agreed is not None and steps > 0:  # (none: the group waits, and agrees again)
            self.on_agreed(self)

    def collective_failed(self, error: BaseException) -> bool:
        """Whether ``error``, raised by a training step, means a collective of the group failed:
        the comm hook saw its all-reduce fail, the backend raised it, or the group abandoned it (a newer
        view dropped a member, or a wait for rank 0 in the store saw a newer view: ``GenerationAborted``)."""
        return (self._hook_failure is not None or self.group.aborted is not None
                or isinstance(error, GenerationAborted) or is_collective_failure(error))

    def recover(self, error: BaseException) -> bool:
        """Re-form the group after a collective of it failed; False if the worker was asked to stop meanwhile.

        Waits for the coordinator's next view (the lost member declared
        dead), forms it and shares state (from the member furthest ahead).
        The step that failed was not applied: the training loop redoes the
        step ``self.step`` says.  Raises ``GroupLost`` when no new view comes
        in time, or after ``MAX_RECOVERIES`` attempts without a completed
        step between them.
        """
        started, failed_step = time.monotonic(), self.step
        self.optimizer.zero_grad(set_to_none=True)  # local gradients of the failed step (outside dist_autograd)
        logger.warning("%s: a collective failed at step %d in %s; re-forming: %s", self.group.members[self.group.rank],
                       failed_step, self.group.describe(),
                       _first_line(self.group.aborted or self._hook_failure or str(error)))
        while True:
            traceback.clear_frames(error.__traceback__)  # its frames may hold the broken group's work
            self._failures_in_a_row += 1
            if self._failures_in_a_row > MAX_RECOVERIES:
                raise GroupLost(f"trainer group {self.group.view.group} failed {MAX_RECOVERIES} times in a row without "
                                f"completing a step (last: {_first_line(str(error))})") from error
            self._drop_ddp()
            try:
                self.group.reform(after_failure=True)
                self._form()
                break
            except GroupStopped:
                return False
            except TimeoutError as timeout:
                raise GroupLost(f"trainer group {self.group.view.group} did not re-form after a failed collective "
                                f"at step {failed_step}: {timeout}") from timeout
            except RuntimeError as again:  # a member was lost while forming too
                error = again
        self.recoveries += 1
        logger.info("re-formed in %.1f s after a failed collective at step %d: %s, at step %d",
                    time.monotonic() - started, failed_step, self.group.describe(), self.step)
        return True

    def uneven_step(self) -> bool:
        """Whether some member of the group has no batch for this step (``uneven_steps``): the members with one
        train it without DDP (``module`` itself) and the gradients are averaged over them (``average_over_present``)."""
        return self.even_until <= self.step < self.next_agreement

    def average_over_present(self, present: bool) -> int:
        """Collective, on every member at an uneven step (after the backward pass of the members with a batch,
        ``present``): every gradient becomes the mean over the members present (those absent count zero), in
        one all-reduce that carries who was present too, as a step of the members present alone would give.
        The comm hook is not used.  The module's buffers (a batch norm's running statistics) then become those
        of the lowest-ranked member present, as DDP gives every member rank 0's at a step's forward pass: a
        member that sat out, rank 0 included, does not keep buffers that missed the step's batch.  Returns how
        many members were present."""
        params = [param for param in self.module.parameters() if param.requires_grad]
        dtype = params[0].dtype if params else torch.float32
        pieces = [param.grad.reshape(-1) if present and param.grad is not None else
                  torch.zeros(param.numel(), dtype=param.dtype, device=param.device) for param in params]
        presence = torch.zeros(self.group.world_size, dtype=dtype, device=self.group.device)
        presence[self.group.rank] = float(present)
        flat = torch.cat(pieces + [presence])
        self._collective(dist.all_reduce(flat, async_op=True))
        present_ranks = flat[-self.group.world_size:].nonzero().flatten().tolist()
        if not present_ranks:
            raise RuntimeError(f"step {self.step}: no member of {self.group.describe()} had a batch")
        flat = flat[:-self.group.world_size].div_(len(present_ranks))
        start = 0
        for param in params:
            param.grad = flat[start:start + param.numel()].view_as(param)
            start += param.numel()
        self._broadcast_buffers(source=present_ranks[0])
        return len(present_ranks)

    def _broadcast_buffers(self, source: int) -> None:
        """Every member takes member ``source``'s buffers, one broadcast per dtype."""
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for buffer in self.module.buffers():
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
        for buffers in by_dtype.values():
            flat = torch.cat([buffer.detach().reshape(-1) for buffer in buffers])
            self._collective(dist.broadcast(flat, src=source, async_op=True))
            start = 0
            for buffer in buffers:
                buffer.detach().copy_(flat[start:start + buffer.numel()].view_as(buffer))
                start += buffer.numel()

    def _collective(self, work) -> None:
        """Wait for a collective of the group, abandoned at once when the group's generation is."""
        self.group.abortable(work.get_future()).wait()

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
        self._failures_in_a_row = 0
        if self.recorder is not None:
            self.recorder.step_finished()

    def close(self) -> None:
        """Leave the group: DDP (its reducer and hook) goes first, while its process group still exists."""
        self._bytes_when_closed = self.bytes_per_step
        self._drop_ddp()
        self.hook_state = None
        self.group.close()

    def _drop_ddp(self) -> None:
        """DDP (its reducer and hook) goes before its process group: destroyed the other way round, a member
        hung in DDP's destructor."""
        self.ddp = None
        gc.collect()

    @property
    def bytes_per_step(self) -> int:
        if self.hook_state is None:  # closed
            return self._bytes_when_closed
        return int(self.hook_state.last_step_bytes)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "no message"
