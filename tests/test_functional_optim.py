"""FunctionalQHM and FunctionalSGD: trajectories against the local optimizers,
None gradients, bad input, row-sparse steps and state dicts.  Every test runs
twice: as plain Python and compiled with TorchScript (``build_functional``)."""

import pytest
import torch

from paramserver.optim import QHM, FunctionalQHM, FunctionalSGD

QHM_CONFIGS = [
    dict(lr=0.1, momentum=0.9, nu=0.7),
    dict(lr=0.1, momentum=0.9, nu=1.0),
    dict(lr=0.1, momentum=0.9, nu=0.0),
    dict(lr=0.1, momentum=0.0, nu=0.7),
    dict(lr=0.05, momentum=0.999, nu=0.7, weight_decay=0.01),
    dict(lr=0.1, momentum=0.9, nu=0.7, weight_decay=0.05, weight_decay_type="direct"),
]
SGD_CONFIGS = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True, weight_decay=0.01),
]
LOCAL_OF = {FunctionalQHM: QHM, FunctionalSGD: torch.optim.SGD}
config_id = lambda c: ",".join(f"{k}={v}" for k, v in c.items())  # noqa: E731
ALL = [(FunctionalQHM, c) for c in QHM_CONFIGS] + [(FunctionalSGD, c) for c in SGD_CONFIGS]
ALL_IDS = [f"{cls.__name__}({config_id(c)})" for cls, c in ALL]


def trajectory_gap(build, functional_cls, config, dtype, steps=100, count=3, shape=(20, 5)):
    """Largest |difference| between local and functional parameters after ``steps``."""
    local_params = [torch.nn.Parameter(torch.randn(shape, dtype=dtype)) for _ in range(count)]
    params = [p.detach().clone() for p in local_params]
    local = LOCAL_OF[functional_cls](local_params, **config)
    functional = build(functional_cls, params, **config)
    for step in range(steps):
        grads = [None if (step + i) % 7 == 0 else torch.randn(shape, dtype=dtype) for i in range(count)]
        for p, g in zip(local_params, grads):
            p.grad = None if g is None else g.clone()
        local.step()
        functional.step(grads)
    return local_params, params


@pytest.mark.parametrize("functional_cls, config", ALL, ids=ALL_IDS)
def test_trajectory_matches_local_optimizer_float64(build_functional, functional_cls, config):
    # Same math: in float64 the trajectories agree far below 1e-6.
    expected, actual = trajectory_gap(build_functional, functional_cls, config, torch.float64)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e.detach(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("functional_cls, config", ALL, ids=ALL_IDS)
def test_trajectory_matches_local_optimizer_float32(build_functional, functional_cls, config):
    # FunctionalQHM computes QHM as one fused pass over a rescaled momentum
    # buffer; in float32 that rounds differently from the reference's four
    # passes, by about an ulp of the values involved per step.  The bound is
    # 1e-6 of the tensor's scale (its largest magnitude, at least 1).
    expected, actual = trajectory_gap(build_functional, functional_cls, config, torch.float32)
    for e, a in zip(expected, actual):
        scale = max(1.0, e.detach().abs().max().item())
        torch.testing.assert_close(a, e.detach(), rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.parametrize("functional_cls, config", [(FunctionalQHM, QHM_CONFIGS[0]), (FunctionalSGD, SGD_CONFIGS[1])])
def test_none_gradient_leaves_parameter_and_state_untouched(build_functional, functional_cls, config):
    params = [torch.randn(4, 3), torch.randn(5)]
    before = [p.clone() for p in params]
    optimizer = build_functional(functional_cls, params, **config)
    optimizer.step([torch.randn(4, 3), None])
    assert torch.equal(params[1], before[1])
    assert set(optimizer.state_dict()) == {0}
    optimizer.step([None, None])
    assert set(optimizer.state_dict()) == {0}


@pytest.mark.parametrize("functional_cls, config", [(FunctionalQHM, QHM_CONFIGS[0]), (FunctionalSGD, SGD_CONFIGS[1])])
def test_wrong_number_of_gradients_names_both_lengths(build_functional, functional_cls, config):
    optimizer = build_functional(functional_cls, [torch.zeros(2), torch.zeros(2)], **config)
    with pytest.raises(ValueError, match="got 3 gradients for 2 parameters"):
        optimizer.step([torch.zeros(2)] * 3)


@pytest.mark.parametrize("functional_cls, config", [(FunctionalQHM, QHM_CONFIGS[0]), (FunctionalSGD, SGD_CONFIGS[1])])
@pytest.mark.parametrize("bad_grad, message", [
    (torch.zeros(3, 2), r"gradient 1 has shape \[3, 2\] but parameter 1 has shape \[2, 3\]"),
    (torch.zeros(2, 3, dtype=torch.float64), "gradient 1 has dtype"),
])
def test_bad_gradient_is_refused_and_changes_nothing(build_functional, functional_cls, config, bad_grad, message):
    params = [torch.randn(4), torch.randn(2, 3)]
    before = [p.clone() for p in params]
    optimizer = build_functional(functional_cls, params, **config)
    with pytest.raises(ValueError, match=message):
        optimizer.step([torch.ones(4), bad_grad])
    for p, b in zip(params, before):
        assert torch.equal(p, b)
    assert optimizer.state_dict() == {}


@pytest.mark.parametrize("functional_cls, config", ALL, ids=ALL_IDS)
def test_gradients_are_never_written(build_functional, functional_cls, config):
    params = [torch.randn(6, 2)]
    grad = torch.randn(6, 2)
    grad_before = grad.clone()
    optimizer = build_functional(functional_cls, params, **config)
    for _ in range(2):
        optimizer.step([grad])
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 3, 3]]), torch.ones(3, 2), (6, 2))
    optimizer.step([sparse])
    assert torch.equal(sparse._values(), torch.ones(3, 2))
    assert torch.equal(grad, grad_before)


def sparse_grad(rows, table_rows, dim):
    return torch.sparse_coo_tensor(torch.tensor([rows]), torch.randn(len(rows), dim), (table_rows, dim))


@pytest.mark.parametrize("functional_cls, config", [
    (FunctionalQHM, QHM_CONFIGS[0]), (FunctionalQHM, QHM_CONFIGS[5]), (FunctionalQHM, QHM_CONFIGS[2]),
    (FunctionalSGD, SGD_CONFIGS[2]), (FunctionalSGD, SGD_CONFIGS[3]), (FunctionalSGD, SGD_CONFIGS[0]),
], ids=lambda x: x.__name__ if isinstance(x, type) else config_id(x))
def test_row_sparse_step_equals_dense_step_on_the_touched_rows(build_functional, functional_cls, config):
    """A sparse step == a dense step of the sub-table made of the touched rows,
    with that sub-table's own (lazily created) momentum; other rows untouched."""
    table = torch.randn(30, 4)
    sparse = build_functional(functional_cls, [table], **config)
    row_sets = [[3, 7, 3, 12], [7, 20], [3, 29, 0], [12]]
    # Every row ever touched, with a dense optimizer over exactly that row.
    touched = sorted({r for rows in row_sets for r in rows})
    row_params = {r: table[r:r + 1].clone() for r in touched}
    row_optimizers = {r: build_functional(functional_cls, [row_params[r]], **config) for r in touched}
    for rows in row_sets:
        grad = sparse_grad(rows, 30, 4)
        before = table.clone()
        sparse.step([grad])
        dense_rows = grad.coalesce().to_dense()
        for r in sorted(set(rows)):
            row_optimizers[r].step([dense_rows[r:r + 1]])
            # Same math; small row slices use multi-tensor ops, the dense step
            # the fused kernel, so float32 rounding may differ by an ulp.
            torch.testing.assert_close(table[r:r + 1], row_params[r], rtol=1e-6, atol=1e-6)
        untouched = [r for r in range(30) if r not in rows]
        assert torch.equal(table[untouched], before[untouched])
    state = sparse.state_dict()
    if "momentum_buffer" in state.get(0, {}):
        never = [r for r in range(30) if r not in touched]
        assert torch.count_nonzero(state[0]["momentum_buffer"][never]) == 0


@pytest.mark.parametrize("functional_cls, config", [(FunctionalQHM, QHM_CONFIGS[0]), (FunctionalSGD, SGD_CONFIGS[2])])
def test_embedding_sparse_gradient_from_autograd(build_functional, functional_cls, config):
    embedding = torch.nn.Embedding(50, 8, sparse=True)
    dense = torch.nn.Embedding(50, 8)
    dense.weight.data.copy_(embedding.weight.data)
    sparse_opt = build_functional(functional_cls, [embedding.weight.data], **config)
    dense_opt = build_functional(functional_cls, [dense.weight.data], **config)
    ids = torch.tensor([[1, 4, 4, 9], [9, 2, 1, 1]])
    embedding(ids).pow(2).sum().backward()
    dense(ids).pow(2).sum().backward()
    before = embedding.weight.data.clone()
    sparse_opt.step([embedding.weight.grad])
    dense_opt.step([dense.weight.grad])
    # One step from fresh state: equal on the touched rows; the lazy sparse
    # step leaves the other rows alone (the dense one weight-decays them).
    touched = ids.unique()
    untouched = [r for r in range(50) if r not in touched.tolist()]
    torch.testing.assert_close(embedding.weight.data[touched], dense.weight.data[touched], rtol=1e-6, atol=1e-6)
    assert torch.equal(embedding.weight.data[untouched], before[untouched])


@pytest.mark.parametrize("functional_cls, config", [(FunctionalQHM, QHM_CONFIGS[0]), (FunctionalSGD, SGD_CONFIGS[2])])
def test_mixed_sparse_then_dense_steps_match_row_wise_semantics(build_functional, functional_cls, config):
    table = torch.randn(10, 3)
    optimizer = build_functional(functional_cls, [table], **config)
    optimizer.step([sparse_grad([2, 5], 10, 3)])
    dense_grad = torch.randn(10, 3)
    reference = table.clone()
    reference_opt = build_functional(functional_cls, [reference], **config)
    reference_opt.load_state_dict(optimizer.state_dict())
    optimizer.step([dense_grad])
    reference_opt.step([dense_grad.to_sparse(1)])
    torch.testing.assert_close(table, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("functional_cls, config", ALL, ids=ALL_IDS)
def test_state_dict_round_trip_continues_the_same_trajectory(build_functional, functional_cls, config):
    straight = [torch.randn(6, 3), torch.randn(4)]
    resumed = [p.clone() for p in straight]
    grads = [[torch.randn_like(p) for p in straight] for _ in range(12)]
    first = build_functional(functional_cls, straight, **config)
    second = build_functional(functional_cls, resumed, **config)
    for step, step_grads in enumerate(grads):
        if step == 6:
            saved = second.state_dict()
            second = build_functional(functional_cls, resumed, **config)
            second.load_state_dict(saved)
        first.step(step_grads)
        second.step(step_grads)
    for a, b in zip(straight, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_qhm_state_dict_holds_the_reference_momentum(build_functional):
    local_param = torch.nn.Parameter(torch.randn(8))
    param = local_param.detach().clone()
    local = QHM([local_param], **QHM_CONFIGS[0])
    functional = build_functional(FunctionalQHM, [param], **QHM_CONFIGS[0])
    for _ in range(5):
        grad = torch.randn(8)
        local_param.grad = grad.clone()
        local.step()
        functional.step([grad])
    torch.testing.assert_close(functional.state_dict()[0]["momentum_buffer"],
                               local.state[local_param]["momentum_buffer"], rtol=1e-6, atol=1e-7)


def test_changing_nu_and_momentum_mid_training_follows_qhm(build_functional):
    local_param = torch.nn.Parameter(torch.randn(10, dtype=torch.float64))
    param = local_param.detach().clone()
    local = QHM([local_param], **QHM_CONFIGS[0])
    functional = build_functional(FunctionalQHM, [param], **QHM_CONFIGS[0])
    for step in range(30):
        if step in (10, 20):
            new = dict(nu=0.3, momentum=0.5) if step == 10 else dict(nu=0.0, momentum=0.8)
            local.param_groups[0].update(new)
            target = functional.script_object if hasattr(functional, "script_object") else functional
            for key, value in new.items():
                setattr(target, key, value)
        grad = torch.randn(10, dtype=torch.float64)
        local_param.grad = grad.clone()
        local.step()
        functional.step([grad])
    torch.testing.assert_close(param, local_param.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("functional_cls, config", [(FunctionalQHM, QHM_CONFIGS[0]), (FunctionalSGD, SGD_CONFIGS[2])])
def test_load_state_dict_refuses_mismatched_state_whole(build_functional, functional_cls, config):
    params = [torch.zeros(3), torch.zeros(2)]
    optimizer = build_functional(functional_cls, params, **config)
    optimizer.step([torch.ones(3), torch.ones(2)])
    saved = optimizer.state_dict()
    bad = {0: {"momentum_buffer": torch.ones(3)}, 1: {"momentum_buffer": torch.ones(5)}}
    with pytest.raises(ValueError, match=r"momentum_buffer 1 has shape \[5\] but parameter 1 has shape \[2\]"):
        optimizer.load_state_dict(bad)
    with pytest.raises(ValueError, match="index 7 out of range"):
        optimizer.load_state_dict({7: {"momentum_buffer": torch.ones(3)}})
    after = optimizer.state_dict()
    for index in saved:
        assert torch.equal(after[index]["momentum_buffer"], saved[index]["momentum_buffer"])


@pytest.mark.parametrize("functional_cls, config, message", [
    (FunctionalQHM, dict(lr=-0.1, momentum=0.9, nu=0.7), "lr=-0.1"),
    (FunctionalQHM, dict(lr=0.1, momentum=0.9, nu=0.7, weight_decay_type="l2"), "weight_decay_type='l2'"),
    (FunctionalSGD, dict(lr=0.1, momentum=0.0, nesterov=True), "Nesterov"),
    (FunctionalSGD, dict(lr=0.1, momentum=-1.0), "momentum=-1"),
])
def test_invalid_hyperparameters_raise_value_error(build_functional, functional_cls, config, message):
    with pytest.raises(ValueError, match=message):
        build_functional(functional_cls, [torch.zeros(1)], **config)


def test_empty_parameter_list_is_refused_unless_allowed(build_functional):
    with pytest.raises(ValueError, match="empty parameter list"):
        build_functional(FunctionalQHM, [], lr=0.1, momentum=0.9, nu=0.7)
    build_functional(FunctionalSGD, [], lr=0.1, _allow_empty_param_list=True).step([])


@pytest.mark.parametrize("functional_cls, config", ALL, ids=ALL_IDS)
def test_large_and_small_tensors_take_both_kernels_and_match(build_functional, functional_cls, config):
    """Tensors of >= 32768 elements go through the fused kernel, smaller ones
    through multi-tensor ops; both must follow the local optimizer."""
    shapes = [(200, 200), (7, 3), (40000,)]
    local_params = [torch.nn.Parameter(torch.randn(s, dtype=torch.float64)) for s in shapes]
    params = [p.detach().clone() for p in local_params]
    local = LOCAL_OF[functional_cls](local_params, **config)
    functional = build_functional(functional_cls, params, **config)
    for _ in range(15):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for p, g in zip(local_params, grads):
            p.grad = g.clone()
        local.step()
        functional.step(grads)
    for p, q in zip(local_params, params):
        torch.testing.assert_close(q, p.detach(), rtol=0, atol=1e-10)


MOMENTUM_STEP_CASES = [
    dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
    dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False),
    dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01, nesterov=False, maximize=True),
    dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False),
]


@pytest.mark.parametrize("scripted", [False, True], ids=["eager", "scripted"])
@pytest.mark.parametrize("config", MOMENTUM_STEP_CASES, ids=config_id)
def test_momentum_step_with_every_tensor_fused_equals_the_split_path_bit_for_bit(scripted, config):
    """``fused_min_elements=0`` (every dense step) hands the lists to the fused kernel as they are; the
    general path (here with a threshold of 1, which every tensor also meets) splits them first.  Same
    kernel, same tensors: the same bits, first step and later ones, parameters and momentum."""
    from paramserver.optim.kernels import momentum_step
    step = torch.jit.script(momentum_step) if scripted else momentum_step
    shapes = [(64, 32), (7, 3), (1,), (40000,)]
    params = [torch.randn(s) for s in shapes]
    buffers = [torch.zeros(s) for s in shapes] if config["momentum"] != 0.0 else []
    split_params = [p.clone() for p in params]
    split_buffers = [b.clone() for b in buffers]
    args = [config[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")]
    for index in range(5):
        grads = [torch.randn(s) for s in shapes]
        written = step(params, grads, buffers, *args, index == 0, 0)
        split_written = step(split_params, grads, split_buffers, *args, index == 0, 1)
        assert len(written) == len(split_written) == len(params) + len(buffers)
        for a, b in zip(params + buffers, split_params + split_buffers):
            assert torch.equal(a, b)
