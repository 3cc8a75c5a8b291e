"""Shard servers across processes on loopback: ShardedEmbeddingBag against a
local nn.EmbeddingBag (forward, row-sparse backward, optimizer steps), and
PlacedModule (placement balance, training equal to local training)."""

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

from dataplane import run_cluster, shard_names
from paramserver.optim import QHM, DistributedOptimizer, FunctionalQHM, ScriptedOptimizer
from paramserver.shards import PlacedModule, ShardedEmbeddingBag, shard_loads

pytestmark = pytest.mark.timeout(150)

ROWS, DIM = 103, 8


def _owner_gradient(context_id, rref):
    """RPC target on an owner: (is sparse, touched local rows) of a row range's gradient."""
    gradient = dist_autograd.get_gradients(context_id)[rref.local_value()]
    return gradient.is_sparse, sorted(set(gradient.coalesce().indices()[0].tolist()))


def _inputs(mode):
    """(forward args, kwargs) cases: 2-D bags, 1-D ids with offsets, per-sample weights."""
    ids_2d = torch.randint(0, ROWS, (16, 5))
    ids_1d = torch.randint(0, ROWS, (30,))
    offsets = torch.tensor([0, 4, 4, 11, 20])  # one empty bag
    cases = [((ids_2d,), {}), ((ids_1d, offsets), {})]
    if mode == "sum":
        cases.append(((ids_2d,), {"per_sample_weights": torch.rand(16, 5)}))
    return cases


def trainer_embedding_matches_local():
    shards = shard_names(4)
    for mode in ("sum", "mean"):
        weight = torch.randn(ROWS, DIM)
        for args, kwargs in _inputs(mode):
            sharded = ShardedEmbeddingBag.from_pretrained(weight, mode, shards=shards)
            local = nn.EmbeddingBag.from_pretrained(weight.clone(), mode=mode, freeze=False)
            dist_opt = DistributedOptimizer(torch.optim.SGD, sharded.remote_parameters(), lr=1.0)
            with dist_autograd.context() as context_id:
                out = sharded(*args, **kwargs)
                expected = local(*args, **kwargs)
                target = torch.randn_like(expected)
                torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
                dist_autograd.backward(context_id, [(out * target).sum()])
                # Each shard got a row-sparse gradient of exactly the rows it served.
                ids = args[0].unique()
                for rows, rref in zip(sharded.ranges, sharded.remote_parameters()):
                    is_sparse, touched = rpc.rpc_sync(rows.shard, _owner_gradient, args=(context_id, rref))
                    mine = [i - rows.start for i in ids.tolist() if rows.start <= i < rows.stop]
                    assert is_sparse and touched == mine, (rows, touched, mine)
                dist_opt.step(context_id)
            (expected * target).sum().backward()
            updated = sharded.fetch_weight()
            torch.testing.assert_close(updated, weight - local.weight.grad, rtol=1e-6, atol=1e-6)
            untouched = torch.ones(ROWS, dtype=torch.bool)
            untouched[args[0].unique()] = False
            assert torch.equal(updated[untouched], weight[untouched])


def trainer_embedding_qhm_matches_local_functional():
    # Several steps of QHM on the shards vs FunctionalQHM on a local table with
    # nn.EmbeddingBag(sparse=True) gradients: the same lazy-momentum trajectory.
    weight = torch.randn(ROWS, DIM)
    sharded = ShardedEmbeddingBag.from_pretrained(weight, "mean", shards=shard_names(4))
    local = nn.EmbeddingBag.from_pretrained(weight.clone(), mode="mean", freeze=False, sparse=True)
    config = dict(lr=0.5, momentum=0.9, nu=0.7)
    dist_opt = DistributedOptimizer(QHM, sharded.remote_parameters(), **config)
    local_opt = ScriptedOptimizer(FunctionalQHM, [local.weight], **config)
    for _ in range(5):
        ids = torch.randint(0, 20, (8, 3)) * 5  # a few rows, spread over the shards
        target = torch.randn(8, DIM)
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [(sharded(ids) * target).sum()])
            dist_opt.step(context_id)
        local.weight.grad = None
        (local(ids) * target).sum().backward()
        local_opt.step([local.weight.grad])
    torch.testing.assert_close(sharded.fetch_weight(), local.weight.detach(), rtol=1e-6, atol=1e-6)


def trainer_embedding_rejects_out_of_range_ids():
    sharded = ShardedEmbeddingBag(ROWS, DIM, shards=shard_names(2), seed=3)
    before = sharded.fetch_weight()
    for bad in (ROWS, -1, 10**9):
        with pytest.raises(IndexError, match=f"id {bad} is out of range for a table of {ROWS} rows"):
            sharded(torch.tensor([[0, bad]]))
    with pytest.raises(TypeError, match="integer tensor"):
        sharded(torch.tensor([[0.0, 1.0]]))
    with pytest.raises(ValueError, match="need offsets"):
        sharded(torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="offsets must be None"):
        sharded(torch.tensor([[0, 1]]), torch.tensor([0]))
    assert torch.equal(sharded.fetch_weight(), before)
    # Rows drawn on the shards from the seed: same seed, same table.
    assert torch.equal(ShardedEmbeddingBag(ROWS, DIM, shards=shard_names(2), seed=3).fetch_weight(), before)
    _empty_batches_work_like_embedding_bag(sharded)


def _empty_batches_work_like_embedding_bag(sharded):
    """No ids at all (no rows, or bags that are all empty): what nn.EmbeddingBag returns, still differentiable,
    and a step that leaves every row as it was."""
    local = nn.EmbeddingBag.from_pretrained(sharded.fetch_weight(), mode=sharded.mode, freeze=False)
    before = sharded.fetch_weight()
    optimizer = DistributedOptimizer(QHM, sharded.remote_parameters(), lr=1.0, momentum=0.9, nu=0.7)
    cases = [((torch.empty(0, 3, dtype=torch.long),), {}),
             ((torch.empty(0, dtype=torch.long), torch.tensor([0, 0, 0])), {})]
    for args, kwargs in cases:
        with dist_autograd.context() as context_id:
            out, expected = sharded(*args, **kwargs), local(*args, **kwargs)
            assert out.shape == expected.shape and out.requires_grad == expected.requires_grad, (out, expected)
            assert torch.equal(out, expected)
            dist_autograd.backward(context_id, [out.sum()])
            optimizer.step(context_id)
        with torch.no_grad():
            assert not sharded(*args, **kwargs).requires_grad
    assert torch.equal(sharded.fetch_weight(), before)


def trainer_shared_tables_are_one_table():
    shards = shard_names(2)
    first = ShardedEmbeddingBag(ROWS, DIM, shards=shards, name="shared", seed=1, shared=True, init_std=0.01)
    second = ShardedEmbeddingBag(ROWS, DIM, shards=shards, name="shared", seed=99, shared=True, init_std=0.01)
    weight = first.fetch_weight()
    assert torch.equal(second.fetch_weight(), weight)  # found by name: the second seed is not used
    assert 0.005 < weight.std().item() < 0.02
    ids = torch.tensor([[0, 5, 102]])
    optimizer = DistributedOptimizer(QHM, first.remote_parameters(), lr=1.0, momentum=0.0, nu=1.0)
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [first(ids).sum()])
        optimizer.step(context_id)
    assert torch.equal(second.fetch_weight(), first.fetch_weight())  # an update through one is seen by the other
    assert torch.equal(second.start(ids)(), second(ids))  # the two halves of a lookup are the forward
    with pytest.raises(Exception, match="shared table 'shared.* is hosted here as"):
        ShardedEmbeddingBag(ROWS, DIM + 1, shards=shards, name="shared", shared=True)
    with pytest.raises(ValueError, match="a shared table needs a name"):
        ShardedEmbeddingBag(ROWS, DIM, shards=shards, shared=True)


def test_sharded_tables_and_placed_modules_match_local_ones_share_by_name_and_refuse_bad_ids():
    # One cluster, five trainers at once (their tables have names of their own): the trainer that fails is
    # named, with its traceback, by run_cluster.
    run_cluster([(trainer_embedding_matches_local, ()), (trainer_embedding_qhm_matches_local_functional, ()),
                 (trainer_shared_tables_are_one_table, ()), (trainer_embedding_rejects_out_of_range_ids, ()),
                 (trainer_placed_module_trains_like_local, ())], num_shards=4)


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(16)] + [nn.Linear(64, 1)])

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def trainer_placed_module_trains_like_local():
    shards = shard_names(4)
    local, template = Tower(), Tower()
    template.load_state_dict(local.state_dict())
    placed = PlacedModule(template, shards)
    # Balance: 34 parameters by size over 4 shards, loads within 10%.
    sizes = {name: p.numel() * p.element_size() for name, p in local.named_parameters()}
    loads = shard_loads(placed.placement(), sizes, shards)
    assert (max(loads.values()) - min(loads.values())) / max(loads.values()) <= 0.10, loads
    config = dict(lr=0.05, momentum=0.9, nu=0.7)
    dist_opt = DistributedOptimizer(QHM, placed.remote_parameters(), **config)
    local_opt = QHM(local.parameters(), **config)
    for _ in range(4):
        x, y = torch.randn(32, 64), torch.randn(32, 1)
        with dist_autograd.context() as context_id:
            dist_autograd.backward(context_id, [(placed(x) - y).pow(2).mean()])
            dist_opt.step(context_id)
        local_opt.zero_grad()
        (local(x) - y).pow(2).mean().backward()
        local_opt.step()
    fetched = placed.fetch_state_dict()
    for name, value in local.state_dict().items():
        torch.testing.assert_close(fetched[name], value, rtol=1e-5, atol=1e-6)
    x = torch.randn(5, 64)
    torch.testing.assert_close(placed.materialize()(x), local(x), rtol=1e-5, atol=1e-6)


def trainer_terminates_shard():
    import os
    import signal
    import time

    from dataplane import owner_pid
    from paramserver.shards import leave
    pid = rpc.rpc_sync("shard0", owner_pid)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}/status") and time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as status:
            if "State:\tZ" in status.read():  # exited, waiting to be reaped by the test
                break
        time.sleep(0.05)
    else:
        assert not os.path.exists(f"/proc/{pid}"), "shard0 did not leave within 10 s of SIGTERM"
    leave(graceful=False)


def test_sigterm_makes_a_shard_server_leave_cleanly():
    # Exit code 0 for the shard (asserted by run_cluster): it left, it did not die.
    run_cluster([(trainer_terminates_shard, ())], num_shards=1)
