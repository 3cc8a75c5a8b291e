"""Dynamic tables in one process: the id index, admission, capacity and TTL eviction, rows re-created from
their initial values, optimizer state following the rows (equal to a fixed table's on the rows both hold),
routing, and a checkpoint restored onto another number of shards; every case on each lookup path (the
``kernel`` fixture: the C kernel's best build, its baseline build, the torch path).  Where the kernel comes
from: a shard's state loads it when it hosts its first dynamic table, never at import."""

import ctypes

import pytest
import torch

from torch.optim import SGD

from paramserver.optim import QHM
from paramserver.shards.server.optimizers import OwnerOptimizer
from paramserver.optim.registry import functional_optim_map
from paramserver.checkpoint.shard_part import select_part
from paramserver.shards.server.dynamic import DynamicRows
from paramserver.tables import DynamicOptions
from paramserver.tables.id_hash import initial_rows, shard_of
from paramserver.shards.server.dynamic import huge_pages, native
from paramserver.shards.server.dynamic.huge_pages import HugePages
from paramserver.shards.server.dynamic.id_index import IdIndex
from paramserver.shards.server import ShardState
from paramserver.shards.server.hosted import host_dynamic
from paramserver.train.contract import Table

DIM = 4
INT64_MIN, INT64_MAX = -2 ** 63, 2 ** 63 - 1


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    """The C kernel's builds, loaded once for the tests here (``PARAMSERVER_NATIVE`` honoured)."""
    return native.NativeKernels()


@pytest.fixture(params=["native", "baseline", "torch"], autouse=True)
def kernel(request, kernels):
    """Every test here on each path: ids found by the C kernel (its best build for this processor, and its
    baseline build where that is another one), and by the torch path (``None``)."""
    if request.param == "torch":
        return None
    best = kernels.chosen()
    if best is None:
        pytest.skip("the C kernel is not available here (no C compiler, or PARAMSERVER_NATIVE=0)")
    if request.param == "baseline":
        if best.variant == "baseline":
            pytest.skip("the best build of the C kernel here is its baseline build (run as 'native')")
        best = kernels.build("baseline")
        assert best.variant == "baseline"
    return best


def spread_ids(count: int, seed: int = 0) -> torch.Tensor:
    """Distinct ids over the whole int64 range, the extremes and small ones included."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(INT64_MIN, INT64_MAX, (count,), generator=generator)
    ids = torch.cat([ids, torch.tensor([INT64_MIN, INT64_MAX, -1, 0, 1])]).unique()
    return ids[torch.randperm(ids.numel(), generator=generator)]


def dynamic(kernel, options: DynamicOptions = DynamicOptions(), state: ShardState = None,
            seed: int = 3) -> DynamicRows:
    """A table part whose lookups run in ``kernel`` (a ``native.Kernel``, or ``None``: the torch path)."""
    state = state or ShardState()
    return state.shared_dynamic("t@0/1", lambda: DynamicRows("t@0/1", DIM, torch.float32, seed, 0.1, options,
                                                             lambda t: state.lock_for(t)[1], kernel=kernel,
                                                             huge_pages=state.huge_pages))


def held_ids(rows: DynamicRows) -> set:
    return set(rows.index.items()[0].tolist())


def test_the_index_maps_ids_over_the_whole_int64_range_through_growth_and_removal(kernel):
    index = IdIndex(kernel, HugePages())
    ids = spread_ids(60_000)
    for start in range(0, ids.numel(), 5_000):  # grows several times
        index.insert(ids[start:start + 5_000], torch.arange(start, min(start + 5_000, ids.numel())))
    assert torch.equal(index.find(ids), torch.arange(ids.numel()))
    others = spread_ids(1_000, seed=1)
    assert (index.find(others[~torch.isin(others, ids)]) == -1).all()
    index.remove(ids[:20_000])
    index.remove(ids[:10])  # not held any more: ignored
    found = index.find(ids)
    assert (found[:20_000] == -1).all() and torch.equal(found[20_000:], torch.arange(20_000, ids.numel()))
    index.insert(ids[:5_000], torch.arange(5_000) + 100_000)
    assert torch.equal(index.find(ids[:5_000]), torch.arange(5_000) + 100_000)
    assert len(index) == ids.numel() - 15_000
    # ids crowding one bucket make the index grow, never lose one
    crowd = torch.arange(3_000) << 40
    crowded = IdIndex(kernel, HugePages())
    crowded.insert(crowd, torch.arange(3_000))
    assert torch.equal(crowded.find(crowd), torch.arange(3_000))


def test_routing_and_initial_rows_are_fixed_functions_of_the_id():
    ids = spread_ids(10_000)
    owner = shard_of(ids, 4)
    assert owner.min() >= 0 and owner.max() < 4 and torch.bincount(owner).min() > 2_000
    assert torch.equal(shard_of(ids, 4), owner)
    rows = initial_rows(ids, 7, 16, 0.5, torch.float32)
    assert torch.equal(rows, initial_rows(ids, 7, 16, 0.5, torch.float32))
    assert not torch.equal(rows, initial_rows(ids, 8, 16, 0.5, torch.float32))
    assert rows.std().item() == pytest.approx(0.5, rel=0.05) and abs(rows.mean().item()) < 0.01


def test_rows_are_made_on_first_lookup_and_read_as_their_initial_values(kernel):
    rows = dynamic(kernel)
    ids = spread_ids(500)
    assert torch.equal(rows.lookup(ids, -1), torch.zeros(ids.numel(), DIM))  # reading admits nothing
    assert len(rows.index) == 0
    assert torch.equal(rows.lookup(ids, 0), initial_rows(ids, 3, DIM, 0.1, torch.float32))
    assert torch.equal(rows.lookup(ids, -1), initial_rows(ids, 3, DIM, 0.1, torch.float32))
    assert rows.stats()["rows"] == ids.numel() == rows.stats()["admitted"]


def test_an_id_is_admitted_once_seen_in_admit_after_lookups(kernel):
    rows = dynamic(kernel, DynamicOptions(admit_after=3))
    ids = spread_ids(200)
    for step in range(2):
        assert torch.equal(rows.lookup(ids, step), torch.zeros(ids.numel(), DIM))
    assert len(rows.index) == 0 and rows.stats()["not_admitted"] == 2 * ids.numel()
    assert torch.equal(rows.lookup(ids, 2), initial_rows(ids, 3, DIM, 0.1, torch.float32))
    assert len(rows.index) == ids.numel()
    sampled = dynamic(kernel, DynamicOptions(admit_probability=0.25))
    sampled.lookup(spread_ids(4_000), 0)
    assert 800 < len(sampled.index) < 1_200


def test_capacity_is_never_exceeded_and_the_hot_ids_are_never_evicted(kernel):
    capacity = 300
    rows = dynamic(kernel, DynamicOptions(capacity=capacity))
    hot = spread_ids(100, seed=5)
    generator = torch.Generator().manual_seed(1)
    for step in range(40):
        cold = torch.randint(INT64_MIN, INT64_MAX, (90,), generator=generator)
        ids = torch.cat([hot, cold]).unique()
        values = rows.lookup(ids, step)
        assert len(rows.index) <= capacity
        assert hot.tolist() and set(hot.tolist()) <= held_ids(rows)
        # every id of the step got its row (there was room among rows of earlier steps)
        assert (values.abs().sum(1) > 0).all()
    assert rows.stats()["evicted"] >= 40 * 90 - capacity
    # a step asking for more new ids than the shard can hold: the extra ones read zeros, none evicted from it
    full = dynamic(kernel, DynamicOptions(capacity=50))
    values = full.lookup(spread_ids(80), 0)
    assert len(full.index) == 50 and int((values.abs().sum(1) > 0).sum()) == 50


def test_rows_untouched_for_ttl_steps_are_evicted_and_come_back_from_their_initial_values(kernel):
    rows = dynamic(kernel, DynamicOptions(ttl_steps=3))
    old, kept = spread_ids(50, seed=1), spread_ids(50, seed=2)
    kept = kept[~torch.isin(kept, old)]
    rows.lookup(torch.cat([old, kept]), 0)
    rows.slab.add_(1.0)  # as if trained
    for step in range(1, 5):
        rows.lookup(kept, step)
    assert not set(old.tolist()) & held_ids(rows) and set(kept.tolist()) <= held_ids(rows)
    assert rows.stats()["evicted"] == old.numel()
    assert torch.equal(rows.lookup(old, 5), initial_rows(old, 3, DIM, 0.1, torch.float32))


def assert_same(actual, expected):
    """Equal up to float rounding: the multi-tensor kernels round a row's values alike only where it sits alike
    in the batch (a vectorized body or a scalar tail), and the two tables order their rows differently."""
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7)


def _owner_optimizer(state: ShardState, params, optimizer=QHM, **options):
    return OwnerOptimizer(optimizer, functional_optim_map[optimizer], params, [f"p{i}" for i in range(len(params))],
                          (), options, state)


@pytest.mark.parametrize("optimizer,options", [(QHM, dict(lr=0.5, momentum=0.9, nu=0.7)),
                                               (SGD, dict(lr=0.5, momentum=0.9, dampening=0.1))])
def test_updates_equal_a_fixed_table_holding_the_same_rows_with_state_following_the_rows(optimizer, options,
                                                                                         kernel):
    equal_to_a_fixed_table(kernel, optimizer, options)


def equal_to_a_fixed_table(kernel, optimizer, options) -> None:
    """A dynamic table's part (lookups in ``kernel``) stepped by ``optimizer`` holds, through growth and
    eviction, the rows and optimizer state of a fixed table of every id stepped alike (evicted ids start again
    there: their rows from their initial values, their state from the optimizer's initial values)."""
    state = ShardState()
    rows = dynamic(kernel, DynamicOptions(capacity=1500), state)
    universe = spread_ids(2_000)
    fixed = initial_rows(universe, 3, DIM, 0.1, torch.float32)
    fixed_optimizer = _owner_optimizer(state, [fixed], optimizer, **options)
    dynamic_optimizer = _owner_optimizer(state, [rows.slab], optimizer, **options)
    generator = torch.Generator().manual_seed(0)
    for step in range(12):  # the slab grows, rows get evicted: the held rows stay equal
        positions = torch.randperm(universe.numel(), generator=generator)[:400].sort().values
        ids = universe[positions]
        looked_up = rows.lookup(ids, step)
        held = looked_up.abs().sum(1) > 0
        assert_same(looked_up[held], fixed[positions[held]])
        gradients = torch.randn(ids.numel(), DIM, generator=generator)
        dynamic_optimizer.apply_rows([0], [ids], [gradients], "test")
        fixed_optimizer.apply_rows([0], [positions[held]], [gradients[held]], "test")
        # an evicted id's row starts again from its initial value: so does the fixed table's copy of it
        gone = torch.tensor(sorted(set(universe.tolist()) - held_ids(rows)), dtype=torch.int64)
        lost = torch.isin(universe, gone).nonzero().view(-1)
        fixed[lost] = initial_rows(universe[lost], 3, DIM, 0.1, torch.float32)
        fixed_optimizer.reset_rows(0, lost)  # and its state starts again at the optimizer's initial values
    assert rows.stats()["evicted"] > 0 and rows.slab.size(0) > 1024
    held, slots = rows.index.items()
    positions = torch.searchsorted(universe.sort().values, held)
    order = universe.argsort()[positions]
    assert_same(rows.slab[slots], fixed[order])
    dynamic_state, fixed_state = dynamic_optimizer.state_dict()[0], fixed_optimizer.state_dict()[0]
    for key, value in dynamic_state.items():  # (a step count is one value for the whole table)
        assert_same(value[slots] if value.dim() else value,
                    fixed_state[key][order] if value.dim() else fixed_state[key])


def test_an_optimizer_whose_state_cannot_follow_rows_is_refused_naming_the_table(kernel):
    state = ShardState()
    rows = dynamic(kernel, state=state)
    with pytest.raises(TypeError, match="t@0/1"):
        _owner_optimizer(state, [rows.slab], torch.optim.RMSprop, lr=0.1)


def test_a_checkpoint_is_restored_onto_another_number_of_shards(kernel):
    states = [ShardState(), ShardState()]
    parts = [dynamic(kernel, DynamicOptions(admit_after=2), state, seed=3) for state in states]
    optimizers = [_owner_optimizer(state, [part.slab], lr=0.5, momentum=0.9, nu=0.7)
                  for state, part in zip(states, parts)]
    ids = spread_ids(3_000)
    owner = shard_of(ids, 2)
    for step in range(3):
        for index, (part, optimizer) in enumerate(zip(parts, optimizers)):
            mine = ids[owner == index]
            part.lookup(mine, step)
            optimizer.apply_rows([0], [mine], [torch.ones(mine.numel(), DIM) * (step + 1)], "test")
    entries = [optimizer.snapshot()[0][0] for optimizer in optimizers]  # as a shard writes its checkpoint part
    values = {i: v for part in parts for i, v in zip(part.index.items()[0].tolist(),
                                                     part.slab[part.index.items()[1]])}
    momentum = {}
    for part, optimizer in zip(parts, optimizers):
        ids_held, slots = part.index.items()
        buffer = optimizer.state_dict()[0]["momentum_buffer"]
        momentum.update({i: b for i, b in zip(ids_held.tolist(), buffer[slots])})
    for count in (1, 3):
        restored_ids = set()
        for index in range(count):
            new_state = ShardState()
            part = dynamic(kernel, DynamicOptions(admit_after=2), new_state)
            part.restore(**select_part(entries, index, count))
            optimizer = _owner_optimizer(new_state, [part.slab], lr=0.5, momentum=0.9, nu=0.7)
            optimizer.load_state_dict({0: part.restored_optimizer_state(optimizer.class_name)})
            held, slots = part.index.items()
            assert (shard_of(held, count) == index).all()
            restored_ids |= set(held.tolist())
            buffers = optimizer.state_dict()[0]["momentum_buffer"][slots]
            for i, row, buffer in zip(held.tolist(), part.slab[slots], buffers):
                assert torch.equal(row, values[i]) and torch.equal(buffer, momentum[i])
            assert part.clock == 2 and part.admission.counts.sum() > 0
        assert restored_ids == set(values)


def test_tables_check_their_options_and_route_any_int64_id():
    with pytest.raises(ValueError, match="capacity"):
        Table(None, 8, capacity=0)
    with pytest.raises(ValueError, match="dynamic tables"):
        Table(100, 8, capacity=10)
    assert Table(None, 8, ttl_steps=5).dynamic


def test_a_state_loads_its_kernel_when_it_hosts_its_first_dynamic_table_and_two_states_live_in_one_process(kernel):
    choice = "torch" if kernel is None else "best" if kernel.variant == "avx2" else "baseline"
    states = [ShardState(kernels=native.NativeKernels(choice)) for _ in range(2)]
    ids = spread_ids(2_000)
    read = []
    for state in states:
        assert state.kernels.loaded() == {}  # nothing loaded before a dynamic table is hosted
        rows = state.dynamic_rows(host_dynamic(state, "t", DIM, torch.float32, 3, 0.1, DynamicOptions(), 0, 1))
        assert (rows.index.kernel and rows.index.kernel.variant) == (kernel and kernel.variant)
        read.append(rows.lookup(ids, 0))
    assert torch.equal(read[0], read[1]) and torch.equal(read[0], initial_rows(ids, 3, DIM, 0.1, torch.float32))


def test_an_install_time_build_is_used_only_when_made_from_the_kernel_c_beside_it(monkeypatch, tmp_path):
    installed = native.installed_library("baseline")
    if installed is None:
        pytest.skip("no install-time build here (no compiler at install, or the package is not installed)")
    probe = native.Kernel(ctypes.CDLL(str(installed)), "baseline", installed, installed=True)
    current = probe.digest == native.source_digest(native.SOURCE_PATH.read_bytes())
    build = native.NativeKernels().build("baseline")
    assert build.installed == current and (build.origin == installed) == current
    # kernel.c edited since the install: its build is passed over for one made on first use from the new source
    edited = tmp_path / "kernel.c"
    edited.write_bytes(native.SOURCE_PATH.read_bytes() + b"/* edited */\n")
    monkeypatch.setattr(native, "SOURCE_PATH", edited)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    rebuilt = native.NativeKernels().build("baseline")
    if rebuilt is None:
        pytest.skip("no C compiler to build the edited source with")
    assert not rebuilt.installed and rebuilt.origin.parent == tmp_path / "cache"
    assert rebuilt.digest == native.source_digest(edited.read_bytes())


def test_a_row_swept_by_ttl_in_the_lookup_that_asks_for_it_comes_back_fresh_in_a_slot_of_its_own(kernel):
    rows = dynamic(kernel, DynamicOptions(ttl_steps=1))
    stale, others = spread_ids(40, seed=3), spread_ids(40, seed=4)
    others = others[~torch.isin(others, stale)]
    rows.lookup(stale, 0)
    rows.slab.add_(1.0)  # as if trained
    asked = torch.cat([stale, others])
    values = rows.lookup(asked, 3)  # step 3 sweeps rows untouched since step 0, these among them
    held, slots = rows.index.items()
    assert torch.unique(slots).numel() == slots.numel() == asked.numel()  # one row per id
    assert torch.equal(values, initial_rows(asked, 3, DIM, 0.1, torch.float32))


def test_the_c_kernel_and_the_torch_path_find_touch_and_read_alike(kernel):
    index = IdIndex(kernel, HugePages())
    ids = spread_ids(20_000)
    index.insert(ids, torch.arange(ids.numel()))
    index.remove(ids[:3_000])
    table = torch.randn(ids.numel(), DIM)
    asked = torch.cat([ids[:5_000], spread_ids(500, seed=9)]).unique()
    slots, rows, all_held = index.find_rows(asked, table, 7)
    expected = torch.tensor([int(torch.nonzero(ids == i)) if bool((ids[3_000:] == i).any()) else -1
                             for i in asked.tolist()])
    assert torch.equal(slots, expected) and not all_held
    held = expected >= 0
    assert torch.equal(rows[held], table[expected[held]]) and not rows[~held].any()
    _, _, held_slots, touches = index.held()
    assert torch.equal(held_slots[touches == 7].sort().values, expected[held].sort().values)
    assert bool((touches[touches != 7] == -1).all())  # inserted without a touch, not asked for since
    assert torch.equal(index.find(asked), expected)


def test_huge_page_tensors_hold_what_plain_ones_would():
    pages = HugePages()
    big = huge_pages.MIN_BYTES // 4 + 5  # int32 elements: advised (where the system allows)
    grown = pages.grown(torch.arange(20, dtype=torch.int32).view(10, 2), big // 2)
    assert grown.shape == (big // 2, 2) and torch.equal(grown[:10], torch.arange(20, dtype=torch.int32).view(10, 2))
    assert pages.empty((big // 4, 4), torch.int32).shape == (big // 4, 4)
    assert pages.advise(torch.empty(16)) is False  # small tensors keep ordinary pages
