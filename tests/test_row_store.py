"""The row store in one process: dynamic tables whose rows evicted for ``capacity`` are kept on disk with their
optimizer state, and come back from there; a table with a store trains to the same rows, optimizer state and
checkpoint as the same table held whole in memory, bit for bit, whatever its capacity; records laid out by the
optimizer's row state; the shard's folder made, checked and removed."""

import pathlib

import pytest
import torch

from paramserver.optim import QHM
from paramserver.optim.rowwise_adagrad import RowWiseAdagrad
from paramserver.optim.registry import class_name, functional_optim_map
from paramserver.shards.server import ShardState
from paramserver.shards.server.dynamic import DynamicRows
from paramserver.shards.server.optimizers import OwnerOptimizer
from paramserver.shards.server.row_store.layout import RowLayout
from paramserver.shards.server.row_store.stores import DEFAULT_ENGINE, ENGINES, RowStoreOptions, RowStores, \
    check_folder, engine_class
from paramserver.tables import DynamicOptions

DIM = 8
UNIVERSE = 3_000


def available_engines():
    names = []
    for name in sorted(ENGINES):
        try:
            engine_class(name)
        except ImportError:
            continue
        names.append(name)
    return names


@pytest.fixture(params=available_engines())
def engine(request):
    return request.param


def zipf_steps(steps: int, per_step: int, seed: int = 0):
    """Each step's distinct ids (sorted), drawn from a Zipf-like law over ``UNIVERSE`` ids spread over int64."""
    generator = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, UNIVERSE + 1, dtype=torch.float64) ** 1.05
    spread = torch.randint(-2 ** 62, 2 ** 62, (UNIVERSE,), generator=generator)
    return [spread[torch.multinomial(weights, per_step, replacement=True, generator=generator)].unique()
            for _ in range(steps)]


def train(tmp_path: pathlib.Path, engine, capacity, *, optimizer=RowWiseAdagrad, options=None,
          dtype=torch.float32, ttl_steps=None, steps=14, checkpoint_at=None, prefetch=False, lookup_first=True,
          restore=None, exports=None):
    """A dynamic table part trained as a pipelined trainer drives it (step t+1's lookup before step t's push),
    with a row store of ``engine`` under ``tmp_path`` (``None``: none) and ``capacity`` rows in memory; returns
    its checkpoint entry (every row and its state, memory's and the store's), sorted by id, and the part.
    ``prefetch``: the next step's rows read ahead before each push; ``lookup_first``: step t+1's lookup before
    step t's push (a pipelined trainer at staleness 1), else after it (at staleness 0)."""
    options = options or dict(lr=0.1)
    state = ShardState()
    tmp_path.mkdir(exist_ok=True)
    stores = RowStores(RowStoreOptions(str(tmp_path), engine), "shard") if engine is not None else None
    name = "t@0/1"
    rows = state.shared_dynamic(name, lambda: DynamicRows(
        name, DIM, dtype, 3, 0.1, DynamicOptions(capacity=capacity, ttl_steps=ttl_steps),
        lambda t: state.lock_for(t)[1], kernel=state.kernels.chosen(), huge_pages=state.huge_pages,
        store=stores.tier(name) if stores is not None else None))
    first = 0
    if restore is not None:  # a checkpoint entry (``sorted_entry``'s), and the steps trained on from it
        entry, first = restore
        rows.restore(entry["ids"], entry["value"], entry["last_touch"], class_name(optimizer), entry["state"], [],
                     entry["clock"])
    owner = OwnerOptimizer(optimizer, functional_optim_map[optimizer], [rows.slab], ["t"], (), options, state)
    if restore is not None:
        owner.load_state_dict({0: rows.restored_optimizer_state(owner.class_name)})
    generator = torch.Generator().manual_seed(1 + first)
    ids = zipf_steps(first + steps + 1, 300)[first:]
    looked = [rows.lookup(ids[0], first)]
    entries = []
    for step in range(steps):
        if prefetch:
            rows.prefetch(ids[step + 1])
        gradients = torch.randn(ids[step].numel(), DIM, generator=generator)
        if lookup_first:
            looked.append(rows.lookup(ids[step + 1], first + step + 1))
        owner.apply_rows([0], [ids[step]], [gradients], "test")
        if not lookup_first:
            looked.append(rows.lookup(ids[step + 1], first + step + 1))
        if checkpoint_at is not None and step == checkpoint_at:
            entries.append(owner.snapshot()[0][0])
        if exports is not None and step % 3 == 2:  # a live export every third step, the first one whole
            with state.lock_for(rows.slab)[1]:
                exports.append(rows.export_entry_locked(state.row_marks(rows.slab).take()))
    entries.append(owner.snapshot()[0][0])
    if exports is not None:  # and one at the end
        with state.lock_for(rows.slab)[1]:
            exports.append(rows.export_entry_locked(state.row_marks(rows.slab).take()))
    return [sorted_entry(entry) for entry in entries], looked, rows, stores


def sorted_entry(entry):
    order = torch.argsort(entry["ids"])
    return {"ids": entry["ids"][order], "value": entry["value"][order], "last_touch": entry["last_touch"][order],
            "state": {key: value[order] if value.dim() else value for key, value in entry["state"].items()},
            "clock": entry["clock"]}


def assert_bitwise_equal(actual, expected):
    assert actual["ids"].equal(expected["ids"])
    assert actual["value"].view(torch.uint8).equal(expected["value"].view(torch.uint8))
    assert actual["last_touch"].equal(expected["last_touch"])
    assert actual["state"].keys() == expected["state"].keys()
    for key in expected["state"]:
        assert actual["state"][key].equal(expected["state"][key]), key
    assert actual["clock"] == expected["clock"]


OPTIMIZERS = [(RowWiseAdagrad, dict(lr=0.1)), (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
              (torch.optim.Adam, dict(lr=0.01)), (QHM, dict(lr=0.1, momentum=0.9, nu=0.7))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def exactness_cases():
    """Every optimizer in every row type on the default engine; on the others, two of them (the engines keep
    bytes: what a record holds is the layout's, tested whole on one)."""
    cases = []
    for engine in available_engines():
        for optimizer, options in OPTIMIZERS:
            for dtype in DTYPES:
                if engine == DEFAULT_ENGINE or (optimizer, dtype) in ((RowWiseAdagrad, torch.float16),
                                                                     (QHM, torch.float32)):
                    cases.append((engine, optimizer, options, dtype))
    return cases


@pytest.mark.parametrize("engine,optimizer,options,dtype", exactness_cases())
def test_a_table_with_a_store_trains_to_the_rows_and_state_of_one_held_whole_in_memory(tmp_path, engine, dtype,
                                                                                      optimizer, options):
    whole, looked_whole, _, _ = train(tmp_path / "a", None, None, optimizer=optimizer, options=options, dtype=dtype)
    kept, looked_kept, rows, stores = train(tmp_path / "b", engine, 200, optimizer=optimizer, options=options,
                                            dtype=dtype)
    assert rows.stats()["evicted"] > 0 and rows.store_reads > 0  # rows went to disk and came back
    assert len(rows.index) <= 300 + 300  # capacity, passed by at most the rows of the steps in flight
    for a, b in zip(looked_kept, looked_whole):
        assert a.view(torch.uint8).equal(b.view(torch.uint8))
    assert_bitwise_equal(kept[0], whole[0])
    assert rows.stats()["rows_on_disk"] == kept[0]["ids"].numel() - len(rows.index)  # counted exactly
    stores.close()
    assert not stores.folder.exists()


def test_expired_rows_in_the_store_are_swept_as_memory_sweeps_them(tmp_path, engine):
    whole, _, _, _ = train(tmp_path / "a", None, None, ttl_steps=3, steps=20)
    kept, _, rows, stores = train(tmp_path / "b", engine, 150, ttl_steps=3, steps=20)
    assert_bitwise_equal(kept[0], whole[0])
    stores.close()


def test_a_checkpoint_taken_mid_run_holds_what_memory_would(tmp_path, engine):
    whole, _, _, _ = train(tmp_path / "a", None, None, checkpoint_at=6)
    kept, _, _, stores = train(tmp_path / "b", engine, 120, checkpoint_at=6)
    for a, b in zip(kept, whole):
        assert_bitwise_equal(a, b)
    stores.close()


@pytest.mark.parametrize("optimizer,options", [(RowWiseAdagrad, dict(lr=0.1)),
                                               (QHM, dict(lr=0.1, momentum=0.9, nu=0.7))])
def test_a_checkpoint_restored_into_less_memory_trains_on_as_one_held_whole(tmp_path, engine, optimizer, options):
    """Rows restored past the capacity go to the store with their state, the least recently touched first; the
    table trains on to the rows and state of a table restored whole into memory."""
    whole, _, _, _ = train(tmp_path / "a", None, None, optimizer=optimizer, options=options)
    kept, _, _, stores = train(tmp_path / "b", engine, 200, optimizer=optimizer, options=options)
    stores.close()
    on_whole, _, _, _ = train(tmp_path / "c", None, None, optimizer=optimizer, options=options, steps=6,
                              restore=(whole[0], 14))
    on_kept, _, rows, stores = train(tmp_path / "d", engine, 150, optimizer=optimizer, options=options, steps=6,
                                     restore=(kept[0], 14))
    assert rows.store_reads > 0
    assert_bitwise_equal(on_kept[0], on_whole[0])
    stores.close()


def test_live_exports_carry_the_rows_on_disk_a_follower_needs(tmp_path, engine):
    """A follower applying a whole export, then deltas (rows changed, ids dropped), holds every row of the
    table, those on disk too: rows changed and then moved to disk are in the next delta."""
    exports = []
    kept, _, rows, stores = train(tmp_path, engine, 150, exports=exports)
    assert exports[0]["whole"] and not any(entry["whole"] for entry in exports[1:])
    follower = {}
    for entry in exports:
        for index, value in zip(entry["ids"].tolist(), entry["values"]):
            follower[index] = value
        for index in entry["evicted"].tolist():
            follower.pop(index, None)
    expected = kept[0]
    assert sorted(follower) == expected["ids"].tolist()
    assert torch.stack([follower[i] for i in expected["ids"].tolist()]).equal(expected["value"])
    stores.close()


def test_read_only_lookups_read_rows_on_disk_without_bringing_them_back(tmp_path, engine):
    _, _, rows, stores = train(tmp_path, engine, 100, steps=6)
    entry = sorted_entry(rows.checkpoint_entry())
    held_before = len(rows.index)
    values = rows.lookup(entry["ids"], -1)
    assert values.equal(entry["value"]) and len(rows.index) == held_before
    stores.close()


def test_a_record_holds_the_touch_the_row_and_each_state_row_in_order():
    values = torch.randn(5, DIM).to(torch.float16)
    state = [torch.randn(5, DIM), torch.rand(5), torch.rand(5) > 0.5]
    layout = RowLayout.of(values, state)
    assert layout.record_bytes == 8 + DIM * 2 + DIM * 4 + 4 + 1
    touches, back, back_state = layout.unpack(layout.pack(torch.arange(5), values, state))
    assert touches.equal(torch.arange(5)) and back.equal(values)
    assert all(a.equal(b) for a, b in zip(back_state, state))
    records = layout.pack(torch.arange(5), values, state)
    for one in (records[3:4], records.index_select(0, torch.tensor([3]))):  # a read that found one row
        touches, back, back_state = layout.unpack(one)  # its record is 61 bytes: no wider type divides its stride
        assert touches.tolist() == [3] and back.equal(values[3:4])
        assert all(a.equal(b[3:4]) for a, b in zip(back_state, state))
    with pytest.raises(ValueError, match="do not fit"):
        layout.pack(torch.arange(5), values.float(), state)


def test_the_folder_is_checked_made_per_shard_and_removed(tmp_path, engine):
    with pytest.raises(ValueError, match="--row-store .*no such directory"):
        check_folder(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--row-store-engine"):
        RowStoreOptions(str(tmp_path), "tape")
    stale = tmp_path / "shard_0"
    stale.mkdir()
    (stale / "old").write_text("left by a process that ended")
    stores = RowStores(RowStoreOptions(str(tmp_path), engine), "shard/0")
    assert stores.folder == stale and not (stale / "old").exists()
    tier = stores.tier("t@0/1")
    tier.write(torch.tensor([5, 7]), torch.tensor([1, 2]), torch.ones(2, DIM), [])
    assert tier.read(torch.tensor([7, 8])).found.tolist() == [True, False]
    stores.close()
    assert not stale.exists()



def test_rows_read_ahead_are_the_rows_a_lookup_reads(tmp_path, engine):
    """The next step's rows on disk read ahead while a push is applied (as a push-and-lookup message does): the
    lookups take them from there, and the table trains as one held whole in memory.  Lookups before the push
    (as staleness orders them) evict rows after the read ahead began: what they write is never read stale."""
    for lookup_first in (False, True):
        whole, looked_whole, _, _ = train(tmp_path / f"a{lookup_first}", None, None, lookup_first=lookup_first)
        kept, looked_kept, rows, stores = train(tmp_path / f"b{lookup_first}", engine, 200, prefetch=True,
                                                lookup_first=lookup_first)
        assert rows.store.prefetched > 0
        for a, b in zip(looked_kept, looked_whole):
            assert a.equal(b)
        assert_bitwise_equal(kept[0], whole[0])
        stores.close()


class FullDisk:
    """An engine whose disk is full: every write fails with ENOSPC."""

    record_bytes = 0

    def __init__(self, folder, record_bytes):
        self.folder, self.record_bytes = folder, record_bytes

    def put(self, ids, records):
        raise OSError(28, "No space left on device", str(self.folder))

    def close(self, remove=False):
        pass


def test_a_full_disk_faults_the_shard_once_and_keeps_every_row_it_held(tmp_path):
    state = ShardState()
    stores = RowStores(RowStoreOptions(str(tmp_path), available_engines()[0]), "shard")
    stores._engine = FullDisk  # (every tier opened from now on writes to a full disk)
    state.row_stores = stores
    reasons = []
    state.on_store_failure = reasons.append
    from paramserver.shards.server.hosted import host_dynamic
    slab = host_dynamic(state, "t", DIM, torch.float32, 3, 0.1, DynamicOptions(capacity=100), 0, 1)
    rows = state.dynamic_rows(slab)
    first = torch.arange(100, dtype=torch.int64)
    before = rows.lookup(first, 0).clone()
    from paramserver.shards.server.state import ShardFault
    with pytest.raises(ShardFault, match="could not write"):
        rows.lookup(torch.arange(100, 200, dtype=torch.int64), 1)
    assert len(reasons) == 1 and "No space left on device" in reasons[0] and str(stores.folder) in reasons[0]
    assert rows.lookup(first, -1).equal(before)  # every row it evicted for the write that failed is still held
    with pytest.raises(ShardFault):
        state.refuse_if_faulted()
    stores.close()


def test_a_step_past_the_capacity_holds_all_its_rows_and_says_the_capacity_it_needs(tmp_path, engine, caplog):
    state = ShardState()
    stores = RowStores(RowStoreOptions(str(tmp_path), engine), "shard")
    rows = state.shared_dynamic("t@0/1", lambda: DynamicRows(
        "t@0/1", DIM, torch.float32, 3, 0.1, DynamicOptions(capacity=50), lambda t: state.lock_for(t)[1],
        kernel=state.kernels.chosen(), huge_pages=state.huge_pages, store=stores.tier("t@0/1")))
    with caplog.at_level("WARNING"):
        rows.lookup(torch.arange(120, dtype=torch.int64), 0)
    assert len(rows.index) == 120 and rows.stats()["not_admitted"] == 0  # none refused: memory passes the bound
    assert "'t@0/1': step 0 holds 70 rows past its capacity of 50" in caplog.text
    assert "at least 120 rows" in caplog.text
    rows.lookup(torch.arange(120, 150, dtype=torch.int64), 1)  # the next step evicts back within it
    assert len(rows.index) == 50 and rows.stats()["rows_on_disk"] == 120 + 30 - 50
    stores.close()


def test_row_memory_is_shared_by_what_the_tables_hold(tmp_path, engine):
    """Tables without a capacity share --row-memory: a small one keeps what it uses, the large one the rest;
    a table with a capacity of its own takes its rows' bytes first; a budget that pays for no row is refused."""
    from paramserver.shards.server.hosted import host_dynamic
    from paramserver.shards.server.row_store.stores import row_bytes
    state = ShardState()
    state.row_stores = RowStores(RowStoreOptions(str(tmp_path), engine, memory=4 << 20), "shard")
    small, large, fixed = (state.dynamic_rows(host_dynamic(state, name, DIM, torch.float32, 3, 0.1, options, 0, 1))
                           for name, options in (("small", DynamicOptions()), ("large", DynamicOptions()),
                                                 ("own", DynamicOptions(capacity=1000))))
    small.lookup(torch.arange(500, dtype=torch.int64), 0)
    for step in range(1, 40):
        large.lookup(torch.arange(step * 2000, step * 2000 + 2000, dtype=torch.int64), step)
    per_row = row_bytes(large)
    assert small.capacity < 2000 and len(small.index) == 500  # its ask: what it holds and a little more
    left = (4 << 20) - 1000 * per_row - small.capacity * per_row
    assert left - per_row < large.capacity * per_row <= left and len(large.index) <= large.capacity
    assert large.stats()["rows_on_disk"] == 39 * 2000 - len(large.index)
    state.row_stores.close()
    other = ShardState()
    other.row_stores = RowStores(RowStoreOptions(str(tmp_path), engine, memory=100), "shard")
    with pytest.raises(ValueError, match="--row-memory 100 bytes leaves table part"):
        host_dynamic(other, "t", DIM, torch.float32, 3, 0.1, DynamicOptions(), 0, 1)
    other.row_stores.close()


def test_reads_ahead_of_several_workers_stay_good_but_for_the_ids_written_or_dropped_since(tmp_path, engine):
    """Two workers' next steps read ahead before either lookup: each lookup takes its own; an id evicted
    (written) or read back (dropped) after its read ahead began is read again, never taken stale."""
    from paramserver.shards.server.row_store.tier import StoreTier
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as reader:
        tier = StoreTier(lambda record_bytes: engine_class(engine)(tmp_path / "e", record_bytes), reader)
        ids = torch.arange(100, dtype=torch.int64)
        tier.write(ids, torch.zeros(100), torch.arange(100.0).view(100, 1), [])
        tier.prefetch(ids[:50])
        tier.prefetch(ids[50:])
        tier.drop(ids[:10])  # read back by a push meanwhile...
        tier.write(ids[:5], torch.ones(5), torch.full((5, 1), -1.0), [])  # ...and evicted again, changed
        read = tier.read(ids[:50])
        assert read.found.tolist() == [True] * 5 + [False] * 5 + [True] * 40
        assert read.values.view(-1).tolist() == [-1.0] * 5 + list(range(10, 50))
        assert tier.prefetched == 40  # the five written again and the five dropped were read now
        read = tier.read(ids[50:])
        assert read.values.view(-1).tolist() == list(range(50, 100)) and tier.prefetched == 90
        tier.close()


class PartsSource:
    """A checkpoint's dynamic table parts as a shard's restore source hands them out (``dynamic_part``): ``rows``
    rows per table, of ids spread over int64, last touched at steps ``0..rows-1``."""

    def __init__(self, rows):
        self.parts = {}
        for table, count in rows.items():
            ids = torch.arange(count, dtype=torch.int64) * -7046029254386353131
            self.parts[table] = dict(ids=ids, values=torch.randn(count, DIM), optimizer="", state={}, admission=[],
                                     last_touch=torch.arange(count, dtype=torch.int32), clock=count)

    def dynamic_part(self, table, index, count):
        return self.parts.get(table)

    def check_row_type(self, table, held, wanted):
        pass


def test_a_restore_keeps_in_memory_the_rows_its_share_of_row_memory_pays_for(tmp_path, engine):
    """A part restored under --row-memory asks for the rows it restores, not for the few a new table first asks
    for: those its share pays for stay in memory (all of a small table's), and only the least recently touched
    past it go to the store."""
    from paramserver.shards.server.hosted import host_dynamic
    from paramserver.shards.server.row_store.stores import row_bytes
    budget = 4 << 20
    state = ShardState()
    state.row_stores = RowStores(RowStoreOptions(str(tmp_path), engine, memory=budget), "shard")
    state.restore_source = PartsSource({"fits": 10_000, "passes": 50_000})
    fits, passes = (state.dynamic_rows(host_dynamic(state, name, DIM, torch.float32, 3, 0.1, DynamicOptions(), 0, 1))
                    for name in ("fits", "passes"))
    assert len(fits.index) == 10_000 and fits.stats()["rows_on_disk"] == 0
    per_row = row_bytes(passes)
    left = budget - fits.capacity * per_row
    assert left - per_row < passes.capacity * per_row <= left  # what the budget leaves it, all in memory
    assert len(passes.index) == passes.capacity and passes.stats()["rows_on_disk"] == 50_000 - passes.capacity
    ids = state.restore_source.parts["passes"]["ids"]  # in the order of their last touch
    assert bool((passes.index.find(ids[-passes.capacity:]) >= 0).all())
    assert bool((passes.index.find(ids[:-passes.capacity]) < 0).all())
    state.row_stores.close()
