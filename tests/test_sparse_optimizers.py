"""The sparse optimizers recommendation models train their tables with, in one process: row-wise Adagrad and
FTRL against their formulas, Adagrad and Adam against torch's own classes, each over 100 steps of row-sparse
gradients with duplicates, compiled and eager; the row state (initial values, growth, restore); what is
refused, and where (hyperparameters, tables, checkpoints); and the eager path a shard takes with TorchScript
off, bit-identical to the compiled one."""

import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paramserver.optim import (FTRL, QHM, FunctionalAdagrad, FunctionalAdam, FunctionalFTRL, FunctionalRowWiseAdagrad,
                               RowState, RowWiseAdagrad, ScriptedOptimizer, functional_optim_map,
                               register_functional_optim)
from paramserver.optim.local import ROUNDING_STEP
from paramserver.optim.records import builtin_records
from paramserver.shards.server import ShardState
from paramserver.shards.server import optimizers as owner_optimizers
from paramserver.shards.server.dynamic import DynamicRows
from paramserver.shards.server.hosted import host_rows
from paramserver.shards.server.optimizers import OwnerOptimizer, owner_optimizer_for
from paramserver.shards.server.state import ShardFault
from paramserver._torch_compat import is_remote_refusal
from paramserver.checkpoint.shard_part import select_part
from paramserver.tables import DynamicOptions
from paramserver.tables.id_hash import shard_of
from test_dynamic_tables import equal_to_a_fixed_table  # (this folder is on the tests' path)

ROWS, DIM, STEPS, TOUCHED = 40, 6, 100, 24
#: Every row-wise optimizer's record (``paramserver.optim.records``).
RECORDS = builtin_records()


def row_sparse_gradients(steps=STEPS, rows=ROWS, dim=DIM, dtype=torch.float64, seed=0):
    """Uncoalesced COO gradients touching ``TOUCHED`` random rows a step, some of them twice."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        indices = torch.randint(0, rows, (TOUCHED,), generator=generator)
        values = torch.randn(TOUCHED, dim, generator=generator, dtype=dtype)
        yield torch.sparse_coo_tensor(indices.unsqueeze(0), values, (rows, dim))


def rowwise_adagrad_reference(weights, gradients, lr, eps=1e-8, weight_decay=0.0):
    """FBGEMM's EXACT_ROWWISE_ADAGRAD, row by row, in float64."""
    weights = weights.clone()
    state = torch.zeros(weights.size(0), dtype=torch.float64)
    for gradient in gradients:
        summed = gradient.to_dense()
        for row in gradient.coalesce().indices()[0].tolist():
            g = summed[row] + weight_decay * weights[row]
            state[row] += float((g * g).mean())
            weights[row] -= lr * g / (math.sqrt(state[row]) + eps)
    return weights, state


def ftrl_reference(weights, gradients, lr, lr_power=-0.5, initial=0.1, l1=0.0, l2=0.0, beta=0.0):
    """FTRL-Proximal as TensorFlow/Keras define it, per coordinate of the touched rows, in float64."""
    weights = weights.clone()
    n = torch.full_like(weights, initial)
    z = torch.zeros_like(weights)
    for gradient in gradients:
        summed = gradient.to_dense()
        for row in gradient.coalesce().indices()[0].tolist():
            g, w = summed[row], weights[row]
            n_new = n[row] + g * g
            sigma = (n_new ** -lr_power - n[row] ** -lr_power) / lr
            z[row] += g - sigma * w
            shrunk = (torch.sign(z[row]) * l1 - z[row]) / ((beta + n_new ** -lr_power) / lr + 2 * l2)
            weights[row] = torch.where(z[row].abs() > l1, shrunk, torch.zeros_like(shrunk))
            n[row] = n_new
    return weights, n, z


def build(mode, functional_cls, params, **options):
    return ScriptedOptimizer(functional_cls, params, **options) if mode == "scripted" else \
        functional_cls(params, **options)


def close(actual, expected, rel=1e-6):
    scale = max(1.0, float(expected.abs().max()))
    assert float((actual - expected).abs().max()) <= rel * scale


@pytest.mark.parametrize("mode", ["eager", "scripted"])
@pytest.mark.parametrize("options", [dict(lr=0.3), dict(lr=0.1, eps=1e-6, weight_decay=0.01)], ids=["plain", "decay"])
def test_rowwise_adagrad_follows_fbgemms_formula_with_one_float_of_state_per_row(mode, options):
    weights = torch.randn(ROWS, DIM, dtype=torch.float64)
    expected, expected_state = rowwise_adagrad_reference(weights, list(row_sparse_gradients()), **options)
    params = [weights.clone()]
    optimizer = build(mode, FunctionalRowWiseAdagrad, params, **options)
    for gradient in row_sparse_gradients():
        optimizer.step([gradient])
    close(params[0], expected)
    state = optimizer.state_dict()[0]["sum"]
    assert list(state.shape) == [ROWS]  # one float per row
    close(state, expected_state)


@pytest.mark.parametrize("mode", ["eager", "scripted"])
@pytest.mark.parametrize("options", [dict(lr=0.5), dict(lr=0.2, lr_power=-0.7, initial_accumulator_value=0.3, l1=2.0,
                                                         l2=0.02, beta=0.5)], ids=["plain", "regularized"])
def test_ftrl_follows_the_keras_formula(mode, options):
    weights = torch.randn(ROWS, DIM, dtype=torch.float64)
    reference = dict(options)
    reference["initial"] = reference.pop("initial_accumulator_value", 0.1)
    expected, n, z = ftrl_reference(weights, list(row_sparse_gradients()), **reference)
    params = [weights.clone()]
    optimizer = build(mode, FunctionalFTRL, params, **options)
    for gradient in row_sparse_gradients():
        optimizer.step([gradient])
    close(params[0], expected)
    state = optimizer.state_dict()[0]
    close(state["accumulator"], n)
    close(state["linear"], z)
    if options.get("l1"):
        assert (params[0] == 0).any()  # FTRL's sparsity: rows held at exactly zero


TORCH_CASES = [
    (torch.optim.Adagrad, FunctionalAdagrad, dict(lr=0.2, lr_decay=0.01, initial_accumulator_value=0.1, eps=1e-8)),
    (torch.optim.Adagrad, FunctionalAdagrad, dict(lr=0.2, maximize=True)),
    (torch.optim.SparseAdam, FunctionalAdam, dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6)),
    (torch.optim.SparseAdam, FunctionalAdam, dict(lr=0.01, maximize=True)),
]


@pytest.mark.parametrize("mode", ["eager", "scripted"])
@pytest.mark.parametrize("local_cls, functional_cls, options", TORCH_CASES,
                         ids=["Adagrad", "Adagrad-maximize", "SparseAdam", "SparseAdam-maximize"])
def test_adagrad_and_adam_equal_torchs_classes_on_row_sparse_gradients(mode, local_cls, functional_cls, options):
    dtype = torch.float32  # (float64 agrees as well; float32 is where rounding could part them)
    assert functional_optim_map[local_cls] is functional_cls
    weights = torch.randn(ROWS, DIM, dtype=dtype)
    local_param = torch.nn.Parameter(weights.clone())
    local = local_cls([local_param], **options)
    params = [weights.clone()]
    optimizer = build(mode, functional_cls, params, **options)
    for gradient in row_sparse_gradients(dtype=dtype):
        local_param.grad = gradient.clone()
        local.step()
        optimizer.step([gradient])
    torch.testing.assert_close(params[0], local_param.detach(), rtol=1e-6, atol=1e-7)
    local_state = local.state[local_param]
    for key, value in optimizer.state_dict()[0].items():
        torch.testing.assert_close(value.double(), torch.as_tensor(local_state[key]).double(), rtol=1e-6, atol=1e-7)


def test_adam_on_rows_is_lazy_adam_and_dense_steps_are_torchs_adam():
    weights = torch.randn(ROWS, DIM, dtype=torch.float64)
    sparse_reference = torch.nn.Parameter(weights.clone())
    reference = torch.optim.SparseAdam([sparse_reference], lr=0.01)
    params = [weights.clone()]
    optimizer = ScriptedOptimizer(functional_optim_map[torch.optim.Adam], params, lr=0.01)
    touched = torch.zeros(ROWS, dtype=torch.bool)
    for gradient in row_sparse_gradients(steps=10):
        touched[gradient.coalesce().indices()[0]] = True
        sparse_reference.grad = gradient.clone()
        reference.step()
        optimizer.step([gradient])
    torch.testing.assert_close(params[0], sparse_reference.detach(), rtol=0, atol=0)
    assert torch.equal(params[0][~touched], weights[~touched])  # only touched rows change
    dense_reference = torch.nn.Parameter(weights.clone())
    adam = torch.optim.Adam([dense_reference], lr=0.01, amsgrad=True, weight_decay=0.1)
    dense = [weights.clone()]
    functional = ScriptedOptimizer(functional_optim_map[torch.optim.Adam], dense, lr=0.01, amsgrad=True,
                                   weight_decay=0.1)
    for gradient in row_sparse_gradients(steps=10):
        dense_reference.grad = gradient.to_dense()
        adam.step()
        functional.step([gradient.to_dense()])
    torch.testing.assert_close(dense[0], dense_reference.detach(), rtol=0, atol=0)


def test_adam_counts_a_step_of_a_gradient_without_rows_as_sparse_adam_does():
    """The table's step count is counted once a step, before its rows (``prepare_step``): a row-sparse gradient
    without rows counts one too, as ``torch.optim.SparseAdam`` counts it, so the next bias correction is
    torch's."""
    weights = torch.randn(ROWS, DIM, dtype=torch.float64)
    reference = torch.nn.Parameter(weights.clone())
    sparse_adam = torch.optim.SparseAdam([reference], lr=0.1)
    params = [weights.clone()]
    optimizer = ScriptedOptimizer(functional_optim_map[torch.optim.Adam], params, lr=0.1)
    for rows in ([1, 3], [], [3, 5]):
        gradient = torch.sparse_coo_tensor(torch.tensor(rows, dtype=torch.int64).reshape(1, -1),
                                           torch.ones(len(rows), DIM, dtype=torch.float64), (ROWS, DIM))
        reference.grad = gradient.clone()
        sparse_adam.step()
        optimizer.step([gradient])
    assert torch.equal(params[0], reference.detach())
    assert float(optimizer.state_dict()[0]["step"]) == float(sparse_adam.state[reference]["step"]) == 3


@pytest.mark.parametrize("local_cls, options", [(RowWiseAdagrad, dict(lr=0.3)), (FTRL, dict(lr=0.5, l1=0.01))])
def test_the_local_classes_take_dense_and_sparse_gradients_with_the_functional_update(local_cls, options):
    embedding = torch.nn.Embedding(ROWS, DIM, sparse=True).double()
    bias = torch.nn.Parameter(torch.randn(DIM, dtype=torch.float64))
    optimizer = local_cls([embedding.weight, bias], **options)
    functional = functional_optim_map[local_cls]([embedding.weight.detach().clone(), bias.detach().clone()],
                                                 **options)
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        ids = torch.randint(0, ROWS, (8, 3), generator=generator)
        optimizer.zero_grad()
        (embedding(ids).sum(1) * bias).pow(2).sum().backward()
        functional.step([embedding.weight.grad.clone(), bias.grad.clone()])
        optimizer.step()
    assert torch.equal(embedding.weight.detach(), functional.params[0])
    assert torch.equal(bias.detach(), functional.params[1])
    saved = optimizer.state_dict()
    again = local_cls([embedding.weight, bias], **options)
    again.load_state_dict(saved)
    assert set(again.state_dict()["state"][0]) == set(functional.state.names)


def test_row_state_starts_grows_and_resets_rows_at_their_initial_values():
    table = torch.zeros(4, DIM)
    bias = torch.zeros(3)
    state = RowState("Test", [table, bias], ["sum", "n", "step"], ["row", "element", "scalar"], [0.5, 0.1, 0.0])
    made = state.of(0)
    assert list(made[0].shape) == [4] and list(made[1].shape) == [4, DIM] and made[2].dim() == 0
    assert list(state.of(1)[0].shape) == [3]  # "row" on a 1-D parameter: element-wise
    made[0].fill_(7.0)
    made[1].fill_(7.0)
    table.resize_(6, DIM)
    state.resize_rows(0, 6)
    assert made[0].tolist() == [7.0] * 4 + [0.5] * 2 and (made[1][4:] == 0.1).all()
    state.reset_rows(0, torch.tensor([1]))
    assert made[0].tolist() == [7.0, 0.5, 7.0, 7.0, 0.5, 0.5] and (made[1][1] == 0.1).all()
    saved = state.state_dict()
    restored = RowState("Test", [table, bias], ["sum", "n", "step"], ["row", "element", "scalar"], [0.5, 0.1, 0.0])
    restored.load_state_dict(saved)
    assert torch.equal(restored.of(0)[0], made[0])
    with pytest.raises(ValueError, match=r"sum 0 has shape \[6, 6\] but parameter 0 has shape \[6, 6\]"):
        restored.load_state_dict({0: dict(saved[0], sum=torch.zeros(6, DIM))})
    assert torch.equal(restored.of(0)[0], made[0])  # refused whole: nothing changed


@pytest.mark.parametrize("functional_cls, options, message", [
    (FunctionalRowWiseAdagrad, dict(lr=-0.1), "lr=-0.1"),
    (FunctionalRowWiseAdagrad, dict(lr=0.1, eps=0.0), "eps=0.0"),
    (FunctionalFTRL, dict(lr=0.1, lr_power=0.5), "lr_power=0.5"),
    (FunctionalFTRL, dict(lr=0.1, l1=-1.0), "l1=-1.0"),
    (FunctionalFTRL, dict(lr=0.1, l2=-1.0), "l2=-1.0"),
    (FunctionalFTRL, dict(lr=0.0), "lr=0.0"),
    (FunctionalAdagrad, dict(lr=0.1, eps=0.0), "eps=0.0"),
    (FunctionalAdagrad, dict(lr=-1.0), "lr=-1.0"),
    (FunctionalAdam, dict(lr=0.1, betas=(1.0, 0.9)), r"betas\[0\]=1.0"),
])
def test_hyperparameters_out_of_range_are_refused_naming_the_value(functional_cls, options, message):
    for mode in ("eager", "scripted"):
        with pytest.raises(ValueError, match=message):
            build(mode, functional_cls, [torch.zeros(2, 2)], **options)


def test_a_class_registered_for_tables_must_keep_row_state():
    with pytest.raises(TypeError, match="RowState"):
        register_functional_optim(torch.optim.RMSprop, functional_optim_map[torch.optim.RMSprop])


# -- on a shard: tables, checkpoints, TorchScript off --------------------------------------------------------

def dynamic_table(state: ShardState, name="t@0/1") -> DynamicRows:
    return state.shared_dynamic(name, lambda: DynamicRows(name, DIM, torch.float32, 3, 0.1, DynamicOptions(),
                                                          lambda t: state.lock_for(t)[1], kernel=None,
                                                          huge_pages=state.huge_pages))


def owner(state, params, optimizer_cls, **options) -> OwnerOptimizer:
    return owner_optimizer_for(state, optimizer_cls, params, list(range(len(params))), (), options)


@pytest.mark.parametrize("optimizer_cls, options", [
    (torch.optim.Adagrad, dict(lr=0.5, initial_accumulator_value=0.1)), (RowWiseAdagrad, dict(lr=0.5)),
    (torch.optim.SparseAdam, dict(lr=0.05)), (FTRL, dict(lr=0.5, l1=0.001))],
    ids=["Adagrad", "RowWiseAdagrad", "SparseAdam", "FTRL"])
def test_a_dynamic_table_equals_a_fixed_one_with_state_following_its_rows(optimizer_cls, options):
    # (the lookup paths are covered with QHM and SGD there; the optimizer's side does not depend on them)
    equal_to_a_fixed_table(None, optimizer_cls, options)


def test_a_dynamic_tables_new_rows_start_with_the_optimizers_initial_state():
    state = ShardState()
    rows = dynamic_table(state)
    optimizer = owner(state, [rows.slab], torch.optim.Adagrad, lr=0.1, initial_accumulator_value=0.25)
    ids = torch.arange(5, dtype=torch.int64) * 1_000_003
    rows.lookup(ids, 0)
    optimizer.apply_rows([0], [ids[:2]], [torch.ones(2, DIM)], "test")
    rows.lookup(ids * 7 + 1, 1)  # admitted after the first step: their sums start at 0.25 too
    sums = optimizer.state_dict()[0]["sum"]
    slots = rows.slots_locked(torch.cat([ids[:2], ids[2:], ids * 7 + 1]))
    assert torch.allclose(sums[slots[:2]], torch.full((2, DIM), 1.25))
    assert (sums[slots[2:]] == 0.25).all()


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
@pytest.mark.parametrize("optimizer_cls, options, error, message", [
    (torch.optim.RMSprop, dict(lr=0.1), TypeError, "cannot apply row-sparse gradients"),
    (torch.optim.Adam, dict(lr=0.1, amsgrad=True), ValueError, "amsgrad=True"),
    (torch.optim.Adagrad, dict(lr=0.1, weight_decay=0.01), ValueError, "weight_decay=0.01"),
], ids=["RMSprop", "Adam-amsgrad", "Adagrad-weight-decay"])
def test_a_table_refuses_an_optimizer_that_cannot_apply_its_rows_when_it_is_created(dynamic, optimizer_cls, options,
                                                                                   error, message):
    state = ShardState()
    table = dynamic_table(state).slab if dynamic else host_rows(state, "job.t[0:10]", 10, DIM, torch.float32, 0, 0,
                                                                 shared=True)
    before = table.detach().clone()
    with pytest.raises(error, match=message) as refused:
        owner(state, [table], optimizer_cls, **options)
    assert ("t@0/1" if dynamic else "job.t[0:10]") in str(refused.value)
    assert optimizer_cls.__name__ in str(refused.value)
    assert torch.equal(table.detach(), before)


def test_a_checkpoint_kept_by_another_optimizer_is_refused_naming_both():
    state = ShardState()
    rows = dynamic_table(state)
    ids = torch.arange(3, dtype=torch.int64)
    rows.restore(ids, torch.ones(3, DIM), torch.zeros(3, dtype=torch.int32), "paramserver.optim.qhm.QHM",
                 {"momentum_buffer": torch.zeros(3, DIM)}, [], 0)
    with pytest.raises(ValueError, match=r"t@0/1.*paramserver.optim.qhm.QHM.*torch.optim.adagrad.Adagrad"):
        owner(state, [rows.slab], torch.optim.Adagrad, lr=0.1)
    owner(state, [rows.slab], QHM, lr=0.1,
          momentum=0.9, nu=0.7)  # the same optimizer takes its state


class FailingKernel:
    """An optimizer step whose kernel fails, as one that cannot take row-sparse gradients does."""

    def apply(self, gradients, measure):
        raise RuntimeError("Could not run 'aten::lerp_.Scalar' with arguments from the 'SparseCPU' backend")


def test_a_kernel_failure_in_a_push_is_a_shard_fault_not_a_refusal_and_bad_input_is_refused_first(monkeypatch):
    state = ShardState()
    faults = []
    state.on_fault = faults.append
    table = host_rows(state, "job.t[0:10]", 10, DIM, torch.float32, 0, 0, shared=True)
    with pytest.raises(ValueError, match="dtype"):  # bad input is refused before any kernel runs
        owner(state, [table], torch.optim.Adagrad, lr=0.2).apply_rows([0], [torch.tensor([1])],
                                                                      [torch.ones(1, DIM, dtype=torch.float64)], "test")
    assert not faults
    # (QHM with nu 0 has no fused form, so the native row kernel declines it: its step module runs)
    optimizer = owner(state, [table], QHM, lr=0.1, momentum=0.9, nu=0.0)
    monkeypatch.setattr(optimizer, "_impl", FailingKernel())
    with pytest.raises(ShardFault, match=r"optimizer QHM failed applying a push to 'job.t\[0:10\]'.*lerp_"):
        optimizer.apply_rows([0], [torch.tensor([1])], [torch.ones(1, DIM)], "test")
    assert len(faults) == 1 and not is_remote_refusal(ShardFault(faults[0]))


@pytest.mark.parametrize("optimizer_cls, options", [(record.local[-1], dict(record.example)) for record in RECORDS],
                         ids=[record.name for record in RECORDS])
def test_with_torchscript_off_a_shard_steps_the_same_classes_eagerly_to_the_same_rows(monkeypatch, optimizer_cls,
                                                                                     options):
    def train(scripted: bool):
        monkeypatch.setattr(owner_optimizers, "torchscript_enabled", lambda: scripted)
        state = ShardState()
        rows = dynamic_table(state)
        optimizer = owner(state, [rows.slab], optimizer_cls, **options)
        assert isinstance(optimizer._impl, torch.jit.ScriptModule) == scripted
        generator = torch.Generator().manual_seed(2)
        for step in range(30):
            ids = torch.randint(0, 200, (50,), generator=generator).unique()
            rows.lookup(ids, step)
            optimizer.apply_rows([0], [ids], [torch.randn(ids.numel(), DIM, generator=generator)], "test")
        ids, slots = rows.index.items()
        order = ids.argsort()
        held = slots[order]  # the rows held, by id (the slab's free slots hold nothing)
        return ids[order], rows.slab.detach()[held].clone(), \
            {key: value[held] if value.dim() else value for key, value in optimizer.state_dict()[0].items()}

    scripted_ids, scripted_rows, scripted_state = train(True)
    eager_ids, eager_rows, eager_state = train(False)
    assert torch.equal(eager_ids, scripted_ids)
    assert torch.equal(eager_rows, scripted_rows)
    for key, value in scripted_state.items():
        assert torch.equal(eager_state[key], value)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad"])
def test_a_trainer_job_with_torchscript_off_trains_the_same_rows_as_with_it(tmp_path, optimizer):
    runs = {}
    for scripted in (True, False):
        out = tmp_path / f"{scripted}.pt"
        env = dict(os.environ, PYTORCH_JIT="1" if scripted else "0")
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("shard_job.py")), str(out), optimizer],
                              env=env, capture_output=True, text=True, timeout=150)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[scripted] = torch.load(out)
        assert runs[scripted]["scripted"] == scripted
    compiled, eager = runs[True], runs[False]
    assert torch.equal(eager["losses"], compiled["losses"])
    assert set(eager["rows"]) == set(compiled["rows"]) and len(compiled["rows"]) >= 2
    for name, rows in compiled["rows"].items():
        if isinstance(rows, tuple):  # a dynamic table: its ids and their rows
            assert torch.equal(eager["rows"][name][0], rows[0]) and torch.equal(eager["rows"][name][1], rows[1])
        else:
            assert torch.equal(eager["rows"][name], rows)


def test_one_float_per_row_of_state_is_checkpointed_and_split_with_the_rows_onto_another_shard_count():
    states = [ShardState(), ShardState()]
    parts = [dynamic_table(state) for state in states]
    optimizers = [owner(state, [part.slab], RowWiseAdagrad, lr=0.1) for state, part in zip(states, parts)]
    ids = torch.arange(1, 2_001, dtype=torch.int64) * 7_919
    mine = shard_of(ids, 2)
    for step in range(3):
        for index, (part, optimizer) in enumerate(zip(parts, optimizers)):
            held = ids[mine == index]
            part.lookup(held, step)
            optimizer.apply_rows([0], [held], [torch.full((held.numel(), DIM), step + 1.0)], "test")
    entries = [optimizer.snapshot()[0][0] for optimizer in optimizers]  # as a shard writes its checkpoint part
    assert all(list(entry["state"]["sum"].shape) == [entry["ids"].numel()] for entry in entries)
    expected = {}
    for part, optimizer in zip(parts, optimizers):
        held, slots = part.index.items()
        sums = optimizer.state_dict()[0]["sum"]
        expected.update({i: (part.slab[slot].clone(), sums[slot]) for i, slot in zip(held.tolist(), slots.tolist())})
    restored = set()
    for index in range(3):
        state = ShardState()
        part = dynamic_table(state)
        part.restore(**select_part(entries, index, 3))
        optimizer = owner(state, [part.slab], RowWiseAdagrad, lr=0.1)
        optimizer.load_state_dict({0: part.restored_optimizer_state(optimizer.class_name)})
        held, slots = part.index.items()
        sums = optimizer.state_dict()[0]["sum"]
        for i, slot in zip(held.tolist(), slots.tolist()):
            row, total = expected[i]
            assert torch.equal(part.slab[slot], row) and torch.equal(sums[slot], total)
        restored |= set(held.tolist())
    assert restored == set(expected)


def test_a_local_float16_parameter_rounds_updates_below_half_its_gap_from_one_advancing_stream():
    """200 steps whose updates are each below half float16's gap at 1.5 (2**-10): rounded to nearest, or with
    the same bits every step, most values would never move; from one stream advancing with the steps, nearly
    every value moves, by about what the updates add up to."""
    param = torch.nn.Parameter(torch.full((256, 4), 1.5, dtype=torch.float16))
    optimizer = RowWiseAdagrad([param], lr=2e-4)
    reference = torch.full((256, 4), 1.5, dtype=torch.float32, requires_grad=True)
    exact = RowWiseAdagrad([reference], lr=2e-4)  # the same updates on float32 values
    for _ in range(200):
        for tensor in (param, reference):
            tensor.grad = -torch.ones(tensor.shape, dtype=tensor.dtype)
        optimizer.step()
        exact.step()
    gap = 2.0 ** -10
    total = (reference.detach() - 1.5).mean().item()
    assert 2 * gap < total < 20 * gap  # what the updates add up to; each below half a gap
    moved = param.detach().float() - 1.5
    assert (moved > 0).float().mean().item() > 0.95
    assert abs(moved.mean().item() - total) < 0.2 * total


def test_a_local_optimizer_loaded_from_a_state_dict_steps_on_as_the_one_that_saved_it():
    params = [torch.nn.Parameter(torch.randn(ROWS, DIM, dtype=torch.float64)) for _ in range(2)]
    optimizer = FTRL([params[0]], lr=0.5, l1=0.01)
    gradients = list(row_sparse_gradients(steps=10))
    for step, gradient in enumerate(gradients):
        if step == 5:
            saved = copy.deepcopy(optimizer.state_dict())  # as a checkpoint holds it
            params[1].data.copy_(params[0].detach())
            again = FTRL([params[1]], lr=0.5, l1=0.01)
            again.load_state_dict(saved)
        params[0].grad = gradient
        optimizer.step()
        if step >= 5:
            params[1].grad = gradient.clone()
            again.step()
    assert torch.equal(params[0].detach(), params[1].detach())
    for name, value in optimizer.state_dict()["state"][0].items():
        assert torch.equal(value, again.state_dict()["state"][0][name])


@pytest.mark.parametrize("optimizer_cls, options", [(RowWiseAdagrad, dict(lr=0.05)), (FTRL, dict(lr=0.5, l1=0.01))])
def test_a_local_optimizer_of_a_float16_parameter_loaded_from_a_state_dict_rounds_on_from_the_same_stream(
        optimizer_cls, options):
    """Saved after 5 steps (as a checkpoint holds it), loaded into a fresh optimizer over a copy of the parameter:
    the next steps give the bits of the run that was not interrupted, its float32 state and its rounding steps
    carried over (from step 1 again, the rounding bits would differ).  A state dict saved without rounding steps
    still loads, and steps (its stream from step 1)."""
    param = torch.nn.Parameter(torch.randn(ROWS, DIM).to(torch.float16))
    optimizer = optimizer_cls([param], **options)
    gradients = list(row_sparse_gradients(steps=10, dtype=torch.float16))
    for step, gradient in enumerate(gradients):
        if step == 5:
            saved = copy.deepcopy(optimizer.state_dict())
            copied = torch.nn.Parameter(param.detach().clone())
            again = optimizer_cls([copied], **options)
            again.load_state_dict(saved)
        param.grad = gradient
        optimizer.step()
        if step >= 5:
            copied.grad = gradient.clone()
            again.step()
    assert torch.equal(param.detach(), copied.detach())
    state, loaded = optimizer.state_dict()["state"][0], again.state_dict()["state"][0]
    assert state.keys() == loaded.keys() and state[ROUNDING_STEP] == loaded[ROUNDING_STEP] == 10, (state, loaded)
    for name in (name for name in state if name != ROUNDING_STEP):
        assert state[name].dtype == loaded[name].dtype == torch.float32 and torch.equal(state[name], loaded[name])

    legacy = copy.deepcopy(saved)
    legacy["state"][0].pop(ROUNDING_STEP)
    older = optimizer_cls([torch.nn.Parameter(param.detach().clone())], **options)
    older.load_state_dict(legacy)
    older.param_groups[0]["params"][0].grad = gradients[0].clone()
    older.step()
    assert older.state_dict()["state"][0][ROUNDING_STEP] == 1
