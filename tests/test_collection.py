"""EmbeddingCollection on shard servers over loopback: one lookup and one push per shard per step, and rows
exactly equal to the unfused path's (a lookup RPC per row range, dist_autograd, DistributedOptimizer.step);
a dynamic table trained alongside a fixed table of the same rows, equal to it, and the figures its shards
serve as metrics and heartbeats."""

import collections
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F

from dataplane import run_cluster, shard_names
from paramserver.optim import QHM, DistributedOptimizer
from paramserver.shards import DynamicEmbeddingBag, EmbeddingCollection, ShardedEmbeddingBag, ShardRequestFailed
from paramserver.shards.client.embedding import Route
from paramserver.shards.client.row_cache import RowWindow
from paramserver.tables import distinct_ids
from paramserver.tables.id_hash import initial_rows
from paramserver.shards.server import service

pytestmark = pytest.mark.timeout(150)

DIM = 8
#: name -> (rows, mode, shards it lives on): one table split over three shards, two whole on one shard.
TABLES = {"users": (97, "sum", (0, 1, 2)), "items": (40, "mean", (1,)), "site": (7, "sum", (1,))}


def _tables(shards, prefix, weights):
    return {name: ShardedEmbeddingBag.from_pretrained(weights[name], mode, shards=[shards[i] for i in on],
                                                      name=f"{prefix}.{name}")
            for name, (_, mode, on) in TABLES.items()}


def _optimizer(tables):
    return DistributedOptimizer(QHM, [r for table in tables.values() for r in table.remote_parameters()],
                                lr=0.5, momentum=0.9, nu=0.7)


def _weights(tables):
    return {name: table.fetch_weight() for name, table in tables.items()}


class _CountedRpc:
    """Counts rpc_async calls by target while the collection's step runs."""

    def __init__(self):
        self.calls = collections.Counter()
        self._real = rpc.rpc_async

    def __enter__(self):
        def counted(to, func, *args, **kwargs):
            self.calls[(getattr(func, "name", None) or func.__name__, to)] += 1
            return self._real(to, func, *args, **kwargs)
        rpc.rpc_async = counted
        return self

    def __exit__(self, *exc):
        rpc.rpc_async = self._real


def trainer_fused_equals_unfused():
    shards = shard_names(3)
    weights = {name: torch.randn(rows, DIM) for name, (rows, _, _) in TABLES.items()}
    fused_tables, plain_tables = _tables(shards, "fused", weights), _tables(shards, "plain", weights)
    fused_optimizer, plain_optimizer = _optimizer(fused_tables), _optimizer(plain_tables)
    collection = EmbeddingCollection(fused_tables, fused_optimizer.owner_layout(), rpc.get_worker_info().name)
    for step in range(6):
        features = {name: torch.randint(0, rows, (16, 3 if mode == "mean" else 1))
                    for name, (rows, mode, _) in TABLES.items()}
        targets = {name: torch.randn(16, DIM) for name in TABLES}
        with _CountedRpc() as counted:
            lookup = collection.lookup(features)
            pooled = lookup.pooled()
            loss = sum((pooled[name] * targets[name]).sum() for name in TABLES)
            if step % 2:  # as the Trainer does: the push leaves from inside the backward pass
                push = lookup.push_during_backward(step)
                loss.backward()
                push.wait()
            else:  # after it, from the rows' .grad
                loss.backward()
                lookup.push().wait()
        # One lookup and one push to each shard serving a looked-up row; nothing else.
        serving = {rows.shard for name, table in fused_tables.items() for rows in table.ranges
                   if ((features[name] >= rows.start) & (features[name] < rows.stop)).any()}
        assert counted.calls == {(kind, shard): 1 for kind in ("lookup", "push_lookup") for shard in serving}, \
            counted.calls
        with dist_autograd.context() as context_id:
            plain = {name: table(features[name]) for name, table in plain_tables.items()}
            for name in TABLES:
                torch.testing.assert_close(plain[name], pooled[name].detach(), rtol=0, atol=0)
            dist_autograd.backward(context_id, [sum((plain[name] * targets[name]).sum() for name in TABLES)])
            plain_optimizer.step(context_id)
        fused, expected = _weights(fused_tables), _weights(plain_tables)
        for name in TABLES:
            assert torch.equal(fused[name], expected[name]), (step, name)
    # The optimizer state follows the same trajectory too.
    fused_state, plain_state = fused_optimizer.state_dict()["state"], plain_optimizer.state_dict()["state"]
    assert fused_state.keys() == plain_state.keys()
    for index in fused_state:
        for key, value in fused_state[index].items():
            assert torch.equal(value, plain_state[index][key]), (index, key)
    # An empty batch: empty pooled embeddings that still take a backward pass, and nothing pushed.
    empty = collection.lookup({name: torch.empty(0, 1, dtype=torch.long) for name in TABLES})
    pooled = empty.pooled()
    assert all(p.shape == (0, DIM) and p.requires_grad for p in pooled.values())
    sum(p.sum() for p in pooled.values()).backward()
    with _CountedRpc() as counted:
        empty.push().wait()
    assert not counted.calls
    # Evaluation lookups record no gradient.
    with torch.no_grad():
        assert not any(t.requires_grad for t in collection.lookup(features).pooled(differentiable=False).values())
    # A push naming a parameter the optimizer does not have is refused, naming it, and changes nothing.
    handle, incarnation = collection.optimizer_handle(shards[1]), collection.incarnation(shards[1])
    push = (handle, [99], torch.tensor([0]), [1], torch.ones(DIM), "x")
    with pytest.raises(RuntimeError, match="names parameter 99"):
        rpc.rpc_sync(shards[1], service.push, args=(incarnation, *push))
    # Handles of another process of the shard (one that was restarted) are refused, whatever they name here.
    with pytest.raises(RuntimeError, match="StaleHandles: the handles were made by an earlier process"):
        rpc.rpc_sync(shards[1], service.push, args=(incarnation + 1, *push))
    with pytest.raises(RuntimeError, match="StaleHandles"):
        rpc.rpc_sync(shards[1], service.lookup, args=(incarnation + 1, [1], torch.tensor([0]), [1]))
    # Packed ids and rows that do not add up are refused, naming what was wrong.
    with pytest.raises(RuntimeError, match="do not split into counts"):
        rpc.rpc_sync(shards[1], service.push, args=(incarnation, handle, [0], torch.tensor([0]), [2], torch.ones(DIM),
                                                    "x"))
    assert all(torch.equal(a, b) for a, b in zip(_weights(fused_tables).values(), fused.values()))


def trainer_failures_name_the_shard():
    shards = shard_names(2)
    tables = {"t": ShardedEmbeddingBag(10, DIM, shards=shards, name="t", seed=0)}
    optimizer = _optimizer(tables)
    unknown = {shard: (9999, params) for shard, (_, params) in optimizer.owner_layout().items()}
    collection = EmbeddingCollection(tables, unknown, rpc.get_worker_info().name)
    before = tables["t"].fetch_weight()
    lookup = collection.lookup({"t": torch.tensor([[1], [9]])})
    lookup.pooled()["t"].sum().backward()
    with pytest.raises(ShardRequestFailed) as failed:
        lookup.push().wait()
    assert "\n" not in str(failed.value)
    assert str(failed.value).startswith("push failed on shard 'shard0': KeyError: 'no optimizer with handle 9999"), \
        failed.value
    assert torch.equal(tables["t"].fetch_weight(), before)


def trainer_pushes_are_idempotent_per_step():
    shards = shard_names(2)
    tables = {"idem": ShardedEmbeddingBag(10, DIM, shards=shards, name="idem", seed=0)}
    optimizer = DistributedOptimizer(QHM, tables["idem"].remote_parameters(), lr=0.5, momentum=0.9, nu=0.7)
    collection = EmbeddingCollection(tables, optimizer.owner_layout(), rpc.get_worker_info().name)
    ids = {"idem": torch.tensor([[1], [8]])}

    def pushed(step, during_backward=False):
        lookup = collection.lookup(ids)
        loss = lookup.pooled()["idem"].sum()
        if during_backward:  # sent from inside the backward pass, before it returns
            push = lookup.push_during_backward(step)
            loss.backward()
            assert push.pending is not None
            push.wait()
        else:
            loss.backward()
            lookup.push(step).wait()
        return tables["idem"].fetch_weight()

    first = pushed(5, during_backward=True)
    assert torch.equal(pushed(5), first)  # the same step again (a step redone): not applied twice
    assert torch.equal(pushed(4), first)  # an older step: not applied
    assert not torch.equal(pushed(6), first)  # the next step: applied
    # Another pusher (another worker, or this one's next run) has steps of its own.
    other = EmbeddingCollection(tables, optimizer.owner_layout(), rpc.get_worker_info().name)
    before = tables["idem"].fetch_weight()
    lookup = other.lookup(ids)
    lookup.pooled()["idem"].sum().backward()
    lookup.push(5).wait()
    assert not torch.equal(tables["idem"].fetch_weight(), before)


def trainer_a_push_reaching_some_tables_carries_theirs_after_the_pass():
    """A backward pass that reaches one table's rows and not the other's: the push leaves after it (from
    ``sent()``) with that table's gradients only, as the push made from the rows' ``.grad`` does."""
    shards = shard_names(2)
    pairs = []
    for side in ("during", "after"):
        tables = {name: ShardedEmbeddingBag(10, DIM, shards=shards, name=f"some-{side}-{name}", seed=index)
                  for index, name in enumerate(("used", "unused"))}
        optimizer = _optimizer(tables)
        pairs.append((tables, optimizer, EmbeddingCollection(tables, optimizer.owner_layout(),
                                                             rpc.get_worker_info().name)))
    ids = {"used": torch.tensor([[1], [8]]), "unused": torch.tensor([[2], [3]])}
    (tables, _, collection), (expected_tables, _, expected_collection) = pairs
    before = _weights(tables)
    lookup = collection.lookup(ids)
    pooled = lookup.pooled()
    push = lookup.push_during_backward(0)
    pooled["used"].sum().backward()
    assert push.pending is None  # not every table's rows got a gradient: it leaves after the pass
    push.wait()
    lookup = expected_collection.lookup(ids)
    lookup.pooled()["used"].sum().backward()
    lookup.push(0).wait()  # from the rows' .grad (the unused table's is None)
    after, expected = _weights(tables), _weights(expected_tables)
    assert torch.equal(after["unused"], before["unused"])
    assert not torch.equal(after["used"], before["used"])
    assert all(torch.equal(after[name], expected[name]) for name in after)


def trainer_dynamic_equals_fixed():
    """A dynamic table over 3 shards, ids anywhere in int64, trains like a fixed table made of the same rows."""
    shards = shard_names(3)
    universe = torch.cat([torch.randint(-2 ** 63, 2 ** 63 - 1, (300,)), torch.tensor([-2 ** 63, -1, 0])]).unique()
    dynamic = DynamicEmbeddingBag(DIM, "sum", shards=shards, name="dyn", seed=11, init_std=0.1)
    fixed = ShardedEmbeddingBag.from_pretrained(initial_rows(universe, 11, DIM, 0.1, torch.float32), "sum",
                                                shards=shards, name="dyn-fixed")
    tables = {"dynamic": dynamic, "fixed": fixed}
    optimizer = _optimizer(tables)
    collection = EmbeddingCollection(tables, optimizer.owner_layout(), rpc.get_worker_info().name)
    for bad in (torch.rand(4, 2), torch.zeros(4, 2, 2, dtype=torch.int64)):
        with _CountedRpc() as counted, pytest.raises((TypeError, ValueError), match=r"'dyn'.*\[4, 2"):
            collection.lookup({"dynamic": bad, "fixed": torch.zeros(4, 2, dtype=torch.int64)}, 0)
        assert not counted.calls  # nothing was sent
    seen = torch.zeros(universe.numel(), dtype=torch.bool)
    for step in range(5):
        positions = torch.randint(0, universe.numel(), (16, 2))
        seen[positions.view(-1)] = True
        with _CountedRpc() as counted:
            lookup = collection.lookup({"dynamic": universe[positions], "fixed": positions}, step)
            pooled = lookup.pooled()
            torch.testing.assert_close(pooled["dynamic"], pooled["fixed"], rtol=1e-6, atol=1e-7)
            target = torch.randn(16, DIM)
            ((pooled["dynamic"] * target).sum() + (pooled["fixed"] * target).sum()).backward()
            lookup.push(step).wait()
        assert counted.calls == {(kind, shard): 1 for kind in ("lookup", "push_lookup") for shard in shards}, \
            counted.calls
    rows = dynamic(universe.view(-1, 1))  # reading only: ids never looked up in training have no row
    torch.testing.assert_close(rows[seen], fixed.fetch_weight()[seen], rtol=1e-6, atol=1e-7)
    assert torch.equal(rows[~seen], torch.zeros(int((~seen).sum()), DIM))
    unseen = dynamic(torch.tensor([[12345678987654321]]))
    assert torch.equal(unseen, torch.zeros(1, DIM))
    # What each shard serves as metrics and heartbeats: a row per id seen in training, none evicted.
    parts = [part for shard in shards for part in rpc.rpc_sync(shard, service.dynamic_table_parts)]
    assert sorted((table, part) for table, part, _ in parts) == [("dyn", "0/3"), ("dyn", "1/3"), ("dyn", "2/3")]
    figures = [rpc.rpc_sync(shard, service.dynamic_table_figures) for shard in shards]
    assert [f["dynamic.rows"] for f in figures] == [f["dynamic.admitted"] for f in figures] == [
        stats["rows"] for _, _, stats in sorted(parts, key=lambda part: part[1])]
    assert sum(f["dynamic.rows"] for f in figures) == int(seen.sum())
    assert all(f["dynamic.evicted"] == 0 and f["dynamic.rows"] > 0 and f["dynamic.bytes"] > 0 for f in figures)


def trainer_row_window_reads_once_and_pushes_in_order():
    """A row window serves each step the rows a lookup of that step alone reads, reading each row once; the
    pushes of its steps in one message per shard leave the tables as the same pushes sent one by one."""
    shards = shard_names(3)
    weights = {name: torch.randn(rows, DIM) for name, (rows, _, _) in TABLES.items()}
    one_by_one, together = _tables(shards, "window-a", weights), _tables(shards, "window-b", weights)
    peer = rpc.get_worker_info().name
    optimizers = [_optimizer(one_by_one), _optimizer(together)]  # (their owners' optimizers live as long)
    plain = EmbeddingCollection(one_by_one, optimizers[0].owner_layout(), peer)
    cached = EmbeddingCollection(together, optimizers[1].owner_layout(), peer)
    generator = torch.Generator().manual_seed(3)
    steps = [(step, {name: torch.randint(0, rows, (6, 2), generator=generator)
                     for name, (rows, _, _) in TABLES.items()}) for step in range(3)]
    targets = {name: torch.randn(6, DIM, generator=generator) for name in TABLES}

    def backward(lookup):  # linear in the rows: each step's gradients are the same on both sides
        pooled = lookup.pooled()
        sum((pooled[name] * targets[name]).sum() for name in TABLES).backward()

    window = RowWindow(cached, steps)
    assert window.steps == [0, 1, 2] and 0 < window.rows_held < window.rows_needed  # shared rows read once
    with _CountedRpc() as counted:
        window.read(cached.lookup_planned(window.plan))
    assert counted.calls == {("lookup", shard): 1 for shard in shards}, counted.calls
    # The same window from distinct ids found ahead (as the Trainer's batch reader finds them) reads the same.
    found = {step: {name: distinct_ids(ids) for name, ids in features.items()} for step, features in steps}
    ahead = RowWindow(cached, steps, distinct=found)
    assert (ahead.steps, ahead.rows_held, ahead.rows_needed) == (window.steps, window.rows_held, window.rows_needed)
    ahead.read(cached.lookup_planned(ahead.plan))
    with pytest.raises(ValueError, match="table 'window-b.users': distinct ids found for 1 ids are handed with 12"):
        RowWindow(cached, steps[:1], distinct={0: {"users": distinct_ids(torch.zeros(1, 1, dtype=torch.long))}})
    pushes = []
    for step, features in steps:
        lookup = window.lookup(step)
        alone = cached.lookup(features).unique_rows()  # nothing was pushed yet: the same rows
        assert all(torch.equal(lookup.unique_rows()[name], alone[name]) for name in TABLES)
        pooled, pooled_ahead = lookup.pooled(), ahead.lookup(step).pooled()
        assert all(torch.equal(pooled[name], pooled_ahead[name]) for name in TABLES)
        backward(lookup)
        pushes.append(lookup.step_push(step))
        lookup = plain.lookup(features)
        backward(lookup)
        lookup.push(step).wait()
    with _CountedRpc() as counted:
        cached.send(pushes).wait()
    assert counted.calls == {("push_lookup", shard): 1 for shard in shards}, counted.calls
    assert all(torch.equal(one, two) for one, two in zip(_weights(one_by_one).values(), _weights(together).values()))
    # A bound on the rows held, or on their bytes, cuts the window short (its first step always stays).
    assert RowWindow(cached, steps, max_rows=1).steps == RowWindow(cached, steps, max_bytes=1).steps == [0]
    row_bytes = DIM * 4
    assert RowWindow(cached, steps, max_bytes=window.rows_held * row_bytes).steps == [0, 1, 2]
    assert RowWindow(cached, steps, max_bytes=window.rows_held * row_bytes - 1).steps == [0, 1]


@pytest.mark.parametrize("mode", ["sum", "mean"])
@pytest.mark.parametrize("bag", [1, 3])
def test_pooling_a_lookups_rows_equals_embedding_bag_forward_and_backward(mode, bag):
    """``Route.pool`` (a gather and a reduction; bags of one id: the gather alone) against ``embedding_bag`` over
    the whole table, on integer values so that every sum is exact whatever its order."""
    ids = torch.randint(0, 10, (64, bag))
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    weight = torch.randint(-8, 8, (10, DIM)).double()
    upstream = torch.randint(-4, 4, (64, DIM)).double()
    rows = weight[unique].clone().requires_grad_()
    pooled = Route(SimpleNamespace(mode=mode), inverse, []).pool(rows)
    (pooled * upstream).sum().backward()
    whole = weight.clone().requires_grad_()
    expected = F.embedding_bag(ids, whole, mode=mode)
    (expected * upstream).sum().backward()
    assert pooled.shape == expected.shape == (64, DIM)
    assert torch.equal(pooled, expected.detach())
    if mode == "mean" and bag > 1:  # a third of each upstream value, summed in another order: within rounding
        torch.testing.assert_close(rows.grad, whole.grad[unique], rtol=0, atol=1e-12)
    else:
        assert torch.equal(rows.grad, whole.grad[unique])


def test_one_lookup_and_one_push_per_shard_with_rows_equal_to_the_unfused_path():
    run_cluster([(trainer_fused_equals_unfused, ()), (trainer_failures_name_the_shard, ()),
                 (trainer_pushes_are_idempotent_per_step, ()),
                 (trainer_a_push_reaching_some_tables_carries_theirs_after_the_pass, ()),
                 (trainer_dynamic_equals_fixed, ()),
                 (trainer_row_window_reads_once_and_pushes_in_order, ())], num_shards=3)
