"""Jobs: what workers run, how its code travels, and what it sees while running.

Owns naming a job (``package.module:function`` or ``path/to/file.py:function``),
packing it as cloudpickle bytes *by value* (so a worker needs no copy of the
job's file, only the packages it imports), unpacking it on the worker, and
``JobContext``, the job's view of the cluster (its RPC name, the live
shards, its trainer group's views, progress reporting, the stop request).
"""

import datetime
import importlib
import importlib.util
import json
import pathlib
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import cloudpickle

from ..control.protocol import pb

#: The job ``ps-server`` ships when given none.
DEFAULT_JOB = "workers.ctr:main"
#: How long a job waits for its trainer group to form before giving up.
GROUP_WAIT = datetime.timedelta(seconds=120)
_GROUP_POLL = datetime.timedelta(seconds=0.25)


class JobError(ValueError):
    """A job that cannot be found, packed or unpacked; the message says which and why."""


def load_job(reference: str) -> Callable:
    """The callable named by ``reference``: ``module:function`` or ``file.py:function``."""
    module_part, sep, function_name = reference.rpartition(":")
    if not sep or not module_part or not function_name:
        raise JobError(f"job {reference!r} must look like package.module:function or path/to/file.py:function")
    if module_part.endswith(".py"):
        path = pathlib.Path(module_part)
        if not path.is_file():
            raise JobError(f"job file {path} does not exist")
        module_name = f"paramserver_job_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            raise JobError(f"job file {path} failed to load: {type(error).__name__}: {error}") from error
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as error:
            raise JobError(f"job module {module_part!r} cannot be imported: {error}") from error
    function = getattr(module, function_name, None)
    if not callable(function):
        raise JobError(f"job {reference!r}: {module_part} has no callable named {function_name!r}")
    return function


def pack_job(reference: str, config: Dict[str, Any] = None, group_size: int = 0) -> pb.JobSpec:
    """Load the job and pickle it by value, with ``config`` (JSON-able keyword arguments).

    ``group_size``: workers per trainer group (0: one group of every worker).
    """
    if group_size < 0:
        raise JobError(f"group_size must be 0 (one group of every worker) or positive, got {group_size}")
    function = load_job(reference)
    module = sys.modules[function.__module__]
    cloudpickle.register_pickle_by_value(module)
    try:
        code = cloudpickle.dumps(function)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    try:
        config_json = json.dumps(config or {})
    except TypeError as error:
        raise JobError(f"job config must be JSON: {error}") from error
    return pb.JobSpec(name=reference, code=code, config_json=config_json, group_size=group_size)


def unpack_job(spec: pb.JobSpec) -> Tuple[Callable, Dict[str, Any]]:
    """The callable and its keyword arguments, from a job spec received from the coordinator."""
    try:
        function = cloudpickle.loads(spec.code)
    except Exception as error:
        raise JobError(f"job {spec.name!r} cannot be unpickled here ({type(error).__name__}: {error}); "
                       "are its imports installed on this worker?") from error
    try:
        config = json.loads(spec.config_json or "{}")
    except json.JSONDecodeError as error:
        raise JobError(f"job {spec.name!r} has a config that is not JSON: {error}") from error
    if not isinstance(config, dict):
        raise JobError(f"job {spec.name!r}: config must be a JSON object, got {type(config).__name__}")
    return function, config


@dataclass
class JobContext:
    """What a running job knows of the cluster; passed as the job's first argument.

    A job is ``def main(ctx: JobContext, **config) -> dict``.  It should call
    ``report`` every step (heartbeats carry the latest figures to the
    coordinator) and return soon after ``should_stop()`` turns true.
    ``join_trainer_group()`` forms the DDP process group of its trainer group.
    """

    rpc_name: str
    worker_index: int
    generation: int
    trainer_group: int
    shards: List[str]
    store_host: str
    store_port: int
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    step: int = 0
    metrics: Dict[str, float] = field(default_factory=dict)
    #: Asks the coordinator for news now (a heartbeat); set by the worker runtime.
    refresh: Callable[[], None] = field(default=lambda: None, repr=False)
    _group_view: Optional[pb.TrainerGroupView] = field(default=None, repr=False)
    _group_changed: threading.Condition = field(default_factory=threading.Condition, repr=False)
    #: Where checkpoints go and what to restore from (an empty ``directory``: none configured).
    checkpoint: pb.CheckpointSettings = field(default_factory=pb.CheckpointSettings)
    #: Commits a written checkpoint at the coordinator (returns its id); set by the worker runtime.
    commit_checkpoint: Callable[[pb.CommitCheckpointRequest], str] = field(default=None, repr=False)
    #: The shards serving now, as of the last heartbeat (``shards`` is the list at join); set by the runtime.
    live_shards: Callable[[], List[str]] = field(default=None, repr=False)
    #: Tells the coordinator that a generation of this worker's trainer group broke (a new one is due).
    request_regroup: Callable[[int], None] = field(default=lambda generation: None, repr=False)
    #: The member id the coordinator knows this worker by (commits carry it).
    member_id: str = ""
    _checkpoint_request: int = 0

    def __post_init__(self):
        if self.live_shards is None:
            self.live_shards = lambda: list(self.shards)

    def report(self, step: int, **metrics: float) -> None:
        """Record progress: the step reached and a few figures (loss, samples/s...)."""
        with self._lock:
            self.step = int(step)
            self.metrics = {key: float(value) for key, value in metrics.items()}

    def progress(self) -> Tuple[int, Dict[str, float]]:
        with self._lock:
            return self.step, dict(self.metrics)

    def should_stop(self) -> bool:
        """True once the coordinator asked this worker to stop (or was lost)."""
        return self._stop.is_set()

    def request_stop(self) -> None:
        self._stop.set()
        with self._group_changed:
            self._group_changed.notify_all()

    # -- checkpoints ---------------------------------------------------
    def request_checkpoint(self, number: int) -> None:
        """The coordinator asked for checkpoint request ``number`` (its KIND_CHECKPOINT command)."""
        with self._lock:
            self._checkpoint_request = max(self._checkpoint_request, number)

    def checkpoint_request(self) -> int:
        """The newest checkpoint request heard of (0: none)."""
        with self._lock:
            return self._checkpoint_request

    # -- trainer group -------------------------------------------------
    def set_group_view(self, view: pb.TrainerGroupView) -> None:
        """A view of this worker's trainer group arrived (kept when newer than the last)."""
        with self._group_changed:
            if self._group_view is None or view.generation > self._group_view.generation:
                self._group_view = view
                self._group_changed.notify_all()

    def group_view(self) -> Optional[pb.TrainerGroupView]:
        """The newest view of this worker's trainer group heard of (``None`` before it formed)."""
        with self._group_changed:
            return self._group_view

    def wait_for_group_view(self, newer_than: int = 0,
                            timeout: datetime.timedelta = GROUP_WAIT) -> Optional[pb.TrainerGroupView]:
        """Block until a view newer than generation ``newer_than`` that includes this worker arrives.

        Returns ``None`` when the worker is asked to stop meanwhile; raises
        ``TimeoutError`` after ``timeout``.
        """
        deadline = datetime.datetime.now() + timeout
        while not self.should_stop():
            with self._group_changed:
                view = self._group_view
                if view is not None and view.generation > newer_than and self.rpc_name in view.members:
                    return view
                self._group_changed.wait(_GROUP_POLL.total_seconds())
            if datetime.datetime.now() > deadline:
                raise TimeoutError(f"{self.rpc_name}: trainer group {self.trainer_group} did not form "
                                   f"within {timeout.total_seconds():.0f} s (newest view: "
                                   f"{_describe(self.group_view())})")
            self.refresh()
        return None

    def join_trainer_group(self, timeout: datetime.timedelta = GROUP_WAIT):
        """Join this worker's trainer group: a ``paramserver.ddp.TrainerGroup`` (blocks until it forms)."""
        from ..ddp.group import TrainerGroup  # the data plane's DDP side; torch is loaded by now
        return TrainerGroup.join(self, timeout=timeout)


def _describe(view: Optional[pb.TrainerGroupView]) -> str:
    if view is None:
        return "none yet"
    return f"generation {view.generation} of {', '.join(view.members) or 'nobody'}"
