"""A worker's trainer group: the DDP process group behind one coordinator view.

Owns turning the views the coordinator publishes (``TrainerGroupView``:
a generation, its members in rank order, the backend) into a
``torch.distributed`` process group, and re-forming it when a newer view
comes: every generation rendezvouses under its own key prefix in the
coordinator's c10d store (``trainer_group/<group>/<generation>/``), so
stale members of an old generation never meet new ones.  Members agree on
*when* to re-form, to stop and to checkpoint with one small all-reduce
(``agree``): all of them act at the same step, none is left waiting in a
collective of the old group.  When a collective fails instead (a member was lost), each
member that saw it drops the broken process group at once and forms the
next generation the coordinator publishes (``reform(after_failure=True)``).

A member that hangs (stopped, not dead) fails no collective: its peers
would wait in one until the collective timeout.  So a watcher thread reads
the views the coordinator publishes, and once one drops a member of the
current generation it abandons that generation's pending collectives:
every collective the group runs is waited on through ``abortable``, whose
future fails at once with ``GenerationAborted``.  Gloo cannot cancel the
operation itself, and destroying a process group waits for its pending
operations, so an abandoned generation's process group is kept aside
(``_retired``) until they end (the hung member resumed and left, or the
collective timeout), and the next generation forms meanwhile.  Forming a
generation waits for its members in the same way: a member that never
comes (its job failed at start) is dropped by a newer view, and the wait
ends then, naming it, instead of at the rendezvous's timeout.

It knows nothing of gRPC: the view source is a
``paramserver.runtime.context.GroupChannel`` (or any object with its
members: ``rpc_name``, ``worker_index``, ``trainer_group``, ``gpu`` (optional),
``store_host``/``store_port``, ``group_view()``, ``wait_for_group_view()``,
and ``request_regroup()`` if it has one).
What is trained and how state moves is ``replica``'s business.  Each
generation formed is noted by the group's ``recorder`` when it was handed
one (a ``GroupRecorder``: the worker's training metrics, when it serves
them).
"""

import datetime
import logging
import os
import pickle
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Protocol, Tuple

import torch
import torch.distributed as dist
# Imported before any process group exists: its functions take ``group=group.WORLD``
# as a default argument, evaluated on import.  Imported later (DDP's constructor
# imports it), the defaults would keep the first generation's process group, and
# its connections, alive after it is destroyed, and members still waiting in one
# of its collectives after a failure would wait for the timeout instead of failing.
import torch.distributed.nn  # noqa: F401

from ..shards.peer import TENSORPIPE_INTERFACE_ENV

logger = logging.getLogger(__name__)

#: How long a collective of the group may wait for a member before failing.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
#: How long forming a generation waits for all its members to arrive.
FORM_TIMEOUT = datetime.timedelta(seconds=120)
#: How often forming a generation looks whether every member came, and whether a newer view replaced it.
ARRIVAL_POLL = datetime.timedelta(seconds=0.05)
#: After a failed collective, how long to wait for the coordinator's next view
#: (it comes once the lost member is declared dead) before asking for one with
#: the same members (nobody was lost: a collective timed out).
REGROUP_AFTER = datetime.timedelta(seconds=20)
#: How often the watcher looks for a view that dropped a member of the current generation.
WATCH_VIEWS_EVERY = datetime.timedelta(seconds=0.2)
#: How long ``hand_out`` waits in the store at a time before it looks whether the generation was abandoned.
HAND_OUT_SLICE = datetime.timedelta(seconds=0.5)
STORE_PREFIX = "trainer_group"
#: The keys of ``job_store``: every group's, whatever its generation.
JOB_STORE_PREFIX = "job"


class GroupRecorder(Protocol):
    """What a trainer group records (``paramserver.metrics.training.TrainingMetrics`` has it): each generation
    formed here."""

    def group_formed(self, group: int, generation: int) -> None: ...


class Agreement(NamedTuple):
    """What the members of a group agreed on at a step: re-form, stop, the checkpoint request to serve, and
    ``short``: the most steps of the coming window that a member has no data for yet (its data follows files as
    they land, or comes from a slow store), so that the group takes only the steps every member has data for;
    ``least_short``: the fewest (the steps some member has data for: ``DenseReplica``'s uneven steps);
    ``export``: a live export is due here (some member said so)."""

    reform: bool
    stop: bool
    checkpoint_request: int
    short: int = 0
    least_short: int = 0
    export: bool = False


class GroupStopped(RuntimeError):
    """The worker was asked to stop while waiting for its trainer group."""


class GenerationAborted(RuntimeError):
    """A newer view dropped a member of this generation: its pending collectives were abandoned."""


def device_for(backend: str, gpu: Optional[int]) -> torch.device:
    """Where a member keeps its dense replica: under nccl the GPU it holds for itself, else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    if gpu is None:
        raise ValueError("this trainer group uses nccl, but this worker holds no GPU of its own "
                         "(the coordinator gives nccl only to groups whose every member holds one)")
    return torch.device("cuda", gpu)


#: The collectives backends' own variables for their network interface.
COLLECTIVE_INTERFACE_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _collectives_on_data_plane_interface() -> None:
    """Gloo and NCCL connect over the interface the data plane listens on, unless told otherwise: left to
    themselves they use the address this machine's host name resolves to, which on a multi-homed host (or
    in a network namespace) may not be the one the group's other members can reach."""
    interface = os.environ.get(TENSORPIPE_INTERFACE_ENV)  # set by ``peer.join`` from the member's --host
    if interface:
        for variable in COLLECTIVE_INTERFACE_ENVS:
            os.environ.setdefault(variable, interface)


class TrainerGroup:
    """This worker's membership in its trainer group; ``join`` forms the first generation.

    ``recorder``: where each generation formed is noted (``None``: nowhere).
    """

    def __init__(self, source, timeout: datetime.timedelta = FORM_TIMEOUT,
                 collective_timeout: datetime.timedelta = COLLECTIVE_TIMEOUT, *,
                 recorder: Optional[GroupRecorder] = None):
        self._source = source
        self.recorder = recorder
        self._timeout = timeout
        self._collective_timeout = collective_timeout
        self._store = dist.TCPStore(source.store_host, source.store_port, is_master=False, timeout=timeout)
        self.view = None
        self.rank = -1
        self.world_size = 0
        self.device = torch.device("cpu")
        self._lock = threading.Lock()
        #: Why the current generation was abandoned (None: it was not).
        self.aborted: Optional[str] = None
        #: The futures handed out by ``abortable`` still pending, each with the collective's own future.
        self._pending: Dict[torch.futures.Future, torch.futures.Future] = {}
        #: The collectives of the current generation abandoned by ``_watch_views``.
        self._abandoned: List[torch.futures.Future] = []
        #: Process groups of abandoned generations and their collectives still running.
        self._retired: List[Tuple[object, List[torch.futures.Future]]] = []
        self._closed = threading.Event()
        self._watcher = threading.Thread(target=self._watch_views, name="trainer-group-views", daemon=True)
        #: The current generation's keys for ``hand_out``, and how many it handed out.
        self._handouts: Optional[dist.Store] = None
        self._handed_out = 0
        #: How many times the store was connected to again (its coordinator was started again).
        self.store_connections = 0

    @classmethod
    def join(cls, source, timeout: datetime.timedelta = FORM_TIMEOUT, *,
             recorder: Optional[GroupRecorder] = None,
             collective_timeout: datetime.timedelta = COLLECTIVE_TIMEOUT) -> "TrainerGroup":
        """Wait for the first view that includes this worker and form its process group (noted by ``recorder``,
        as every generation formed after it)."""
        group = cls(source, timeout, collective_timeout, recorder=recorder)
        view = source.wait_for_group_view(0, timeout)
        if view is None:
            raise GroupStopped(f"{source.rpc_name} was asked to stop before its trainer group formed")
        group._form_newest(view)
        group._watcher.start()
        return group

    @property
    def generation(self) -> int:
        return self.view.generation

    @property
    def backend(self) -> str:
        return self.view.backend

    @property
    def members(self):
        return list(self.view.members)

    def _form(self, view) -> None:
        """Form ``view``'s process group.  The view is this member's from then on, even if forming fails:
        the next attempt waits for a newer one."""
        self._drop_process_group()
        name = self._source.rpc_name
        rank = list(view.members).index(name)
        prefix = f"{STORE_PREFIX}/{view.group}/{view.generation}/"
        logger.info("%s: forming trainer group %d generation %d as rank %d of %d (%s): %s", name, view.group,
                    view.generation, rank, len(view.members), view.backend, ", ".join(view.members))
        with self._lock:
            self.view, self.rank, self.world_size = view, rank, len(view.members)
            self.aborted = None
            self._abandoned = []  # (an abort noted while the last generation was being dropped: moot now)
        self._reach_store()  # the coordinator hosting it may have been started again since the last generation
        self._handout_prefix = f"{prefix}handout"
        self._handouts = dist.PrefixStore(self._handout_prefix, self._store)  # keys: .../handout/N
        self._handed_out = 0
        _collectives_on_data_plane_interface()
        self.device = device_for(view.backend, getattr(self._source, "gpu", None))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._await_members(prefix, view)
        dist.init_process_group(view.backend, store=dist.PrefixStore(prefix, self._store), rank=rank,
                                world_size=len(view.members), timeout=self._collective_timeout)
        if self.recorder is not None:
            self.recorder.group_formed(view.group, view.generation)

    def _await_members(self, prefix: str, view) -> None:
        """Wait until every member of ``view`` came to form it, polling the store (``ARRIVAL_POLL``), so that a
        newer view (a member left or was lost meanwhile: its job failed at start) ends the wait at once with
        ``GenerationAborted`` naming whom it dropped; ``init_process_group`` itself would wait for the missing
        member until its timeout.  Past the collective timeout it returns, and ``init_process_group`` says
        which member is missing."""
        arrivals = dist.PrefixStore(f"{prefix}arrived", self._store)
        arrivals.set(str(self.rank), "1")
        everyone = [str(rank) for rank in range(len(view.members))]
        deadline = time.monotonic() + self._collective_timeout.total_seconds()
        while not arrivals.check(everyone) and time.monotonic() < deadline:
            newest = self._source.group_view()
            if newest is not None and newest.generation > view.generation:
                dropped = sorted(set(view.members) - set(newest.members))
                raise GenerationAborted(
                    f"trainer group {view.group} generation {view.generation} was replaced by generation "
                    f"{newest.generation}{' without ' + ', '.join(dropped) if dropped else ''} while it formed")
            time.sleep(ARRIVAL_POLL.total_seconds())

    def _form_newest(self, view) -> None:
        """Form ``view``, or the newest view that includes this worker when a newer one replaced it while it
        formed (``_await_members``)."""
        while True:
            try:
                self._form(view)
                return
            except GenerationAborted as replaced:
                logger.warning("%s: %s; forming the newer one", self._source.rpc_name, replaced)
            view = self._source.wait_for_group_view(view.generation, self._timeout)
            if view is None:
                raise GroupStopped(f"{self._source.rpc_name} was asked to stop while its trainer group formed")

    def _drop_process_group(self) -> None:
        """Destroy the current generation's process group; an abandoned one is kept aside until its collectives
        end (destroying it would wait for them), and those kept before are let go once theirs ended."""
        self._retired = [(group, running) for group, running in self._retired
                         if not all(future.done() for future in running)]
        if not dist.is_initialized():
            return
        if self.aborted is not None:
            with self._lock:
                running, self._abandoned = self._abandoned, []
            world = dist.group.WORLD
            if self.backend != "gloo":
                world.abort()  # NCCL (and others) can end the operation itself
            self._retired.append((world, running))
        dist.destroy_process_group()

    def abortable(self, future: torch.futures.Future) -> torch.futures.Future:
        """``future`` (of a collective of this generation), failing at once with ``GenerationAborted`` if the
        generation is abandoned before it completes."""
        mine = torch.futures.Future(devices=[self.device] if self.device.type == "cuda" else None)
        with self._lock:
            if self.aborted is not None:
                # Launched after the abort, it still runs in this generation's process group: that group is kept
                # until it ends (``_drop_process_group``), as for those abandoned, or dropping it would wait for it.
                self._abandoned.append(future)
                mine.set_exception(GenerationAborted(self.aborted))
                return mine
            self._pending[mine] = future

        def forward(done: torch.futures.Future) -> None:
            with self._lock:  # whichever comes first, the collective's end or the abort, completes ``mine``
                if self._pending.pop(mine, None) is None:
                    return
            try:
                mine.set_result(done.value())
            except Exception as error:  # noqa: BLE001 - the collective's failure, handed on
                mine.set_exception(error)

        future.add_done_callback(forward)
        return mine

    def gather_objects(self, value: Any) -> List[Any]:
        """Every member's ``value`` (pickled), in rank order, through collectives abandoned with the generation
        (``abortable``): a member that hangs holds the others no longer than an agreement would."""
        mine = _pickled(value, self.device)
        size = torch.tensor([mine.numel()], dtype=torch.int64, device=self.device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        self.abortable(dist.all_gather(sizes, size, async_op=True).get_future()).wait()
        lengths = [int(length) for length in sizes]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=self.device)
        padded[:mine.numel()] = mine
        every = [torch.empty_like(padded) for _ in range(self.world_size)]
        self.abortable(dist.all_gather(every, padded, async_op=True).get_future()).wait()
        return [_unpickled(tensor[:length]) for tensor, length in zip(every, lengths)]

    def broadcast_object(self, value: Any, source: int) -> Any:
        """Member ``source``'s ``value`` (pickled; the others' is ignored), abandoned with the generation like
        ``gather_objects``'s collectives."""
        mine = _pickled(value, self.device) if self.rank == source else None
        size = torch.tensor([0 if mine is None else mine.numel()], dtype=torch.int64, device=self.device)
        self.abortable(dist.broadcast(size, src=source, async_op=True).get_future()).wait()
        data = mine if mine is not None else torch.empty(int(size), dtype=torch.uint8, device=self.device)
        self.abortable(dist.broadcast(data, src=source, async_op=True).get_future()).wait()
        return value if self.rank == source else _unpickled(data)

    def job_store(self, name: str, own_connection: bool = False) -> dist.Store:
        """Keys under ``name`` in the coordinator's store, shared by every trainer group of the job and kept
        across generations (``paramserver.train.positions`` keeps the data positions of groups other than 0
        there, ``paramserver.train.claims`` the parts of a followed input each group reads).
        ``own_connection``: through a connection of its own, for a thread that must not queue behind this
        group's waits in the store (``hand_out``'s)."""
        return JobStore(self, f"{JOB_STORE_PREFIX}/{name}", own_connection)

    def hand_out(self, value: Any, source: int, within: datetime.timedelta) -> Any:
        """Member ``source``'s ``value`` (pickled; the others' is ignored) to every member, through the group's
        store instead of a collective: for what takes the source longer to make than the collective timeout
        allows (a checkpoint it writes while the others wait).  The others wait in slices that end at once when
        the generation is abandoned or a newer view is published (``GenerationAborted``), for at most
        ``within`` (``TimeoutError``).  Every member calls it at the same point, as with a collective."""
        key = str(self._handed_out)
        self._handed_out += 1
        if self.rank == source:
            if self.world_size > 1:
                try:
                    self._handouts.set(key, pickle.dumps(value))
                except dist.DistNetworkError:  # the store went with its coordinator, and is back (or waited for)
                    self.reconnect_store()
                    self._handouts.set(key, pickle.dumps(value))
            return value
        deadline = time.monotonic() + within.total_seconds()
        while True:
            if self.aborted is not None:
                raise GenerationAborted(self.aborted)
            newest = self._source.group_view()
            if newest is not None and newest.generation > self.view.generation:
                # (the same members, re-formed after a collective failed on some of them: the source may be
                # forming the new one instead of handing out in this one)
                raise GenerationAborted(f"{self.describe()} was replaced by generation {newest.generation} while "
                                        f"waiting for rank {source}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.describe()}: rank {source} handed nothing out within "
                                   f"{within.total_seconds():g} s")
            try:
                self._handouts.wait([key], datetime.timedelta(seconds=min(left, HAND_OUT_SLICE.total_seconds())))
            except dist.DistNetworkError:  # the store went with its coordinator: wait for it on a new connection
                self.reconnect_store()
                continue
            except dist.DistStoreError:  # this slice's wait timed out
                continue
            value = pickle.loads(self._handouts.get(key))
            if self._handouts.add(f"{key}/read", 1) == self.world_size - 1:  # the last to read it: the store
                self._handouts.delete_key(key)  # does not keep a checkpoint's outcome for the cluster's life
                self._handouts.delete_key(f"{key}/read")
            return value

    def _watch_views(self) -> None:
        while not self._closed.wait(WATCH_VIEWS_EVERY.total_seconds()):
            newest = self._source.group_view()
            with self._lock:
                current = self.view
                if newest is None or current is None or newest.generation <= current.generation \
                        or self.aborted is not None:
                    continue
                dropped = sorted(set(current.members) - set(newest.members))
                if not dropped:
                    continue
                self.aborted = (f"trainer group {current.group} generation {current.generation} was replaced by "
                                f"generation {newest.generation} without {', '.join(dropped)}")
                abandoned, self._pending = self._pending, {}
                self._abandoned.extend(abandoned.values())
            if abandoned:
                logger.warning("%s: %s; abandoning its %d pending collective%s", self._source.rpc_name, self.aborted,
                               len(abandoned), "s" if len(abandoned) > 1 else "")
            for future in abandoned:
                future.set_exception(GenerationAborted(self.aborted))

    def agree(self, want_stop: bool = False, checkpoint_request: int = 0, short: int = 0,
              export: bool = False) -> Agreement:
        """Collective: one all-reduce (MAX) of what each member heard of.

        A member heard of a newer view: all re-form; one wants to stop: all
        stop; the newest checkpoint request any member heard of: all serve it;
        a member is ``short`` of data for that many of the coming steps: all
        take that many fewer (the most any member is short of; and the fewest,
        as the MAX of ``-short``); one says a live ``export`` is due: all
        take part in it.
        """
        newest = self._source.group_view()
        heard = newest.generation if newest is not None else 0
        flags = torch.tensor([heard, int(want_stop), checkpoint_request, short, -short, int(export)],
                             dtype=torch.int64, device=self.device)
        self.abortable(dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True).get_future()).wait()
        newest_heard, stop, request, most_short, least_short, exporting = flags.tolist()
        return Agreement(newest_heard > self.generation, bool(stop), int(request), int(most_short), -int(least_short),
                         bool(exporting))

    def barrier(self) -> None:
        """Collective: returns once every member called it (abandoned with the generation, ``abortable``)."""
        token = torch.zeros(1, device=self.device)
        self.abortable(dist.all_reduce(token, async_op=True).get_future()).wait()

    def reform(self, after_failure: bool = False) -> None:
        """Form the newest generation that includes this worker.

        Members call it at the step they agreed on, or once a collective of
        this generation failed (``after_failure``): then its process group
        goes first, so that members still waiting in one of its collectives
        fail too, and if no newer view comes within ``REGROUP_AFTER`` the
        coordinator is asked for one.  Raises ``GroupStopped`` if the worker
        is asked to stop meanwhile, ``TimeoutError`` if no view comes.
        """
        if after_failure:
            self._drop_process_group()
            view = self._wait_for_view_after_failure()
        else:
            view = self._source.wait_for_group_view(self.generation, self._timeout)
        if view is None:
            raise GroupStopped(f"{self._source.rpc_name} was asked to stop while its trainer group re-formed")
        self._form_newest(view)

    def _wait_for_view_after_failure(self):
        try:
            return self._source.wait_for_group_view(self.generation, min(REGROUP_AFTER, self._timeout))
        except TimeoutError:
            logger.warning("%s: no new view of trainer group %d within %.0f s of a failed collective; asking for "
                           "generation %d to be replaced", self._source.rpc_name, self.view.group,
                           min(REGROUP_AFTER, self._timeout).total_seconds(), self.generation)
        getattr(self._source, "request_regroup", lambda generation: None)(self.generation)
        return self._source.wait_for_group_view(self.generation, self._timeout)

    @property
    def store(self) -> dist.Store:
        """This group's connection to the coordinator's store (a new one after ``reconnect_store``)."""
        return self._store

    def connect_store(self) -> dist.Store:
        """A new connection to the coordinator's store."""
        return dist.TCPStore(self._source.store_host, self._source.store_port, is_master=False,
                             timeout=self._timeout)

    def _reach_store(self) -> None:
        """A connection to the store that works: the one held, or a new one when the store went with the
        coordinator that hosted it (a coordinator started again brings it back on the same port)."""
        try:
            self._store.check(["-"])
        except dist.DistNetworkError:
            self.reconnect_store()

    def reconnect_store(self) -> None:
        """Connect to the store again, waiting for it (bounded by the group's formation timeout; a member
        asked to stop meanwhile gives up with the connection's error)."""
        logger.warning("%s: the connection to the group's store broke (its coordinator was started again?); "
                       "connecting again", self._source.rpc_name)
        self._store = self.connect_store()
        self.store_connections += 1
        if self._handouts is not None:
            self._handouts = dist.PrefixStore(self._handout_prefix, self._store)

    def close(self) -> None:
        self._closed.set()
        if self._watcher.is_alive():  # not left running into the interpreter's teardown (its view source may be C++)
            self._watcher.join(2 * WATCH_VIEWS_EVERY.total_seconds() + 5)
        self._drop_process_group()
        self._store = None

    def describe(self) -> str:
        return (f"trainer group {self.view.group} generation {self.generation}, rank {self.rank} of "
                f"{self.world_size} ({self.backend} on {self.device})")


def _pickled(value: Any, device: torch.device) -> torch.Tensor:
    """``value`` pickled into a uint8 tensor on ``device`` (what a collective carries)."""
    return torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)


def _unpickled(data: torch.Tensor) -> Any:
    return pickle.loads(data.cpu().numpy().tobytes())


class JobStore:
    """Keys under one prefix of the coordinator's store (``TrainerGroup.job_store``) that survive the
    coordinator being started again: an operation that finds the connection broken connects again (the store
    comes back with its coordinator, on the same port) and is tried once more.  The store's keys do not come
    back: ``reconnections`` tells a caller that must publish its keys again."""

    def __init__(self, group: TrainerGroup, prefix: str, own_connection: bool = False):
        self._group = group
        self._prefix = prefix
        self._own: Optional[dist.Store] = group.connect_store() if own_connection else None
        #: How many times this store's connection was made again.
        self.reconnections = 0
        self._on_reconnect: List[Callable[[], None]] = []

    def on_reconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` each time the connection is made again, before the operation that found it broken
        is tried again: to publish again, in the store that came back empty, what this member had there."""
        self._on_reconnect.append(callback)

    def _store(self) -> dist.Store:
        return dist.PrefixStore(self._prefix, self._own if self._own is not None else self._group.store)

    def _reconnect(self) -> None:
        if self._own is not None:
            logger.warning("the connection to the job's store broke (its coordinator was started again?); "
                           "connecting again")
            self._own = self._group.connect_store()
        else:
            self._group.reconnect_store()
        self.reconnections += 1
        for callback in self._on_reconnect:
            callback()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args, **kwargs):
            try:
                return getattr(self._store(), name)(*args, **kwargs)
            except dist.DistNetworkError:
                self._reconnect()
                return getattr(self._store(), name)(*args, **kwargs)
        return call

