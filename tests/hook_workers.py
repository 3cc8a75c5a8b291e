"""The two-rank comm-hook checks, run in spawned children on one gloo group.

``run_rank`` joins a 2-rank gloo group on loopback and runs every check in
``CHECKS`` in order; each rank writes ``{check: "ok" | traceback}`` to
``rank<r>.json`` in the results folder.  The first failing check stops the
rank with exit code 1 (later collectives would pair up wrongly), so the other
rank fails at its next collective and stops too.

Gradients are planted: ``Planted`` is a model whose gradient is whatever its
forward is given, and both ranks know every rank's gradients (seeded by rank
and step), so each checks the hooks' averages against the true ones locally.
"""

import datetime
import json
import os
import pickle
import traceback
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from paramserver.ddp import HOOK_NAMES, comm_hook

WORLD_SIZE = 2
GROUP_TIMEOUT = datetime.timedelta(seconds=30)
FLOAT_BYTES = 4

Shapes = Sequence[Tuple[int, ...]]
Gradients = Callable[[int, int], List[torch.Tensor]]  # (rank, step) -> one gradient per shape


class Planted(torch.nn.Module):
    """Zero parameters of the given shapes; ``forward(gradients)`` is a loss whose gradient is ``gradients``."""

    def __init__(self, shapes: Shapes):
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(shape)) for shape in shapes])

    def forward(self, gradients: List[torch.Tensor]) -> torch.Tensor:
        return sum((weight * gradient).sum() for weight, gradient in zip(self.weights, gradients))


def random_gradients(shapes: Shapes, seed: int = 0) -> Gradients:
    def gradients(rank: int, step: int) -> List[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed * 10_000 + step * 10 + rank)
        return [torch.randn(shape, generator=generator) for shape in shapes]
    return gradients


def true_mean(gradients: Gradients, step: int) -> List[torch.Tensor]:
    per_rank = [gradients(rank, step) for rank in range(WORLD_SIZE)]
    return [sum(tensors) / WORLD_SIZE for tensors in zip(*per_rank)]


class PlantedRun:
    """A DDP model of ``Planted`` parameters with a comm hook; ``step`` returns the averaged gradients."""

    def __init__(self, shapes: Shapes, gradients: Gradients, state, hook):
        self.model = DistributedDataParallel(Planted(shapes))
        self.model.register_comm_hook(state, hook)
        self.gradients, self.state = gradients, state

    def step(self, step: int) -> List[torch.Tensor]:
        self.model.zero_grad(set_to_none=True)
        self.model(self.gradients(dist.get_rank(), step)).backward()
        return [weight.grad.clone() for weight in self.model.module.weights]


def run_planted(name: str, shapes: Shapes, gradients: Gradients, steps: int, **options):
    """``steps`` steps of hook ``name``: (averaged gradients per step, bytes per step, the state)."""
    run = PlantedRun(shapes, gradients, *comm_hook(name, **options))
    outputs, sent = [], []
    for step in range(steps):
        outputs.append(run.step(step))
        sent.append(run.state.last_step_bytes)
    return outputs, sent, run.state


def numel(shapes: Shapes) -> int:
    return sum(torch.Size(shape).numel() for shape in shapes)


def powersgd_numel(shapes: Shapes, rank: int) -> int:
    """Elements PowerSGD sends for ``shapes`` when every matrix is compressed: P and Q, or the vector."""
    total = 0
    for shape in shapes:
        if len(shape) < 2:
            total += numel([shape])
        else:
            rows, columns = shape[0], numel([shape]) // shape[0]
            total += (rows + columns) * min(rows, columns, rank)
    return total


def assert_close_to(got: List[torch.Tensor], expected: List[torch.Tensor], rtol: float, what: str) -> None:
    """Each tensor's largest error within ``rtol`` of its largest entry (entries near zero need not be exact)."""
    for index, (g, e) in enumerate(zip(got, expected)):
        assert g.dtype == e.dtype and g.shape == e.shape, (what, index, g.dtype, g.shape)
        error = ((g - e).abs().max() / e.abs().max()).item()
        assert error <= rtol, f"{what}, tensor {index}: largest error {error:.2e} of the largest entry, over {rtol:g}"


def assert_equal(got: List[torch.Tensor], expected: List[torch.Tensor], what: str) -> None:
    for index, (g, e) in enumerate(zip(got, expected)):
        assert torch.equal(g, e), f"{what}, tensor {index}: largest difference {(g - e).abs().max().item()}"


def assert_same_on_every_rank(tensor: torch.Tensor, what: str) -> None:
    gathered = [torch.empty_like(tensor) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered, tensor)
    assert all(torch.equal(gathered[0], t) for t in gathered), f"{what}: ranks differ"


# ------------------------------------------------------------------------------------------------ checks

SHAPES = [(16, 8), (8,), (5, 3, 2), (1,)]
# PowerSGD in low precision rounds M, P and Q, and a random Q at a narrow angle to the gradient magnifies
# that: its tolerance is wider than the plain cast's.
LOW_PRECISION_POWERSGD_RTOL = {"fp16_powersgd": 5e-3, "bf16_powersgd": 5e-2}


def check_allreduce_averages_exactly_and_sends_the_bucket():
    gradients = random_gradients(SHAPES)
    outputs, sent, state = run_planted("allreduce", SHAPES, gradients, 3)
    for step, output in enumerate(outputs):
        assert_equal(output, true_mean(gradients, step), f"allreduce step {step}")
    assert sent == [numel(SHAPES) * FLOAT_BYTES] * 3, sent
    assert state.steps == 3 and state.total_bytes == 3 * numel(SHAPES) * FLOAT_BYTES


def check_fp16_and_bf16_average_within_their_precision_and_send_half():
    gradients = random_gradients(SHAPES, seed=1)
    for name, rtol in (("fp16", 1e-3), ("bf16", 1e-2)):
        outputs, sent, _ = run_planted(name, SHAPES, gradients, 2)
        for step, output in enumerate(outputs):
            assert all(o.dtype == torch.float32 for o in output)
            assert_close_to(output, true_mean(gradients, step), rtol, f"{name} step {step}")
        assert sent == [numel(SHAPES) * 2] * 2, (name, sent)


def check_noop_keeps_the_local_gradient_and_sends_nothing():
    gradients = random_gradients(SHAPES, seed=2)
    outputs, sent, state = run_planted("noop", SHAPES, gradients, 2)
    for step, output in enumerate(outputs):
        assert_equal(output, gradients(dist.get_rank(), step), f"noop step {step}")
    assert sent == [0, 0] and state.total_bytes == 0 and state.steps == 2


def check_powersgd_at_full_rank_reproduces_the_average():
    shapes = [(12, 6), (6,), (4, 10), (3, 2, 2)]
    gradients = random_gradients(shapes, seed=3)
    for name, rtol in (("powersgd", 1e-5), *LOW_PRECISION_POWERSGD_RTOL.items()):
        element_bytes = FLOAT_BYTES if name == "powersgd" else 2
        outputs, sent, _ = run_planted(name, shapes, gradients, 5, rank=12, start_iter=2, min_compression_rate=0)
        for step, output in enumerate(outputs):
            if step < 2:  # before start_iter: plain all-reduce, in the hook's precision
                assert sent[step] == numel(shapes) * element_bytes, (name, step, sent)
            else:
                assert sent[step] == powersgd_numel(shapes, 12) * element_bytes, (name, step, sent)
            assert_close_to(output, true_mean(gradients, step), rtol, f"{name} step {step}")


def check_batching_tensors_of_one_shape_changes_nothing_but_the_products():
    # torch's names (batch_tensors_with_same_shape...) as options; three matrices of one shape compressed in
    # one batched product give what they give one by one, with error feedback and warm start.
    shapes = [(16, 12), (16, 12), (16, 12), (12,)]
    gradients = random_gradients(shapes, seed=7)
    options = dict(matrix_approximation_rank=2, start_powerSGD_iter=2, orthogonalization_epsilon=1e-8)
    alone, sent_alone, _ = run_planted("powersgd", shapes, gradients, 5, **options)
    together, sent_together, state = run_planted("powersgd", shapes, gradients, 5, batch_tensors_with_same_shape=True,
                                                 **options)
    assert sent_alone == sent_together and state.powersgd_options.batch_tensors_with_same_shape
    for step in range(5):
        assert_close_to(together[step], alone[step], 1e-5, f"step {step}")


def check_powersgd_respects_start_iter():
    shapes = [(32, 24), (24,)]
    gradients = random_gradients(shapes, seed=4)
    outputs, sent, state = run_planted("powersgd", shapes, gradients, 5, rank=1, start_iter=3)
    for step in range(3):
        assert_equal(outputs[step], true_mean(gradients, step), f"step {step}, before start_iter")
    assert sent == [numel(shapes) * FLOAT_BYTES] * 3 + [powersgd_numel(shapes, 1) * FLOAT_BYTES] * 2, sent
    for step in (3, 4):  # random gradients are not rank 1: compressed, not exact; the vector still is
        assert not torch.allclose(outputs[step][0], true_mean(gradients, step)[0], rtol=1e-2)
        assert_equal(outputs[step][1:], true_mean(gradients, step)[1:], f"step {step}, the vector")
    assert sorted(state.error_memory) == sorted(state.q_memory) == [0]


def rank_one_gradients(rows: int, columns: int) -> Gradients:
    """Rank r's matrix is scale_r * u v^T (u, v new each step), so the average is rank 1; plus a random vector."""
    def gradients(rank: int, step: int) -> List[torch.Tensor]:
        shared = torch.Generator().manual_seed(100 + step)
        u, v = torch.randn(rows, 1, generator=shared), torch.randn(1, columns, generator=shared)
        own = torch.Generator().manual_seed(200 + 10 * step + rank)
        return [(1.0 + 0.5 * rank) * u @ v, torch.randn(columns, generator=own)]
    return gradients


def check_rank_one_powersgd_reproduces_a_rank_one_average():
    shapes = [(32, 24), (24,)]
    gradients = rank_one_gradients(32, 24)
    for name, rtol in (("powersgd", 1e-5), *LOW_PRECISION_POWERSGD_RTOL.items()):
        options = dict(rank=1, start_iter=0, error_feedback=False, warm_start=False)
        outputs, _, _ = run_planted(name, shapes, gradients, 3, **options)
        for step, output in enumerate(outputs):
            mean = true_mean(gradients, step)
            assert_close_to(output[:1], mean[:1], rtol, f"{name} step {step}")
            if name == "powersgd":
                assert_equal(output[1:], mean[1:], f"{name} step {step}, the vector")


def drift(outputs: List[List[torch.Tensor]], gradients: Gradients) -> float:
    """How far the sum of the averaged gradients is from the sum of the true averages, relatively."""
    got = sum(output[0] for output in outputs)
    expected = sum(true_mean(gradients, step)[0] for step in range(len(outputs)))
    return ((got - expected).norm() / expected.norm()).item()


def check_error_feedback_tracks_the_summed_average():
    # Each rank's gradient: its own fixed rank-2 matrix plus noise; compressed to rank 1.  Without error
    # feedback the lost second direction is lost for good; with it, it is sent later.
    shapes = [(16, 8)]

    def gradients(rank: int, step: int) -> List[torch.Tensor]:
        fixed = torch.Generator().manual_seed(400 + rank)
        base = torch.randn(16, 2, generator=fixed) @ torch.randn(2, 8, generator=fixed)
        noise = torch.Generator().manual_seed(300 + 10 * step + rank)
        return [base + 0.1 * torch.randn(shapes[0], generator=noise)]

    steps = 20
    with_feedback, _, _ = run_planted("powersgd", shapes, gradients, steps, rank=1, start_iter=2)
    without, _, _ = run_planted("powersgd", shapes, gradients, steps, rank=1, start_iter=2, error_feedback=False)
    assert drift(with_feedback, gradients) < 0.35 * drift(without, gradients), \
        (drift(with_feedback, gradients), drift(without, gradients))


def train_a_few_steps(model: DistributedDataParallel, hook_name: str, options: dict, in_features: int,
                      lr: float, steps: int = 4):
    """Register the hook and take a few SGD steps on this rank's own random batches; returns the hook state."""
    state, hook = comm_hook(hook_name, **options)
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        optimizer.zero_grad()
        data = torch.Generator().manual_seed(10 * step + dist.get_rank())
        model(torch.randn(8, in_features, generator=data)).pow(2).mean().backward()
        optimizer.step()
    return state


def check_batched_powersgd_on_tiny_and_odd_buckets():
    # A tiny real model: torch's batched_powerSGD_hook raises AssertionError on it.
    model = DistributedDataParallel(torch.nn.Linear(4, 3))
    state = train_a_few_steps(model, "batched_powersgd", dict(rank=1, start_iter=2, min_compression_rate=0),
                              in_features=4, lr=0.1)
    assert state.last_step_bytes == 2 * 4 * 1 * FLOAT_BYTES, state.last_step_bytes  # 15 elements: a 4 x 4 square
    assert_same_on_every_rank(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "tiny model")
    # Odd sizes at full rank (the square's side): the average, closely.
    for shapes, side in (([(7,), (3, 5)], 5), ([(1,)], 1), ([(2, 3, 3)], 5)):
        gradients = random_gradients(shapes, seed=6)
        outputs, sent, _ = run_planted("batched_powersgd", shapes, gradients, 4, rank=8, start_iter=2,
                                       min_compression_rate=0)
        for step, output in enumerate(outputs):
            assert_close_to(output, true_mean(gradients, step), 1e-5, f"batched {shapes} step {step}")
        assert sent[2:] == [2 * side * side * FLOAT_BYTES] * 2, (shapes, sent)
    # Too small to be worth it at the default rate: all-reduced plainly.
    gradients = random_gradients([(3,)], seed=7)
    outputs, sent, _ = run_planted("batched_powersgd", [(3,)], gradients, 3, rank=1, start_iter=2)
    assert_equal(outputs[2], true_mean(gradients, 2), "batched, 3 elements")
    assert sent == [3 * FLOAT_BYTES] * 3, sent


def check_bytes_of_a_1024_square_layer():
    layer_numel = 1024 * 1024 + 1024
    sent = {}
    for name, options in (("allreduce", {}), ("bf16", {}), ("powersgd", dict(rank=1, start_iter=2))):
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(1024, 1024))
        state, hook = comm_hook(name, **options)
        model.register_comm_hook(state, hook)
        for step in range(3):
            model.zero_grad()
            data = torch.Generator().manual_seed(10 * step + dist.get_rank())
            model(torch.randn(4, 1024, generator=data)).pow(2).mean().backward()
        sent[name] = state.last_step_bytes
    bucket_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sent["allreduce"] == bucket_bytes == layer_numel * FLOAT_BYTES, sent
    assert sent["bf16"] == bucket_bytes // 2, sent
    assert sent["powersgd"] == (1024 + 1024 + 1024) * FLOAT_BYTES, sent  # P, Q, the bias
    assert sent["allreduce"] / sent["powersgd"] >= 50, sent


def check_plain_ddp_replicas_stay_identical():
    # A plain torch model in more than one bucket (after DDP rebuilds them, from the second step).
    for name in HOOK_NAMES:
        torch.manual_seed(dist.get_rank())  # different initial weights: DDP must broadcast rank 0's
        model = DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(600, 600), torch.nn.ReLU(), torch.nn.Linear(600, 600), torch.nn.ReLU(),
            torch.nn.Linear(600, 4)), bucket_cap_mb=1)
        options = dict(rank=2, start_iter=2, min_compression_rate=0) if "powersgd" in name else {}
        state = train_a_few_steps(model, name, options, in_features=600, lr=0.01)
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        assert torch.isfinite(weights).all(), name
        if name == "noop":  # no communication: the replicas drift apart, by design
            gathered = [torch.empty_like(weights) for _ in range(WORLD_SIZE)]
            dist.all_gather(gathered, weights)
            assert not torch.equal(gathered[0], gathered[1])
        else:
            assert_same_on_every_rank(weights, name)
        shapes = [tuple(p.shape) for p in model.parameters()]
        expected_bytes = {"allreduce": numel(shapes) * FLOAT_BYTES, "fp16": numel(shapes) * 2,
                          "powersgd": powersgd_numel(shapes, 2) * FLOAT_BYTES}
        if name in expected_bytes:  # all buckets together
            assert state.last_step_bytes == expected_bytes[name], (name, state.last_step_bytes)


def check_pickled_state_continues_after_attach():
    shapes = [(32, 24), (24,), (16, 16)]
    gradients = random_gradients(shapes, seed=8)
    group = dist.new_group(list(range(WORLD_SIZE)))
    options = dict(rank=2, start_iter=2)
    for name in ("powersgd", "batched_powersgd", "bf16_powersgd"):
        original = PlantedRun(shapes, gradients, *comm_hook(name, process_group=group, **options))
        for step in range(4):
            original.step(step)
        saved = original.state.state_dict()
        restored = pickle.loads(pickle.dumps(original.state))
        assert restored.process_group is None and original.state.process_group is group
        assert restored.steps == 4 and restored.total_bytes == original.state.total_bytes
        for memory in ("error_memory", "q_memory"):
            kept = getattr(restored, memory)
            assert kept and sorted(kept) == sorted(saved[memory]), (name, memory)
            assert all(torch.equal(kept[i], saved[memory][i]) for i in kept), (name, memory)

        def continued(state) -> Tuple[List[List[torch.Tensor]], List[int]]:
            run = PlantedRun(shapes, gradients, state, comm_hook(name, **options).hook)
            outputs, sent = [], []
            for step in (4, 5):
                outputs.append(run.step(step))
                sent.append(state.last_step_bytes)
            return outputs, sent

        from_pickle, sent = continued(restored.attach(group))
        # The first backward after a restore is a plain average; then compression resumes.
        low_precision = name.startswith("bf16")
        assert_close_to(from_pickle[0], true_mean(gradients, 4), 1e-2 if low_precision else 0,
                        f"{name}, first step after restore")
        element_bytes = 2 if low_precision else FLOAT_BYTES
        assert sent[0] == numel(shapes) * element_bytes and sent[1] < sent[0] / 4, (name, sent)
        assert restored.steps == 6
        # ... with the restored memory: as a state loaded from state_dict() does, unlike a state without it.
        loaded = comm_hook(name, **options).state
        loaded.load_state_dict(saved)
        from_state_dict, _ = continued(loaded)
        assert_equal(from_state_dict[1], from_pickle[1], f"{name}, pickled vs state_dict")
        forgetful = comm_hook(name, **options).state
        forgetful.load_state_dict({**saved, "error_memory": {}, "q_memory": {}})
        without_memory, _ = continued(forgetful)
        assert not torch.equal(without_memory[1][0], from_pickle[1][0]), name


CHECKS: Dict[str, Callable[[], None]] = {
    name[len("check_"):]: function for name, function in sorted(globals().items())
    if name.startswith("check_") and callable(function)
}


def run_rank(rank: int, port: int, results_dir: str) -> None:
    """Child body: join the group, run every check, write this rank's results; exit 1 at the first failure."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=GROUP_TIMEOUT)
    results = {}
    failed = False
    for name, check in CHECKS.items():
        try:
            check()
            results[name] = "ok"
        except BaseException:
            results[name] = traceback.format_exc()
            failed = True
            break
    with open(os.path.join(results_dir, f"rank{rank}.json"), "w") as out:
        json.dump(results, out)
    if failed:
        os._exit(1)  # without leaving the group: the other rank must not wait for us
    dist.destroy_process_group()
