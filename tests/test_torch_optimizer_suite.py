"""PyTorch's own DistributedOptimizer tests pass with ours in place (``torch_optimizer_suite``), run in a
process of their own so that torch's test utilities change nothing in this one."""

import os
import pathlib

import pytest

from commands import errors, output

pytestmark = pytest.mark.timeout(180)

SUITE = "torch_optimizer_suite"


def test_pytorchs_own_distributed_optimizer_tests_pass_with_ours_in_place(commands):
    tests_folder = str(pathlib.Path(__file__).parent)
    path = os.pathsep.join(filter(None, [tests_folder, os.environ.get("PYTHONPATH")]))
    process = commands.start("python", "-m", "unittest", SUITE,
                             env={"PYTHONPATH": path, "PYTHONWARNINGS": "ignore::DeprecationWarning"})
    code = process.wait(150)
    report = errors(process)
    assert code == 0, f"torch's DistOptimizerTest failed with ours in place:\n{output(process)}\n{report[-6000:]}"
    # unittest's summary: the one test ran (not skipped: torch skips a multi-process test it cannot run here).
    assert "Ran 1 test" in report and report.rstrip().endswith("OK"), report[-3000:]
