"""Live exports (``Trainer(..., export_to=...)``) and serving that follows them: a base, then deltas of the
rows changed, written while the job trains; ``serving.load`` of the root serves the newest, ``refresh()``
applies newer ones in place and scores as a fresh load of the same exports, and as the Trainer did; with
``keep_exports`` the older chains are removed (after a grace for their readers) and a follower of a chain
removed moves onto the newest.

The job runs in this process (``JobContext.local``: the process is its own shard).
"""

import datetime
import logging
import shutil
import time

import pytest
import torch

from paramserver import serving
from paramserver.checkpoint import live_export
from paramserver.filesystems import locate
from paramserver.jobs import ctr
from paramserver.jobs.ctr_data import CTRSpec, PlantedCTR, auc, to_batch

pytestmark = pytest.mark.timeout(180)

HOLDOUT = 4096


@pytest.fixture(scope="module")
def local_context():
    from paramserver.runtime.context import JobContext
    ctx = JobContext.local()
    yield ctx
    ctx.close()


def scores(model, batches) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(batch) for batch in batches])


def copy_exports(source, target, names) -> None:
    for name in names:
        shutil.copytree(source / name, target / name)


def test_a_job_exports_live_and_serving_follows_to_the_trainers_model(local_context, tmp_path):
    root = tmp_path / "live"
    # dynamic tables whose rows expire after 5 steps untouched: deltas carry evictions as well as rows
    result = ctr.main(local_context, table_name="live", steps=60, batch_size=256, hook="allreduce",
                      holdout_size=HOLDOUT, eval_every=60, log_every=10 ** 9, dynamic_tables=True,
                      table_options={"ttl_steps": 5}, export_to=str(root), export_every=10, export_base_every=3,
                      keep_exports=2)
    exports = live_export.chain(locate(root))
    assert [(e.kind, e.step) for e in exports] == [("base", 40), ("delta", 50), ("delta", 60)]
    every = sorted(path.name for path in root.iterdir())
    assert len(every) == 6, every  # 10 base, 20 and 30 deltas, 40 base, 50 and 60 deltas: 2 bases, all kept

    # serving follows: loaded at step 20, refreshed with a delta, then across a new base
    following = tmp_path / "following"
    following.mkdir()
    copy_exports(root, following, every[:2])
    model = serving.load(str(following))
    assert model.step == 20
    assert not model.refresh()
    copy_exports(root, following, every[2:3])
    assert model.refresh() and model.step == 30
    holdout = [to_batch(b, hashed=True) for b in PlantedCTR(CTRSpec(), seed=0).holdout(HOLDOUT)]
    assert torch.allclose(scores(model, holdout), scores(serving.load(str(following)), holdout), atol=1e-6)
    copy_exports(root, following, every[3:])
    assert model.refresh() and model.step == 60
    fresh = serving.load(str(root))
    assert torch.allclose(scores(model, holdout), scores(fresh, holdout), atol=1e-6)

    # a follower of the first chain, which is then removed (keep 1): its refresh moves onto the newest base
    pruned = tmp_path / "pruned"
    pruned.mkdir()
    copy_exports(root, pruned, every[:3])
    behind = serving.load(str(pruned))
    assert behind.step == 30
    copy_exports(root, pruned, every[3:])
    assert live_export.prune(locate(pruned), keep=1, grace=datetime.timedelta(0)) == every[:3]
    assert sorted(path.name for path in pruned.iterdir()) == every[3:]
    assert behind.refresh() and behind.step == 60
    assert torch.allclose(scores(behind, holdout), scores(fresh, holdout), atol=1e-6)

    # and it is the Trainer's model: the held-out AUC it reported at step 60
    labels = torch.cat([batch.labels for batch in holdout])
    assert auc(scores(fresh, holdout), labels) == pytest.approx(result["auc"], abs=1e-6), result


def test_a_shards_delta_holds_the_rows_pushed_since_and_a_failed_export_gives_them_back(tmp_path):
    from paramserver.optim import QHM, functional_optim_map
    from paramserver.shards.server.export_part import write_export_part
    from paramserver.shards.server.optimizers import OwnerOptimizer
    from paramserver.shards.server.state import ShardState

    state = ShardState()
    table = state.shared_table("m.t[0:10000]", lambda: torch.randn(10_000, 8))
    optimizer = OwnerOptimizer(QHM, functional_optim_map[QHM], [table], ["t"], (), dict(lr=0.1, momentum=0.9, nu=0.7), state)

    def push(rows):
        optimizer.apply_rows([0], [torch.tensor(rows)], [torch.ones(len(rows), 8)], "test")

    def part(name, whole=False):
        record = write_export_part(state, str(tmp_path / name), None, "shard0", whole)
        return torch.load(tmp_path / name / record.name, weights_only=True)["tables"]["m.t[0:10000]"], record

    base, base_record = part("a")  # the first export of a process holds everything
    assert base["whole"] and torch.equal(base["values"], table)
    push([5, 17, 9000])
    push([17, 42])
    delta, delta_record = part("b")
    assert not delta["whole"] and delta["rows"].tolist() == [5, 17, 42, 9000]
    assert torch.equal(delta["values"], table[[5, 17, 42, 9000]])
    assert delta_record.bytes < base_record.bytes / 20  # its size grows with the rows pushed, not the table
    assert part("c")[0]["rows"].numel() == 0  # nothing since
    push([3])
    (tmp_path / "blocked").write_text("a file where the export's directory should be")
    with pytest.raises(Exception):
        part("blocked")
    push([4])
    assert part("d")[0]["rows"].tolist() == [3, 4]  # what the failed export took is carried by the next
    assert part("e", whole=True)[0]["whole"]


def test_serving_follows_the_base_committed_last_when_a_restarted_job_exports_older_steps(tmp_path):
    root = locate(tmp_path)

    def write(step, writer, kind, previous=None):
        name = live_export.export_name(step, writer)
        directory = root.join(name)
        directory.fs.makedirs(directory.path, exist_ok=True)
        live_export.commit(directory, kind=kind, step=step, previous=previous, base=name, model={}, files=[])
        return name

    base = write(10, "aaaa", "base")
    delta = write(20, "aaaa", "delta", base)
    last = write(30, "aaaa", "delta", delta)
    assert [e.name for e in live_export.chain(root)] == [base, delta, last]
    assert live_export.chain(root, after=delta)[0].name == last
    (tmp_path / "000000000040-aaaa").mkdir()  # being written: no manifest, not there
    assert [e.name for e in live_export.chain(root)] == [base, delta, last]
    restarted = write(20, "bbbb", "base")  # the job came back from its checkpoint of step 20
    assert [e.name for e in live_export.chain(root)] == [restarted]
    assert [e.name for e in live_export.chain(root, after=last)] == [restarted]  # a refresh moves back with it


def test_an_appended_delta_holds_exactly_the_rows_that_differ_and_the_ids_gone():
    """``ps-ctl export --delta``'s comparison (``chain_append``): a fixed table's changed rows, a dynamic
    table's new and changed ids and the ids it no longer holds; applied to what was served, it gives the
    checkpoint's rows."""
    from paramserver.checkpoint.chain_append import table_entry
    from paramserver.checkpoint.export import CheckpointModel
    from paramserver.checkpoint.model import ModelDescription, TableShape

    description = ModelDescription(prefix="job", tables={"fixed": TableShape(5, 2, "sum"),
                                                         "dynamic": TableShape(None, 2, "sum")},
                                   dense_class="m:C", dense_kwargs=None)
    served = {"fixed": live_export.TableRows("fixed", 2, 5), "dynamic": live_export.TableRows("dynamic", 2, None)}
    served["fixed"].weight = torch.arange(10.0).view(5, 2)
    served["dynamic"].ids, served["dynamic"].rows = torch.tensor([3, 7, 9]), torch.tensor([[3.0, 3], [7, 7], [9, 9]])
    weight = served["fixed"].weight.clone()
    weight[1, 0], weight[4, 1] = -1.0, -4.0
    now = CheckpointModel(checkpoint=None, description=description, record={}, dense_state={},
                          tables={"fixed": {"weight": weight},
                                  "dynamic": {"ids": torch.tensor([3, 5, 9]),
                                              "rows": torch.tensor([[3.0, 3], [5, 5], [-9, 9]])}})
    key, entry = table_entry(now, "fixed", served["fixed"])
    assert key == "job.fixed[0:5]" and entry["rows"].tolist() == [1, 4] and not entry["whole"]
    served["fixed"].apply(key, entry)
    assert torch.equal(served["fixed"].weight, weight)
    key, entry = table_entry(now, "dynamic", served["dynamic"])
    assert key == "job.dynamic@0/1" and entry["ids"].tolist() == [5, 9] and entry["evicted"].tolist() == [7]
    served["dynamic"].apply(key, entry)
    assert served["dynamic"].ids.tolist() == [3, 5, 9]
    assert torch.equal(served["dynamic"].rows, now.tables["dynamic"]["rows"])


class _Group:
    """A trainer group's side of an export, for one member: the barrier and rank 0's word (``hand_out``)."""

    def __init__(self, rank: int, lost_rank_0: bool = False):
        self.rank, self.lost_rank_0 = rank, lost_rank_0
        self.calls = []

    def barrier(self):
        self.calls.append("barrier")

    def hand_out(self, value, source, within):
        self.calls.append(("hand_out", value if self.rank == source else None))
        if self.lost_rank_0:
            from paramserver.ddp.group import GenerationAborted
            raise GenerationAborted("a newer view without rank 0")
        return value


class _Replica:
    def __init__(self, group):
        self.group, self.step, self.module = group, 0, torch.nn.Linear(2, 1)


def test_an_export_is_due_every_n_steps_and_counted_done_only_once_rank_0s_word_came(tmp_path):
    """What each member says at the agreement (``due``) and does where the group agreed on an export: the
    barrier, then rank 0 writes and hands out its outcome; a member whose wait ended without it (rank 0 lost)
    still says the export is due, so the re-formed group exports at its next agreement."""
    from paramserver.ddp.group import GenerationAborted
    from paramserver.train.live_exports import LiveExports
    writer, other = _Replica(_Group(0)), _Replica(_Group(1))
    exports = {replica: LiveExports(str(tmp_path / "root"), 20, 3, replica, [], {}) for replica in (writer, other)}
    for replica in (writer, other):
        replica.step = 19
        assert not exports[replica].due()
        replica.step = 20
        assert exports[replica].due()
        exports[replica].at_boundary()
        assert not exports[replica].due()  # counted from here
    name = live_export.chain(locate(str(tmp_path / "root")))[-1].name
    assert writer.group.calls == ["barrier", ("hand_out", name)]
    assert other.group.calls == ["barrier", ("hand_out", None)]
    lost = _Replica(_Group(1, lost_rank_0=True))
    waiting = LiveExports(str(tmp_path / "root"), 20, 3, lost, [], {})
    lost.step = 20
    with pytest.raises(GenerationAborted):
        waiting.at_boundary()
    assert waiting.due()  # the re-formed group's next agreement asks for it again


def test_keep_exports_keeps_the_newest_bases_with_their_deltas_as_the_job_writes(tmp_path, caplog):
    """1,200 steps with an export every 50 and a base every 4th, ``keep=2`` and no grace: never more than the
    two newest chains (8 folders) under the root, the newest chain always whole, one line per folder removed,
    and the folder of an export that failed before its commit removed with the next pruning."""
    from paramserver.train.live_exports import LiveExports
    root = tmp_path / "root"
    replica = _Replica(_Group(0))
    exports = LiveExports(str(root), 50, 4, replica, [], {}, keep=2, grace=datetime.timedelta(0))
    caplog.set_level(logging.INFO, logger="paramserver.checkpoint.live_export")
    most = 0
    for step in range(1, 1201):
        replica.step = step
        if step == 650:  # this export fails after writing its dense part (a model that is no JSON)
            exports.model = {"unwritable": object()}
        if exports.due():
            exports.at_boundary()
            exports.model = {}
            most = max(most, len(list(root.iterdir())))
    failed = live_export.export_name(650, exports.writer)
    assert failed not in exports.written and len(exports.written) == 23
    assert most <= 9  # two chains of 4, and a failed export's folder until the next pruning (at most 10 asked for)
    links = live_export.chain(locate(str(root)))
    assert [(e.kind, e.step) for e in links] == [("base", 1100), ("delta", 1150), ("delta", 1200)]
    left = sorted(path.name for path in root.iterdir())
    assert left == sorted(exports.written[-7:]), left  # the base of 900 with 3 deltas, 1100's with 2
    removed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("removed live export")]
    assert len(removed) == len(exports.written) - len(left) + 1  # every export removed, and the failed folder
    assert sum("failed before the commit" in line for line in removed) == 1 and not (root / failed).exists()


def test_a_chain_superseded_stays_for_its_readers_until_the_grace_has_passed_on_any_store(tmp_path):
    """``prune`` keeps an older chain while the base after it is younger than the grace (a reader may be
    loading it), on a local root and on a remote fsspec store alike (the manifest removed first)."""
    for root in (locate(str(tmp_path)), locate("memory://keep-exports/root")):
        def write(step, kind, base, previous=None):
            name = live_export.export_name(step, "aaaa")
            directory = root.join(name)
            directory.fs.makedirs(directory.path, exist_ok=True)
            record = live_export.write_tensors(directory.join(live_export.DENSE_FILE), {"step": step})
            live_export.commit(directory, kind=kind, step=step, previous=previous, base=base or name, model={},
                               files=[record])
            return name

        first = write(10, "base", None)
        delta = write(20, "delta", first, first)
        second = write(30, "base", None)
        grace = datetime.timedelta(minutes=5)
        assert live_export.prune(root, keep=1, grace=grace) == []  # superseded just now: a reader may be loading it
        later = time.time() + grace.total_seconds() + 1
        assert live_export.prune(root, keep=1, grace=grace, now=later) == [first, delta]
        assert [e.name for e in live_export.chain(root)] == [second]
        root.fs.invalidate_cache()
        names = sorted(path.rstrip("/").rsplit("/", 1)[-1] for path in root.fs.ls(root.path, detail=False))
        assert names == [second]
        assert live_export.prune(root, keep=1, grace=grace, now=later) == []  # the newest chain is never removed
