"""The sparse part of a Trainer's model: its tables on the shards, their optimizer there, and surviving a lost shard.

Owns building a job's ``Table``s as shared ``ShardedEmbeddingBag``s (a
table of ``row_wise_min_rows`` rows or more split by rows over every
shard, smaller ones placed whole and packed onto as few shards as keep
the fullest no fuller than a balanced plan's, ``placement.pack_whole``:
a step sends one message to every shard holding a table it reads, so
splitting or spreading small tables only adds messages; or, with
``placement="spread"``, spread over every shard, as many on each as can
be, ``placement.spread_whole``: more messages, and fewer tables for each
shard to update per push), the owner-side optimizers that update their rows on the
shards (created through ``DistributedOptimizer``), the
``EmbeddingCollection`` through which a step looks them up and pushes
their gradients (one RPC per shard each way), and rebuilding all of it
after a shard was lost (the first build too, when a shard process died as
the job started).

The handles are RRefs bound to the processes that owned them: when a
shard process dies, ``ps-server`` starts a new one under the same name,
which restores its tables from the newest checkpoint, and every handle
built against the old process is stale.  ``rebuild`` waits until every
shard serves again and builds anew, a bounded number of times within a
bounded time, returning at once when the worker is asked to stop.  The
new handles are built before the old ones are dropped, so that what the
surviving shards hold for several trainers (a shared optimizer and its
state) is never released in between.  An old handle holding an RRef of
the dead process is not dropped but retired (``retire``): releasing it
would message an owner that no longer exists, and torch logs a C++ stack
trace for each one; the runtime drops retired handles as it leaves the
data plane, without telling their owners.  A build that fails (a shard
process dying meanwhile may still have answered part of it) is retired
whole, as its error: the parts it made, RRefs of that process among them,
are reachable only from the error's traceback, and dropped with it they
would be released at whatever moment that error is freed.  Which steps
are redone is the training loop's decision (``paramserver.train.step``).  The ``recorder``
it is handed (the worker's data-plane metrics, or ``None``) goes to every
collection and optimizer it builds, rebuilt ones included.
"""

import datetime
import logging
import secrets
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from ..logs import one_line
from ..optim import DistributedOptimizer
from ..shards import DynamicEmbeddingBag, EmbeddingCollection, ShardedEmbeddingBag
from ..shards.client.placement import pack_whole, spread_whole
from ..shards.client.collection import CollectionLookup, CollectionRecorder
from .contract import Batch, Table

logger = logging.getLogger(__name__)

#: How long a trainer waits for lost shards to serve again before it gives up.
SHARD_RETURN_TIMEOUT = datetime.timedelta(seconds=120)
#: Rebuilds in a row (without a good step between them) before the trainer gives up.
MAX_CONSECUTIVE_REBUILDS = 3
_POLL = datetime.timedelta(seconds=0.5)


class ShardLost(RuntimeError):
    """A shard did not come back in time, or steps kept failing after it did."""


class RebuildStopped(RuntimeError):
    """The worker was asked to stop while waiting for a lost shard."""


#: How the tables placed whole are laid out over the shards (``Trainer(table_placement=...)``).
TABLE_PLACEMENTS = ("packed", "spread")


def check_placement(placement: str) -> None:
    """``ValueError`` naming ``placement`` unless it is one of ``TABLE_PLACEMENTS``."""
    if placement not in TABLE_PLACEMENTS:
        raise ValueError(f"table_placement must be one of {TABLE_PLACEMENTS}, got {placement!r}")


def place_whole(sizes: Dict[str, int], shards: Sequence[str], placement: str) -> Dict[str, str]:
    """Table name -> shard for the tables placed whole: ``"packed"`` onto as few shards as keep the fullest no
    fuller than a balanced plan's (``pack_whole``), ``"spread"`` over every shard, as many tables on each as can
    be (``spread_whole``)."""
    check_placement(placement)
    if not sizes:
        return {}
    return pack_whole(sizes, list(shards)) if placement == "packed" else spread_whole(sizes, list(shards))


def build_tables(tables: Dict[str, Table], shards: Sequence[str], prefix: str, seed: int, row_wise_min_rows: int,
                 placement: str = "packed") -> Dict[str, Union[ShardedEmbeddingBag, DynamicEmbeddingBag]]:
    """Every table on ``shards``, named ``<prefix>.<table>`` there (those placed whole by ``placement``,
    ``place_whole``); the i-th table's rows drawn from ``seed + i`` (a dynamic table's over every shard)."""
    names = {name: f"{prefix}.{name}" for name in tables}
    whole = {names[name]: table.num_embeddings * table.embedding_dim for name, table in tables.items()
             if not table.dynamic and table.num_embeddings < row_wise_min_rows}
    plan = place_whole(whole, shards, placement)
    built: Dict[str, Union[ShardedEmbeddingBag, DynamicEmbeddingBag]] = {}
    for index, (name, table) in enumerate(tables.items()):
        if table.dynamic:  # over every shard, by the ids' hash
            built[name] = DynamicEmbeddingBag(table.embedding_dim, table.mode, shards=list(shards), name=names[name],
                                              seed=seed + index, dtype=table.dtype, init_std=table.init_std,
                                              options=table.options, rounding=table.rounding)
        else:
            built[name] = ShardedEmbeddingBag(table.num_embeddings, table.embedding_dim, table.mode,
                                              shards=[plan[names[name]]] if names[name] in plan else list(shards),
                                              name=names[name], seed=seed + index, dtype=table.dtype, shared=True,
                                              init_std=table.init_std, rounding=table.rounding)
    return built


#: What a build of the sparse part makes: the tables by name, their optimizer, the collection over both.
_Built = Tuple[Dict[str, Union[ShardedEmbeddingBag, DynamicEmbeddingBag]], DistributedOptimizer, EmbeddingCollection]


class SparseTables:
    """The tables of ``specs`` on the shards and ``optimizer``'s ``DistributedOptimizer`` over their rows.

    ``live_shards()`` lists the shards serving now (the coordinator's view,
    refreshed by ``refresh()``), ``shards_gone()`` those that will not serve
    again (name -> why); ``should_stop()`` ends a wait for a lost shard.
    ``recorder``: where the collection's lookups and pushes and the
    optimizer's step RPCs are counted (``None``: nowhere).
    """

    def __init__(self, specs: Dict[str, Table], optimizer: Tuple[type, Dict], shards: Sequence[str], prefix: str,
                 seed: int, row_wise_min_rows: int, live_shards: Callable[[], List[str]],
                 refresh: Callable[[], None] = lambda: None, should_stop: Callable[[], bool] = lambda: False,
                 timeout: datetime.timedelta = SHARD_RETURN_TIMEOUT,
                 max_consecutive: int = MAX_CONSECUTIVE_REBUILDS,
                 shards_gone: Callable[[], Dict[str, str]] = dict,
                 retire: Optional[Callable[[Any], None]] = None, recorder: Optional[CollectionRecorder] = None,
                 placement: str = "packed", push_dtype: Optional[torch.dtype] = None):
        self.specs = dict(specs)
        self._push_dtype = push_dtype
        self._placement = placement
        self._recorder = recorder
        self.shards = list(shards)
        self._optimizer_class, self._optimizer_options = optimizer
        self._prefix, self._seed, self._row_wise_min_rows = prefix, seed, row_wise_min_rows
        self._live_shards, self._refresh, self._should_stop = live_shards, refresh, should_stop
        self._shards_gone = shards_gone
        self._retired: List[Any] = []
        self._retire = retire or self._retired.append
        self._timeout = timeout
        self._max_consecutive = max_consecutive
        self._in_a_row = 0
        self.rebuilds = 0
        self._pusher = secrets.randbits(62)  # this run's name in idempotent pushes, kept across rebuilds
        self.tables, self.optimizer, self.collection = self._first_build()

    def _build(self) -> _Built:
        tables = build_tables(self.specs, self.shards, self._prefix, self._seed, self._row_wise_min_rows,
                              self._placement)
        optimizer = DistributedOptimizer(self._optimizer_class,
                                         [rref for table in tables.values() for rref in table.remote_parameters()],
                                         recorder=self._recorder, **self._optimizer_options)
        return tables, optimizer, EmbeddingCollection(tables, optimizer.owner_layout(), rpc.get_worker_info().name,
                                                      self._pusher, recorder=self._recorder,
                                                      push_dtype=self._push_dtype)

    def lookup(self, batch: Batch, step: int = -1) -> CollectionLookup:
        """Send the batch's lookups for training step ``step`` (negative: evaluation, reading only), one RPC
        per shard for every table it serves (see ``EmbeddingCollection``)."""
        return self.collection.lookup(batch.sparse, step)

    def describe(self) -> str:
        return ", ".join(f"{name} ({'dynamic' if table.num_embeddings is None else table.num_embeddings} x "
                         f"{table.embedding_dim} on {', '.join(sorted(set(table.shards)))})"
                         for name, table in self.tables.items())

    def step_succeeded(self) -> None:
        self._in_a_row = 0

    def _first_build(self) -> _Built:
        """The first build; a shard lost meanwhile (its process died as the job started) is waited for and the
        sparse part built again, as after a step's failed lookups and with the same bounds."""
        try:
            return self._build()
        except RuntimeError as error:  # torch's type for a request to a shard that died or did not answer in time
            self._retire(error)  # what it built before failing: see the module's docstring
            self._count_rebuild(error)
            logger.warning("building the sparse part failed against the shards (%s); building it again once %s "
                           "serve", one_line(error), ", ".join(self.shards))
            return self._built_once_served(error)

    def rebuild(self, cause: BaseException) -> None:
        """Wait until every shard serves again, then build anew.

        Raises ``ShardLost`` when that cannot be done in time (or keeps
        failing), or at once when a shard will not serve again;
        ``RebuildStopped`` when the worker is asked to stop meanwhile.
        """
        self._count_rebuild(cause)
        logger.warning("a step failed against the shards (%s); rebuilding the sparse part once %s serve",
                       one_line(cause), ", ".join(self.shards))
        built = self._built_once_served(cause)
        old = [*self.tables.values(), self.optimizer]
        # the old handles go only now: see the module's docstring
        self.tables, self.optimizer, self.collection = built
        self._let_go(old)

    def _count_rebuild(self, cause: BaseException) -> None:
        """One more rebuild in a row; ``ShardLost`` past the bound."""
        self._in_a_row += 1
        if self._in_a_row > self._max_consecutive:
            raise ShardLost(f"{self._in_a_row - 1} rebuilds in a row did not make a step succeed; "
                            f"last failure: {one_line(cause)}") from cause

    def _built_once_served(self, cause: BaseException) -> _Built:
        """The sparse part built anew once every shard serves (bounded by the timeout; see ``rebuild``)."""
        started = time.monotonic()
        deadline = started + self._timeout.total_seconds()
        last_error = ""  # the last failed build's error, in one line
        while not self._should_stop():
            self._refresh()
            gone = {name: why for name, why in self._shards_gone().items() if name in self.shards}
            if gone:
                raise ShardLost("; ".join(f"shard {name} will not serve again: {why}"
                                          for name, why in sorted(gone.items()))) from cause
            missing = sorted(set(self.shards) - set(self._live_shards()))
            if not missing:
                try:
                    built = self._build()
                except Exception as error:  # noqa: BLE001 - e.g. the restarted shard not reachable yet
                    self._retire(error)  # what it built before failing: see the module's docstring
                    last_error = one_line(error)
                else:
                    self.rebuilds += 1
                    logger.warning("sparse part rebuilt after %.1f s (rebuild %d)", time.monotonic() - started,
                                   self.rebuilds)
                    return built
            if time.monotonic() > deadline:
                waited = f"{self._timeout.total_seconds():.0f} s"
                if missing:
                    raise ShardLost(f"shards {', '.join(missing)} did not serve again within {waited}") from cause
                raise ShardLost(f"every shard serves, but the sparse part could not be built again within {waited}: "
                                f"{last_error}") from cause
            time.sleep(_POLL.total_seconds())
        raise RebuildStopped("asked to stop while waiting for a lost shard")

    def _let_go(self, handles: Iterable[Any]) -> None:
        """Drop old handles (releasing what they hold on the shards), except those holding an RRef of a process
        that died: those are retired (``retire``)."""
        for handle in handles:
            if not owned_by_live_peers(rrefs_of(handle)):
                self._retire(handle)

    def close(self) -> None:
        """Let go of the handles in use now (what they hold on the shards is released), retiring those of a
        shard process that died meanwhile."""
        old, self.tables, self.optimizer = [*self.tables.values(), self.optimizer], {}, None
        self.collection = None
        self._let_go(old)

    @torch.no_grad()
    def eval_pool(self, batch: Batch) -> Dict[str, Tensor]:
        """The batch's pooled embeddings, for evaluation (no gradient recorded)."""
        return self.lookup(batch).pooled(differentiable=False)


def rrefs_of(handle: Any) -> List[Any]:
    """The RRefs a handle of this module holds: a table's row ranges, or an optimizer's owner-side optimizers."""
    if isinstance(handle, (ShardedEmbeddingBag, DynamicEmbeddingBag)):
        return handle.remote_parameters()
    if isinstance(handle, DistributedOptimizer):
        return handle.remote_optimizers
    return []


def owned_by_live_peers(rrefs: Iterable[Any]) -> bool:
    """Whether the owner of every one of ``rrefs`` is still a peer of this process's data plane: the same
    process, not one that died (and was forgotten, or replaced by a new process under its name)."""
    for rref in rrefs:
        try:
            owner = rref.owner()
            if rpc.get_worker_info(owner.name).id != owner.id:
                return False
        except RuntimeError:  # the owner (its id, or its name) is no longer known: forgotten after it died
            return False
    return True
