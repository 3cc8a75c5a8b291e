"""The Trainer's row pipeline in one process (``JobContext.local``): reads carried by pushes give the same
results as the unpipelined step (across a lost shard and a lost member too), the staleness bound holds the
worker back where it says, and the row cache reads shared rows once within its bounds.  A push lost with its
shard is sent again once the shard serves, applied once; one refused when sent again ends the job; a shard tells
its ledger of a pusher."""

import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from paramserver import Batch, Table, Trainer
from paramserver.ddp.hooks import CommHookState
from paramserver.metrics.data_plane import DataPlaneMetrics
from paramserver.optim import QHM
from paramserver.runtime.context import GroupView, JobContext, Recorders
from paramserver.shards.server import rows as shard_rows

pytestmark = pytest.mark.timeout(120)

FIXED_ROWS, BAG = 30, 3


@pytest.fixture(scope="module")
def local_context():
    ctx = JobContext.local()
    yield ctx
    ctx.close()


def overlapping_batches(count: int, size: int = 16, hashed_ids: bool = True):
    """Batches whose ids overlap from step to step (few ids: most rows a step updates, the next reads); the
    second table's ids are 40 raw 64-bit hashes, or ``0..39`` without ``hashed_ids``."""
    generator = torch.Generator().manual_seed(7)
    for _ in range(count):
        fixed = torch.randint(0, FIXED_ROWS, (size, BAG), generator=generator)
        hashed = torch.randint(0, 40, (size, 1), generator=generator)
        if hashed_ids:
            hashed = hashed * 0x9E3779B97F4A7C15 % (2 ** 62)
        dense = torch.randn(size, 2, generator=generator)
        labels = (torch.rand(size, generator=generator) < 0.5).float()
        yield Batch(sparse={"fixed": fixed, "hashed": hashed}, dense=dense, labels=labels)


class Tower(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4 + 4 + 2, 1)

    def forward(self, pooled, dense):
        return self.linear(torch.cat([pooled["fixed"], pooled["hashed"], dense], 1)).squeeze(1)


class RecordedLoss:
    """BCE with logits, each step's value kept (exactly, as a tensor)."""

    def __init__(self):
        self.values = []
        self._bce = torch.nn.BCEWithLogitsLoss()

    def __call__(self, logits, labels):
        loss = self._bce(logits, labels)
        self.values.append(loss.detach().clone())
        return loss


def trainer(ctx, name: str, loss, second_options=None, dynamic: bool = True, **options) -> Trainer:
    """The second table is dynamic, or fixed with 40 rows (with ``second_options`` either way)."""
    torch.manual_seed(0)  # the same tower in every run
    second = Table(None if dynamic else 40, 4, **(second_options or {}))
    tables = {"fixed": Table(FIXED_ROWS, 4, mode="mean"), "hashed": second}
    return Trainer(ctx, tables=tables, dense=Tower(), sparse_optimizer=(QHM, dict(lr=0.5, momentum=0.9, nu=0.7)),
                   dense_optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=loss, name=name,
                   **dict(dict(agree_every=5), **options))


@pytest.mark.parametrize("dynamic, dynamic_options", [(False, None), (True, None), (True, {"admit_after": 2})],
                         ids=["fixed", "dynamic", "admission"])
def test_reads_carried_by_pushes_train_bit_identically_to_the_unpipelined_step(local_context, dynamic,
                                                                                dynamic_options):
    # Reads of fixed tables cross the agreements (every 5 steps); with a dynamic table they stop there.
    runs = {}
    for how in ("unpipelined", "pipelined", "stale"):
        loss = RecordedLoss()
        options = dict(read_ahead=how != "unpipelined", staleness=int(how == "stale"))
        figures = trainer(local_context, f"exact-{how}-{dynamic}-{bool(dynamic_options)}", loss, dynamic_options,
                          dynamic, **options).fit(overlapping_batches(23, hashed_ids=dynamic), steps=23,
                                                  log_every=5)
        assert figures["sparse_steps"] == 23 and figures["steps"] == 23, figures
        runs[how] = (torch.stack(loss.values), figures["replica_checksum"])
    (plain_losses, plain_checksum), (piped_losses, piped_checksum) = runs["unpipelined"], runs["pipelined"]
    assert torch.equal(plain_losses, piped_losses), (plain_losses - piped_losses).abs().max()
    assert plain_checksum == piped_checksum
    # The comparison sees a read that misses an update: with staleness 1, rows read ahead differ.
    assert not torch.equal(runs["stale"][0], plain_losses)


class HeldPushes:
    """Holds every message with a push of step ``from_step`` or later on this process's shard until
    ``release()``."""

    def __init__(self, monkeypatch, from_step: int):
        self.from_step = from_step
        self._released = threading.Event()
        apply = shard_rows.pushes

        def held(*arguments):
            if max(arguments[-1]) >= self.from_step:  # the steps of the message's pushes
                self._released.wait(60)
            return apply(*arguments)
        monkeypatch.setattr(shard_rows, "pushes", held)

    def release(self) -> None:
        self._released.set()


@pytest.mark.parametrize("staleness, cache_steps, from_step, agree_every, exports",
                         [(0, None, 3, 10, False), (2, None, 3, 10, False), (2, 3, 3, 10, False),
                          (2, 2, 4, 10, False), (2, None, 3, 5, False), (2, None, 3, 5, True)],
                         ids=["exact", "stale", "stale-window-3", "stale-window-2", "stale-across-an-agreement",
                              "stale-export-at-the-agreement"])
def test_a_worker_stops_exactly_staleness_steps_ahead_of_a_held_push_and_goes_on_when_released(
        local_context, monkeypatch, tmp_path, staleness, cache_steps, from_step, agree_every, exports):
    # With a row cache, pushes leave every cache_steps steps (after steps 2, 5, 8... with 3; 1, 3, 5... with
    # 2): the held push is the first of its message, which the worker waits for before step from_step + k + 1.
    # Pushes in flight cross an agreement, unless a live export (or a checkpoint) takes the model there:
    # then every push is applied first.
    held, loss = HeldPushes(monkeypatch, from_step=from_step), RecordedLoss()
    cache = {} if cache_steps is None else dict(cache_rows=10_000, cache_steps=cache_steps)
    export = dict(export_to=str(tmp_path / "exports"), export_every=agree_every) if exports else {}
    job = trainer(local_context, f"bound-{staleness}-{cache_steps}-{agree_every}-{exports}", loss,
                  staleness=staleness, agree_every=agree_every, **cache, **export)
    result = {}
    fitting = threading.Thread(target=lambda: result.update(job.fit(overlapping_batches(12), steps=12, log_every=4)))
    fitting.start()
    try:
        # Steps 0..from_step+staleness finish (however slow the machine); the step after waits for the push
        # of step from_step, and a second is long enough for many steps, were the worker not held back.
        held_at = min(from_step + staleness + 1, agree_every if exports else 12)
        deadline = time.monotonic() + 60
        while len(loss.values) < held_at and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1)
        assert len(loss.values) == held_at
    finally:
        held.release()
        fitting.join(60)
    assert not fitting.is_alive()
    assert result["steps"] == 12 and result["sparse_steps"] == 12 and len(loss.values) == 12, result


def test_staleness_is_refused_unless_a_whole_number_of_steps(local_context):
    for staleness in (-1, 1.5, True):
        with pytest.raises(ValueError, match="staleness"):
            trainer(local_context, "refused", RecordedLoss(), staleness=staleness)
    with pytest.raises(ValueError, match="read_ahead"):
        trainer(local_context, "refused", RecordedLoss(), staleness=1, read_ahead=False)


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
def test_a_row_cache_at_staleness_0_changes_nothing(local_context, dynamic):
    runs = []
    for cache in ({}, dict(cache_rows=1000)):
        loss = RecordedLoss()
        figures = trainer(local_context, f"cache0-{dynamic}-{bool(cache)}", loss, dynamic=dynamic,
                          **cache).fit(overlapping_batches(17, hashed_ids=dynamic), steps=17, log_every=5)
        assert figures["sparse_steps"] == 17, figures
        runs.append((torch.stack(loss.values), figures["replica_checksum"], figures))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert runs[1][2]["row_cache.hits"] == 0  # a window of one step: nothing read twice


ROW_BYTES = 4 * 4  # the tables' rows: 4 float32 values


@pytest.mark.parametrize("dynamic, bound, cache_rows", [
    (False, dict(cache_rows=10_000), 10_000), (True, dict(cache_rows=10_000), 10_000),
    (False, dict(cache_rows=50), 50), (False, dict(cache_mib=50 * ROW_BYTES / 2 ** 20), 50),
    (False, dict(cache_rows=200, cache_mib=50 * ROW_BYTES / 2 ** 20), 50)],
    ids=["fixed", "dynamic", "fixed-tight", "fixed-tight-in-mib", "rows-and-mib"])
def test_a_row_cache_reads_shared_rows_once_holds_at_most_cache_rows_and_applies_every_push(
        local_context, monkeypatch, dynamic, bound, cache_rows):
    """``cache_rows`` in rows, ``cache_mib`` in MiB of rows (``cache_rows`` here: the rows that MiB hold)."""
    from paramserver.train import pipeline
    most_held = []
    count_read = pipeline.RowPipeline._count_read

    def counted(self, window):
        count_read(self, window)
        most_held.append(self.cache.rows_held)
    monkeypatch.setattr(pipeline.RowPipeline, "_count_read", counted)
    registry = CollectorRegistry()  # what the worker's metrics port would serve
    monkeypatch.setattr(local_context, "recorders", Recorders(data_plane=DataPlaneMetrics(registry)))
    loss = RecordedLoss()
    # Agreements every 6 steps: windows of 3 steps line up with them (a dynamic table's reads stop there).
    figures = trainer(local_context, f"cache2-{dynamic}-{'-'.join(bound)}-{cache_rows}", loss, dynamic=dynamic,
                      staleness=2, agree_every=6, cache_steps=3, **bound).fit(
        overlapping_batches(24, hashed_ids=dynamic), steps=24, log_every=4)
    assert figures["steps"] == 24 and figures["sparse_steps"] == 24 and len(loss.values) == 24, figures
    assert max(most_held) <= cache_rows, (max(most_held), cache_rows)
    assert figures["row_cache.rows_held"] == 0  # every window was dropped by the end
    assert figures["row_cache.evictions"] == figures["row_cache.rows_read"]
    served = {name: registry.get_sample_value(f"paramserver_row_cache_{name}") for name in
              ("rows_read_total", "hits_total", "saved_bytes_total", "evictions_total", "rows")}
    assert served == {"rows_read_total": figures["row_cache.rows_read"], "hits_total": figures["row_cache.hits"],
                      "saved_bytes_total": figures["row_cache.bytes_saved"],
                      "evictions_total": figures["row_cache.evictions"], "rows": 0}, (served, figures)
    if cache_rows >= 1000:  # 3 steps a window: each shared row read once
        assert figures["row_cache.windows"] == 8 and figures["row_cache.hit_rate"] > 0.3, figures
    else:  # windows cut short to hold at most 50 rows (a step of these batches needs at most 30 + 16)
        assert figures["row_cache.windows"] > 8, figures


def test_a_tables_own_cache_rows_turns_the_cache_on_and_bounds_that_tables_rows(local_context, monkeypatch):
    """``Table(..., cache_rows=N)`` alone: the cache is on, and no window holds more than ``N`` of that table's
    rows (cut short where three steps' rows would be more), whatever the other table holds."""
    from paramserver.train import pipeline
    held = []
    count_read = pipeline.RowPipeline._count_read

    def counted(self, window):
        count_read(self, window)
        held.append(dict(window.table_rows_held, steps=len(window.steps)))
    monkeypatch.setattr(pipeline.RowPipeline, "_count_read", counted)
    loss = RecordedLoss()
    # A step's 16 ids of the 40-row table are at most 16 rows, two steps' about 22, three steps' about 28.
    job = trainer(local_context, "table-bound", loss, {"cache_rows": 24}, dynamic=False, staleness=2,
                  cache_steps=3, agree_every=6)
    assert job.caches_rows
    figures = job.fit(overlapping_batches(24, hashed_ids=False), steps=24, log_every=4)
    assert figures["steps"] == 24 and figures["sparse_steps"] == 24 and len(loss.values) == 24, figures
    assert held and max(window["hashed"] for window in held) <= 24, held
    assert figures["row_cache.windows"] > 8, (figures, held)  # some of the 8 windows of 3 steps were cut short
    assert max(window["hashed"] + window["fixed"] for window in held) > 24, held  # the bound is that table's
    assert figures["row_cache.rows_held"] == 0 and figures["row_cache.hit_rate"] > 0, figures


@pytest.mark.parametrize("cores_to_spare, window", [(True, 2), (False, 3)], ids=["spare-cores", "short-of-cores"])
def test_the_row_caches_default_window_follows_the_host(local_context, monkeypatch, caplog, cores_to_spare,
                                                        window):
    """``k`` steps a window where the host has cores to spare (each message overlaps a step), ``k + 1`` where
    it is short of them (the fewest messages); a window given is kept either way."""
    monkeypatch.setattr(local_context, "cores_to_spare", cores_to_spare)
    assert trainer(local_context, "window", RecordedLoss(), staleness=2, cache_rows=100).cache_steps == window
    assert trainer(local_context, "window", RecordedLoss(), staleness=2, cache_rows=100,
                   cache_steps=1).cache_steps == 1
    assert trainer(local_context, "window", RecordedLoss(), staleness=0, cache_rows=100).cache_steps == 1
    with caplog.at_level("INFO", logger="paramserver.train.trainer"):
        figures = trainer(local_context, f"window-{window}", RecordedLoss(), staleness=2, cache_rows=1000,
                          agree_every=6).fit(overlapping_batches(12), steps=12, log_every=4)
    assert figures["sparse_steps"] == 12 and figures["row_cache.windows"] == 12 // window, figures
    assert f"staleness 2, a message per shard every {window} steps;" in caplog.text, caplog.text


def test_row_cache_options_are_refused_unless_they_make_sense(local_context):
    for options in (dict(cache_rows=0), dict(cache_rows=True), dict(cache_rows=1.5),
                    dict(cache_rows=10, staleness=1, cache_steps=3), dict(cache_steps=1),
                    dict(cache_rows=10, staleness=1, cache_steps=0), dict(cache_mib=0), dict(cache_mib=-1.0),
                    dict(cache_mib=True), dict(cache_mib="64"), dict(cache_mib=float("inf")),
                    dict(cache_mib=float("nan")), dict(cache_mib=1.0, staleness=1, cache_steps=3)):
        with pytest.raises(ValueError, match="cache_"):
            trainer(local_context, "refused", RecordedLoss(), **options)
    for bound in (0, -3, True, 1.5, "16"):
        with pytest.raises(ValueError, match="a table's cache_rows must be a whole number"):
            Table(40, 4, cache_rows=bound)
    # A worker's cache bound is not part of what a table is.
    assert Table(40, 4, cache_rows=16) == Table(40, 4)


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
def test_across_a_lost_shard_the_pipelined_step_stays_bit_identical_to_the_unpipelined_one(
        local_context, monkeypatch, dynamic):
    # Step 9's rows fail to arrive once (a shard lost under the step, seen by the worker as a failed lookup,
    # whether read ahead by step 8's push or looked up when step 9 starts): the reads ahead are dropped, the
    # sparse part is rebuilt (here: its tables start again from their seeds, as a shard without checkpoints
    # would) and step 9 is redone.  Both ways must take the same path to the same numbers.
    from paramserver.shards.client import collection as client_collection
    unique_rows = client_collection.CollectionLookup.unique_rows
    runs = {}
    for how in ("unpipelined", "pipelined"):
        failed = []

        def lost_once(self):
            if self.step == 9 and not failed:
                failed.append(self.step)
                raise client_collection.ShardRequestFailed("lookup", [("local", RuntimeError("shard lost"))])
            return unique_rows(self)
        monkeypatch.setattr(client_collection.CollectionLookup, "unique_rows", lost_once)
        loss = RecordedLoss()
        figures = trainer(local_context, f"lost-{how}-{dynamic}", loss, dynamic=dynamic,
                          read_ahead=how == "pipelined").fit(overlapping_batches(17, hashed_ids=dynamic), steps=17,
                                                             log_every=5)
        assert failed == [9] and figures["shard_rebuilds"] == 1 and figures["sparse_steps"] == 17, figures
        runs[how] = (torch.stack(loss.values), figures["replica_checksum"])
    assert torch.equal(runs["unpipelined"][0], runs["pipelined"][0])
    assert runs["unpipelined"][1] == runs["pipelined"][1]


class LostMember:
    """A member of the group lost at step ``at`` (counting from 0), as its survivors see it: the backward pass
    fails like a collective does (``DistError``) in the loss's gradient (before anything of the step left) or
    in the group's all-reduce (the comm hook), after the coordinator's next view of the group was published
    (the same one member, a newer generation), so that the group re-forms and the step is redone."""

    def __init__(self, ctx, monkeypatch, at: int, where: str):
        self.ctx, self.at, self.where, self.calls = ctx, at, where, 0
        if where == "all-reduce":
            all_reduce = CommHookState.all_reduce

            def failing(state, tensor):
                if self._now():
                    raise torch.distributed.DistError("a member of the group was lost (simulated)")
                return all_reduce(state, tensor)
            monkeypatch.setattr(CommHookState, "all_reduce", failing)

    def _now(self) -> bool:
        self.calls += 1
        if self.calls != self.at + 1:
            return False
        view = self.ctx.inbox.group_view()
        self.ctx.inbox.set_group_view(GroupView(view.group, view.generation + 1, view.members, view.backend))
        return True

    def loss(self, recorded: RecordedLoss):
        def loss(logits, labels):
            value = recorded(logits, labels)
            if self.where == "loss" and self._now():
                def lost(_gradient):
                    raise torch.distributed.DistError("a member of the group was lost (simulated)")
                value.register_hook(lost)
            return value
        return loss


@pytest.mark.parametrize("dynamic, where", [(False, "loss"), (True, "all-reduce")],
                         ids=["fixed-in-loss", "dynamic-in-all-reduce"])
def test_across_a_lost_worker_the_pipelined_step_stays_bit_identical_to_the_unpipelined_one(
        local_context, monkeypatch, dynamic, where):
    # Step 7's backward fails as a collective does when a member is lost: the group re-forms, the reads ahead
    # are dropped, every push in flight is waited for, and the step is redone (its push, if it left, is not
    # applied twice).
    runs = {}
    for how in ("unpipelined", "pipelined"):
        recorded = RecordedLoss()
        lost = LostMember(local_context, monkeypatch, at=7, where=where)
        figures = trainer(local_context, f"member-{how}-{dynamic}", lost.loss(recorded), dynamic=dynamic,
                          read_ahead=how == "pipelined").fit(overlapping_batches(17, hashed_ids=dynamic), steps=17,
                                                             log_every=5)
        assert figures["recoveries"] == 1 and figures["steps"] == 17 and figures["sparse_steps"] == 17, figures
        assert len(recorded.values) == 18  # step 7 twice
        runs[how] = (torch.stack(recorded.values), figures["replica_checksum"])
    assert torch.equal(runs["unpipelined"][0], runs["pipelined"][0])
    assert runs["unpipelined"][1] == runs["pipelined"][1]


class DenseOnly(torch.nn.Module):
    """A tower that ignores the pooled rows: no row ever gets a gradient, so every step's push is empty."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, pooled, dense):
        return self.linear(dense).squeeze(1)


@pytest.mark.parametrize("options", [dict(), dict(staleness=2, cache_rows=1000)], ids=["exact", "stale-cache"])
def test_steps_whose_rows_get_no_gradient_are_counted_once_each(local_context, options):
    job = Trainer(local_context, tables={"fixed": Table(FIXED_ROWS, 4, mode="mean"), "hashed": Table(None, 4)},
                  dense=DenseOnly(), sparse_optimizer=(QHM, dict(lr=0.5, momentum=0.9, nu=0.7)),
                  dense_optimizer=lambda params: torch.optim.SGD(params, lr=0.1), loss=RecordedLoss(),
                  name=f"empty-{bool(options)}", agree_every=5, **options)
    figures = job.fit(overlapping_batches(12), steps=12, log_every=4)
    assert figures["steps"] == 12 and figures["sparse_steps"] == 12 and figures["sparse_steps_lost"] == 0, figures


class LostPushMessage:
    """The messages carrying step ``at``'s push fail, the first as against a shard process that was lost: before
    it arrives (nothing of it applied), or after it was applied (only its answer lost); then with each of
    ``then`` (a ``ValueError``: refused by the shard)."""

    def __init__(self, monkeypatch, at: int, applied: bool, then=()):
        from paramserver.shards.client.collection import EmbeddingCollection, PendingPush
        send = EmbeddingCollection.send
        self.failed = []
        errors = [RuntimeError("shard lost (simulated)"), *then]

        def failing(collection, pushes, then=None):
            if len(self.failed) == len(errors) or at not in [push.step for push in pushes]:
                return send(collection, pushes, then)
            error = errors[len(self.failed)]
            self.failed.append([push.step for push in pushes])
            if applied:
                send(collection, pushes, then).wait()
            futures = {}
            for shard in dict.fromkeys(shard for push in pushes for shard in push.by_shard):
                futures[shard] = torch.futures.Future()
                futures[shard].set_exception(error)
            return PendingPush(futures, None, [push.step for push in pushes], pushes)
        monkeypatch.setattr(EmbeddingCollection, "send", failing)


@pytest.mark.parametrize("applied, options", [(False, {}), (True, {}), (False, dict(staleness=2, cache_rows=1000))],
                         ids=["exact-lost-before-it-arrived", "exact-applied-answer-lost", "stale-cache"])
def test_a_push_lost_with_its_shard_is_sent_again_once_the_shard_serves_and_applied_once(local_context, monkeypatch,
                                                                                        applied, options):
    # The push of step 9 fails against the shard: the sparse part is rebuilt, and the push is sent again to
    # it through the new collection.  Sent again, a push the shard had applied is skipped there (idempotent per
    # pusher and step): exact, the run is bit-identical to one without the loss, every step applied once.
    runs = {}
    for how in ("undisturbed", "lost"):
        lost = LostPushMessage(monkeypatch, at=9, applied=applied) if how == "lost" else None
        loss = RecordedLoss()
        figures = trainer(local_context, f"resent-{how}-{applied}-{bool(options)}", loss, dynamic=False,
                          **options).fit(overlapping_batches(17, hashed_ids=False), steps=17, log_every=5)
        assert figures["sparse_steps"] == 17 and figures["sparse_steps_lost"] == 0, figures
        assert figures["shard_rebuilds"] == (how == "lost") and figures["replayed_pushes"] == 0, figures
        runs[how] = (torch.stack(loss.values), figures["replica_checksum"])
    assert lost.failed and 9 in lost.failed[0]
    if not options:
        assert torch.equal(runs["undisturbed"][0], runs["lost"][0])
        assert runs["undisturbed"][1] == runs["lost"][1]


def test_a_push_refused_when_sent_again_ends_the_job_naming_the_refusal(local_context, monkeypatch):
    from paramserver.shards.client.collection import ShardRefused
    lost = LostPushMessage(monkeypatch, at=5, applied=False, then=[ValueError("rows out of range (simulated)")])
    with pytest.raises(ShardRefused, match="rows out of range"):
        trainer(local_context, "resent-refused", RecordedLoss(), dynamic=False).fit(
            overlapping_batches(9, hashed_ids=False), steps=9, log_every=5)
    assert lost.failed == [[5], [5]]  # sent, then sent again after the rebuild, and refused


def test_a_shard_tells_its_ledger_of_a_pusher(local_context):
    """``EmbeddingCollection.push_ledgers`` (``service.push_ledger``): the newest step of the collection's pusher
    that the shard's optimizer applied (a step pushed again is skipped), and the pushes its process replayed."""
    from paramserver.train.sparse import SparseTables
    sparse = SparseTables({"t": Table(40, 4)}, (QHM, dict(lr=0.5, momentum=0.9, nu=0.7)), local_context.shards,
                          "ledger", 0, 1_000_000, local_context.live_shards)
    try:
        collection = sparse.collection
        shards = list(collection.incarnations())
        assert collection.push_ledgers(shards) == {shard: (-1, 0) for shard in shards}
        for step in (3, 5, 4):
            lookup = collection.lookup({"t": torch.tensor([[1, 2], [3, 4]])}, step)
            lookup.pooled()["t"].sum().backward()
            lookup.push(step).wait()
        assert collection.push_ledgers(shards) == {shard: (5, 0) for shard in shards}
    finally:
        sparse.close()
