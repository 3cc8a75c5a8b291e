"""Running the real console scripts (ps-server, ps-worker, ps-ctl) from tests.

Every process started here is tracked and, when the test ends however it
ends, killed by its pid and reaped; output goes to files, so no pipe fills.
"""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
from typing import List, Optional

BIN = pathlib.Path(sys.executable).parent


class Commands:
    def __init__(self, folder: pathlib.Path):
        self.folder = folder
        self.processes: List[subprocess.Popen] = []
        self._count = 0

    def start(self, command: str, *args: str, netns: Optional[str] = None,
              env: Optional[dict] = None) -> subprocess.Popen:
        """``command`` (a console script, or a path) with ``args``, and ``env`` over this process's
        environment; in network namespace ``netns`` if given (``ip netns exec`` execs the command itself, so
        the pid is still the command's)."""
        self._count += 1
        stem = self.folder / f"{self._count:02d}-{pathlib.Path(command).name}"
        stdout, stderr = open(f"{stem}.out", "w"), open(f"{stem}.err", "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        prefix = ["ip", "netns", "exec", netns] if netns else []
        process = subprocess.Popen([*prefix, str(BIN / command), *args], stdout=stdout, stderr=stderr, env=env,
                                   start_new_session=True)
        process.out_path, process.err_path = f"{stem}.out", f"{stem}.err"
        self.processes.append(process)
        return process

    def run(self, command: str, *args: str, timeout: float = 60,
            netns: Optional[str] = None) -> subprocess.CompletedProcess:
        process = self.start(command, *args, netns=netns)
        code = process.wait(timeout)
        return subprocess.CompletedProcess(process.args, code, output(process), errors(process))

    def reap(self) -> List[str]:
        """Kill and reap whatever is still running; returns what was.

        Each command runs in a session of its own (its pid is the group's id),
        so killing the group also ends the children it started (ps-server's
        shards) and nothing else.
        """
        leftovers = []
        for process in self.processes:
            if process.poll() is None:
                leftovers.append(" ".join(process.args))
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait(10)
        return leftovers


def output(process) -> str:
    return pathlib.Path(process.out_path).read_text()


def errors(process) -> str:
    return pathlib.Path(process.err_path).read_text()


def wait_for_output(process, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        match = re.search(pattern, output(process))
        if match:
            return match
        if process.poll() is not None:
            raise AssertionError(f"{process.args[0]} exited with {process.returncode} before printing "
                                 f"{pattern!r}:\n{output(process)}\n{errors(process)[-3000:]}")
        time.sleep(0.1)
    raise AssertionError(f"{process.args[0]} did not print {pattern!r} within {timeout} s:\n{errors(process)[-3000:]}")


def start_server(commands: Commands, *args: str, timeout: float = 90, netns: Optional[str] = None,
                 env: Optional[dict] = None):
    """ps-server on a free port (``env`` over this process's environment); returns (process, address) once it
    said it is ready."""
    server = commands.start("ps-server", "--port", "0", *args, netns=netns, env=env)
    address = wait_for_output(server, r"ps-server ready at (\S+)", timeout).group(1)
    return server, address


def status(commands: Commands, address: str, *extra: str, netns: Optional[str] = None) -> dict:
    """What ``ps-ctl --connect ADDRESS [EXTRA] status --json`` prints: asked from this process when there are
    no extra flags and no namespace (a ps-ctl process costs a third of a CPU second, and tests poll this
    up to five times a second beside the cluster they test), else by running ps-ctl."""
    if not extra and netns is None:
        from paramserver.cli.ctl import status_as_dict
        from paramserver.control import CoordinatorClient
        client = CoordinatorClient(address)
        try:
            return status_as_dict(client.status())
        finally:
            client.close()
    result = commands.run("ps-ctl", "--connect", address, *extra, "status", "--json", netns=netns)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_for_status(commands, address, predicate, timeout: float, *extra: str, netns: Optional[str] = None) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        current = status(commands, address, *extra, netns=netns)
        if predicate(current):
            return current
        if time.monotonic() > deadline:
            raise AssertionError(f"status never matched within {timeout} s: {current}")
        time.sleep(0.5 if extra or netns else 0.2)  # a ps-ctl process per poll, or an RPC from this process


def terminate_within(process, seconds: float) -> float:
    """SIGTERM ``process``; assert it exits 0 within ``seconds``; returns how long it took."""
    began = time.monotonic()
    process.send_signal(signal.SIGTERM)
    code = process.wait(seconds)
    took = time.monotonic() - began
    assert code == 0, f"exit {code}:\n{errors(process)[-3000:]}"
    return took


def pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def job_config(**config) -> str:
    return json.dumps(config)


__all__ = ["Commands", "output", "errors", "wait_for_output", "start_server", "status", "wait_for_status",
           "terminate_within", "pid_exists", "job_config"]


def self_signed_certificate(folder: pathlib.Path):
    """(cert.pem, key.pem) for 127.0.0.1/localhost, made by openssl; skips the test without it."""
    import shutil

    import pytest
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def listening_addresses(pids) -> set:
    """The local IP addresses on which processes ``pids`` listen for TCP (from /proc)."""
    inodes = set()
    for pid in pids:
        for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    addresses = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                if width == 8:
                    addresses.add(".".join(str(b) for b in reversed(raw)))
                else:
                    words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
                    address = socket.inet_ntop(socket.AF_INET6, b"".join(words))
                    addresses.add(address.removeprefix("::ffff:"))  # IPv4 on an IPv6 socket
    return addresses
