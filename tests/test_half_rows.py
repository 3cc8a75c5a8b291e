"""Half-precision rows: float16 and bfloat16 tables, updated in float32 and rounded back.

The rounding kernel (unbiased, reproducible, small updates accumulate), the row-sparse driver's half
parameters for every optimizer (float32 state, compiled equal to eager, close to a float32 run), the
shard's side (hosting, pushes in float32 or bfloat16, refusals naming the table and the types, restoring
a checkpoint of another type), the trainer side's upcast, and serving's pooling.  Single process.
"""

import pytest
import torch

from paramserver import Table
from paramserver.checkpoint.model import ModelDescription, describe_model
from paramserver.checkpoint.live_export import TableRows
from paramserver.checkpoint.shard_part import CheckpointSource
from paramserver.checkpoint.storage import CheckpointStore, save_tensors
from paramserver.optim import QHM, FunctionalRowWiseAdagrad, FunctionalSGD, RowWiseAdagrad, ScriptedOptimizer
from paramserver.optim.records import builtin_records
from paramserver.optim.rounding import fmix32, fmix32_, round_rows, rounding_bits, stream_seed
from paramserver.serving import DynamicTable, FixedTable
from paramserver.shards.client.collection import check_push_dtype
from paramserver.shards.client.embedding import computed
from paramserver.shards.server import ShardState
from paramserver.shards.server.hosted import host_dynamic, host_rows
from paramserver.shards.server.optimizers import owner_optimizer_for
from paramserver.tables import DynamicOptions
from paramserver.tables.id_hash import shard_of

HALVES = [torch.float16, torch.bfloat16]
DIM = 8

#: Every optimizer that takes half-precision rows (its record's ``half_rows``), with its record's example settings.
FUNCTIONAL = [(record.functional, dict(record.example)) for record in builtin_records() if record.half_rows]


def sparse(rows, values, shape):
    return torch.sparse_coo_tensor(torch.tensor([rows]), values, shape, check_invariants=True)


# -- the rounding kernel ------------------------------------------------------------------------------------------

def neighbours(value: float, dtype: torch.dtype):
    """The two values of ``dtype`` around float32 ``value`` (the same one twice if it is one)."""
    nearest = torch.tensor(value).to(dtype)
    if nearest.float().item() == torch.tensor(value).item():
        return nearest.float().item(), nearest.float().item()
    other = torch.nextafter(nearest, torch.tensor(-float("inf") if nearest.float() > value else float("inf"),
                                                  dtype=dtype))
    return tuple(sorted((nearest.float().item(), other.float().item())))


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("value", [0.01, -0.37, 3e-6, 1e-7, -2e-5, 1234.5, 0.125 * (1 - 2 ** -24), 1.0 + 2 ** -20,
                                   -(2 ** -26) * 1.7, 0.5])
def test_stochastic_rounding_lands_on_the_two_neighbours_and_is_unbiased(dtype, value):
    """200,000 roundings of one value (each row its own bits): only its two neighbours, and their mean the value
    within 5 standard deviations of a mean of such draws (plus the 2**-24 steps the draws come in), for values
    whose share of the gap is large, small or nearly 1, subnormal, and exactly representable."""
    value = torch.tensor(value).item()  # as float32 holds it
    count = 200_000
    rounded = round_rows(torch.full((count, 1), value), dtype, False, stream_seed(7, 1), torch.arange(count))
    assert rounded.dtype == dtype
    low, high = neighbours(value, dtype)
    assert set(rounded.float().unique().tolist()) <= {low, high}
    if low == high:
        return
    gap, share = high - low, (value - low) / (high - low)
    bound = 5 * gap * (share * (1 - share) / count) ** 0.5 + gap * 2 ** -24
    assert abs(rounded.float().double().mean().item() - value) <= bound


def ids(count: int) -> torch.Tensor:
    return torch.arange(count, dtype=torch.int64)


def test_rounding_is_reproducible_from_its_table_step_and_rows_and_differs_between_them():
    values = torch.randn(1_000, DIM)
    first = round_rows(values, torch.float16, False, stream_seed(3, 5), ids(1_000))
    assert torch.equal(first, round_rows(values, torch.float16, False, stream_seed(3, 5), ids(1_000)))
    for other in (stream_seed(3, 6), stream_seed(4, 5)):
        assert not torch.equal(first, round_rows(values, torch.float16, False, other, ids(1_000)))
    assert not torch.equal(first, round_rows(values, torch.float16, False, stream_seed(3, 5), ids(1_000) + 1))
    compiled = torch.jit.script(round_rows)
    for dtype in HALVES:
        assert torch.equal(compiled(values, dtype, False, stream_seed(3, 5), ids(1_000)),
                           round_rows(values, dtype, False, stream_seed(3, 5), ids(1_000)))


def test_each_rows_bits_depend_on_its_id_only_so_any_split_of_the_rows_gives_the_same_bits():
    rows = torch.tensor([0, 1, 7, 2 ** 31, 2 ** 40 + 3, -5])
    whole = rounding_bits(stream_seed(9, 2), rows, DIM)
    for part in ([0, 1], [2, 3, 4], [5]):
        assert torch.equal(rounding_bits(stream_seed(9, 2), rows[part], DIM), whole[part])
    assert len({tuple(row) for row in whole.tolist()}) == len(rows)


def test_the_rounding_bits_are_murmur3s_finalizer_over_the_key_words_in_uint32_arithmetic():
    """MurmurHash3's ``fmix32`` (its published value at 1, and pinned ones), and the vectorised hash equal to
    the scalar one word for word, edge words included: what a native kernel reproduces with ``uint32_t``."""
    assert [fmix32(word) for word in (0, 1, 0xFFFFFFFF, 0x12345678)] == [0, 0x514E28B7, 0x81F16F39, 0xE37CD1BC]
    generator = torch.Generator().manual_seed(0)
    words = [0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1] + \
        torch.randint(0, 2 ** 32, (500,), generator=generator, dtype=torch.int64).tolist()
    signed = torch.tensor([word - 2 ** 32 if word >= 2 ** 31 else word for word in words], dtype=torch.int32)
    assert [word & 0xFFFFFFFF for word in fmix32_(signed).tolist()] == [fmix32(word) for word in words]
    row_ids = torch.tensor([0, 12, 2 ** 33 + 5, -1])
    seed = stream_seed(0xCAFE, 17)
    assert seed == fmix32(fmix32(0xCAFE) ^ 17)

    def expected(row: int, column: int) -> int:
        lo, hi = row & 0xFFFFFFFF, (row >> 32) & 0xFFFFFFFF
        row_word = fmix32(seed ^ lo ^ ((hi * 0x9E3779B9) & 0xFFFFFFFF))
        return fmix32(row_word ^ (((column + 1) * 0x9E3779B9) & 0xFFFFFFFF))
    assert [[word & 0xFFFFFFFF for word in row] for row in rounding_bits(seed, row_ids, 3).tolist()] == \
        [[expected(row, column) for column in range(3)] for row in row_ids.tolist()]


def test_a_draws_bits_are_uniform_and_independent_across_rows_columns_and_steps():
    """24-bit draws of 1000 x 64 values: their mean and variance those of a uniform draw, every bit of the
    words fair, no correlation between neighbouring rows, columns or steps (within 6 standard deviations)."""
    rows = torch.arange(1_000) * 3 + 11
    draws = [(rounding_bits(stream_seed(5, step), rows, 64) & 0xFFFFFF).double() / 2 ** 24 for step in (1, 2)]
    count = draws[0].numel()
    assert abs(draws[0].mean().item() - 0.5) < 6 * (1 / 12 / count) ** 0.5
    assert abs(draws[0].var().item() - 1 / 12) < 6 * (1 / 180 / count) ** 0.5
    bits = rounding_bits(stream_seed(5, 1), rows, 64)
    for bit in range(32):
        share = ((bits >> bit) & 1).double().mean().item()
        assert abs(share - 0.5) < 6 * (0.25 / count) ** 0.5

    def correlation(a, b):
        a, b = a - a.mean(), b - b.mean()
        return ((a * b).mean() / (a.std() * b.std())).item()
    for a, b in ((draws[0][1:], draws[0][:-1]), (draws[0][:, 1:], draws[0][:, :-1]), (draws[0], draws[1])):
        assert abs(correlation(a, b)) < 6 / a.numel() ** 0.5


def test_rounding_keeps_infinities_nans_and_signed_zeros_and_leaves_float32_alone():
    inf = float("inf")
    special = torch.tensor([inf, -inf, 0.0, -0.0])
    for dtype in HALVES:
        rounded = round_rows(special.view(1, 4), dtype, False, 0, ids(1)).view(4)
        assert rounded.float().tolist() == special.tolist()
        assert torch.signbit(rounded).tolist() == [False, True, False, True]
        assert round_rows(torch.tensor([[float("nan")]]), dtype, False, 0, ids(1)).isnan().all()
    beyond = torch.tensor([[1e9, -1e9, 3.4e38]])  # beyond float16's range: infinite, as to nearest
    assert round_rows(beyond, torch.float16, False, 0, ids(1)).float().tolist() == [[inf, -inf, inf]]
    values = torch.randn(5, 2)
    assert round_rows(values, torch.float32, False, 0, ids(5)) is values


def test_nearest_rounding_is_torchs_own_conversion():
    values = torch.randn(100, DIM) * 100
    for dtype in HALVES:
        assert torch.equal(round_rows(values, dtype, True, 0, ids(100)), values.to(dtype))


def test_small_updates_accumulate_with_stochastic_rounding_and_are_lost_to_nearest():
    results = {}
    for nearest in (True, False):
        row = torch.ones(4_000, 1, dtype=torch.float16)
        for step in range(200):  # each step adds 1e-4, under half float16's gap at 1.0 (about 4.9e-4)
            row = round_rows(row.float() + 1e-4, torch.float16, nearest, stream_seed(1, step), ids(4_000))
        results[nearest] = row.float().mean().item()
    assert results[True] == 1.0
    assert results[False] == pytest.approx(1.02, abs=0.002)


# -- the row-sparse driver -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("functional_cls, options", FUNCTIONAL, ids=[cls.__name__ for cls, _ in FUNCTIONAL])
def test_every_optimizer_updates_half_rows_in_float32_close_to_float32_rows(functional_cls, options, dtype):
    torch.manual_seed(0)
    start = torch.randn(50, DIM)
    half, full = start.to(dtype), start.to(dtype).float()
    optimizer, reference = functional_cls([half], **options), functional_cls([full], **options)
    for step in range(30):
        rows = sorted(torch.randperm(50)[:10].tolist())
        gradient = sparse(rows, torch.randn(10, DIM), (50, DIM))
        optimizer.step([gradient])
        reference.step([gradient])
    assert half.dtype == dtype
    for kind in optimizer.state.of(0):
        assert kind.dtype in (torch.float32, torch.bool)
    gap = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    assert (half.float() - full).abs().max().item() <= 30 * gap * full.abs().max().item()


@pytest.mark.parametrize("functional_cls, options", FUNCTIONAL, ids=[cls.__name__ for cls, _ in FUNCTIONAL])
def test_a_compiled_step_gives_the_same_half_rows_as_an_eager_one(functional_cls, options):
    compiled_rows, eager_rows = torch.randn(40, DIM).half(), None
    eager_rows = compiled_rows.clone()
    compiled, eager = ScriptedOptimizer(functional_cls, [compiled_rows], **options), functional_cls([eager_rows],
                                                                                                   **options)
    for step in range(5):
        gradient = sparse([1, 4, 9, 30], torch.randn(4, DIM), (40, DIM))
        compiled.step([gradient])
        eager.step([gradient])
    assert torch.equal(compiled_rows, eager_rows)


def test_a_dense_gradient_of_half_rows_touches_every_row_and_takes_float32_or_its_own_type():
    rows = torch.zeros(6, DIM, dtype=torch.bfloat16)
    optimizer = FunctionalRowWiseAdagrad([rows], lr=0.5)
    optimizer.step([torch.ones(6, DIM)])
    optimizer.step([torch.ones(6, DIM, dtype=torch.bfloat16)])
    assert rows.dtype == torch.bfloat16 and (rows < 0).all()
    with pytest.raises(ValueError, match="dtype torch.float64"):
        optimizer.step([torch.ones(6, DIM, dtype=torch.float64)])


def test_nearest_rounding_is_chosen_per_parameter():
    rows = [torch.ones(4, DIM, dtype=torch.float16) for _ in range(2)]
    optimizer = FunctionalSGD(rows, lr=1.0)
    optimizer.state.set_rounding(0, 5, True)
    for _ in range(100):
        optimizer.step([torch.full((4, DIM), -1e-4), torch.full((4, DIM), -1e-4)])
    assert (rows[0] == 1.0).all()  # every update of 1e-4 lost to nearest
    assert rows[1].float().mean().item() == pytest.approx(1.01, abs=0.002)


# -- the shard's side --------------------------------------------------------------------------------------------------

def owner(state, params, optimizer_cls, **options):
    return owner_optimizer_for(state, optimizer_cls, params, list(range(len(params))), (), options)


@pytest.mark.parametrize("dtype", HALVES)
def test_a_shard_hosts_half_rows_and_applies_float32_and_bfloat16_pushes_with_float32_state(dtype):
    state = ShardState()
    table = host_rows(state, "job.t[0:100]", 100, DIM, dtype, 0, 0, shared=True, init_std=0.1)
    assert table.dtype == dtype
    reference = host_rows(ShardState(), "job.t[0:100]", 100, DIM, torch.float32, 0, 0, shared=True, init_std=0.1)
    assert torch.equal(table, reference.to(dtype))  # the same draw, stored in the table's type
    optimizer = owner(state, [table], RowWiseAdagrad, lr=0.1)
    before = table.detach().clone()
    optimizer.apply_rows([0], [torch.tensor([3, 7])], [torch.ones(2, DIM)], "test")
    optimizer.apply_rows([0], [torch.tensor([3, 9])], [torch.ones(2, DIM, dtype=torch.bfloat16)], "test")
    changed = (table != before).any(1).nonzero().view(-1).tolist()
    assert changed == [3, 7, 9] and table.dtype == dtype
    assert optimizer.state_dict()[0]["sum"].dtype == torch.float32


def test_a_shards_rounding_is_seeded_by_the_table_so_the_same_pushes_give_the_same_rows():
    results = []
    for _ in range(2):
        state = ShardState()
        table = host_rows(state, "job.t[0:50]", 50, DIM, torch.float16, 0, 0, shared=True)
        optimizer = owner(state, [table], QHM, lr=0.3, momentum=0.9, nu=0.7)
        for step in range(5):
            optimizer.apply_rows([0], [torch.arange(10) * 3], [torch.full((10, DIM), 0.01 * step)], "test", (1, step))
        results.append(table.detach().clone())
    assert torch.equal(results[0], results[1])


def test_a_dynamic_tables_half_rows_are_updated_with_float32_state():
    state = ShardState()
    slab = host_dynamic(state, "job.d", DIM, torch.bfloat16, 0, 0.1, DynamicOptions(), 0, 1)
    rows = state.dynamic_rows(slab)
    ids = torch.tensor([11, 22, 33])
    assert rows.lookup(ids, 0).dtype == torch.bfloat16
    optimizer = owner(state, [rows.slab], torch.optim.Adagrad, lr=0.5)
    before = rows.lookup(ids, 1).clone()
    optimizer.apply_rows([0], [ids], [torch.ones(3, DIM)], "test")
    after = rows.lookup(ids, 2)
    assert after.dtype == torch.bfloat16 and (after < before).all()
    assert optimizer.state_dict()[0]["sum"].dtype == torch.float32


def test_a_half_table_refuses_an_optimizer_that_cannot_round_naming_the_table_and_types():
    state = ShardState()
    table = host_rows(state, "job.t[0:10]", 10, DIM, torch.float16, 0, 0, shared=True)
    with pytest.raises(TypeError, match=r"job.t\[0:10\].*torch.float16.*RMSprop.*round"):
        owner(state, [table], torch.optim.RMSprop, lr=0.1)
    assert torch.equal(table, host_rows(ShardState(), "job.t[0:10]", 10, DIM, torch.float16, 0, 0, shared=True))


@pytest.mark.parametrize("make", [
    lambda state: host_rows(state, "job.t[0:10]", 10, DIM, torch.float64, 0, 0, shared=True),
    lambda state: host_dynamic(state, "job.d", DIM, torch.int8, 0, 0.1, DynamicOptions(), 0, 1),
    lambda state: host_rows(state, "job.t[0:10]", 10, DIM, torch.float16, 0, 0, shared=True, rounding="up")])
def test_a_row_type_or_rounding_a_shard_does_not_keep_is_refused_naming_the_table(make):
    state = ShardState()
    with pytest.raises(ValueError, match=r"table 'job\.(t\[0:10\]|d)'.*(float64|int8|'up')"):
        make(state)
    assert state.shared_tables() == {}


def checkpoint_of(tmp_path, dtype: torch.dtype, convert_rows: bool = False) -> CheckpointSource:
    store = CheckpointStore(tmp_path)
    directory = store.new_directory(10)
    part = save_tensors(directory / "shard-shard0.pt", {"format": 1, "shard": "shard0", "tables": {
        "job.t[0:4]": {"value": torch.linspace(-1, 1, 4 * DIM).view(4, DIM).to(dtype), "optimizer": "",
                       "state": {}}}})
    return CheckpointSource(store.commit(directory, [part], 10, {}), convert_rows=convert_rows)


@pytest.mark.parametrize("held, wanted", [(torch.float32, torch.float16), (torch.float16, torch.float32),
                                          (torch.bfloat16, torch.float16)])
def test_restoring_rows_of_another_type_is_refused_naming_table_and_types_unless_converting(tmp_path, held, wanted):
    state = ShardState(restore_source=checkpoint_of(tmp_path / "refused", held))
    with pytest.raises(ValueError, match=rf"table 'job.t'.*holds its rows as {held}.*are {wanted}.*--convert-rows"):
        host_rows(state, "job.t[0:4]", 4, DIM, wanted, 0, 0, shared=True)
    assert state.shared_tables() == {}
    state = ShardState(restore_source=checkpoint_of(tmp_path / "converted", held, convert_rows=True))
    rows = host_rows(state, "job.t[0:4]", 4, DIM, wanted, 0, 0, shared=True)
    assert rows.dtype == wanted
    assert torch.equal(rows, torch.linspace(-1, 1, 4 * DIM).view(4, DIM).to(held).to(wanted))


def test_restoring_rows_of_the_same_half_type_keeps_them_bit_for_bit(tmp_path):
    state = ShardState(restore_source=checkpoint_of(tmp_path, torch.bfloat16))
    rows = host_rows(state, "job.t[0:4]", 4, DIM, torch.bfloat16, 0, 0, shared=True)
    assert torch.equal(rows, torch.linspace(-1, 1, 4 * DIM).view(4, DIM).to(torch.bfloat16))


# -- the trainer's and serving's side ---------------------------------------------------------------------------------

def test_a_table_takes_float32_float16_and_bfloat16_rows_and_refuses_other_types_and_roundings():
    assert Table(10, 4).dtype == torch.float32
    assert Table(None, 4, dtype=torch.bfloat16, rounding="nearest").rounding == "nearest"
    assert Table(10, 4, dtype=torch.float16) != Table(10, 4)  # workers naming a table agree on its type
    with pytest.raises(ValueError, match="dtype must be torch.float32, torch.float16 or torch.bfloat16.*float64"):
        Table(10, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="rounding must be one of.*'up'"):
        Table(10, 4, dtype=torch.float16, rounding="up")
    with pytest.raises(ValueError, match="push_dtype.*torch.float16"):
        check_push_dtype(torch.float16)


def test_half_rows_are_upcast_where_they_arrive():
    rows = torch.randn(3, DIM).half()
    assert computed(rows).dtype == torch.float32 and torch.equal(computed(rows), rows.float())
    full = torch.randn(3, DIM)
    assert computed(full) is full


def test_a_models_description_keeps_each_tables_row_type_as_json():
    import json
    model = describe_model("job", {"a": Table(10, 4, dtype=torch.float16), "b": Table(None, 4)}, torch.nn.Linear(1, 1))
    read = ModelDescription.from_dense_part({"model": json.loads(json.dumps(model))}, "here")
    assert read.tables["a"].dtype == torch.float16 and read.tables["b"].dtype == torch.float32
    legacy = json.loads(json.dumps(model))
    del legacy["tables"]["a"]["dtype"]  # written before tables had a type
    assert ModelDescription.from_dense_part({"model": legacy}, "here").tables["a"].dtype == torch.float32


@pytest.mark.parametrize("dtype", HALVES)
def test_serving_pools_half_rows_in_float32_like_the_float32_rows(dtype):
    weight = torch.randn(20, DIM).to(dtype)
    ids = torch.tensor([[1, 2, 3], [4, 4, 19]])
    for mode in ("sum", "mean"):
        expected = torch.nn.functional.embedding_bag(ids, weight.float(), mode=mode)
        served = FixedTable("t", weight, mode)(ids)
        assert served.dtype == torch.float32 and torch.allclose(served, expected)
        dynamic = DynamicTable("d", torch.arange(20) * 10, weight, mode)(ids * 10)
        assert dynamic.dtype == torch.float32 and torch.allclose(dynamic, expected)
    rows = TableRows("t", DIM, 20, dtype)
    rows.apply("job.t[0:20]", {"whole": True, "values": weight.float()})
    assert rows.weight.dtype == dtype and torch.equal(rows.weight, weight)


def test_half_rows_restore_onto_another_cut_of_the_table(tmp_path):
    """Two shards' parts of a float16 table, read back as the middle rows (a restore onto another shard count)."""
    store = CheckpointStore(tmp_path)
    directory = store.new_directory(10)
    rows = (torch.linspace(-1, 1, 8 * DIM).view(8, DIM) / 3).to(torch.float16)
    parts = [save_tensors(directory / f"shard-shard{index}.pt", {"format": 1, "shard": f"shard{index}", "tables": {
        f"job.t[{start}:{start + 4}]": {"value": rows[start:start + 4].clone(), "optimizer": "", "state": {}}}})
        for index, start in enumerate((0, 4))]
    state = ShardState(restore_source=CheckpointSource(store.commit(directory, parts, 10, {})))
    middle = host_rows(state, "job.t[2:6]", 4, DIM, torch.float16, 0, 2, shared=True)
    assert middle.dtype == torch.float16 and torch.equal(middle, rows[2:6])


def cut_pushes(count: int):
    generator = torch.Generator().manual_seed(3)
    return [(torch.randperm(count, generator=generator)[:count * 3 // 5].sort().values,
             torch.randn(count * 3 // 5, DIM, generator=generator) * 0.01) for _ in range(4)]


@pytest.mark.parametrize("dtype", HALVES)
def test_a_row_split_tables_half_rows_are_the_same_on_one_shard_or_cut_over_two(dtype):
    """The same pushes to a table hosted whole and cut by rows over two shards (each shard pushed its rows of
    every push): the same rows, bit for bit, as each row is rounded with the bits of its id in the table."""
    rows, pushes = 40, cut_pushes(40)
    start_rows = torch.randn(rows, DIM, generator=torch.Generator().manual_seed(4)).to(dtype)

    def trained(ranges):
        tables = []
        for start, stop in ranges:
            state = ShardState()
            table = host_rows(state, f"job.t[{start}:{stop}]", stop - start, DIM, dtype, 0, start, shared=True)
            with torch.no_grad():
                table.copy_(start_rows[start:stop])
            optimizer = owner(state, [table], QHM, lr=0.3, momentum=0.9, nu=0.7)
            for step, (ids, gradients) in enumerate(pushes):
                mine = ((ids >= start) & (ids < stop)).nonzero().view(-1)
                assert mine.numel() > 0  # every shard steps every push: the step numbers agree
                optimizer.apply_rows([0], [ids[mine] - start], [gradients[mine]], "test", (1, step))
            tables.append(table.detach().clone())
        return torch.cat(tables)
    whole = trained([(0, rows)])
    assert not torch.equal(whole, start_rows)
    assert torch.equal(whole, trained([(0, 25), (25, rows)]))


@pytest.mark.parametrize("dtype", HALVES)
def test_a_dynamic_tables_half_rows_are_the_same_on_one_shard_or_two(dtype):
    """A dynamic table's ids served by one shard or by two (their slots differing): the same rows, bit for bit,
    as each row is rounded with the bits of its id."""
    table_ids = torch.arange(30) * 1_000_003 + 2 ** 40
    pushes = [(table_ids[ids], gradients) for ids, gradients in cut_pushes(30)]

    def trained(count: int) -> torch.Tensor:
        found = torch.zeros(table_ids.numel(), DIM, dtype=dtype)
        for index in range(count):
            state = ShardState()
            rows = state.dynamic_rows(host_dynamic(state, "job.d", DIM, dtype, 0, 0.1, DynamicOptions(), index,
                                                   count))
            optimizer = owner(state, [rows.slab], RowWiseAdagrad, lr=0.1)
            for step, (ids, gradients) in enumerate(pushes):
                mine = (shard_of(ids, count) == index).nonzero().view(-1)
                assert mine.numel() > 0  # every shard steps every push: the step numbers agree
                mine = mine.flip(0)  # admitted in another order than on one shard: other slots
                rows.lookup(ids[mine], step)
                optimizer.apply_rows([0], [ids[mine]], [gradients[mine]], "test", (1, step))
            held = shard_of(table_ids, count) == index
            found[held] = rows.lookup(table_ids[held], -1)
        return found
    one = trained(1)
    assert torch.equal(one, trained(2))


@pytest.mark.parametrize("dtype", HALVES)
def test_a_shard_restored_from_a_state_dict_rounds_on_with_the_steps_it_had(dtype):
    """The optimizer state of half-precision rows holds the steps that rounded them: an owner restored from the
    rows and that state steps on bit for bit as the one that saved it (not with the bits of its first steps
    again); a state dict without the count still loads."""
    pushes = cut_pushes(40)

    def fresh():
        state = ShardState()
        table = host_rows(state, "job.t[0:40]", 40, DIM, dtype, 0, 0, shared=True)
        return table, owner(state, [table], RowWiseAdagrad, lr=0.1)
    table, saver = fresh()
    for step, (ids, gradients) in enumerate(pushes[:3]):
        saver.apply_rows([0], [ids], [gradients], "test", (1, step))
    saved = saver.state_dict()
    assert saved[0]["rounding_step"].item() == 3
    restored_table, restored = fresh()
    with torch.no_grad():
        restored_table.copy_(table)
    restored.load_state_dict(saved)
    for optimizer in (saver, restored):
        optimizer.apply_rows([0], [pushes[3][0]], [pushes[3][1]], "test", (1, 3))
    assert torch.equal(table, restored_table)
    legacy_table, legacy = fresh()
    legacy.load_state_dict({0: {key: value for key, value in saved[0].items() if key != "rounding_step"}})
    assert legacy.state_dict()[0]["rounding_step"].item() == 0
