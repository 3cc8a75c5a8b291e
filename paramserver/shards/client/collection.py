"""``EmbeddingCollection``: many sharded tables looked up and updated together, one RPC per shard each way.

Owns the trainer side of a step's fused row traffic, the way torchrec's
``EmbeddingBagCollection`` batches the features of a ``KeyedJaggedTensor``
and FBGEMM's TBE fuses backward and optimizer: every table's ids are
checked, deduplicated and routed to their row ranges
(``ShardedEmbeddingBag.route``; a ``DynamicEmbeddingBag``'s to the shard
each id's hash names), then grouped by shard, so that a step sends
each shard ONE lookup carrying the ids of every table it serves, and from
the backward pass ONE push carrying their row gradients (sent after it, or
from inside it as soon as the rows' gradients exist), which the shard's
optimizer applies on arrival (``paramserver.shards.server.rows``), once per step.  The unfused
path (a lookup RPC per row range inside a ``dist_autograd`` context, a
gradient message per lookup, then a step RPC per owner) stays what
``ShardedEmbeddingBag`` and ``DistributedOptimizer`` do for any RRef
parameters; both paths give the same rows.

A lookup's rows are a local leaf per table: the model's backward pass
fills their gradients, and ``push`` sends them.  A message's ids, rows and
row gradients travel packed, a few tensors each (``paramserver.shards.wire``):
compact copies (an RPC sends a view's whole storage).  A collection's tables
may store rows in different types (float32, float16, bfloat16); rows arrive
as stored (a shard whose tables differ in type sends them as float32) and
are upcast to float32 on arrival, and row gradients leave as float32, or in
the collection's ``push_dtype``.  Each lookup and push RPC is
counted by the collection's ``recorder`` when it was handed one (a
``CollectionRecorder``: the worker's data-plane metrics, when it serves
them).
"""

import secrets
from typing import Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union

import torch
import torch.distributed.rpc as rpc
from torch import Tensor

from ..._torch_compat import is_remote_refusal, remote_error_cause
from ..peer import creation_timeout, settle
from .. import wire
from ..server import service
from .dynamic_embedding import DynamicEmbeddingBag
from .embedding import LookupRecorder, Route, ShardedEmbeddingBag, computed


class CollectionRecorder(LookupRecorder, Protocol):
    """What a collection records of its RPCs (``paramserver.metrics.data_plane.DataPlaneMetrics`` has it): a
    ``lookup`` per shard a lookup asks, a ``client_request(shard, "push", sent_bytes)`` per shard a push
    reaches."""

    def client_request(self, peer: str, rpc: str, sent_bytes: int = 0, received_bytes: int = 0) -> None: ...


class ShardRequestFailed(RuntimeError):
    """A fused lookup or push failed on one or more shards (gone, timed out, or refused); names each."""

    def __init__(self, action: str, failures: Sequence[Tuple[str, BaseException]]):
        super().__init__("; ".join(f"{action} failed on shard {shard!r}: {remote_error_cause(error)}"
                                   for shard, error in failures))
        self.failures = list(failures)

    def refusal(self) -> Optional["ShardRefused"]:
        """A ``ShardRefused`` naming the shards that refused the request (bad input, an optimizer that cannot
        apply it), or ``None`` when every failure is a shard gone or timed out."""
        refused = [(shard, error) for shard, error in self.failures if is_remote_refusal(error)]
        if not refused:
            return None
        return ShardRefused("; ".join(f"shard {shard!r} refused it: {remote_error_cause(error)}"
                                      for shard, error in refused))


class ShardRefused(ValueError):
    """A shard refused a lookup or push for a reason of the request's own (its rows, its gradients, an
    optimizer that cannot apply them), not because it is gone: sending it again cannot succeed."""


#: The types row gradients may travel in (``EmbeddingCollection(push_dtype=...)``; ``None`` is float32).
PUSH_DTYPES = (None, torch.float32, torch.bfloat16)


def check_push_dtype(push_dtype: Optional[torch.dtype]) -> None:
    """``ValueError`` unless row gradients may travel as ``push_dtype``."""
    if push_dtype not in PUSH_DTYPES:
        raise ValueError(f"push_dtype is None (float32), torch.float32 or torch.bfloat16, got {push_dtype!r}")


class _Slot:
    """How a shard names one row range of one table: its table handle and its index in the shard's optimizer."""

    __slots__ = ("table_handle", "param_index")

    def __init__(self, table_handle: int, param_index: int):
        self.table_handle, self.param_index = table_handle, param_index


class EmbeddingCollection:
    """``tables`` (by feature name) looked up and updated as one.

    ``optimizer_layout``: ``DistributedOptimizer.owner_layout()`` of an
    optimizer built over ``[rref for table in tables.values() for rref in
    table.remote_parameters()]`` (in that order): whose owner-side optimizer
    applies each shard's pushes.  ``push_dtype``: the type row gradients
    travel in (``None``: float32; ``torch.bfloat16`` halves a push's bytes).  ``peer``: this process's RPC name (the
    shards count what each peer pushes).  ``token``: names this pusher in
    idempotent pushes (random by default; keep it when the collection is
    built again in the same process, so that a step's push is recognised).
    ``recorder``: where its lookup and push RPCs are counted (``None``:
    nowhere).
    """

    def __init__(self, tables: Mapping[str, Union[ShardedEmbeddingBag, DynamicEmbeddingBag]],
                 optimizer_layout: Mapping[str, Tuple[int, List[int]]],
                 peer: str, token: Optional[int] = None, *, recorder: Optional[CollectionRecorder] = None,
                 push_dtype: Optional[torch.dtype] = None):
        self.tables = dict(tables)
        check_push_dtype(push_dtype)
        self.push_dtype = push_dtype
        self.peer = peer
        self.recorder = recorder
        #: Names this pusher on the shards, for idempotent pushes (``CollectionLookup.push(step=...)``).
        self.token = secrets.randbits(62) if token is None else token
        ranges = [(name, index, rref) for name, table in self.tables.items()
                  for index, rref in enumerate(table.remote_parameters())]
        owner_of_param: Dict[int, Tuple[str, int]] = {}  # global parameter index -> (owner, local index)
        self._optimizers: Dict[str, int] = {}
        for owner, (handle, params) in optimizer_layout.items():
            self._optimizers[owner] = handle
            for local, global_index in enumerate(params):
                owner_of_param[global_index] = (owner, local)
        by_shard: Dict[str, List[Tuple[str, int, object, int]]] = {}
        for global_index, (name, range_index, rref) in enumerate(ranges):
            owner, local = owner_of_param[global_index]
            by_shard.setdefault(owner, []).append((name, range_index, rref, local))
        handles = {shard: rpc.rpc_async(shard, service.table_handles, args=([entry[2] for entry in entries],),
                                        timeout=creation_timeout())
                   for shard, entries in by_shard.items()}
        self._incarnations: Dict[str, int] = {}
        self._slot_of: Dict[Tuple[str, int], Tuple[str, _Slot]] = {}  # (table, range index) -> (shard, slot)
        for shard, entries in by_shard.items():
            self._incarnations[shard], table_handles = handles[shard].wait()
            for (name, range_index, _, local), table_handle in zip(entries, table_handles):
                self._slot_of[(name, range_index)] = (shard, _Slot(table_handle, local))

    def where(self, table: str, range_index: int) -> Tuple[str, _Slot]:
        """The shard serving row range ``range_index`` of ``table``, and how it names it."""
        return self._slot_of[(table, range_index)]

    def optimizer_handle(self, shard: str) -> int:
        """The handle of the owner-side optimizer that applies pushes on ``shard``."""
        return self._optimizers[shard]

    def incarnation(self, shard: str) -> int:
        """Which process of ``shard`` the handles were made by (``paramserver.shards.server.rows``)."""
        return self._incarnations[shard]

    def incarnations(self) -> Dict[str, int]:
        """Every shard the collection's tables are on, with the process its handles were made by."""
        return dict(self._incarnations)

    def push_ledgers(self, shards: Sequence[str]) -> Dict[str, Tuple[int, int]]:
        """Per shard of ``shards``: the newest step of this pusher (``token``) its optimizer applied in the
        process serving it now (-1: none), and how many of this pusher's pushes that process replayed from its
        push log (``service.push_ledger``).  ``ShardRequestFailed`` naming the shards that did not answer."""
        return _wait_all({shard: rpc.rpc_async(shard, service.push_ledger,
                                               args=(self.optimizer_handle(shard), self.token))
                          for shard in shards}, "push ledger")

    def lookup(self, features: Mapping[str, Tensor], step: int = -1) -> "CollectionLookup":
        """Send every table's lookups of ``features[name]`` (``(bags, ids per bag)`` ids): one RPC per shard.
        ``step``: the training step they are for (dynamic tables admit and touch ids then); negative for a
        lookup that only reads (evaluation)."""
        return self.lookup_planned(self.plan_lookup(features, step))

    def lookup_planned(self, plan: "LookupPlan") -> "CollectionLookup":
        """Send the lookups of ``plan`` (made by ``plan_lookup``): one RPC per shard."""
        return plan.sent({shard: rpc.rpc_async(shard, service.lookup, args=(self.incarnation(shard), *request))
                          for shard, request in plan.requests().items()})

    def plan_lookup(self, features: Mapping[str, Tensor], step: int) -> "LookupPlan":
        """The lookups of ``features`` routed and grouped by shard, not sent yet (``lookup`` sends them; a push
        can carry them, see ``CollectionLookup.push``)."""
        return self.plan_routes({name: table.route(features[name]) for name, table in self.tables.items()}, step)

    def plan_routes(self, routes: Mapping[str, Route], step: int) -> "LookupPlan":
        """The lookups of ``routes`` (a ``Route`` per table: ``table.route(...)``, or the union of several
        steps' a row cache reads at once) grouped by shard, not sent yet."""
        by_shard: Dict[str, Tuple[List[int], List[Tensor], List[Tuple[str, int]]]] = {}
        for name, route in routes.items():
            for position, (range_index, local_ids) in enumerate(route.requests):
                shard, slot = self.where(name, range_index)
                handles, ids, keys = by_shard.setdefault(shard, ([], [], []))
                handles.append(slot.table_handle)
                ids.append(local_ids)
                keys.append((name, position))
        return LookupPlan(self, dict(routes), by_shard, step)

    def send(self, pushes: Sequence["StepPush"], then: Optional["LookupPlan"] = None) -> "PendingPush":
        """Send ``pushes`` (one or more steps' row gradients, ``CollectionLookup.step_push``) and ``then``'s
        lookups: ONE message per shard, whose pushes the shard applies in order (each at most once per
        (``token``, step)) before it reads ``then``'s rows (ps-lite's push-pull).  A shard that only reads is
        asked with a plain lookup.  The pending push's ``then`` is that lookup (``None`` without one)."""
        reads = then.requests() if then is not None and then.collection is self else {}
        recorder = self.recorder
        shards = dict.fromkeys([shard for push in pushes for shard in push.by_shard] + list(reads))
        futures, read_futures = {}, {}
        for shard in shards:
            params, param_counts, ids, values, steps = [], [], [], [], []
            for push in pushes:
                entry = push.by_shard.get(shard)
                if entry is not None:
                    params.extend(entry[0])
                    param_counts.append(len(entry[0]))
                    ids.extend(entry[1])
                    values.extend(entry[2])
                    steps.append(push.step)
            read = reads.get(shard)
            if not steps:
                read_futures[shard] = rpc.rpc_async(shard, service.lookup, args=(self.incarnation(shard), *read))
                continue
            if recorder is not None:
                recorder.client_request(shard, "push", sum(g.numel() * g.element_size() for g in values))
            future = rpc.rpc_async(shard, service.push_lookup, args=(
                self.incarnation(shard), self.optimizer_handle(shard), params, param_counts, wire.pack_ids(ids),
                wire.counts(ids), wire.pack_rows(values), self.peer, self.token, steps,
                *(read if read is not None else _NO_READ)))
            futures[shard] = future
            if read is not None:
                read_futures[shard] = future
        return PendingPush(futures, then.sent(read_futures) if reads else None, [push.step for push in pushes],
                           pushes)


#: The lookup part of a push that reads nothing: no tables, no ids, no counts, no step.
_NO_READ = ([], torch.empty(0, dtype=torch.long), [], -1)


class StepPush:
    """One step's row gradients grouped by shard, ready to leave with ``collection.send``
    (``CollectionLookup.step_push``): ``by_shard[shard]`` is (parameter indices in the shard's optimizer, each
    one's row ids, its gradient rows)."""

    __slots__ = ("collection", "step", "by_shard")

    def __init__(self, collection: EmbeddingCollection, step: int,
                 by_shard: Dict[str, Tuple[List[int], List[Tensor], List[Tensor]]]):
        self.collection, self.step, self.by_shard = collection, step, by_shard


class LookupPlan:
    """A step's lookups routed to their shards, before they leave: ``requests()`` is what each shard is asked
    (table handles, ids, step), ``sent(futures)`` the lookup once they left (and counts them)."""

    def __init__(self, collection: EmbeddingCollection, routes: Dict[str, Route],
                 by_shard: Dict[str, Tuple[List[int], List[Tensor], List[Tuple[str, int]]]], step: int):
        self.collection, self.step = collection, step
        self._routes, self._by_shard = routes, by_shard

    def requests(self) -> Dict[str, Tuple[List[int], Tensor, List[int], int]]:
        """Per shard: table handles, their ids packed, the count of each, the step (``wire``)."""
        return {shard: (handles, wire.pack_ids(ids), wire.counts(ids), self.step)
                for shard, (handles, ids, _) in self._by_shard.items()}

    def sent(self, futures: Dict[str, torch.futures.Future]) -> "CollectionLookup":
        """The lookup, its requests sent as ``futures`` (one per shard, each answering the shard's rows)."""
        recorder = self.collection.recorder
        if recorder is not None:  # one lookup RPC per shard, whatever the tables it serves
            for shard, (_, ids, keys) in self._by_shard.items():
                rows = sum(local.numel() for local in ids)
                sent = sum(local.numel() * local.element_size() for local in ids)
                returned = sum(local.numel() * self.collection.tables[name].row_bytes
                               for local, (name, _) in zip(ids, keys))
                recorder.lookup(shard, rows, sent, returned)
        return CollectionLookup(self.collection, self._routes,
                                {shard: (keys, wire.counts(ids)) for shard, (_, ids, keys) in self._by_shard.items()},
                                futures, self.step)


class CollectionLookup:
    """One step's lookups in flight: ``pooled()`` waits for them and pools; after the backward pass through
    the pooled embeddings, ``push()`` sends the row gradients."""

    def __init__(self, collection: EmbeddingCollection, routes: Dict[str, Route],
                 keys: Dict[str, Tuple[List[Tuple[str, int]], List[int]]], futures: Dict[str, torch.futures.Future],
                 step: int = -1):
        self.collection, self._routes, self._keys, self._futures = collection, routes, keys, futures
        #: The step the lookups are for (negative: a read only).
        self.step = step
        self.rows: Dict[str, Tensor] = {}

    def pooled(self, differentiable: bool = True) -> Dict[str, Tensor]:
        """Every table's pooled embeddings; raises ``ShardRequestFailed`` naming the shards that failed."""
        pooled = {}
        for name, rows in self.unique_rows().items():
            self.rows[name] = rows.requires_grad_(differentiable)
            pooled[name] = self._routes[name].pool(self.rows[name])
        return pooled

    def unique_rows(self) -> Dict[str, Tensor]:
        """Every table's rows of its distinct ids, in its route's order (plain values: no autograd); waits for
        the shards (``ShardRequestFailed`` naming those that failed)."""
        pieces: Dict[str, List[Optional[Tensor]]] = {name: [None] * len(route.requests)
                                                      for name, route in self._routes.items()}
        tables = self.collection.tables
        for shard, reply in _wait_all(self._futures, "lookup").items():
            keys, row_counts = self._keys[shard]
            widths = [tables[name].embedding_dim for name, _ in keys]
            for (name, position), rows in zip(keys, wire.unpack_rows(reply, row_counts, widths)):
                pieces[name][position] = rows
        return {name: computed(torch.cat(pieces[name])) if pieces[name] else tables[name].no_rows(False)
                for name in self._routes}

    def step_push(self, step: int = -1, gradients: Optional[Mapping[str, Optional[Tensor]]] = None) -> StepPush:
        """The looked-up rows' gradients (``gradients``, by table; by default what the backward pass left in
        their ``.grad``) grouped by shard, for ``EmbeddingCollection.send``.  Tables whose rows got no
        gradient have none."""
        collection = self.collection
        if gradients is None:
            gradients = {name: rows.grad for name, rows in self.rows.items()}
        requests: Dict[str, Tuple[List[int], List[Tensor], List[Tensor]]] = {}
        push_dtype = collection.push_dtype
        for name, route in self._routes.items():
            gradient = gradients.get(name)
            if gradient is None:
                continue
            if push_dtype is not None and gradient.dtype != push_dtype:
                gradient = gradient.to(push_dtype)
            start = 0
            for range_index, local_ids in route.requests:
                stop = start + local_ids.numel()
                shard, slot = collection.where(name, range_index)
                params, ids, values = requests.setdefault(shard, ([], [], []))
                params.append(slot.param_index)
                ids.append(local_ids)
                values.append(gradient[start:stop])  # packed (copied) as it leaves
                start = stop
        return StepPush(collection, step, requests)

    def push(self, step: int = -1, gradients: Optional[Mapping[str, Optional[Tensor]]] = None,
             then: Optional[LookupPlan] = None) -> "PendingPush":
        """Send the looked-up rows' gradients (``step_push``): one RPC per shard, applied there on arrival.
        ``step`` (0 or more) makes the push idempotent: a shard applies one push per (collection's
        ``token``, step), so a step's push sent again is not applied twice.

        ``then``: a later step's lookups (``EmbeddingCollection.plan_lookup``), carried by the push (ps-lite's
        push-pull): each shard reads their rows right after applying this push, in the same message, and
        the pending push's ``then`` is that lookup.  A shard the push does not reach is asked on its own.
        """
        return self.collection.send([self.step_push(step, gradients)], then)

    def push_during_backward(self, step: int, then: Optional[LookupPlan] = None, earlier: Sequence[StepPush] = (),
                             hold: bool = False) -> "PushOnGradients":
        """Push as soon as the next backward pass has computed every looked-up row's gradient, while it goes
        on (a DDP all-reduce still in flight): the push of ``step``, idempotent, after the held pushes of
        ``earlier`` steps and carrying ``then``, all in one message per shard (see ``push`` and
        ``EmbeddingCollection.send``).  ``hold``: send nothing; ``PushOnGradients.held`` is the step's push,
        for a later message (a row cache's window)."""
        return PushOnGradients(self, step, then, earlier, hold)


class PushOnGradients:
    """A push made from inside a backward pass (``CollectionLookup.push_during_backward``): sent, with the
    earlier steps' held pushes, as ``pending``, or held back as ``held`` (``sent()`` tells, after the
    backward pass).

    It is made as soon as the last table's rows have their gradient accumulated (a hook after accumulation
    on each table's rows: they are leaves).  When the backward pass reaches only some tables' rows, it is
    made after the pass, by ``sent()``, from those (the others' rows got no gradient)."""

    def __init__(self, lookup: CollectionLookup, step: int, then: Optional[LookupPlan] = None,
                 earlier: Sequence[StepPush] = (), hold: bool = False):
        self.pending: Optional[PendingPush] = None
        self.held: Optional[StepPush] = None
        self.failure: Optional[BaseException] = None
        #: When sending the message failed (``failure``): the pushes it was to carry, in step order.
        self.unsent: List[StepPush] = []
        self._lookup, self._collection, self._then, self._earlier = lookup, lookup.collection, then, list(earlier)
        self._step, self._hold = step, hold
        self._made = False
        self._expected = [name for name, rows in lookup.rows.items() if rows.requires_grad]
        self._grads: Dict[str, Tensor] = {}  # by table, the gradients accumulated so far in the backward pass
        self._handles = [lookup.rows[name].register_post_accumulate_grad_hook(self._accumulated(name))
                         for name in self._expected]

    def _accumulated(self, name: str):
        def hook(rows: Tensor) -> None:
            self._grads[name] = rows.grad
            if len(self._grads) == len(self._expected) and not self._made:
                self._make()
        return hook

    def _make(self) -> None:
        """The step's push from the gradients accumulated: held, or sent with the earlier ones and ``then``."""
        self._made = True
        try:
            push = self._lookup.step_push(self._step, self._grads)
            if self._hold:
                self.held = push
            else:
                self.unsent = self._earlier + [push]
                self.pending = self._collection.send(self.unsent, self._then)
                self.unsent = []
        except Exception as error:  # noqa: BLE001 - raised by sent(), not into the backward pass
            self.failure = error

    def sent(self) -> "PendingPush":
        """The message as it left (after the backward pass): raises what sending it raised.  When the backward
        pass never reached the rows, the earlier pushes and ``then`` leave now (unless held) and the step's
        push is an empty one (its ``steps`` count it); a held push is an empty pending push and ``held``."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if not self._made and self._grads:  # the pass reached some tables' rows only
            self._make()
        if self.failure is not None:
            raise self.failure
        if not self._made and not self._hold:  # once: the earlier pushes and ``then`` leave, this step's is empty
            self._made = True
            try:
                self.pending = self._collection.send(self._earlier, self._then) \
                    if self._earlier or self._then is not None else PendingPush({})
            except Exception as error:  # noqa: BLE001 - raised now and by every later call
                self.failure, self.unsent = error, list(self._earlier)
                raise
            self.pending.steps.append(self._step)
        return self.pending if self.pending is not None else PendingPush({})

    @property
    def holding(self) -> bool:
        """Whether the step's push is held back (``held``, once made) rather than sent."""
        return self._hold

    def wait(self) -> None:
        """Wait for the push (``ShardRequestFailed`` naming the shards that failed)."""
        self.sent().wait()


class PendingPush:
    """Pushes in flight; ``wait()`` raises ``ShardRequestFailed`` naming the shards that failed.  ``then``:
    the later steps' lookup the message carries (``None``: none); ``steps``: the steps whose pushes it
    carries, in order (a step whose rows got no gradient among them, with no push); ``pushes``: those pushes
    (what a failed message would send again)."""

    def __init__(self, futures: Dict[str, torch.futures.Future], then: Optional[CollectionLookup] = None,
                 steps: Sequence[int] = (), pushes: Sequence[StepPush] = ()):
        self._futures = futures
        self.then = then
        self.steps = list(steps)
        self.pushes = list(pushes)

    def wait(self) -> None:
        _wait_all(self._futures, "push")


def _wait_all(futures: Mapping[str, torch.futures.Future], action: str) -> Dict[str, object]:
    """Every future's result by shard, once all answered; ``ShardRequestFailed`` if any failed."""
    results, failures = settle(futures)
    if failures:
        raise ShardRequestFailed(action, failures) from failures[0][1]
    return results
