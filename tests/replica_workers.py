"""Bodies of the trainer-group tests' spawned members (``test_dense_replica``).

A ``StoreViews`` source plays the coordinator: views of the group live in
the test's c10d store under ``views/latest`` (a pickled list of member
names and a generation), so a member that arrives late can publish the
next generation itself, as the coordinator would on its join (and a
member about to be lost publishes the one without it, as the coordinator
would on declaring it dead).  Each member trains a small MLP on its own
seeded batches in a ``DenseReplica``, recovering from failed collectives
as the CTR job does, and writes its final parameters, step and
re-formation counts to a file.
"""

import datetime
import faulthandler
import os
import pickle
import signal
import time
import warnings
import zlib

import torch
from torch import nn

from paramserver.ddp import DenseReplica, TrainerGroup
from paramserver.optim import QHM
from paramserver.runtime.context import GroupView

TIMEOUT = datetime.timedelta(seconds=60)
IN, OUT = 6, 1


class RunningOutputMean(nn.Module):
    """The identity, keeping a running mean of what passes in training (a buffer, as a batch norm's statistics)."""

    def __init__(self, width: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x):
        if self.training:
            self.mean.mul_(0.5).add_(x.detach().mean(0), alpha=0.5)
        return x


def model(buffered: bool = False) -> nn.Module:
    """The members' MLP; ``buffered``: with a ``RunningOutputMean`` last (its parameters keep their names)."""
    torch.manual_seed(0)
    layers = [nn.Linear(IN, 8), nn.Tanh(), nn.Linear(8, OUT)]
    return nn.Sequential(*layers, *([RunningOutputMean(OUT)] if buffered else []))


def batch(name: str, step: int):
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    inputs = torch.randn(16, IN, generator=generator)
    return inputs, inputs.sum(1, keepdim=True).sin()


def make_optimizer(params):
    return QHM(params, lr=0.1, momentum=0.9, nu=0.7)


class StoreViews:
    """A ``GroupChannel`` (what TrainerGroup uses) with views kept in a c10d store."""

    def __init__(self, name: str, index: int, port: int):
        self.rpc_name, self.worker_index, self.trainer_group = name, index, 0
        self.store_host, self.store_port = "127.0.0.1", port
        self._store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)

    def publish(self, generation: int, members) -> None:
        self._store.set("views/latest", pickle.dumps((generation, list(members))))

    def group_view(self):
        if not self._store.check(["views/latest"]):
            return None
        generation, members = pickle.loads(self._store.get("views/latest"))
        return GroupView(group=0, generation=generation, members=tuple(members), backend="gloo")

    def wait_for_group_view(self, newer_than: int, timeout: datetime.timedelta):
        self._store.wait(["views/latest"], timeout)
        view = self.group_view()
        while view.generation <= newer_than or self.rpc_name not in view.members:
            self._store.wait(["views/latest"], timeout)
            view = self.group_view()
        return view


def train(name: str, index: int, port: int, steps: int, hook: str, result_path: str,
          publish=None, late_member_at: int = 0, late: bool = False, lost_at: int = 0,
          lost: bool = False, hangs: bool = False, short_by=None, uneven: bool = False,
          buffered: bool = False, retold_short=None, hangs_forming: bool = False, late_backward=None,
          shares_after_abort: bool = False, fails_at_start: bool = False) -> None:
    """Train ``steps`` steps in the group; ``publish=(generation, members)`` announces a view first.

    ``late_member_at``: a member there from the start waits at that step
    until a ``late`` member has announced itself; the late one waits until
    the others reached it, then announces its view.  ``lost_at``: the
    ``lost`` member waits there until every member finished that many
    steps, publishes the next view without itself and SIGKILLs itself; the
    others' next step fails and they recover.  With ``hangs`` it SIGSTOPs
    itself instead (its peers' collective would wait for the collective
    timeout, unless the new view makes them abandon it); the first
    survivor SIGKILLs it once done.  ``short_by``: ``{step: steps}`` this
    member says it has no data for at the agreement of that step; with
    ``uneven`` the group takes the steps some member has data for, and this
    one sits out those it said it has none for (as the Trainer does).
    ``buffered``: the model has a buffer (``model``).  ``retold_short``:
    ``{step: steps}`` this member says it is short of when asked again after a
    re-formation at that step (``sync_point``'s ``retell``).
    ``hangs_forming``: this member (late, or there from the start) publishes the view without itself and
    SIGSTOPs itself as the group it joins starts sharing state (its peers
    wait in those collectives until the new view makes them abandon them).
    ``shares_after_abort``: in the first generation this member starts
    sharing state only once the group abandoned that generation (its
    collectives are launched after the abort).
    ``fails_at_start``: this member never forms the group (its job failed
    before training): once every other member of the first generation came
    to form it, it publishes the view without itself, as the coordinator
    does when such a member leaves, and returns.
    ``late_backward=(step, seconds)``: this member sleeps that long before
    that step's backward pass (its peers' all-reduce waits for it).
    ``slowest_step_s`` in the result is the longest step, its recovery
    included; ``formed_s`` how long the replica took to form first (its
    recovery included); ``agreed_at`` the steps the group agreed at; ``allreduce_ms``
    the replica's.
    """
    warnings.filterwarnings("ignore")
    faulthandler.dump_traceback_later(75, exit=True)  # a hang shows where, before the test's 90 s deadline
    source = StoreViews(name, index, port)
    if late:
        source._store.wait([f"step/{late_member_at}"], TIMEOUT)
    if publish is not None:
        source.publish(*publish)
    if late:
        source._store.set("late/published", "yes")
    if hangs_forming:
        def hang(replica) -> None:  # (in place of DenseReplica._share_state)
            source.publish(replica.group.generation + 1, [m for m in replica.group.members if m != name])
            source._store.set("hung/pid", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        DenseReplica._share_state = hang
    if shares_after_abort:
        share = DenseReplica._share_state

        def after_abort(replica) -> str:
            deadline = time.monotonic() + TIMEOUT.total_seconds()
            while replica.group.generation == 1 and replica.group.aborted is None and time.monotonic() < deadline:
                time.sleep(0.05)
            return share(replica)
        DenseReplica._share_state = after_abort
    if fails_at_start:
        source._store.wait(["views/latest"], TIMEOUT)
        others = [member for member in source.group_view().members if member != name]
        arrived = [f"trainer_group/0/1/arrived/{rank}" for rank, member in enumerate(source.group_view().members)
                   if member != name]
        source._store.wait(arrived, TIMEOUT)
        source.publish(2, others)
        return
    joining = time.monotonic()
    group = TrainerGroup.join(source, TIMEOUT)
    joined_s = time.monotonic() - joining
    forming = time.monotonic()
    replica = DenseReplica(group, model(buffered), make_optimizer, hook=hook, uneven_steps=uneven)
    formed_s = time.monotonic() - forming
    slowest_step_s, agreed_at, own_until = 0.0, [], 0
    started = time.monotonic()
    while replica.step < steps:
        due = replica.agreement_due()
        short = (short_by or {}).get(replica.step, 0)
        if due:
            own_until = replica.step + replica.window() - short
        retold = (retold_short or {}).get(replica.step)
        if not replica.sync_point(short=short, retell=None if retold is None else lambda: (False, retold)):
            break
        if due:
            agreed_at.append(replica.step)
        slowest_step_s, started = max(slowest_step_s, time.monotonic() - started), time.monotonic()
        uneven_step = replica.uneven_step()
        if uneven_step and replica.step >= own_until:
            replica.average_over_present(False)
            replica.finish_step()
            continue
        inputs, target = batch(name, replica.step)
        try:
            loss = ((replica.module if uneven_step else replica)(inputs) - target).pow(2).mean()
            if late_backward and replica.step == late_backward[0]:
                time.sleep(late_backward[1])
            loss.backward()
            if uneven_step:
                replica.average_over_present(True)
        except RuntimeError as error:
            if not replica.collective_failed(error):
                raise
            assert replica.recover(error)
            continue
        replica.finish_step()
        if late_member_at and not late and replica.step == late_member_at:
            source._store.set(f"step/{late_member_at}", "reached")
            source._store.wait(["late/published"], TIMEOUT)
        if lost_at and replica.step == lost_at:
            source._store.set(f"lost_at/{name}", "reached")
            if lost:
                survivors = [member for member in replica.group.members if member != name]
                source._store.wait([f"lost_at/{member}" for member in survivors], TIMEOUT)
                source.publish(replica.group.generation + 1, survivors)
                source._store.set("hung/pid", str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP if hangs else signal.SIGKILL)
    if hangs and replica.group.rank == 0:
        os.kill(int(source._store.get("hung/pid")), signal.SIGKILL)
    replica.close()
    with open(result_path, "wb") as file:
        pickle.dump({"step": replica.step, "reformations": replica.reformations, "recoveries": replica.recoveries,
                     "steps_skipped": replica.steps_skipped,
                     "state": {k: v.clone() for k, v in replica.module.state_dict().items()},
                     "bytes_per_step": replica.bytes_per_step, "allreduce_ms": replica.allreduce_ms(),
                     "slowest_step_s": slowest_step_s, "formed_s": formed_s, "joined_s": joined_s,
                     "generation": replica.group.generation,
                     "agreed_at": agreed_at}, file)



def hand_out(name: str, index: int, port: int, result_path: str, publish=None) -> None:
    """``TrainerGroup.hand_out`` in a group of two whose collectives time out after 2 s.  Rank 0 hands a value
    out after 4 s (longer than a collective may wait); then nothing, while rank 1 waits at most 1 s; then it
    publishes a newer view of the same members (any newer view, one without rank 0 too, ends a wait), while
    rank 1 waits up to 30 s.  Rank 1 records each outcome (the value, or the error's type) and how long it
    waited."""
    warnings.filterwarnings("ignore")
    source = StoreViews(name, index, port)
    if publish is not None:
        source.publish(*publish)
    group = TrainerGroup.join(source, TIMEOUT, collective_timeout=datetime.timedelta(seconds=2))
    got = []
    if group.rank == 0:
        time.sleep(4)
        group.hand_out("written", 0, TIMEOUT)
        source._store.wait(["rank1/timed-out"], TIMEOUT)
        source.publish(group.generation + 1, group.members)  # re-formed with the same members
        source._store.wait(["rank1/done"], TIMEOUT)
    else:
        for within, then in ((30, None), (1, "rank1/timed-out"), (30, "rank1/done")):
            started = time.monotonic()
            try:
                outcome = group.hand_out(None, 0, datetime.timedelta(seconds=within))
            except (TimeoutError, RuntimeError) as error:
                outcome = type(error).__name__
            got.append((outcome, time.monotonic() - started))
            if then is not None:
                source._store.set(then, "yes")
    with open(result_path, "wb") as file:
        pickle.dump(got, file)
    group.close()
