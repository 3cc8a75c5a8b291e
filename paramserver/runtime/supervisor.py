"""Starting, watching and restarting ``ps-server``'s shard processes.

Owns the shard processes' lives: start N children from a fork server that
imported the shard process's code once (``paramserver.processes.child_context``:
a restarted shard starts in a fraction of a second, not the two seconds an
import of torch takes; no thread of the server is forked), notice at
once when one exits (a thread waits on their sentinels) and report it,
start a new process under the same name in its place (it joins the
coordinator again and restores its tables from the newest checkpoint, then
replays its push log, which a restart keeps and a first start clears; a
bounded number of times per shard, on the same metrics port; never one
whose Join was refused for good), and stop
them all on shutdown:
SIGTERM, a bounded wait, then SIGKILL, and reap every one, so nothing
outlives the server.
"""

import datetime
import logging
import multiprocessing
import multiprocessing.sharedctypes
import multiprocessing.connection
import os
import pathlib
import shutil
import signal
import tempfile
import threading
import time
from typing import Callable, Dict, Optional

from ..control import TlsFiles
from ..metrics.exporter import shard_metrics_port
from ..processes import child_context, run_in_environment
from .shard_policy import MAX_RESTARTS, SHARD_PRELOAD
from .exit_codes import EXIT_DISK_FULL, EXIT_NO_CHECKPOINT, EXIT_REFUSED
from .shard_process import run_shard_member

logger = logging.getLogger(__name__)


class ShardSupervisor:
    """N shard processes named ``<prefix>0..`` (``shard0..``); ``on_exit(name, exit_code, not_restarted)`` runs
    when one exits on its own, before it is restarted (``not_restarted`` ``None``), or saying why it will not
    be (``""``: it left on purpose, or the server is stopping).

    With ``restart``, a shard that fails (exits with a code other than 0:
    killed, crashed) is started again (``MAX_RESTARTS`` times at most); the
    count is in ``restarts``.  Exit code 0 is a shard that left on purpose
    (the coordinator stopped it, or was lost), ``EXIT_REFUSED`` one whose
    Join was refused for good (its credentials): neither is restarted.
    With ``metrics_port`` (not ``None``) shard i serves metrics on
    ``shard_metrics_port(metrics_port, i)``; one that picked a free port
    (``metrics_port`` 0) is given the same port again when restarted.
    """

    def __init__(self, num_shards: int, coordinator_address: str, host: str,
                 on_exit: Callable[[str, Optional[int], Optional[str]], None],
                 token: Optional[str] = None, tls: Optional[TlsFiles] = None, log_level: Optional[str] = None,
                 restart: bool = False, max_restarts: int = MAX_RESTARTS, prefix: str = "shard",
                 metrics_port: Optional[int] = None, shard_token: Optional[str] = None,
                 grace: Optional[datetime.timedelta] = None, push_log: Optional[str] = None,
                 row_store: Optional[object] = None):
        if num_shards < 1:
            raise ValueError(f"--shards must be at least 1, got {num_shards}")
        #: Where shard ``name`` logs its pushes (``push_log/name``); ``None``: no push log (``"off"``, or no
        #: restarts: a log is replayed only by a restarted process).  ``None`` given: a temporary folder.
        self.push_log_root: Optional[pathlib.Path] = None
        self._temporary_push_log = restart and push_log is None
        if restart and push_log != "off":
            self.push_log_root = pathlib.Path(tempfile.mkdtemp(prefix="paramserver-push-log-")
                                              if push_log is None else push_log)
        self._context = child_context(SHARD_PRELOAD)
        self._on_exit = on_exit
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._restart = restart
        self._max_restarts = max_restarts
        # Handed to each child through the fork server's pipe (never its command line or environment).
        self._kwargs = dict(address=coordinator_address, host=host, token=token, tls=tls, log_level=log_level,
                            shard_token=shard_token, grace=grace, row_store=row_store)
        self.restarts: Dict[str, int] = {}
        # Per shard, shared with its process: the port to serve metrics on, and then the one it serves on.
        self._metrics_ports: Dict[str, multiprocessing.sharedctypes.Synchronized] = {} if metrics_port is None else {
            f"{prefix}{index}": self._context.Value("i", shard_metrics_port(metrics_port, index))
            for index in range(num_shards)}
        # Per shard, shared with its process: the member id the coordinator gave it (see ``member_id``).
        self._member_ids = {f"{prefix}{index}": self._context.Array("c", 64) for index in range(num_shards)}
        self.processes: Dict[str, multiprocessing.Process] = {
            f"{prefix}{index}": self._new_process(f"{prefix}{index}") for index in range(num_shards)}
        self._watcher = threading.Thread(target=self._watch, name="shard-supervisor", daemon=True)

    def _new_process(self, name: str) -> multiprocessing.Process:
        self._member_ids[name].value = b""
        kwargs = dict(self._kwargs, name=name, metrics_port=self._metrics_ports.get(name),
                      member_id=self._member_ids[name],
                      push_log=str(self.push_log_root / name) if self.push_log_root is not None else None)
        return self._context.Process(target=run_in_environment, name=name,
                                     args=(dict(os.environ), run_shard_member, (), kwargs))

    def member_id(self, name: str) -> str:
        """The member id of shard ``name``'s current (or just exited) process; "" before it joined."""
        return self._member_ids[name].value.decode()

    def start(self, adopted: Optional[Dict[str, int]] = None) -> "ShardSupervisor":
        """Start every shard process, but those in ``adopted`` (name -> pid): processes a ps-server before this
        one started, which outlived it and serve on; they are watched by their pid (they are not this process's
        children) and restarted like the others when they exit."""
        self._adopted = dict(adopted or {})
        for name, process in self.processes.items():
            if name in self._adopted:
                logger.info("watching %s (pid %d), started by the ps-server before this one", name,
                            self._adopted[name])
                continue
            if self.push_log_root is not None:  # a new process of a new cluster: what a log there holds is not its own
                shutil.rmtree(self.push_log_root / name, ignore_errors=True)
            process.start()
            logger.info("started %s (pid %d)", name, process.pid)
        self._watcher.start()
        return self

    def _watch(self) -> None:
        adopted = dict(getattr(self, "_adopted", {}))
        running = {name: p for name, p in self.processes.items() if name not in adopted}
        while (running or adopted) and not self._stopping.is_set():
            for name, pid in list(adopted.items()):
                if not _pid_alive(pid):
                    del adopted[name]
                    if self._stopping.is_set():
                        break
                    logger.error("shard process %s (pid %d, started by the ps-server before this one) exited",
                                 name, pid)
                    not_restarted = self._why_not_restarted(name, None)
                    if not_restarted:
                        logger.error("not restarting shard %s: %s", name, not_restarted)
                    self._on_exit(name, None, not_restarted)
                    replacement = self._replace(name) if not_restarted is None else None
                    if replacement is not None:
                        running[name] = replacement
            if not running:
                self._stopping.wait(0.2)
                continue
            ready = multiprocessing.connection.wait([p.sentinel for p in running.values()], timeout=0.2)
            for name, process in list(running.items()):
                if process.sentinel in ready:
                    process.join()
                    del running[name]
                    if not self._stopping.is_set():
                        logger.log(logging.INFO if process.exitcode == 0 else logging.ERROR,
                                   "shard process %s (pid %d) exited with code %s", name, process.pid,
                                   process.exitcode)
                        not_restarted = self._why_not_restarted(name, process.exitcode)
                        if not_restarted:
                            logger.error("not restarting shard %s: %s", name, not_restarted)
                        self._on_exit(name, process.exitcode, not_restarted)
                        replacement = self._replace(name) if not_restarted is None else None
                        if replacement is not None:
                            running[name] = replacement

    def _why_not_restarted(self, name: str, exit_code: Optional[int]) -> Optional[str]:
        """``None`` when ``name`` is to be started again; else why not ("" for a shard that left on purpose)."""
        if exit_code == 0 or self._stopping.is_set():
            return ""
        if exit_code == EXIT_REFUSED:
            return "the coordinator refused its join (exit 2)"
        if exit_code == EXIT_NO_CHECKPOINT:
            return "no checkpoint to restore its tables from verifies (exit 3; its log names the files)"
        if exit_code == EXIT_DISK_FULL:
            return "its row store could not write to its disk (exit 4; its log names the folder)"
        if not self._restart:
            return "the cluster keeps no checkpoints to restart it from"
        count = self.restarts.get(name, 0)
        if count >= self._max_restarts:
            return f"it exited {count + 1} time{'s' if count else ''} (at most {self._max_restarts} restarts)"
        return None

    def _replace(self, name: str) -> Optional[multiprocessing.Process]:
        """Start ``name`` again, unless the server is stopping."""
        count = self.restarts.get(name, 0)
        with self._lock:
            if self._stopping.is_set():
                return None
            process = self._new_process(name)
            process.start()
            self.processes[name] = process
            self.restarts[name] = count + 1
        logger.warning("restarted %s (pid %d; restart %d of at most %d)", name, process.pid, count + 1,
                       self._max_restarts)
        return process

    def wait_all_exited(self, timeout: datetime.timedelta) -> bool:
        """Block until every shard has exited for good (none running, none being restarted); False on timeout."""
        self._watcher.join(timeout.total_seconds())
        return not self._watcher.is_alive()

    def alive(self) -> Dict[str, bool]:
        adopted = getattr(self, "_adopted", {})
        return {name: _pid_alive(adopted[name]) if name in adopted and process.pid is None else process.is_alive()
                for name, process in self.processes.items()}

    def stop(self, timeout: datetime.timedelta = datetime.timedelta(seconds=3)) -> Dict[str, Optional[int]]:
        """SIGTERM every shard, wait up to ``timeout``, SIGKILL the rest; returns exit codes."""
        with self._lock:  # no restart starts after this
            self._stopping.set()
        adopted = {name: pid for name, pid in getattr(self, "_adopted", {}).items()
                   if self.processes[name].pid is None}  # still the process of the ps-server before this one
        for name, process in self.processes.items():
            if name in adopted:
                _signal(adopted[name], signal.SIGTERM)
            elif process.is_alive():
                process.terminate()
        deadline = time.monotonic() + timeout.total_seconds()
        codes: Dict[str, Optional[int]] = {}
        for name, pid in adopted.items():
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _pid_alive(pid):
                logger.warning("shard %s (pid %d) did not stop within %.0f s; killing it", name, pid,
                               timeout.total_seconds())
                _signal(pid, signal.SIGKILL)
            codes[name] = None  # not this process's child: its exit code is its parent's to read
        for name, process in self.processes.items():
            if name in adopted:
                continue
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.warning("shard %s (pid %d) did not stop within %.0f s; killing it", name, process.pid,
                               timeout.total_seconds())
                process.kill()
                process.join(5)
        if self._watcher.is_alive():
            self._watcher.join(1)
        if self._temporary_push_log and self.push_log_root is not None:
            shutil.rmtree(self.push_log_root, ignore_errors=True)
        return {name: codes[name] if name in codes else process.exitcode for name, process in self.processes.items()}


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
