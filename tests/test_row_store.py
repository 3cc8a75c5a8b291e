"""The row store in one process: dynamic tables whose rows evicted for ``capacity`` are kept on disk with their
optimizer state, and come back from there; a table with a store trains to the same rows, optimizer state and
checkpoint as the same table held whole in memory, bit for bit, whatever its capacity; records laid out by the
optimizer's row state; the shard's folder made, checked and removed."""

import pathlib

import pytest
import torch

from paramserver.optim import QHM
from paramserver.optim.rowwise_adagrad import RowWiseAdagrad
from paramserver.optim.registry import functional_optim_map
from paramserver.shards.server import ShardState
from paramserver.shards.server.dynamic import DynamicRows
from paramserver.shards.server.optimizers import OwnerOptimizer
from paramserver.shards.server.row_store.layout import RowLayout
from paramserver.shards.server.row_store.stores import ENGINES, RowStoreOptions, RowStores, check_folder, engine_class
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
          dtype=torch.float32, ttl_steps=None, steps=14, checkpoint_at=None):
    """A dynamic table part trained as a pipelined trainer drives it (step t+1's lookup before step t's push),
    with a row store of ``engine`` under ``tmp_path`` (``None``: none) and ``capacity`` rows in memory; returns
    its checkpoint entry (every row and its state, memory's and the store's), sorted by id, and the part."""
    options = options or dict(lr=0.1)
    state = ShardState()
    tmp_path.mkdir(exist_ok=True)
    stores = RowStores(RowStoreOptions(str(tmp_path), engine), "shard") if engine is not None else None
    name = "t@0/1"
    rows = state.shared_dynamic(name, lambda: DynamicRows(
        name, DIM, dtype, 3, 0.1, DynamicOptions(capacity=capacity, ttl_steps=ttl_steps),
        lambda t: state.lock_for(t)[1], kernel=state.kernels.chosen(), huge_pages=state.huge_pages,
        store=stores.tier(name) if stores is not None else None))
    owner = OwnerOptimizer(optimizer, functional_optim_map[optimizer], [rows.slab], ["t"], (), options, state)
    generator = torch.Generator().manual_seed(1)
    ids = zipf_steps(steps + 1, 300)
    looked = [rows.lookup(ids[0], 0)]
    entries = []
    for step in range(steps):
        looked.append(rows.lookup(ids[step + 1], step + 1))
        gradients = torch.randn(ids[step].numel(), DIM, generator=generator)
        owner.apply_rows([0], [ids[step]], [gradients], "test")
        if checkpoint_at is not None and step == checkpoint_at:
            entries.append(owner.snapshot()[0][0])
    entries.append(owner.snapshot()[0][0])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("optimizer,options", [(RowWiseAdagrad, dict(lr=0.1)),
                                               (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                               (torch.optim.Adam, dict(lr=0.01)),
                                               (QHM, dict(lr=0.1, momentum=0.9, nu=0.7))])
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
