"""CPU seconds of a tree of processes, by kind of process, read from ``/proc`` (Linux).

Owns watching the processes a benchmark starts, however they were started
(exec'd, forked by a fork server, in sessions of their own): the tree is
followed by parent pid from a root process; each process gets a kind when
it is seen (a ``classify`` function of its command line, its name, its
parent's command line and kind; by default its parent's kind); its CPU time (utime + stime of ``/proc/<pid>/stat``,
every thread) is read at every ``poll``, and with ``by_thread`` each group of its
threads' too, at ``mark`` and ``end`` only (``/proc/<pid>/task/<tid>/stat`` by
the thread's name: ``main`` for its first thread, ``TP_UV_loop`` for
TensorPipe's, ``pt_gloo_runloop`` for gloo's, ``pt_thread_pool`` for the RPC
handlers...: reading every thread costs the watcher about 4x a plain poll, CPU
taken from what it watches), and the last reading of each
process is kept, since most exit before the run ends (what a process spent
between its last poll and its exit is missed: poll often).  ``mark`` takes
a baseline, so that ``cpu_by_kind`` counts only what was spent after it
(training, not imports and start-up), and ``end`` a last reading, so that
it counts nothing after that either (not the evaluation, export and exit
that follow training).  Also ``name_this_process``: a
process's name (``/proc/<pid>/comm``), for a process that its command line
does not tell apart (a fork server's children share its command line).
"""

import ctypes
import os
import threading
import time
from typing import Callable, Dict, Optional, Tuple

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_PR_SET_NAME = 15
#: (pid, start time in clock ticks): a process, even after its pid is reused.
ProcessKey = Tuple[int, int]
#: ``classify(cmdline, name, parent_cmdline, parent_kind)``: a process's kind, or ``None`` for its parent's.
Classify = Callable[[str, str, str, str], Optional[str]]


def name_this_process(name: str) -> None:
    """Set this process's name (``/proc/self/comm``, what ``ps`` and ``top`` show; 15 bytes at most)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name only helps the figures by kind
        pass


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as source:
            return source.read().decode(errors="replace")
    except OSError:  # gone already
        return None


def read_stat(pid: int) -> Optional[Tuple[int, int, float]]:
    """(parent pid, start time in ticks, CPU seconds) of ``pid``, or ``None`` when it is gone."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (name) ": the name may hold spaces
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def read_threads(pid: int) -> Dict[str, float]:
    """CPU seconds of each named group of ``pid``'s threads: ``main`` (its first thread), the others by their
    name (``/proc/<pid>/task/<tid>/comm``, digits at its end dropped); empty when it is gone."""
    groups: Dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return groups
    for tid in tids:
        stat = _read(f"/proc/{pid}/task/{tid}/stat")
        if stat is None:
            continue
        name = "main" if tid == str(pid) else stat[stat.index("(") + 1:stat.rindex(")")].rstrip("0123456789-_")
        fields = stat[stat.rindex(")") + 2:].split()
        groups[name] = groups.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return groups


def read_rss(pid: int, field: str = "VmRSS") -> int:
    """Resident memory of ``pid`` in bytes (``VmRSS``), or its peak (``field="VmHWM"``); 0 when it is gone."""
    for line in (_read(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def read_cmdline(pid: int) -> str:
    return (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").strip()


def read_name(pid: int) -> str:
    return (_read(f"/proc/{pid}/comm") or "").strip()


class ProcessTreeCPU:
    """The CPU seconds of ``root`` and its descendants, by kind (``classify``; the root's kind is
    ``root_kind``).  ``poll`` is safe to call from a thread of its own (``PollingThread``)."""

    def __init__(self, root: int, root_kind: str, classify: Classify, by_thread: bool = False):
        self.root, self.root_kind, self.classify, self.by_thread = root, root_kind, classify, by_thread
        self._threads: Dict[ProcessKey, Dict[str, float]] = {}  # the last reading of each thread group
        self._threads_baseline: Dict[ProcessKey, Dict[str, float]] = {}
        self._lock = threading.Lock()
        self._parents: Dict[int, Tuple[int, int]] = {}  # pid -> (parent pid, start time), every pid seen
        self._kinds: Dict[ProcessKey, str] = {}
        self._cmdlines: Dict[ProcessKey, str] = {}
        self._readings: Dict[ProcessKey, float] = {}
        self._baseline: Optional[Dict[ProcessKey, float]] = None
        self._rss: Dict[ProcessKey, int] = {}  # the largest resident memory seen
        self._rss_baseline: Dict[ProcessKey, int] = {}
        self._ended = False

    def poll(self, threads: bool = False) -> None:
        """Read the CPU time of every process of the tree now (new ones are classified first), and with
        ``threads`` (and ``by_thread``) of its threads; nothing after ``end``."""
        if self._ended:
            return
        stats = {}
        with self._lock:
            of_tree = {pid for pid, _ in self._kinds}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                pid = int(entry)
                known = self._parents.get(pid)
                if known is None or pid == self.root or pid in of_tree or known[0] in of_tree:
                    stat = read_stat(pid)  # new, or of the tree (or a child of it): read again
                    if stat is not None:
                        self._parents[pid] = stat[:2]
                        stats[pid] = stat
        with self._lock:
            for pid in sorted(stats, key=lambda p: stats[p][1]):  # parents start before their children
                parent, started, cpu = stats[pid]
                key = (pid, started)
                parent_key = (parent, self._parents.get(parent, (0, -1))[1])
                if pid != self.root and parent_key not in self._kinds and key not in self._kinds:
                    continue  # not of the tree
                # Classified again at every poll: a child reads as its parent until it calls exec.  An exited
                # process not yet reaped has an empty command line: the last one read stays.
                self._cmdlines[key] = read_cmdline(pid) or self._cmdlines.get(key, "")
                if pid == self.root:
                    self._kinds[key] = self.root_kind
                elif parent_key in self._kinds:
                    parent_kind = self._kinds[parent_key]
                    self._kinds[key] = self.classify(self._cmdlines[key], read_name(pid),
                                                     self._cmdlines.get(parent_key, ""), parent_kind) or parent_kind
                self._readings[key] = cpu
                if threads and self.by_thread:
                    self._threads[key] = read_threads(pid) or self._threads.get(key, {})
                self._rss[key] = max(self._rss.get(key, 0), read_rss(pid))

    def mark(self) -> None:
        """Poll, and count from now on."""
        self.poll(threads=True)
        with self._lock:
            self._baseline = dict(self._readings)
            self._threads_baseline = {key: dict(groups) for key, groups in self._threads.items()}
            self._rss_baseline = dict(self._rss)

    def end(self) -> None:
        """Poll, and count nothing from now on."""
        self.poll(threads=True)
        self._ended = True

    def alive(self) -> int:
        """How many of the processes seen under the root (not the root) are still running."""
        with self._lock:
            seen = [key for key in self._kinds if key[0] != self.root]
        return sum(1 for pid, started in seen if (read_stat(pid) or (0, -1))[1] == started)

    @property
    def marked(self) -> bool:
        return self._baseline is not None

    @property
    def ended(self) -> bool:
        return self._ended

    def cpu_by_kind(self) -> Dict[str, float]:
        """CPU seconds of each kind of process since ``mark`` (since each one started, without a mark)."""
        with self._lock:
            spent: Dict[str, float] = {}
            for key, cpu in self._readings.items():
                kind = self._kinds[key]
                spent[kind] = spent.get(kind, 0.0) + cpu - (self._baseline or {}).get(key, 0.0)
            return spent


    def cpu_by_thread(self) -> Dict[Tuple[str, str], float]:
        """With ``by_thread``: CPU seconds of each (kind of process, thread group) from ``mark`` to ``end`` (a
        thread that exited between them is not counted; a process that did, up to its reading at ``mark``)."""
        with self._lock:
            spent: Dict[Tuple[str, str], float] = {}
            for key, groups in self._threads.items():
                before = self._threads_baseline.get(key, {})
                for name, cpu in groups.items():
                    group = (self._kinds[key], name)
                    spent[group] = spent.get(group, 0.0) + max(0.0, cpu - before.get(name, 0.0))
            return spent

    def rss_growth_by_kind(self) -> Dict[str, float]:
        """Per kind, the most any one of its processes' resident memory grew from ``mark`` to its largest
        reading after it, in MiB (processes that started after the mark: from their first reading)."""
        with self._lock:
            growth: Dict[str, float] = {}
            for key, peak in self._rss.items():
                kind = self._kinds[key]
                grown = (peak - self._rss_baseline.get(key, peak)) / 2**20
                growth[kind] = max(growth.get(kind, 0.0), grown)
            return growth


class PollingThread:
    """Polls a ``ProcessTreeCPU`` every ``interval`` seconds (every half second at most until ``ready()``, asked
    every ``fast_interval``, says the window starts, then it marks; then every ``fast_interval`` again, once ``done`` is given, until
    ``done()`` says the window ends, then it ends the tree's counting) while the ``with`` block runs, and
    once more at its end."""

    def __init__(self, tree: ProcessTreeCPU, ready: Callable[[], bool], interval: float = 0.5,
                 fast_interval: float = 0.1, done: Optional[Callable[[], bool]] = None):
        self.tree, self.ready, self.interval, self.fast_interval = tree, ready, interval, fast_interval
        self.done = done
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-cpu", daemon=True)

    def _run(self) -> None:
        next_poll = 0.0
        while not self._stop.is_set() and not self.tree.ended:
            if not self.tree.marked:
                if self.ready():
                    self.tree.mark()
                elif time.monotonic() >= next_poll:  # (at most every half second: a reading costs CPU)
                    self.tree.poll()
                    next_poll = time.monotonic() + min(self.interval, 0.5)
            elif self.done is not None and self.done():  # (asked every fast_interval: it is a cheap look)
                self.tree.end()
                return
            elif time.monotonic() >= next_poll:
                self.tree.poll()
                next_poll = time.monotonic() + self.interval
            self._stop.wait(self.interval if self.tree.marked and self.done is None else self.fast_interval)

    def __enter__(self) -> "PollingThread":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        if self.tree.marked and self.done is not None and self.done():  # it ended between two looks
            self.tree.end()
        self.tree.poll()
