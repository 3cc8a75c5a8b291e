"""The child-process launcher: exit codes checked, hangs killed, nothing left behind, children in the caller's
environment (they come from a fork server started earlier)."""

import datetime
import os

import pytest

from child_targets import exit_with, exit_with_variable, sleep_for
from paramserver.processes import Child, ChildProcessesFailed, free_port, run_children

SHORT = datetime.timedelta(seconds=20)


def test_exit_codes_are_returned_and_checked():
    codes = run_children([Child("ok", exit_with, (0,)), Child("three", exit_with, (3,))], SHORT,
                         expected_exit_codes={"three": 3})
    assert codes == {"ok": 0, "three": 3}
    with pytest.raises(ChildProcessesFailed, match="bad exited with 2, expected 0") as raised:
        run_children([Child("good", exit_with, (0,)), Child("bad", exit_with, (2,))], SHORT)
    assert raised.value.exit_codes == {"good": 0, "bad": 2}


def test_a_child_past_the_deadline_is_killed_and_reaped():
    with pytest.raises(ChildProcessesFailed, match="sleeper did not finish within 1 s") as raised:
        run_children([Child("sleeper", sleep_for, (60,)), Child("quick", exit_with, (0,))],
                     datetime.timedelta(seconds=1))
    assert raised.value.exit_codes["sleeper"] == -9
    assert raised.value.exit_codes["quick"] == 0
    # Reaped: neither is left, not even as a zombie.
    for pid in raised.value.pids.values():
        assert not os.path.exists(f"/proc/{pid}"), pid


def test_child_names_must_be_unique_and_ports_are_free():
    with pytest.raises(ValueError, match="unique"):
        run_children([Child("a", exit_with, (0,)), Child("a", exit_with, (0,))], SHORT)
    assert 0 < free_port() < 65536


def test_a_child_runs_in_the_environment_of_its_caller_not_the_fork_servers(monkeypatch):
    run_children([Child("first", exit_with, (0,))], SHORT)  # the fork server is running from here on
    monkeypatch.setenv("PARAMSERVER_TEST_EXIT", "7")
    assert run_children([Child("told", exit_with_variable, ("PARAMSERVER_TEST_EXIT",))], SHORT,
                        expected_exit_codes={"told": 7}) == {"told": 7}
