"""``ps-demo``: the main job on a local cluster, start to finish, in one command.

    ps-demo [--shards 4] [--workers 2] [--hook powersgd] [--steps N] [--job-config JSON] [--log-dir D]
            [--server-flags "--checkpoint-dir D --checkpoint-every 200 ..."]

Starts ``ps-server --shards N`` (the coordinator and its shard servers) and
``--workers`` ``ps-worker --connect`` processes that form one trainer group
with the chosen comm hook and train the default CTR job; shows their
progress from the coordinator's status, where each worker reports every
step (tqdm: a bar on a terminal, plain lines otherwise); and ends by printing one line of JSON on stdout: steps,
samples_per_s (all workers together), auc, log_loss and oracle_auc (held out),
hook, bytes_per_step (what the hook all-reduced per step), loss, sparse_steps_lost and
replayed_pushes (every worker's, summed), seconds.  ``--server-flags`` hands
ps-server more flags (checkpoints, a push log: ``docs/fault-tolerance.md``).
Every process it started is stopped and reaped however it ends (Ctrl-C,
SIGTERM or SIGHUP included: exit code 128 + the signal's number); their
logs stay in ``--log-dir`` (a temporary folder by default), with
``pids.json`` naming every process it started.  ``make demo``
runs it.  Exit code 0 when every process finished cleanly.
"""

import argparse
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from ..control import CoordinatorClient, CoordinatorError
from ..runtime.job import DEFAULT_JOB
from ..runtime.threads import HOST_PROCESSES_ENV
from ..train.trainer import ALLREDUCE_FIGURE, PHASE_FIGURE, ROW_CACHE_FIGURE
from .common import UsageError, command_main, job_config_from
from .progress import Progress

READY_WITHIN = 120.0
SERVER_STOPS_WITHIN = 20.0
_POLL = 1.0  # status polls: a progress display needs no more, and each costs the busy cluster CPU


class DemoFailed(RuntimeError):
    """A process of the demo failed; the message says which and where its log is."""


class Stopped(BaseException):
    """ps-demo was told to stop by signal ``signum`` (SIGTERM, SIGHUP; SIGINT raises ``KeyboardInterrupt``).

    A ``BaseException``, as ``KeyboardInterrupt`` is: raised wherever the main thread is, it must not be taken
    for an error by a library's ``except Exception`` (tqdm's start of its monitor thread, for one, caught it,
    warned "disabling monitor support ... due to: SIGTERM", and ps-demo trained on)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: The signals that stop ps-demo as Ctrl-C does: a process manager's, a launcher's or ``timeout``'s stop
#: (SIGTERM), a closed terminal (SIGHUP).  Its children run in sessions of their own, so they hear none of
#: these; left to the default action, ps-demo would die at once and leave its whole cluster running.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _stop_on_signals() -> None:
    """Have ``STOP_SIGNALS`` raise ``Stopped`` in the main thread, once: from then on they, and SIGINT, are
    ignored, so that a second signal cannot interrupt the reaping of the cluster."""
    def stop(signum, _frame):
        for ignored in (*STOP_SIGNALS, signal.SIGINT):
            signal.signal(ignored, signal.SIG_IGN)
        raise Stopped(signum)
    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, default=4, help="shard servers (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="workers, all in one trainer group (default 2)")
    parser.add_argument("--hook", default="powersgd", help="DDP comm hook of the trainer group (default powersgd)")
    parser.add_argument("--hook-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the comm hook (matrix_approximation_rank=2...); repeatable")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the job's, 1500)")
    parser.add_argument("--job", default=DEFAULT_JOB, help=f"the job (default {DEFAULT_JOB})")
    parser.add_argument("--job-config", default="{}", metavar="JSON", help="more keyword arguments for the job")
    parser.add_argument("--log-dir", help="where the processes' logs go (default: a new temporary folder)")
    parser.add_argument("--server-flags", default="", metavar="FLAGS",
                        help="more flags for ps-server, as one string (\"--checkpoint-dir D --checkpoint-every 200\")")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                        help="give up (and stop everything) after this long (default 900)")


class LocalProcesses:
    """The demo's children: each in a session of its own, logging to files (``<name>.out``, ``<name>.log``),
    all reaped at the end (``benchmarks/online_group.py`` starts its cluster with them too)."""

    def __init__(self, log_dir: pathlib.Path):
        self.log_dir = log_dir
        self.started: Dict[str, subprocess.Popen] = {}

    def start(self, name: str, module: str, *args: str, host_processes: Optional[int] = None) -> subprocess.Popen:
        """``host_processes``: the cluster's processes on this machine, for each to size its threads by from its
        start (``None``: the coordinator counts them as they join)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if host_processes is not None:
            env.setdefault(HOST_PROCESSES_ENV, str(host_processes))  # threads sized to what shares this machine
        with open(self.log_dir / f"{name}.out", "w") as out, open(self.log_dir / f"{name}.log", "w") as err:
            process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=err, env=env,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        self.started[name] = process
        (self.log_dir / "pids.json").write_text(json.dumps({n: p.pid for n, p in self.started.items()}))
        return process

    def tail(self, name: str, lines: int = 15) -> str:
        text = []
        for suffix in (".out", ".log"):
            path = self.log_dir / f"{name}{suffix}"
            if path.exists():
                text += path.read_text(errors="replace").splitlines()
        return "\n".join("    " + line for line in text[-lines:])

    def failure(self, name: str, what: str) -> DemoFailed:
        return DemoFailed(f"{name} {what}; its log ({self.log_dir / name}.log) ends:\n{self.tail(name)}")

    def shut_down(self, address: str, within: float = 60.0) -> None:
        """``ps-ctl shutdown`` the cluster at ``address``, give every child up to ``within`` seconds in all to
        exit, then reap whatever is left."""
        subprocess.run([sys.executable, "-m", "paramserver.cli.ctl", "--connect", address, "shutdown"],
                       capture_output=True, timeout=within)
        deadline = time.monotonic() + within
        for process in self.started.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.reap()

    def reap(self) -> None:
        for process in self.started.values():
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)  # its session: ps-server's shards go too
                except ProcessLookupError:
                    pass
        for process in self.started.values():
            process.wait(10)


def wait_for_ready(processes: LocalProcesses, server: subprocess.Popen) -> str:
    """The address ps-server ``server`` serves at, once it says it is ready (``DemoFailed`` if it exits or is
    not ready within ``READY_WITHIN``)."""
    deadline = time.monotonic() + READY_WITHIN
    out = processes.log_dir / "ps-server.out"
    while time.monotonic() < deadline:
        for line in out.read_text().splitlines():
            if line.startswith("ps-server ready at "):
                return line.split()[3]
        if server.poll() is not None:
            raise processes.failure("ps-server", f"exited with code {server.returncode} before it was ready")
        time.sleep(0.1)
    raise processes.failure("ps-server", f"was not ready within {READY_WITHIN:.0f} s")


def _averaged(key: str) -> bool:
    """Whether a worker figure is shown as the workers' mean: where a step's time goes, the all-reduce in
    flight, the row cache."""
    return key.startswith(PHASE_FIGURE) or key.startswith(ROW_CACHE_FIGURE) or key == ALLREDUCE_FIGURE


def _figures(workers) -> Dict[str, float]:
    """The group's figures from its workers' reports: rank 0 evaluates, every worker counts its samples."""
    figures: Dict[str, float] = {}
    for worker in workers:
        for key in ("auc", "log_loss", "oracle_auc", "bytes_per_step", "loss", "first_loss"):
            if key in worker.metrics:
                figures[key] = worker.metrics[key]
    figures["samples_per_s"] = sum(w.metrics.get("samples_per_s", 0.0) for w in workers)
    for key in ("sparse_steps_lost", "replayed_pushes"):  # every worker's own
        figures[key] = sum(w.metrics.get(key, 0.0) for w in workers)
    for key in sorted({key for worker in workers for key in worker.metrics if _averaged(key)}):
        values = [worker.metrics[key] for worker in workers if key in worker.metrics]
        figures[key] = sum(values) / len(values)
    return figures


def _shown(figures: Dict[str, float], hook: str) -> Dict[str, str]:
    shown = {}
    if "loss" in figures:
        shown["loss"] = f"{figures['loss']:.4f}"
    if "auc" in figures:
        shown["auc"] = f"{figures['auc']:.4f} (oracle {figures.get('oracle_auc', float('nan')):.4f})"
    shown["samples/s"] = f"{figures['samples_per_s']:,.0f}"
    if "bytes_per_step" in figures:
        shown[hook] = f"{figures['bytes_per_step'] / 1024:,.1f} KiB/step"
    return shown


def run_demo(args, config: dict, processes: LocalProcesses) -> dict:
    total = int(config.get("steps", 1500))
    began = time.monotonic()
    host_processes = 1 + args.shards + args.workers  # the coordinator, its shards, the workers: all on this host
    server = processes.start("ps-server", "paramserver.cli.server", "--shards", str(args.shards), "--port", "0",
                             "--group-size", str(args.workers), "--job", args.job,
                             "--job-config", json.dumps(config), *shlex.split(args.server_flags),
                             host_processes=host_processes)
    address = wait_for_ready(processes, server)
    print(f"ps-demo: cluster ready at {address} ({args.shards} shards); starting {args.workers} workers with the "
          f"{args.hook} hook; logs in {processes.log_dir}", file=sys.stderr, flush=True)
    hook_flags = ["--comm-hook", args.hook] + [f for option in args.hook_option for f in ("--comm-hook-option", option)]
    workers = [processes.start(f"ps-worker{i}", "paramserver.cli.worker", "--connect", address, *hook_flags,
                               host_processes=host_processes)
               for i in range(args.workers)]
    client = CoordinatorClient(address)
    progress = Progress(total, "ps-demo")
    deadline = began + args.timeout
    try:
        members = []
        while any(w.poll() is None for w in workers):
            if time.monotonic() > deadline:
                raise DemoFailed(f"the workers did not finish within {args.timeout:.0f} s")
            if server.poll() is not None:
                raise processes.failure("ps-server", f"exited with code {server.returncode} during training")
            try:
                members = list(client.status().workers)
            except CoordinatorError:
                pass  # shown again at the next poll
            if members:
                progress.update(min(m.step for m in members), _shown(_figures(members), args.hook))
            time.sleep(_POLL)
        for index, worker in enumerate(workers):
            if worker.returncode != 0:
                raise processes.failure(f"ps-worker{index}", f"exited with code {worker.returncode}")
        members = list(client.status().workers)
        figures = _figures(members)
        steps = min(m.step for m in members)
        progress.update(steps, _shown(figures, args.hook), force=True)
    finally:
        progress.close()
        client.close()
    server.send_signal(signal.SIGTERM)
    try:
        code = server.wait(SERVER_STOPS_WITHIN)
    except subprocess.TimeoutExpired:
        raise processes.failure("ps-server", f"did not stop within {SERVER_STOPS_WITHIN:.0f} s of SIGTERM") from None
    if code != 0:
        raise processes.failure("ps-server", f"exited with code {code} when stopped")
    summary = {"steps": steps, "samples_per_s": round(figures["samples_per_s"], 1),
               "auc": round(figures.get("auc", float("nan")), 4),
               "log_loss": round(figures.get("log_loss", float("nan")), 4),
               "oracle_auc": round(figures.get("oracle_auc", float("nan")), 4),
               "hook": args.hook, "bytes_per_step": int(figures.get("bytes_per_step", 0)),
               "loss": round(figures.get("loss", float("nan")), 4),
               "first_loss": round(figures.get("first_loss", float("nan")), 4), "workers": args.workers,
               "shards": args.shards, "sparse_steps_lost": int(figures["sparse_steps_lost"]),
               "replayed_pushes": int(figures["replayed_pushes"]), "seconds": round(time.monotonic() - began, 1)}
    summary.update({key: round(value, 2) for key, value in figures.items() if _averaged(key)})
    return summary


def _job_config(args) -> dict:
    """The job's arguments from the flags (checked)."""
    if args.shards < 1 or args.workers < 1:
        raise UsageError("--shards and --workers must be at least 1")
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    config = job_config_from(args.job_config)
    if args.steps is not None:
        config["steps"] = args.steps
    if isinstance(config.get("data"), dict) and not config["data"].get("follow"):  # the workers share fixed files
        config["data"].setdefault("workers", args.workers)  # (a followed input is dealt by the group: docs/data.md)
    return config


def run(args) -> int:
    try:
        config = _job_config(args)
    except UsageError as error:
        print(f"ps-demo: {error}", file=sys.stderr)
        return 2
    log_dir = pathlib.Path(args.log_dir or tempfile.mkdtemp(prefix="ps-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    processes = LocalProcesses(log_dir)
    try:
        _stop_on_signals()
        summary = run_demo(args, config, processes)
    except DemoFailed as error:
        print(f"ps-demo: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt the reaping
        print("ps-demo: interrupted; stopping the cluster", file=sys.stderr)
        return 128 + signal.SIGINT
    except Stopped as stopped:
        print(f"ps-demo: stopped by {stopped}; stopping the cluster", file=sys.stderr)
        return 128 + stopped.signum
    finally:
        processes.reap()
    print(json.dumps(summary), flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return command_main("ps-demo", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
