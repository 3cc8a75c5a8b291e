"""The row-wise optimizers' native kernel (paramserver/optim/row_kernel.c) against the torch path.

Every optimizer whose record names a native update, on float32, float16 and bfloat16 rows, each build of the
kernel: a shard's pushes applied by the kernel give the rows and state the torch path (the functional
class's ``step_rows``) gives, bit for bit (``SETTINGS``: both take the same order of arithmetic and correctly
rounded roots); a push split into parts gives the same; ``PARAMSERVER_NATIVE=0`` keeps the torch path.
Single-process (``ShardState`` and ``OwnerOptimizer``, no RPC).
"""

import threading

import pytest
import torch

from paramserver.native import NATIVE_ENV
from paramserver.optim import RowWiseAdagrad
from paramserver.optim.records import RowOptimizer, builtin_records
from paramserver.optim.row_kernel import Rounding, RowKernels, qhm_as_sgd
from paramserver.shards.server import ShardState
from paramserver.shards.server.hosted import host_dynamic, host_rows
from paramserver.shards.server.optimizers import owner_optimizer_for
from paramserver.tables import DynamicOptions

ROWS = 3000
DIM = 40  # five vectors of eight: and no tail
NATIVE = [record for record in builtin_records() if record.native is not None]

#: Per optimizer, settings that reach every branch of its update, and whether the kernel runs them: ``EXACT``
#: (the torch path's rows and state bit for bit: Nesterov momentum, SGD's and QHM's fused form, in the form the
#: torch path takes for the push's size, torch's fused kernel for large pushes and its multi-tensor operations for
#: small ones; row-wise Adagrad's mean square summed in double and rounded once on both; every square root
#: correctly rounded on both, ``optim.kernels.rounded_sqrt``), ``DECLINED`` (settings the kernel has no exact
#: update for: the torch path applies them).  QHM with momentum or nu 0 or direct weight decay has no fused form:
#: the kernel declines it too.
EXACT, DECLINED = "exact", "declined"
SETTINGS = {
    "RowWiseAdagrad": [(dict(lr=0.1), EXACT), (dict(lr=0.1, eps=1e-3, weight_decay=0.01), EXACT)],
    "SGD": [(dict(lr=0.1), EXACT), (dict(lr=0.1, momentum=0.9), EXACT),
            (dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01), EXACT),
            (dict(lr=0.1, momentum=0.9, weight_decay=0.01, maximize=True), EXACT),
            (dict(lr=0.1, momentum=0.9, nesterov=True), EXACT),
            (dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True), EXACT)],
    # QHM's fused form is Nesterov SGD (nu 1: plain momentum); momentum or nu 0 and direct weight decay have none
    "QHM": [(dict(lr=0.1, momentum=0.9, nu=0.7), EXACT), (dict(lr=0.1, momentum=0.9, nu=1.0), EXACT),
            (dict(lr=0.1, momentum=0.8, nu=0.5, weight_decay=0.01), EXACT),
            (dict(lr=0.1, momentum=0.9, nu=0.0), EXACT),
            (dict(lr=0.1, momentum=0.9, nu=0.7, weight_decay=0.01, weight_decay_type="direct"), EXACT)],
    # Row-sparse Adagrad has no weight decay: a table refuses it, as torch.optim.Adagrad does.
    "Adagrad": [(dict(lr=0.1), EXACT), (dict(lr=0.2, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-3), EXACT),
                (dict(lr=0.2, lr_decay=0.5, maximize=True), EXACT)],
    # the accumulator's powers computed exactly (-lr_power 0.5: FunctionalFTRL's root correctly rounded; 1 and 0);
    # another is declined
    "FTRL": [(dict(lr=0.5), EXACT), (dict(lr=0.5, l1=0.001), EXACT),
             (dict(lr=0.3, lr_power=-1.0, initial_accumulator_value=0.0, l1=0.01, l2=0.1, beta=1.0), EXACT),
             (dict(lr=0.05, lr_power=0.0, l2=0.01, beta=0.5), EXACT),
             (dict(lr=0.5, lr_power=-0.25, l1=0.001), DECLINED)],
    # Row-sparse Adam has no amsgrad or weight decay: a table refuses them, as torch.optim.SparseAdam has neither.
    "Adam": [(dict(lr=0.01), EXACT), (dict(lr=0.05, betas=(0.8, 0.99), eps=1e-3), EXACT),
             (dict(lr=0.02, betas=(0.0, 0.5), eps=1e-6, maximize=True), EXACT)],
}
CASES = [pytest.param(record, options, exact, id=f"{record.name}-{'-'.join(f'{k}={v}' for k, v in options.items())}")
         for record in NATIVE for options, exact in SETTINGS[record.name]]
TYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module", params=["baseline", "avx2"])
def build(request) -> str:
    """The ``RowKernels`` choice that runs each build of the kernel that can be had here (skipped where none:
    no compiler, or no AVX2)."""
    kernels = RowKernels("baseline")
    if kernels.build(request.param) is None:
        pytest.skip(f"no {request.param} build of the row kernel here (no C compiler)")
    if request.param == "avx2" and not kernels.build("baseline").cpu_has_avx2():
        pytest.skip("this processor runs no AVX2 and FMA code")
    return "best" if request.param == "avx2" else "baseline"


def variant(choice: str) -> str:
    return "avx2" if choice == "best" else choice


def owner(choice: str, dtype: torch.dtype, record: RowOptimizer, options: dict):
    state = ShardState(row_kernels=RowKernels(choice))
    table = host_rows(state, f"job.t[0:{ROWS}]", ROWS, DIM, dtype, 0, 0, shared=True, init_std=0.1)
    return table, owner_optimizer_for(state, record.local[0], [table], [0], (), options)


def pushes(steps: int = 4):
    """Distinct rows (the driver sums duplicates first) and their gradients: large pushes (torch's fused kernel
    on the torch path) and small ones (its multi-tensor operations), overlapping; the first two sent sorted, as
    trainers send a fixed table's rows (the kernel's step takes them as they come), the others in any order
    (the step module's way sorts them first)."""
    generator = torch.Generator().manual_seed(5)
    for step in range(steps):
        count = 1000 if step % 2 == 0 else 60
        rows = torch.randperm(ROWS, generator=generator)[:count]
        yield rows.sort().values if step % 4 < 2 else rows, torch.randn(count, DIM, generator=generator)


def gap(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each of ``values`` (float32)."""
    magnitude = values.abs()
    spacing = torch.nextafter(magnitude, torch.full_like(magnitude, float("inf"))) - magnitude
    if dtype == torch.float16:
        return (spacing * 8192).clamp(min=2.0 ** -24)
    return spacing * 65536 if dtype == torch.bfloat16 else spacing


def units_apart(before: torch.Tensor, want: torch.Tensor, have: torch.Tensor) -> float:
    """How far ``have`` is from ``want`` in units in the last place of the largest of the value before the
    step, its change and the value after (a difference of one rounding of a term, even where the step cancels
    the value: 0 is bit for bit)."""
    if want.dtype == torch.bool:
        return float((want != have).sum())
    larger = torch.maximum(torch.maximum(before.float().abs(), want.float().abs()), (want.float() - before.float()).abs())
    return float(((have.float() - want.float()).abs() / gap(larger, want.dtype)).max())


def state_tensors(optimizer):
    return optimizer._impl.row_state(0)


@pytest.mark.parametrize("dtype", TYPES, ids=str)
@pytest.mark.parametrize("record, options, exact", CASES)
def test_the_kernels_rows_and_state_are_the_torch_paths_to_the_last_bit(build, record, options, exact, dtype):
    table, reference = owner("torch", dtype, record, options)
    rows, native = owner(build, dtype, record, options)
    for step, (ids, gradients) in enumerate(pushes()):
        before = [tensor.detach().clone() for tensor in [table, *state_tensors(reference)]]
        reference.apply_rows([0], [ids], [gradients], "test")
        native.apply_rows([0], [ids], [gradients], "test")
        assert reference._native is False
        declined = exact == DECLINED or (record.name == "QHM" and qhm_as_sgd(record.bind((), options)) is None)
        assert native._native is False if declined else native._native.kernel.variant == variant(build)
        expected, got = [table, *state_tensors(reference)], [rows, *state_tensors(native)]
        names = ["rows", *record.state_for(record.bind((), options))[0]]
        assert len(got) == len(names)
        for what, old, want, have in zip(names, before, expected, got):
            assert have.dtype == want.dtype and have.shape == want.shape
            if not torch.equal(have, want):
                distance = units_apart(old, want.detach(), have.detach())
                raise AssertionError(f"step {step}: {what} {distance} units in the last place apart")
        for want, have in zip(expected, got):  # each step from the same rows and state: one step's difference
            with torch.no_grad():
                have.copy_(want)
    untouched = torch.ones(ROWS, dtype=torch.bool)
    for ids, _ in pushes():
        untouched[ids] = False
    assert torch.equal(rows[untouched], host_rows(ShardState(), "x", ROWS, DIM, dtype, 0, 0, init_std=0.1)[untouched])


@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_a_push_split_into_parts_on_the_torch_path_gives_the_kernels_rows(build, dtype):
    sgd = next(record for record in NATIVE if record.name == "SGD")
    options = dict(lr=0.1, momentum=0.9, dampening=0.1)
    table, reference = owner("torch", dtype, sgd, options)
    reference._impl.set_parts(3)
    rows, native = owner(build, dtype, sgd, options)
    generator = torch.Generator().manual_seed(6)
    for _ in range(3):  # 2,400 rows of 40: three parts of 32,000 values, each through torch's fused kernel
        ids, gradients = torch.randperm(ROWS, generator=generator)[:2400], torch.randn(2400, DIM, generator=generator)
        reference.apply_rows([0], [ids], [gradients], "test")
        native.apply_rows([0], [ids], [gradients], "test")
        assert torch.equal(table, rows)
        assert all(torch.equal(a, b) for a, b in zip(state_tensors(reference), state_tensors(native)))


@pytest.mark.parametrize("dtype", TYPES, ids=str)
@pytest.mark.parametrize("name, options", [("RowWiseAdagrad", dict(lr=0.1)), ("Adagrad", dict(lr=0.1, lr_decay=0.1)),
                                           ("Adam", dict(lr=0.01, betas=(0.8, 0.99)))])
def test_a_push_the_kernel_applies_in_parts_on_several_threads_gives_the_rows_of_one_part(build, dtype, name, options):
    """The kernel's parts run on the shard's part threads at once, each writing only its rows and their state:
    the rows and state equal one call's, bit for bit (half rows rounded by id; Adagrad's rate and Adam's step
    size from the step counted once, before the parts), and the parts did run apart."""
    record = next(record for record in NATIVE if record.name == name)
    table, whole = owner(build, dtype, record, options)
    rows, split = owner(build, dtype, record, options)
    generator = torch.Generator().manual_seed(8)
    ids, gradients = torch.randperm(ROWS, generator=generator)[:2400], torch.randn(2400, DIM, generator=generator)
    whole.apply_rows([0], [ids], [gradients], "test")
    split.apply_rows([0], [ids], [gradients], "test")  # made: its native step, with one part a push
    native = split._native_rows()
    native.parts = 3  # 2,400 rows of 40: three parts of 32,000 values
    threads = set()
    step = native.kernel.step

    def recording_step(*args):
        threads.add(threading.get_ident())
        step(*args)
    native.kernel = type("Recording", (), {"step": staticmethod(recording_step), "takes": native.kernel.takes,
                                           "rows_increasing": native.kernel.rows_increasing})()
    for _ in range(3):
        ids, gradients = torch.randperm(ROWS, generator=generator)[:2400], torch.randn(2400, DIM, generator=generator)
        whole.apply_rows([0], [ids], [gradients], "test")
        split.apply_rows([0], [ids], [gradients], "test")
        assert torch.equal(table, rows)
        assert all(torch.equal(a, b) for a, b in zip(state_tensors(whole), state_tensors(split)))
    assert len(threads) >= 2  # the calling thread ran one part, the part threads the others


@pytest.mark.parametrize("dtype", TYPES, ids=str)
def test_a_push_sent_sorted_takes_the_kernels_own_way_and_gives_the_rows_of_the_same_push_sent_unsorted(build, dtype):
    """A fixed table's push with increasing rows goes to the kernel as sent (its rows checked in one pass, no
    sparse gradient made); the same push in another order goes the step module's way (sorted first): the same
    rows and state, bit for bit; a row outside the table is refused either way, naming it, nothing changed."""
    sgd = next(record for record in NATIVE if record.name == "SGD")
    options = dict(lr=0.1, momentum=0.9, dampening=0.1)
    table, sorted_way = owner(build, dtype, sgd, options)
    rows, unsorted_way = owner(build, dtype, sgd, options)
    generator = torch.Generator().manual_seed(9)
    sorted_way.apply_rows([0], [torch.arange(4)], [torch.ones(4, DIM)], "test")  # (its native step made)
    unsorted_way.apply_rows([0], [torch.arange(4)], [torch.ones(4, DIM)], "test")
    taken = []
    apply_pushed = sorted_way._native.apply_pushed
    sorted_way._native.apply_pushed = lambda pushed, measure: taken.append(len(pushed)) or apply_pushed(pushed, measure)
    for count in (1000, 60, 2400):
        ids, gradients = torch.randperm(ROWS, generator=generator)[:count], torch.randn(count, DIM, generator=generator)
        order = ids.argsort()
        sorted_way.apply_rows([0], [ids[order]], [gradients[order]], "test")
        unsorted_way.apply_rows([0], [ids], [gradients], "test")
        assert torch.equal(table, rows)
        assert all(torch.equal(a, b) for a, b in zip(state_tensors(sorted_way), state_tensors(unsorted_way)))
    assert taken == [1, 1, 1]
    before = table.clone()
    for outside in (torch.tensor([3, ROWS]), torch.tensor([-1, 3])):
        with pytest.raises(ValueError, match=f"row {outside[0] if outside[0] < 0 else outside[1]} of parameter"):
            sorted_way.apply_rows([0], [outside], [torch.ones(2, DIM)], "test")
    assert torch.equal(table, before) and taken == [1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_dynamic_tables_half_rows_are_rounded_by_id_as_the_torch_path_rounds_them(build, dtype):
    """Half rows of a dynamic table: each row's rounding bits come from its id (``ids`` by slot), so the kernel
    gives the torch path's rows whatever slot the id has and however its rows are split."""
    results = []
    for choice in ("torch", build):
        state = ShardState(row_kernels=RowKernels(choice))
        slab = host_dynamic(state, "job.d", DIM, dtype, 0, 0.1, DynamicOptions(), 0, 1)
        dynamic = state.dynamic_rows(slab)
        optimizer = owner_optimizer_for(state, torch.optim.SGD, [dynamic.slab], [0], (), dict(lr=0.3))
        ids = torch.arange(500) * 7919
        dynamic.lookup(ids, 0)
        for step in range(3):
            gradients = torch.full((500, DIM), 0.001 * (step + 1))
            optimizer.apply_rows([0], [ids[:250]], [gradients[:250]], "test", (1, 2 * step))
            optimizer.apply_rows([0], [ids[250:]], [gradients[250:]], "test", (2, 2 * step))
        results.append(dynamic.lookup(ids, 9).clone())
    assert results[0].dtype == dtype and torch.equal(results[0], results[1])


def test_native_0_keeps_the_torch_path_and_a_record_says_which_optimizers_have_a_native_update(monkeypatch):
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert RowKernels().chosen() is None
    state = ShardState()
    table = host_rows(state, "job.t[0:10]", 10, DIM, torch.float32, 0, 0, shared=True)
    optimizer = owner_optimizer_for(state, RowWiseAdagrad, [table], [0], (), dict(lr=0.1))
    before = table.detach().clone()
    optimizer.apply_rows([0], [torch.tensor([1, 4])], [torch.ones(2, DIM)], "test")
    assert optimizer._native is False and not torch.equal(before, table)
    assert {record.name for record in NATIVE} >= {"RowWiseAdagrad", "SGD"}
    kernel = RowKernels().build("baseline")
    if kernel is not None:
        assert all(record.native in kernel.updates for record in NATIVE)
    with pytest.raises(TypeError, match="native row update"):
        RowOptimizer(name="X", functional=NATIVE[0].functional, local=(), state=None, native="sgd")


def test_the_kernel_declines_settings_whose_rows_it_cannot_give_as_the_torch_path_does():
    kernel = RowKernels("baseline").build("baseline")
    if kernel is None:
        pytest.skip("no build of the row kernel here (no C compiler)")
    ftrl = dict(lr=0.5, l1=0.0, l2=0.0, beta=0.0)
    assert all(kernel.accepts("ftrl", dict(ftrl, lr_power=power)) for power in (-0.5, -1.0, 0.0, -0.0))
    assert not kernel.accepts("ftrl", dict(ftrl, lr_power=-0.25))  # (torch's general pow)
    adagrad = dict(lr=0.1, lr_decay=0.0, eps=1e-10, maximize=False)
    assert kernel.accepts("adagrad", dict(adagrad, weight_decay=0.0))
    assert not kernel.accepts("adagrad", dict(adagrad, weight_decay=0.01))  # (refused on rows anyway)
    adam = dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8, maximize=False)
    assert kernel.accepts("adam", dict(adam, weight_decay=0.0, amsgrad=False))
    assert not kernel.accepts("adam", dict(adam, weight_decay=0.01, amsgrad=False))  # (both refused on rows anyway)
    assert not kernel.accepts("adam", dict(adam, weight_decay=0.0, amsgrad=True))


def test_the_kernel_refuses_arguments_not_laid_out_as_it_reads_them(build):
    kernel = RowKernels(build).build(variant(build))
    param, sums = torch.zeros(10, DIM), torch.zeros(10)
    hyperparameters = dict(lr=0.1, eps=1e-8, weight_decay=0.0)
    for rows, gradients, state in [(torch.tensor([10]), torch.ones(1, DIM), [sums]),
                                   (torch.tensor([1]), torch.ones(1, DIM + 1), [sums]),
                                   (torch.tensor([1]), torch.ones(1, DIM), [torch.zeros(9)])]:
        with pytest.raises(ValueError):
            kernel.step("rowwise_adagrad", param, rows, gradients, state, hyperparameters, Rounding())
    with pytest.raises(ValueError):
        kernel.step("rowwise_adagrad", param.t(), torch.tensor([1]), torch.ones(1, 10), [sums], hyperparameters,
                    Rounding())
    assert torch.equal(param, torch.zeros(10, DIM)) and torch.equal(sums, torch.zeros(10))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("nearest", [False, True], ids=["stochastic", "nearest"])
def test_the_avx2_builds_half_rows_are_the_baseline_builds_whatever_their_width_and_values(dtype, nearest):
    """The AVX2 build converts and rounds half rows eight columns at a time (on the values' bits where they
    allow, the plain way for a row holding a NaN, an infinity, a value past float16's range or of float16's
    subnormal tail) and the last columns of a row one by one: the same bits as the baseline build, which takes
    every column one by one, at widths under, at and past a multiple of eight."""
    kernels = RowKernels("baseline")
    baseline, avx2 = kernels.build("baseline"), kernels.build("avx2")
    if baseline is None or avx2 is None or not baseline.cpu_has_avx2():
        pytest.skip("no AVX2 build of the row kernel here")
    generator = torch.Generator().manual_seed(8)
    specials = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-30, -3e-8, 6e-5, 7e4, -1e5, 3e38])
    for width in (5, 16, 43):
        start = torch.randn(200, width, generator=generator) * 0.01
        odd = torch.randperm(200 * width, generator=generator)[:60]  # a few rows with a value out of the ordinary
        start.view(-1)[odd] = specials[torch.randint(len(specials), (60,), generator=generator)]
        sums = torch.rand(200, generator=generator)
        tables, states = [start.to(dtype) for _ in range(2)], [[sums.clone(), torch.zeros(200, width)] for _ in range(2)]
        for step in range(3):
            rows = torch.randperm(200, generator=generator)[:150]
            gradients = torch.randn(150, width, generator=generator)
            rounding = Rounding(nearest, 1000 + step, 7, None)
            for kernel, table, (sums, buffers) in zip((baseline, avx2), tables, states):
                kernel.step("rowwise_adagrad", table, rows, gradients, [sums], dict(lr=0.1, eps=1e-3, weight_decay=0.01),
                            rounding)
                kernel.step("sgd", table, rows, gradients, [buffers],
                            dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
                            rounding)
        # zero rows at lr 1: the values rounded are the gradients negated, any float32 bits (NaN payloads, float32's
        # subnormals, values below float16's subnormals: rows the AVX2 build rounds again the plain way)
        rows = torch.arange(0, 200, 2)
        for table in tables:
            table[rows] = 0
        for step in range(3):
            gradients = torch.randint(-2 ** 31, 2 ** 31, (100, width), generator=generator, dtype=torch.int32)
            for kernel, table in zip((baseline, avx2), tables):
                kernel.step("sgd", table, rows, gradients.view(torch.float32), [], dict(lr=1.0, momentum=0.0, dampening=0.0,
                            weight_decay=0.0, nesterov=False, maximize=False), Rounding(nearest, 2000 + step, 7, None))
        assert torch.equal(tables[0].view(torch.int16), tables[1].view(torch.int16))
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(states[0], states[1]))
