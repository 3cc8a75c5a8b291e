"""The DDP comm hooks (paramserver.ddp.hooks): averages within each hook's
precision, PowerSGD's options and error feedback, measured bytes, replicas in
step, checkpointed states, and the errors for bad names and options.

The two-rank checks run once, in one spawned gloo group (``hook_workers``),
and are reported here one test per check."""

import datetime
import inspect
import json
import pickle

import pytest
import torch
import torch.distributed as dist

import hook_workers
from test_checkpoint_store import OnAnotherDevice
from paramserver.ddp import HOOK_NAMES, CommHookState, PowerSGDOptions, PowerSGDState, canonical_hook_options, comm_hook
from paramserver.processes import Child, ChildProcessesFailed, free_port, run_children

# The two-rank run takes ~10 s on 2 idle cores; the margin is for a loaded machine.
TWO_RANK_TIMEOUT = datetime.timedelta(seconds=75)
pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """Run every check of hook_workers on 2 ranks; returns (results per rank, the launcher's failure or None)."""
    results_dir = tmp_path_factory.mktemp("comm_hooks")
    port = free_port()
    failure = None
    try:
        run_children([Child(f"rank{rank}", hook_workers.run_rank, (rank, port, str(results_dir)))
                      for rank in range(hook_workers.WORLD_SIZE)], TWO_RANK_TIMEOUT)
    except ChildProcessesFailed as error:
        failure = error
    results = []
    for rank in range(hook_workers.WORLD_SIZE):
        path = results_dir / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return results, failure


@pytest.mark.parametrize("check", list(hook_workers.CHECKS))
def test_two_ranks(two_rank_run, check):
    results, failure = two_rank_run
    reports = [rank_results.get(check, "not run") for rank_results in results]
    if reports != ["ok"] * len(reports):
        pytest.fail("\n".join(f"rank {rank}: {report}" for rank, report in enumerate(reports))
                    + (f"\nlauncher: {failure}" if failure else ""))


def test_every_rank_exits_cleanly(two_rank_run):
    _, failure = two_rank_run
    assert failure is None, failure


def test_the_hooks_by_name():
    assert set(HOOK_NAMES) == {"allreduce", "fp16", "bf16", "powersgd", "batched_powersgd", "fp16_powersgd",
                               "bf16_powersgd", "fp16_batched_powersgd", "bf16_batched_powersgd", "noop"}
    for name in HOOK_NAMES:
        state, hook = comm_hook(name)
        assert state.hook_name == name and state.process_group is None
        assert isinstance(state, PowerSGDState) == ("powersgd" in name)
        # What DDP's register_comm_hook checks: a parameter called bucket, and a name other than
        # torch's bf16 hooks' (which it refuses off NCCL).
        assert list(inspect.signature(hook).parameters) == ["state", "bucket"]
        assert inspect.signature(hook).parameters["bucket"].annotation is dist.GradBucket
        assert hook.__name__ == f"{name}_hook"


def test_unknown_hook_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown comm hook 'powerSGD'; the hooks are: allreduce, .*noop"):
        comm_hook("powerSGD")


def test_unknown_option_names_the_hook_and_the_accepted_options():
    with pytest.raises(ValueError, match=r"comm hook 'powersgd' got unknown option\(s\) matrix_rank; "
                                         r"it accepts: matrix_approximation_rank, start_powerSGD_iter, "
                                         r"min_compression_rate, use_error_feedback, warm_start, "
                                         r"orthogonalization_epsilon, random_seed, batch_tensors_with_same_shape "
                                         r"\(or rank for matrix_approximation_rank, "):
        comm_hook("powersgd", matrix_rank=2)
    with pytest.raises(ValueError, match=r"comm hook 'fp16' got unknown option\(s\) rank; it takes no options"):
        comm_hook("fp16", rank=1)


@pytest.mark.parametrize("options, problem", [
    (dict(matrix_approximation_rank=0), "matrix_approximation_rank must be an int >= 1, got 0"),
    (dict(rank=1.5), "matrix_approximation_rank must be an int >= 1, got 1.5"),
    (dict(start_powerSGD_iter=-1), "start_powerSGD_iter must be an int >= 0, got -1"),
    (dict(start_iter=1), "start_powerSGD_iter must be >= 2 with use_error_feedback or warm_start"),
    (dict(min_compression_rate=-1), "min_compression_rate must be a number >= 0, got -1"),
    (dict(orthogonalization_epsilon="tiny"), "orthogonalization_epsilon must be a number >= 0, got 'tiny'"),
    (dict(use_error_feedback="yes"), "use_error_feedback must be True or False, got 'yes'"),
    (dict(batch_tensors_with_same_shape=1), "batch_tensors_with_same_shape must be True or False, got 1"),
    (dict(seed=-3), "random_seed must be an int >= 0, got -3"),
    (dict(rank=2, matrix_approximation_rank=2), "got rank and matrix_approximation_rank: the first is an alias"),
    (dict(error_feedback=False, use_error_feedback=False, seed=1, random_seed=1),
     "got error_feedback and use_error_feedback; seed and random_seed: the first is an alias"),
])
def test_bad_option_values_name_the_hook_the_option_and_the_accepted_ones(options, problem):
    with pytest.raises(ValueError) as raised:
        comm_hook("bf16_batched_powersgd", **options)
    message = str(raised.value)
    assert message.startswith("comm hook 'bf16_batched_powersgd': ") or message.startswith(
        "comm hook 'bf16_batched_powersgd' got "), message
    assert problem in message, message


def test_torch_powersgd_state_names_and_our_aliases_mean_the_same():
    torch_names = dict(matrix_approximation_rank=2, start_powerSGD_iter=0, min_compression_rate=1.5,
                       use_error_feedback=False, warm_start=False, orthogonalization_epsilon=1e-8, random_seed=3,
                       batch_tensors_with_same_shape=True)
    state, _ = comm_hook("powersgd", **torch_names)
    assert state.options() == torch_names
    aliases = dict(rank=2, start_iter=0, min_compression_rate=1.5, error_feedback=False, warm_start=False,
                   orthogonalization_epsilon=1e-8, seed=3, batch_tensors_with_same_shape=True)
    assert comm_hook("powersgd", **aliases).state.options() == torch_names
    assert canonical_hook_options("powersgd", dict(rank=2, warm_start=False)) == dict(
        matrix_approximation_rank=2, warm_start=False)
    assert canonical_hook_options("fp16", dict(rank=2)) == dict(rank=2)  # comm_hook refuses it, naming the hook


def test_options_pickled_under_the_earlier_names_load_as_torchs():
    old = PowerSGDOptions.__new__(PowerSGDOptions)
    old.__dict__.update(rank=4, start_iter=10, min_compression_rate=2.0, error_feedback=False, warm_start=True, seed=0)
    assert pickle.loads(pickle.dumps(old)) == PowerSGDOptions(matrix_approximation_rank=4, start_powerSGD_iter=10,
                                                              use_error_feedback=False)


def test_start_iter_below_2_is_fine_without_memory():
    state, _ = comm_hook("powersgd", start_iter=0, error_feedback=False, warm_start=False)
    assert state.options() == dict(matrix_approximation_rank=1, start_powerSGD_iter=0, min_compression_rate=2.0,
                                   use_error_feedback=False, warm_start=False, orthogonalization_epsilon=0.0,
                                   random_seed=0, batch_tensors_with_same_shape=False)


@pytest.mark.parametrize("device", ["stand-in", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU here"))])
def test_powersgd_memories_pickle_onto_the_cpu(device):
    """A checkpoint's hook state from a worker on a GPU unpickles on a host without one (``OnAnotherDevice``
    stands in for a GPU tensor where there is none: pickled as it is, it would unpickle as itself)."""
    def on_device(tensor):
        return tensor.as_subclass(OnAnotherDevice) if device == "stand-in" else tensor.to(device)

    state, _ = comm_hook("powersgd", rank=1, start_iter=2)
    error, q = on_device(torch.arange(4.0)), on_device(torch.ones(2))
    state.error_memory, state.q_memory = {0: error}, {0: q}
    copy = pickle.loads(pickle.dumps(state))
    for moved, expected in ((copy.error_memory[0], torch.arange(4.0)), (copy.q_memory[0], torch.ones(2))):
        assert type(moved) is torch.Tensor and moved.device.type == "cpu" and torch.equal(moved, expected)
    assert state.error_memory[0] is error and state.q_memory[0] is q  # the live state keeps its own


def test_a_fresh_state_pickles_and_loads_only_into_the_same_hook():
    state, _ = comm_hook("powersgd", rank=4, start_iter=10)
    copy = pickle.loads(pickle.dumps(state))
    assert copy.options() == state.options() and copy.steps == 0 and copy.attach() is copy
    with pytest.raises(ValueError, match="cannot be loaded into comm hook 'powersgd' with options"):
        comm_hook("powersgd", rank=2, start_iter=10).state.load_state_dict(state.state_dict())
    with pytest.raises(ValueError, match="state of comm hook 'allreduce'"):
        state.load_state_dict(CommHookState("allreduce").state_dict())
