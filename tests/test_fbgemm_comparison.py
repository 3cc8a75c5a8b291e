"""benchmarks/optim_step.py's case (d) against FBGEMM's CPU kernel: an optional comparison.

Where ``fbgemm_gpu`` does not import (``make test`` never installs the ``bench`` extra), the comparison prints
one line saying why and how to install it, and fails nothing; where it imports, ours and FBGEMM's take the
same first step (rows, and row-wise Adagrad's sums) on small tables.  Single-process; no timing is asserted.
"""

import importlib.util
import pathlib
import sys

import pytest
import torch

BENCHMARK = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "optim_step.py"


@pytest.fixture(scope="module")
def optim_step():
    spec = importlib.util.spec_from_file_location("optim_step_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_fbgemm_gpu_the_comparison_says_why_and_how_to_install_it(optim_step, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fbgemm_gpu", None)  # import fbgemm_gpu raises ImportError
    assert optim_step.fbgemm_comparison(rows=200, touched=10, rounds=1) == []
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    assert "fbgemm_gpu is not importable (ModuleNotFoundError" in lines[0]
    assert "pip install -e '.[bench]'" in lines[0]


def test_fbgemm_and_ours_take_the_same_first_step(optim_step, capsys):
    fbgemm, why = optim_step.load_fbgemm()
    if fbgemm is None:
        pytest.skip(f"fbgemm_gpu is not importable here ({why}): the bench extra")
    results = optim_step.fbgemm_comparison(rows=2000, touched=100, rounds=1, dims=(16, 40))
    assert {(r.dtype, r.dim, r.optimizer) for r in results} == {
        (dtype, dim, name) for dtype in (torch.float32, torch.float16) for dim in (16, 40)
        for name in ("RowWiseAdagrad", "SGD")}
    for r in results:
        # FBGEMM's float16 SGD rounds its step to float16, then the row to nearest: not ours (stochastic)
        if not (r.dtype == torch.float16 and r.optimizer == "SGD"):
            assert r.beyond == 0.0, r
    assert "| float32 | 16 | RowWiseAdagrad |" in capsys.readouterr().out
