"""Starting, joining and reaping child processes.

Owns the discipline every multi-process run here follows (tests,
benchmarks, local clusters): children are started by a fork server
(``forkserver``: a clean single-threaded process that imported torch and
the data plane once, ``PRELOAD``, so each child skips that two-second
import; nothing of the caller's threads or state is forked, and each child
runs in the caller's environment variables of the moment), are joined
against one deadline, and any child still alive at the deadline, or when
the caller fails, is killed by its pid and reaped, so nothing outlives the
run.  Exit codes are checked against what was expected.
"""

import datetime
import multiprocessing
import multiprocessing.forkserver
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Mapping, Optional, Sequence


#: What the fork server imports once for every child it starts: torch and the data plane.
PRELOAD = ("torch", "torch.distributed.rpc", "torch.distributed.autograd", "paramserver.shards", "paramserver.ddp")


def child_context(preload: Sequence[str] = PRELOAD) -> multiprocessing.context.BaseContext:
    """The context children start in: this process's fork server, which imports ``preload`` when it starts
    (it starts with the first child; one fork server per process, so the first caller's ``preload`` holds)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(preload))
    return context


def run_in_environment(environment: Dict[str, str], target: Callable, args: tuple, kwargs: dict) -> None:
    """Child: ``target(*args, **kwargs)`` under ``environment``, the caller's when it started the child (the
    fork server's own is the one it started with)."""
    os.environ.clear()
    os.environ.update(environment)
    target(*args, **kwargs)


def start_fork_server(preload: Sequence[str]) -> None:
    """Start this process's fork server now (it imports ``preload``), rather than with the first child: a
    caller about to import for seconds itself lets the two imports run side by side."""
    child_context(preload)
    multiprocessing.forkserver.ensure_running()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


@dataclass
class Child:
    """A child process to run: ``target(*args, **kwargs)`` under ``name``."""

    name: str
    target: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


class ChildProcessesFailed(RuntimeError):
    """Some child exited with an unexpected code or did not finish in time."""

    def __init__(self, message: str, exit_codes: Dict[str, Optional[int]], pids: Dict[str, int]):
        super().__init__(message)
        self.exit_codes = exit_codes
        self.pids = pids


def run_children(children: Sequence[Child], timeout: datetime.timedelta,
                 expected_exit_codes: Optional[Mapping[str, int]] = None) -> Dict[str, int]:
    """Run ``children`` concurrently until all exit or ``timeout`` passes; returns their exit codes.

    Raises ``ChildProcessesFailed`` naming every child that timed out (it is
    killed) or exited with a code other than expected (default 0).
    """
    names = [child.name for child in children]
    if len(set(names)) != len(names):
        raise ValueError(f"child names must be unique, got {names}")
    expected = {name: 0 for name in names}
    expected.update(expected_exit_codes or {})
    context = child_context()
    processes = {}
    timed_out = []
    try:
        for child in children:
            process = context.Process(target=run_in_environment, name=child.name,
                                      args=(dict(os.environ), child.target, child.args, child.kwargs))
            process.start()
            processes[child.name] = process
        deadline = time.monotonic() + timeout.total_seconds()
        for name, process in processes.items():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                timed_out.append(name)
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()
        for process in processes.values():
            process.join(10)
    codes = {name: process.exitcode for name, process in processes.items()}
    problems = [f"{name} did not finish within {timeout.total_seconds():.0f} s" for name in timed_out]
    problems += [f"{name} exited with {code}, expected {expected[name]}"
                 for name, code in codes.items() if name not in timed_out and code != expected[name]]
    if problems:
        raise ChildProcessesFailed("; ".join(problems), codes, {name: p.pid for name, p in processes.items()})
    return codes
