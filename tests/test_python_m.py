"""``python -m paramserver COMMAND`` and ``python -m paramserver.cli.X`` run what the console scripts run.

Each check is one short subprocess (``--help``, or a call that fails at once), so no cluster is started.
"""

import importlib
import os
import subprocess
import sys

import pytest

from paramserver.__main__ import COMMANDS

ENV = {**os.environ, "COLUMNS": "100"}  # argparse wraps its help to the terminal's width


def python_m(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=ENV, timeout=60)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_prints_its_console_scripts_help(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exited:
        importlib.import_module(COMMANDS[command]).main(["--help"])
    assert exited.value.code == 0
    expected = capsys.readouterr().out
    ran = python_m("paramserver", command, "--help")
    assert (ran.returncode, ran.stdout) == (0, expected), ran.stderr


def test_the_package_lists_its_commands_and_refuses_others():
    listed = python_m("paramserver", "--help")
    assert listed.returncode == 0 and all(command in listed.stdout for command in COMMANDS), listed
    unknown = python_m("paramserver", "serve")
    assert unknown.returncode == 2 and "unknown command 'serve'; choose one of server" in unknown.stderr, unknown


def test_a_cli_module_run_as_main_reports_its_failure():
    # Port 1 on loopback refuses at once: the command says so and exits 1 (it used to print nothing and exit 0).
    ran = python_m("paramserver.cli.ctl", "--connect", "127.0.0.1:1", "status")
    assert ran.returncode == 1 and "127.0.0.1:1 unreachable" in ran.stderr, ran
    refused = python_m("paramserver.cli.export", "/tmp/unused-export")
    assert refused.returncode == 2 and "export needs --checkpoint-dir" in refused.stderr, refused
