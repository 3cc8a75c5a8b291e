"""The Trainer in one process (``JobContext.local``: the process is its own shard and a trainer group of
one), and its parts that need no cluster: the job contract's checks and the data position."""

import dataclasses
import datetime
import gc
import pathlib
import sys
import threading
import time
import weakref

import pytest
import torch
from prometheus_client import CollectorRegistry

from paramserver import Batch, Table, Trainer
from paramserver.metrics.data_plane import DataPlaneMetrics
from paramserver.metrics.training import TrainingMetrics
from paramserver.optim import QHM
from paramserver.runtime.context import JobContext, Recorders
from paramserver.shards import ShardRequestFailed
from paramserver.train.data import BatchStream, DataExhausted
from paramserver.train.sparse import RebuildStopped, ShardLost, SparseTables

sys.path.insert(0, str(pathlib.Path(__file__).parent / "jobs"))
import watch_next  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def local_context():
    ctx = JobContext.local()
    yield ctx
    ctx.close()


def test_a_job_trains_in_one_process_and_accounts_for_every_step(local_context):
    figures = watch_next.main(local_context, steps=60, log_every=20, eval_every=30)
    assert figures["steps"] == 60 and figures["sparse_steps"] == 60 and figures["group_size"] == 1, figures
    assert figures["loss"] < figures["first_loss"] and 0.5 < figures["auc"] <= 1, figures
    assert figures["log_loss"] > 0 and figures["samples_per_s"] > 0 and figures["bytes_per_step"] > 0, figures
    assert figures["allreduce_ms"] > 0, figures
    assert local_context.progress()[0] == 60


class Counting:
    """A plain iterable of ``count`` batches of one table."""

    def __init__(self, count: int):
        self.count = count

    def __iter__(self):
        for index in range(self.count):
            ids = torch.full((4, 1), index % 10)
            yield Batch(sparse={"t": ids}, dense=torch.zeros(4, 1), labels=torch.tensor([0.0, 1.0, 0.0, 1.0]))


class Logit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4 + 1, 1)

    def forward(self, pooled, dense):
        return self.linear(torch.cat([pooled["t"], dense], 1)).squeeze(1)


def small_trainer(ctx, name: str, **options) -> Trainer:
    return Trainer(ctx, tables={"t": Table(10, 4)}, dense=Logit(), sparse_optimizer=(QHM, dict(lr=0.1, momentum=0.9, nu=0.7)),
                   dense_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                   loss=torch.nn.BCEWithLogitsLoss(), name=name, **options)


def test_tables_can_be_spread_over_the_shards_and_a_placement_not_offered_is_refused(local_context, monkeypatch):
    from paramserver.train import sparse
    placed = []
    place_whole = sparse.place_whole

    def recorded(sizes, shards, placement):
        placed.append(placement)
        return place_whole(sizes, shards, placement)
    monkeypatch.setattr(sparse, "place_whole", recorded)
    figures = small_trainer(local_context, "spread", table_placement="spread").fit(Counting(30), steps=10,
                                                                                   log_every=5)
    assert figures["steps"] == 10 and figures["sparse_steps"] == 10, figures
    assert placed == ["spread"]  # the tables were built spread (on this one-shard context: all on it)
    with pytest.raises(ValueError, match=r"^table_placement must be one of \('packed', 'spread'\), got 'even'$"):
        small_trainer(local_context, "even", table_placement="even")


def test_data_that_ends_stops_the_group_at_an_agreement(local_context):
    # 25 batches: at step 20 the next agreement's 10 batches are not there, so the group stops at step 20.
    figures = small_trainer(local_context, "ends").fit(Counting(25), steps=100, log_every=5)
    assert figures["steps"] == 20 and figures["sparse_steps"] == 20, figures


def test_the_trainer_hands_the_contexts_recorders_down(local_context):
    """The collection, the trainer group, the dense replica and its comm hook record into the context's metric
    sets (``ps-worker --metrics-port``); nothing is found process-wide."""
    registry = CollectorRegistry()
    ctx = dataclasses.replace(local_context, recorders=Recorders(data_plane=DataPlaneMetrics(registry),
                                                                 training=TrainingMetrics(registry)))
    figures = small_trainer(ctx, "recorded").fit(Counting(30), steps=10, log_every=5)
    assert figures["steps"] == 10 and figures["bytes_per_step"] > 0, figures
    sample = registry.get_sample_value
    assert sample("paramserver_training_steps_total") == 10
    assert sample("paramserver_trainer_group_generation", {"group": "0"}) == 1
    assert sample("paramserver_comm_hook_steps_total", {"hook": "allreduce"}) == 10
    assert sample("paramserver_comm_hook_bytes_total", {"hook": "allreduce"}) == 10 * figures["bytes_per_step"]
    assert sample("paramserver_rpc_client_requests_total", {"peer": "worker0", "rpc": "push"}) == 10
    lookups = sample("paramserver_rpc_client_requests_total", {"peer": "worker0", "rpc": "lookup"})
    assert lookups >= 10 and sample("paramserver_lookup_rows_total", {"peer": "worker0"}) >= lookups
    # The same context without them (metrics off): the Trainer records nowhere.
    small_trainer(local_context, "unrecorded").fit(Counting(30), steps=10, log_every=5)
    assert sample("paramserver_training_steps_total") == 10


def test_a_shard_lost_during_an_evaluation_is_waited_for_and_the_evaluation_done_again(local_context, monkeypatch):
    """The held-out lookups meet a lost shard (as the chaos test's kill can land in one): the sparse part is
    rebuilt, as after a step's failed lookups, and the evaluation is done again instead of ending the job."""
    looked_up = SparseTables.eval_pool
    failures = []

    def fails_once(sparse, batch):
        if not failures:
            failures.append(batch)
            raise ShardRequestFailed("lookup", [("worker0", RuntimeError("EOF: end of file"))])
        return looked_up(sparse, batch)

    monkeypatch.setattr(SparseTables, "eval_pool", fails_once)
    figures = small_trainer(local_context, "evaluated").fit(Counting(30), steps=10, eval_data=Counting(4),
                                                             eval_every=5, log_every=5)
    assert len(failures) == 1 and figures["shard_rebuilds"] == 1, figures
    assert figures["steps"] == 10 and figures["sparse_steps"] == 10 and 0 <= figures["auc"] <= 1, figures


def test_a_bad_held_out_batch_is_refused_naming_the_table_not_taken_for_a_lost_shard(local_context):
    class WrongTable(Counting):
        def __iter__(self):
            for batch in super().__iter__():
                yield dataclasses.replace(batch, sparse={"u": batch.sparse["t"]})

    with pytest.raises(ValueError, match=r"batch has ids for tables \['u'\], the Trainer has \['t'\]"):
        small_trainer(local_context, "bad-held-out").fit(Counting(30), steps=10, eval_data=WrongTable(2),
                                                          eval_every=5, log_every=5)


def test_a_shard_lost_as_the_sparse_part_is_first_built_is_waited_for_and_the_job_trains(local_context,
                                                                                          monkeypatch):
    """A shard process that dies as the job starts fails the tables' creation (torch raises ``RuntimeError``):
    the Trainer waits for it and builds again, as after a step's failed lookups, instead of ending the job."""
    built = SparseTables._build
    failures = []

    def fails_once(sparse):
        if not failures:
            failures.append(RuntimeError("EOF: end of file"))
            raise failures[-1]
        return built(sparse)

    monkeypatch.setattr(SparseTables, "_build", fails_once)
    figures = small_trainer(local_context, "first-build").fit(Counting(30), steps=10, log_every=5)
    assert len(failures) == 1 and figures["shard_rebuilds"] == 1, figures
    assert figures["steps"] == 10 and figures["sparse_steps"] == 10, figures


def test_a_worker_asked_to_stop_while_its_first_build_waits_for_a_shard_leaves_with_no_step(local_context,
                                                                                            monkeypatch):
    """...and leaves its trainer group, which the next job of the same worker forms again."""
    asked = []

    def lost(sparse):
        asked.append(True)  # the stop request comes while the worker waits for the shard
        raise RuntimeError("EOF: end of file")

    with monkeypatch.context() as patched:
        patched.setattr(SparseTables, "_build", lost)
        patched.setattr(local_context, "should_stop", lambda: bool(asked))
        figures = small_trainer(local_context, "stopped-first-build").fit(Counting(30), steps=10, log_every=5)
    assert figures == {"steps": 0} and asked == [True], figures
    assert "trainer-group-views" not in [thread.name for thread in threading.enumerate()]  # the group was left
    assert small_trainer(local_context, "after-the-stop").fit(Counting(30), steps=10, log_every=5)["steps"] == 10


def test_a_worker_asked_to_stop_as_its_group_first_forms_leaves_with_no_step_and_lets_go_of_everything(
        local_context, monkeypatch):
    """``DenseReplica`` raises ``GroupStopped`` when the worker is asked to stop while its group first forms
    (a member lost there, the group re-forming: ``test_dense_replica``'s hung first forming): ``fit`` returns
    no step, leaves its group, and closes its tables, reader and pipeline."""
    from paramserver.ddp import GroupStopped
    from paramserver.train import trainer as trainer_module
    closed = []
    close = SparseTables.close

    def counted_close(sparse):
        closed.append(sparse)
        close(sparse)

    def stopped_forming(*args, **kwargs):
        raise GroupStopped("asked to stop while the group re-formed after a member was lost")

    with monkeypatch.context() as patched:
        patched.setattr(trainer_module, "DenseReplica", stopped_forming)
        patched.setattr(SparseTables, "close", counted_close)
        figures = small_trainer(local_context, "stopped-forming").fit(Counting(30), steps=10, log_every=5)
    assert figures == {"steps": 0} and len(closed) == 1 and not closed[0].tables, (figures, closed)
    threads = [thread.name for thread in threading.enumerate()]
    assert "trainer-group-views" not in threads and "batch-reader" not in threads, threads
    assert small_trainer(local_context, "stopped-forming").fit(Counting(30), steps=10, log_every=5)["steps"] == 10


def test_a_first_build_that_keeps_failing_is_bounded_stops_when_asked_and_other_errors_pass(local_context,
                                                                                          monkeypatch):
    def make(name, **options):
        return SparseTables({"t": Table(10, 4)}, (QHM, dict(lr=0.1, momentum=0.9, nu=0.7)), local_context.shards,
                            name, 0, 10**6, live_shards=lambda: list(local_context.shards), **options)

    def fails(error):
        def build(sparse):
            calls.append(error)
            raise error
        calls = []
        monkeypatch.setattr(SparseTables, "_build", build)
        return calls

    calls = fails(RuntimeError("EOF: end of file"))
    with pytest.raises(ShardLost, match=r"^every shard serves, but the sparse part could not be built again within "
                                        r"1 s: RuntimeError: EOF: end of file$"):
        make("keeps-failing", timeout=datetime.timedelta(seconds=1))
    assert len(calls) >= 2  # built again while the shards served, until the timeout
    calls = fails(RuntimeError("EOF: end of file"))
    with pytest.raises(RebuildStopped):
        make("stopped", should_stop=lambda: True)
    assert len(calls) == 1
    calls = fails(ValueError("not a lost shard"))  # e.g. a shard refusing the table: raised at once
    with pytest.raises(ValueError, match="^not a lost shard$"):
        make("refused")
    assert len(calls) == 1


def test_a_failed_build_is_retired_whole_with_what_it_made_before_failing(local_context, monkeypatch):
    """What a build made before it failed (RRefs of a shard process dying meanwhile among them) is reachable only
    from its error: the error is retired, so that none of it is released before the worker leaves the data plane
    (where torch would report it to an owner that is gone), as the first build and a rebuild both retry."""
    built, made, retired = SparseTables._build, [], []

    class Part:  # stands for a table built on the shards before the build failed
        pass

    def fails_first(sparse):
        part = Part()
        made.append(weakref.ref(part))
        if len(made) in (1, 3):  # the first build, and the first rebuild
            raise RuntimeError("EOF: end of file")
        return built(sparse)

    monkeypatch.setattr(SparseTables, "_build", fails_first)
    sparse = SparseTables({"t": Table(10, 4)}, (QHM, dict(lr=0.1, momentum=0.9, nu=0.7)), local_context.shards,
                          "failed-build", 0, 10**6, live_shards=lambda: list(local_context.shards),
                          retire=retired.append)
    sparse.rebuild(RuntimeError("lookup failed"))
    gc.collect()
    assert len(made) == 4 and [type(error) for error in retired[:2]] == [RuntimeError, RuntimeError], retired
    assert made[0]() is not None and made[2]() is not None  # kept by the retired errors
    sparse.close()
    retired.clear()
    gc.collect()
    assert made[0]() is None and made[2]() is None


def test_a_rebuild_gives_up_at_once_on_a_shard_that_will_not_serve_again(local_context):
    gone = {}
    sparse = SparseTables({"t": Table(10, 4)}, (QHM, dict(lr=0.1, momentum=0.9, nu=0.7)), local_context.shards,
                          "gone", 0, 10**6, live_shards=lambda: [], shards_gone=lambda: dict(gone),
                          timeout=datetime.timedelta(seconds=1))
    with pytest.raises(ShardLost, match=r"^shards worker0 did not serve again within 1 s$"):
        sparse.rebuild(RuntimeError("lookup failed"))  # only the shard really missing is named
    gone.update(worker0="process exited with code -9; not restarted: it exited 4 times (at most 3 restarts)",
                shard9="(not one of this job's)")
    patient = SparseTables({"t": Table(10, 4)}, (QHM, dict(lr=0.1, momentum=0.9, nu=0.7)), local_context.shards,
                           "gone-for-good", 0, 10**6, live_shards=lambda: [], shards_gone=lambda: dict(gone),
                           timeout=datetime.timedelta(seconds=60))
    began = time.monotonic()
    with pytest.raises(ShardLost, match=r"^shard worker0 will not serve again: process exited with code -9; "
                                        r"not restarted: it exited 4 times \(at most 3 restarts\)$"):
        patient.rebuild(RuntimeError("lookup failed"))
    assert time.monotonic() - began < 30  # at once, not after the 60 s timeout (with room for a loaded machine)


def test_bad_batches_are_refused_naming_the_table_and_the_shape():
    tables = {"user": Table(10, 4)}
    batch = Batch(sparse={"user": torch.zeros(3, 2)}, dense=torch.zeros(3, 1), labels=torch.zeros(3))
    with pytest.raises(ValueError, match=r"table 'user': ids must be a \(3, bag\) int64 tensor, got torch.float32"):
        batch.check(tables)
    with pytest.raises(ValueError, match="missing: user"):
        Batch(sparse={}, dense=torch.zeros(3, 1), labels=torch.zeros(3)).check(tables)
    with pytest.raises(ValueError, match=r"dense must have shape \(3, features\)"):
        Batch(sparse={"user": torch.zeros(3, 1, dtype=torch.long)}, dense=torch.zeros(2, 1),
              labels=torch.zeros(3)).check(tables)
    with pytest.raises(ValueError, match="mode must be one of"):
        Table(10, 4, mode="max")
    with pytest.raises(ValueError, match="positive"):
        Table(0, 4)


class Stateful(Counting):
    """``Counting`` with a position: the index of the next batch."""

    def __init__(self, count: int):
        super().__init__(count)
        self.index = 0

    def __iter__(self):
        while self.index < self.count:
            self.index += 1
            yield Batch(sparse={"t": torch.full((1, 1), self.index - 1)}, dense=torch.zeros(1, 1),
                        labels=torch.zeros(1))

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, state):
        self.index = state["index"]


def first_id(batch: Batch) -> int:
    return int(batch.sparse["t"][0, 0])


@pytest.mark.parametrize("prefetch", [0, 2], ids=["read-when-asked", "background-reader"])
@pytest.mark.parametrize("make", [Stateful, Counting], ids=["stateful", "skipping"])
def test_the_data_position_excludes_batches_read_ahead_and_resumes_there(make, prefetch):
    stream = BatchStream(make(30), prefetch=prefetch)
    assert stream.ensure(10) and first_id(stream.current()) == 0
    for _ in range(3):
        stream.finished()
    stream.skip(2)  # two steps taken from another member: their batches go unused
    position = stream.position()
    assert position["used"] == 5 and len(stream) == 5  # read ahead, not used
    resumed = BatchStream(make(30), position, prefetch=prefetch)
    assert first_id(resumed.current()) == first_id(stream.current()) == 5
    assert not resumed.ensure(26)  # 25 left
    for _ in range(25):
        resumed.finished()
    with pytest.raises(DataExhausted, match="ended after 30 batches"):
        resumed.current()
    stream.close()
    resumed.close()


def test_a_background_reader_raises_the_datas_error_in_its_turn():
    def failing():
        yield from Counting(3)
        raise ValueError("data.csv line 4: 3 fields, expected 40")
    stream = BatchStream(failing(), prefetch=2)
    for expected in range(3):
        assert first_id(stream.current()) == expected
        stream.finished()
    with pytest.raises(ValueError, match="data.csv line 4"):
        stream.current()
    stream.close()


def test_the_ctr_job_on_dynamic_tables_over_raw_hashed_ids_reaches_the_auc_of_fixed_tables(local_context):
    from paramserver.jobs import ctr
    options = dict(steps=120, batch_size=512, hook="allreduce", holdout_size=6000, eval_every=10 ** 9,
                   log_every=10 ** 9)
    fixed = ctr.main(local_context, table_name="ctr-fixed", **options)
    dynamic = ctr.main(local_context, table_name="ctr-dynamic", dynamic_tables=True, **options)
    assert dynamic["auc"] == pytest.approx(fixed["auc"], abs=0.005), (fixed, dynamic)
    assert dynamic["auc"] > dynamic["oracle_auc"] - 0.06, dynamic


def test_the_ctr_job_trains_on_criteo_format_files_and_reports_their_held_out_auc(local_context, tmp_path):
    from paramserver.jobs import ctr
    from paramserver.jobs.ctr_files import PlantedFiles
    files = PlantedFiles(seed=3)
    for day in range(2):
        files.write_criteo(str(tmp_path / f"day_{day}.gz"), day, 10_000,
                           extra_lines=["1\tnot\ta\tline"] if day == 1 else None)
    oracle = files.write_criteo(str(tmp_path / "eval.txt"), 99, 4_000)
    data = {"format": "criteo", "train": str(tmp_path / "day_*.gz"), "eval": str(tmp_path / "eval.txt"),
            "skip_malformed": True, "epochs": 2}
    result = ctr.main(local_context, table_name="ctr-files", steps=10 ** 6, batch_size=512, hook="allreduce",
                      eval_every=10 ** 9, log_every=10 ** 9, data=data)
    # the data ends after its two epochs (20,000 lines, one malformed, read twice, in batches of 512: 79
    # batches): the job stops at the agreement of step 70, where fewer than the next 10 steps' batches remain
    assert result["steps"] == 70 and result["malformed_skipped"] == 2, result
    assert result["auc"] > 0.5 + 0.6 * (oracle - 0.5), (oracle, result)
    assert 0 < result["log_loss"] < 0.7, result


def test_the_ctr_job_follows_files_as_they_land_and_waits_for_them_at_an_agreement(local_context, tmp_path):
    """Online training: the job trains on what has landed, its group agrees to wait while nothing more has
    (never leaving a member in a step's collective), and trains on the next file once it lands."""
    import logging

    from paramserver.jobs import ctr
    from paramserver.jobs.ctr_files import PlantedFiles
    files = PlantedFiles(seed=5)

    def land(day: int, lines: int) -> None:  # written under a temporary name, renamed once whole
        files.write_criteo(str(tmp_path / f".day_{day}.txt.tmp"), day, lines)
        (tmp_path / f".day_{day}.txt.tmp").rename(tmp_path / f"day_{day}.txt")

    class LandOnWait(logging.Handler):
        """Lands the second file once the group agreed to wait for data."""

        waits = []

        def emit(self, record):
            if "waits for its group's data" in record.getMessage() and not self.waits:
                self.waits.append(record.getMessage())
                land(1, 10 * 256)

    land(0, 10 * 256)  # 10 steps' batches: the next agreement's batches are still to come
    trainer_log = logging.getLogger("paramserver.train.trainer")
    handler, level = LandOnWait(), trainer_log.level
    trainer_log.addHandler(handler)
    trainer_log.setLevel(logging.INFO)
    try:
        data = {"format": "criteo", "train": str(tmp_path), "follow": True, "poll_seconds": 0.2}
        result = ctr.main(local_context, table_name="ctr-follow", steps=20, batch_size=256, hook="allreduce",
                          eval_every=10 ** 9, log_every=10 ** 9, data=data)
    finally:
        trainer_log.removeHandler(handler)
        trainer_log.setLevel(level)
    assert result["steps"] == 20 and result["sparse_steps"] == 20, result
    assert LandOnWait.waits and "step 10 waits" in LandOnWait.waits[0], LandOnWait.waits


def test_a_worker_of_another_trainer_group_trains_on_the_parts_of_a_followed_input_its_group_claims(
        local_context, tmp_path, monkeypatch):
    """Several groups read one followed input (``paramserver.train.claims``): a worker of group 1 claims what it
    starts for group 1 and leaves what group 0 has."""
    import torch.distributed as dist

    from paramserver.data import FileReader
    from paramserver.jobs import ctr
    from test_data_files import line, write

    for day in range(2):
        write(tmp_path / f"day_{day}.txt", [line(day * 2560 + i) for i in range(2560)])  # 10 batches each
    first, second = sorted(part.key for part in FileReader(str(tmp_path), 256, follow=True).parts)
    from paramserver.ddp.group import JOB_STORE_PREFIX
    from paramserver.train.claims import STORE_NAME

    channel = local_context.group
    claims = dist.PrefixStore(f"{JOB_STORE_PREFIX}/{STORE_NAME}/run{local_context.job_run}",
                              dist.TCPStore(channel.store_host, channel.store_port, is_master=False))
    assert claims.compare_set(second, "", "0") == b"0"  # group 0 has the second day
    monkeypatch.setattr(local_context, "trainer_group", 1)
    data = {"format": "criteo", "train": str(tmp_path), "follow": True, "poll_seconds": 0.2}
    result = ctr.main(local_context, table_name="ctr-follow-group-1", steps=10, batch_size=256, hook="allreduce",
                      eval_every=10 ** 9, log_every=10 ** 9, data=data)
    assert result["steps"] == 10, result
    assert claims.get(first) == b"1/done" and claims.get(second) == b"0"  # read whole by group 1; group 0's


def test_a_stream_of_new_ids_keeps_a_bounded_table_with_ttl_steps(local_context, tmp_path):
    """Online data brings new ids all the time: with ``ttl_steps`` the rows not seen for that many steps go,
    so the rows held stay bounded while the stream goes on (here every line brings ids never seen before)."""
    import torch.distributed.rpc as rpc

    from paramserver.shards.server import service
    from test_data_files import line, write
    from paramserver.jobs import ctr

    for day in range(4):
        write(tmp_path / f"day_{day}.txt", [line(day * 2560 + i) for i in range(2560)])
    data = {"format": "criteo", "train": str(tmp_path), "follow": True, "poll_seconds": 0.2}
    result = ctr.main(local_context, table_name="ctr-ttl", steps=40, batch_size=256, hook="allreduce",
                      eval_every=10 ** 9, log_every=10 ** 9, data=data, table_options={"ttl_steps": 5})
    assert result["steps"] == 40, result
    parts = {table: stats for table, _, stats in rpc.rpc_sync(local_context.rpc_name, service.dynamic_table_parts)
             if table.startswith("ctr-ttl.")}
    c1 = parts["ctr-ttl.C1"]
    assert c1["admitted"] == 40 * 256, c1  # every id new
    assert c1["rows"] <= 8 * 256 and c1["evicted"] >= 30 * 256, c1  # about ttl_steps' worth held, not 40 steps'
