"""A trainer group's own collectives on each backend's device, in one process (a group of one).

The multi-member tests (``test_dense_replica``) run gloo on the CPU, and
carry ``broadcast_object``'s and ``hand_out``'s values between members.
Under nccl every tensor a collective carries must be on the member's GPU:
the pickled objects of ``gather_objects`` and ``broadcast_object`` (how
members share their state at forming), the flat gradient and presence of
``average_over_present`` and the buffers ``_broadcast_buffers`` hands on at
an uneven step, and DDP's buckets under a comm hook.  Here a group of one
runs each of them on gloo and, where a GPU is present, on nccl on
``cuda:0`` (one rank: never two ranks of an NCCL group on one device), and
its training equals plain local training.  The coordinator chooses each
generation's backend afresh, so a member holding a GPU whose CPU peer was
lost goes on alone on nccl, and back to gloo when a CPU worker joins: its
replica follows onto each generation's device.
"""

import datetime

import pytest
import torch
import torch.distributed as dist

import replica_workers as rw
from paramserver.ddp import DenseReplica, TrainerGroup
from paramserver.runtime.context import GroupView

TIMEOUT = datetime.timedelta(seconds=30)
NAME = "worker0"

HAS_GPU = torch.cuda.is_available() and dist.is_nccl_available()
BACKENDS = [
    pytest.param("gloo", id="gloo-cpu"),
    pytest.param("nccl", id="nccl-cuda", marks=pytest.mark.skipif(not HAS_GPU, reason="no GPU (or no NCCL) here")),
]


class OneMemberViews:
    """The view source of a group whose only member is this process (the coordinator's part)."""

    def __init__(self, port: int, backend: str):
        self.rpc_name, self.worker_index, self.trainer_group = NAME, 0, 0
        self.store_host, self.store_port = "127.0.0.1", port
        self.gpu = 0 if HAS_GPU else None  # (claimed whatever the backend, as ps-worker does)
        self.view = GroupView(group=0, generation=1, members=(NAME,), backend=backend)

    def publish(self, backend: str) -> None:
        """The next generation, on ``backend``."""
        self.view = GroupView(group=0, generation=self.view.generation + 1, members=(NAME,), backend=backend)

    def group_view(self):
        return self.view

    def wait_for_group_view(self, newer_than: int, timeout: datetime.timedelta):
        return self.view if self.view.generation > newer_than else None


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master
    del master


@pytest.fixture
def group_of_one(store, request):
    group = TrainerGroup.join(OneMemberViews(store.port, request.param), TIMEOUT)
    try:
        yield group
    finally:
        group.close()


@pytest.mark.parametrize("group_of_one", BACKENDS, indirect=True)
def test_objects_gathered_arrive_whole_and_a_broadcast_runs_on_the_backends_device(group_of_one):
    """``gather_objects`` carries the pickled value through the collective and back; ``broadcast_object``'s
    collectives run on the device (the source gets its own value back: a group of one has no receiver)."""
    value = {"step": 7, "rows": torch.arange(5, dtype=torch.float32), "name": "ü" * 300}
    gathered = group_of_one.gather_objects(value)
    assert len(gathered) == 1
    assert gathered[0]["step"] == 7 and gathered[0]["name"] == value["name"]
    assert torch.equal(gathered[0]["rows"], value["rows"]) and gathered[0]["rows"].device.type == "cpu"
    assert group_of_one.broadcast_object(value, 0) is value


@pytest.mark.parametrize("hook", ["allreduce", "fp16", "powersgd"])
@pytest.mark.parametrize("group_of_one", BACKENDS, indirect=True)
def test_a_replica_trains_through_even_and_uneven_steps_as_locally(group_of_one, hook):
    """Steps 0, 2 and 3 through DDP and the comm hook, step 1 an uneven one (``average_over_present``, then
    the buffers broadcast from the member present): parameters and the buffer as plain local training's (the
    hooks' compression is lossless for one member: fp16 halves and doubles back only what it sends, which
    for one member is nothing but its own gradient rounded, within the tolerance)."""
    replica = DenseReplica(group_of_one, rw.model(buffered=True), rw.make_optimizer, hook=hook, uneven_steps=True)
    device = group_of_one.device
    local = rw.model(buffered=True)
    local_optimizer = rw.make_optimizer(local.parameters())
    try:
        assert next(replica.module.parameters()).device.type == device.type
        for step in range(4):
            inputs, target = rw.batch(NAME, step)
            uneven = step == 1
            module = replica.module if uneven else replica
            loss = (module(inputs.to(device)) - target.to(device)).pow(2).mean()
            loss.backward()
            if uneven:
                assert replica.average_over_present(True) == 1
            replica.finish_step()
            local_optimizer.zero_grad()
            (local(inputs) - target).pow(2).mean().backward()
            local_optimizer.step()
        assert replica.step == 4
        for name, expected in local.state_dict().items():
            got = replica.module.state_dict()[name]
            assert got.device.type == device.type, name
            torch.testing.assert_close(got.cpu(), expected, rtol=1e-3, atol=1e-3, msg=name)
    finally:
        replica.close()


def _step(replica: DenseReplica, local: torch.nn.Module, local_optimizer, step: int) -> None:
    """Step ``step`` through DDP on the replica and plainly on ``local``."""
    inputs, target = rw.batch(NAME, step)
    device = replica.group.device
    (replica(inputs.to(device)) - target.to(device)).pow(2).mean().backward()
    replica.finish_step()
    local_optimizer.zero_grad()
    (local(inputs) - target).pow(2).mean().backward()
    local_optimizer.step()


@pytest.mark.parametrize("backends", [
    pytest.param(("gloo", "gloo", "gloo"), id="gloo-gloo-gloo"),
    pytest.param(("gloo", "nccl", "gloo"), id="gloo-nccl-gloo",
                 marks=pytest.mark.skipif(not HAS_GPU, reason="no GPU (or no NCCL) here")),
])
def test_a_replica_follows_each_generation_onto_its_backends_device(store, backends):
    """Re-formed after a failed collective (``recover``) into generations on each of ``backends`` in turn: the
    module and its optimizer's momentum move to each generation's device and train on as locally."""
    source = OneMemberViews(store.port, backends[0])
    replica = DenseReplica(TrainerGroup.join(source, TIMEOUT), rw.model(buffered=True), rw.make_optimizer)
    local = rw.model(buffered=True)
    local_optimizer = rw.make_optimizer(local.parameters())
    try:
        step = 0
        for generation, backend in enumerate(backends, start=1):
            if generation > 1:
                source.publish(backend)
                assert replica.recover(RuntimeError("a collective failed (the test's)"))
            assert replica.group.generation == generation and replica.group.backend == backend
            device = replica.group.device
            assert device.type == ("cuda" if backend == "nccl" else "cpu")
            for _ in range(2):
                _step(replica, local, local_optimizer, step)
                step += 1
            tensors = list(replica.module.parameters()) + list(replica.module.buffers()) + [
                value for state in replica.optimizer.state.values() for value in state.values()
                if isinstance(value, torch.Tensor) and value.dim() > 0]
            assert tensors and {tensor.device.type for tensor in tensors} == {device.type}
        assert replica.recoveries == len(backends) - 1
        for name, expected in local.state_dict().items():
            torch.testing.assert_close(replica.module.state_dict()[name].cpu(), expected, msg=name)
    finally:
        replica.close()


def test_a_replica_moved_where_its_parameters_must_be_replaced_gets_an_optimizer_of_the_new_ones(store):
    """Without a GPU, the move itself onto another device (``meta``, whose tensors cannot take the place of CPU
    ones, so the module gets new parameters): every parameter, buffer and momentum there, and the optimizer
    made again for the module's new parameters with their state."""
    replica = DenseReplica(TrainerGroup.join(OneMemberViews(store.port, "gloo"), TIMEOUT), rw.model(buffered=True),
                           rw.make_optimizer)
    try:
        local = rw.model(buffered=True)
        _step(replica, local, rw.make_optimizer(local.parameters()), 0)
        steps_before = [replica.optimizer.state[p].get("step") for p in replica.module.parameters()]
        replica._move_to(torch.device("meta"))
        parameters = list(replica.module.parameters())
        held = [p for group in replica.optimizer.param_groups for p in group["params"]]
        assert [id(p) for p in held] == [id(p) for p in parameters]
        momenta = [replica.optimizer.state[p]["momentum_buffer"] for p in parameters]
        assert {t.device.type for t in parameters + list(replica.module.buffers()) + momenta} == {"meta"}
        assert [m.shape for m in momenta] == [p.shape for p in parameters]
        assert [replica.optimizer.state[p].get("step") for p in parameters] == steps_before
    finally:
        replica.close()
