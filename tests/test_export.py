"""Exporting a trained model and serving it, in one process (``JobContext.local``: the process is its own
shard and a trainer group of one, checkpoints committed by a ``CheckpointStore`` as the coordinator does): the
newest checkpoint of a Trainer run, exported and loaded with ``serving.load``, scores held-out batches as the
Trainer's own evaluation did, to 1e-6 (fixed and dynamic tables, sum and mean, float32, float16 and bfloat16
rows, gradients pushed in bfloat16, ids without a row in a dynamic table); ``ps-ctl export``'s flags; bad input refused by type, naming what was wrong.  Tables split by rows
over several shards, and an export from a live cluster: ``tests/test_checkpoints.py``."""

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
import types

import pytest
import torch
from torch import nn

import paramserver
from paramserver import Batch, Table, Trainer, serving
from paramserver.checkpoint import MANIFEST, CheckpointStore, CorruptCheckpoint, FileRecord, save_tensors
from paramserver.checkpoint.export import EXPORT_MANIFEST
from paramserver.checkpoint.model import NotExportable, describe_model
from paramserver.checkpoint.records import CheckpointSettings, LiveExportSettings
from paramserver.cli import ctl
from paramserver.cli import export as export_command
from paramserver.cli.common import UsageError, coordinator_client
from paramserver.optim import QHM
from paramserver.runtime.context import JobContext
from paramserver.tables.id_hash import salted
from paramserver.serving import NotServable
from paramserver.train.live_exports import READ_GRACE_ENV

sys.path.insert(0, str(pathlib.Path(__file__).parent / "jobs"))
from watch_next import evaluated_scores  # noqa: E402

pytestmark = pytest.mark.timeout(120)

DIM, DENSE, STEPS = 4, 2, 30
#: Rows of every type a table takes: exports and serving keep each table's (half-precision rows pooled in float32).
TABLES = {"user": Table(40, DIM), "items": Table(30, DIM, mode="mean", dtype=torch.float16),
          "tags": Table(None, DIM, mode="mean", admit_after=2), "video": Table(None, DIM, dtype=torch.bfloat16)}


class Scorer(nn.Module):
    """A dense module that can be rebuilt from an export (``export_kwargs``)."""

    def __init__(self, tables, dim: int, dense_features: int):
        super().__init__()
        self.tables, self.dim, self.dense_features = list(tables), dim, dense_features
        self.linear = nn.Linear(len(self.tables) * dim + dense_features, 1)

    def export_kwargs(self):
        return {"tables": self.tables, "dim": self.dim, "dense_features": self.dense_features}

    def forward(self, pooled, dense):
        return self.linear(torch.cat([pooled[name] for name in self.tables] + [dense], 1)).squeeze(1)


def batch(seed: int, size: int, unseen: bool = False) -> Batch:
    """Ids of small vocabularies (dynamic tables' as 64-bit hashes); ``unseen``: some ids training never saw."""
    g = torch.Generator().manual_seed(seed)
    users = torch.randint(0, 40, (size, 1), generator=g)
    tags = torch.randint(0, 60 if unseen else 50, (size, 3), generator=g)
    video = torch.randint(0, 25 if unseen else 20, (size, 1), generator=g)
    return Batch(sparse={"user": users, "items": torch.randint(0, 30, (size, 3), generator=g),
                         "tags": salted(tags, 2), "video": salted(video, 3)},
                 dense=torch.randn(size, DENSE, generator=g), labels=(users[:, 0] % 2 == video[:, 0] % 2).float())


def committing(ctx: JobContext, root: pathlib.Path, every_steps: int) -> JobContext:
    """``ctx`` writing checkpoints under ``root``, committed there as the coordinator would."""
    store = CheckpointStore(root)

    def commit(written):
        return store.commit(written.directory, [FileRecord.from_json(f) for f in written.files], written.step,
                            written.info).id
    return dataclasses.replace(ctx, checkpoint=CheckpointSettings(directory=str(root), every_steps=every_steps),
                               _commit_checkpoint=commit)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A Trainer run of ``STEPS`` steps, checkpointed every 10, with live exports every 10 (as ``ps-server
    --export-dir`` asks, through the context), and its own scores of the held-out batches at the end (the
    Trainer's evaluation: the dense module's outputs in eval mode)."""
    root = tmp_path_factory.mktemp("checkpoints")
    live = tmp_path_factory.mktemp("live")
    ctx = JobContext.local()
    try:
        torch.manual_seed(5)
        dense = Scorer(list(TABLES), DIM, DENSE)
        evaluated = evaluated_scores(dense)
        # (ps-server --keep-exports 1: the chain the second base supersedes is removed at once, no grace)
        exporting = dataclasses.replace(committing(ctx, root, 10), exports=LiveExportSettings(
            directory=str(live), every_steps=10, base_every=2, keep=1))
        trainer = Trainer(exporting, tables=TABLES, dense=dense,
                          sparse_optimizer=(QHM, dict(lr=8.0, momentum=0.9, nu=0.7)),
                          dense_optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
                          loss=nn.BCEWithLogitsLoss(), name="exported", seed=3,
                          push_dtype=torch.bfloat16)  # row gradients travel in bfloat16
        holdout = [batch(1000 + index, 256, unseen=True) for index in range(2)]
        with pytest.MonkeyPatch.context() as environment:
            environment.setenv(READ_GRACE_ENV, "0")
            figures = trainer.fit((batch(index, 64) for index in range(10 ** 6)), steps=STEPS, eval_data=holdout,
                                  eval_every=10 ** 9, log_every=10 ** 9)
        assert figures["steps"] == STEPS and figures["checkpoints"] == 3 and figures["live_exports"] == 3, figures
        yield types.SimpleNamespace(root=root, live=live, holdout=holdout,
                                    scores=torch.cat(evaluated[-len(holdout):]))
    finally:
        ctx.close()


def scores(model: nn.Module, batches) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(b) for b in batches])


def test_the_newest_checkpoint_exported_scores_as_the_trainer_evaluated(trained, tmp_path):
    out = tmp_path / "model"
    manifest = paramserver.export(trained.root, out)
    assert manifest["step"] == STEPS and manifest["checkpoint"] == str(trained.root / f"ckpt-{STEPS:010d}")
    assert manifest["dense"] == {"class": f"{Scorer.__module__}:Scorer", "file": "dense.pt",
                                 "kwargs": {"tables": list(TABLES), "dim": DIM, "dense_features": DENSE}}
    described = {name: (t["kind"], t["dim"], t["mode"]) for name, t in manifest["tables"].items()}
    assert described == {"user": ("fixed", DIM, "sum"), "items": ("fixed", DIM, "mean"),
                         "tags": ("dynamic", DIM, "mean"), "video": ("dynamic", DIM, "sum")}
    assert (manifest["tables"]["user"]["rows"], manifest["tables"]["items"]["rows"]) == (40, 30)
    assert {name: t["dtype"] for name, t in manifest["tables"].items()} == {
        "user": "float32", "items": "float16", "tags": "float32", "video": "bfloat16"}
    # Plain files: every one as the manifest says, each loadable without paramserver's classes.
    assert sorted(p.name for p in out.iterdir()) == sorted([EXPORT_MANIFEST] + [f["name"] for f in manifest["files"]])
    for record in manifest["files"]:
        assert (out / record["name"]).stat().st_size == record["bytes"]
    assert set(torch.load(out / "dense.pt", weights_only=True)) == {"linear.weight", "linear.bias"}
    assert torch.load(out / manifest["tables"]["user"]["file"], weights_only=True)["weight"].shape == (40, DIM)
    tags = torch.load(out / manifest["tables"]["tags"]["file"], weights_only=True)
    assert tags["rows"].shape == (manifest["tables"]["tags"]["rows"], DIM) and 0 < tags["ids"].numel() <= 50
    assert bool((tags["ids"][1:] > tags["ids"][:-1]).all())  # sorted, distinct
    held_out = torch.cat([b.sparse["tags"].reshape(-1) for b in trained.holdout])
    assert not torch.isin(held_out, tags["ids"]).all()  # some ids read zeros, counted in the mean

    model = serving.load(out)
    assert isinstance(model, nn.Module) and not model.training and model.step == STEPS
    assert (model.table("items").weight.dtype, model.table("video").rows.dtype) == (torch.float16, torch.bfloat16)
    served = scores(model, trained.holdout)
    assert served.shape == trained.scores.shape == (512,)
    assert (served - trained.scores).abs().max().item() <= 1e-6
    # the tables are served from their files, mapped into memory, never read whole into it
    mapped = pathlib.Path("/proc/self/maps").read_text()
    assert all(str(out / manifest["tables"][name]["file"]) in mapped for name in manifest["tables"])


def test_live_exports_the_cluster_asked_for_serve_as_the_trainer_evaluated(trained):
    """Fixed and dynamic tables through a base, a delta and a new base (every 2nd export), which kept alone
    (``keep=1``) removed the chain before it."""
    assert sorted(path.name[:12] for path in trained.live.iterdir()) == [f"{STEPS:012d}"]
    model = serving.load(str(trained.live))
    assert model.step == STEPS
    assert (scores(model, trained.holdout) - trained.scores).abs().max().item() <= 1e-6


def test_ps_ctl_export_takes_a_checkpoint_directory_or_a_cluster(trained, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    ctl.add_arguments(parser)

    def run(*argv):
        code = export_command.run(parser.parse_args(list(argv)))
        return code, capsys.readouterr()
    out = tmp_path / "from-20"
    code, printed = run("export", str(out), "--checkpoint-dir", str(trained.root / "ckpt-0000000020"))
    assert code == 0, printed.err
    assert printed.out.startswith(f"exported step 20 of {trained.root / 'ckpt-0000000020'} to {out}: user (fixed, "
                                  f"40 x {DIM}), items (fixed, 30 x {DIM}), tags (dynamic, ")
    assert json.loads((out / EXPORT_MANIFEST).read_text())["step"] == 20
    for argv, message in [
        (["export", str(out)], "export needs --checkpoint-dir D"),
        (["--connect", "127.0.0.1:1", "export", str(out), "--checkpoint-dir", str(trained.root)],
         "--checkpoint-dir or --connect, not both"),
        (["--connect", "127.0.0.1:1", "export", str(out), "--timeout", "0"],
         "--timeout must be more than 0 and at most 3600 seconds, got 0"),
        (["export", "", "--checkpoint-dir", str(trained.root)], "export DIR is empty: give a path or a URL"),
    ]:
        code, printed = run(*argv)
        assert code == 2 and printed.err.startswith("ps-ctl: ") and message in printed.err, printed.err
    code, printed = run("export", str(out), "--checkpoint-dir", str(tmp_path / "nothing"))
    assert code == 1 and printed.err.startswith("ps-ctl: export failed: no checkpoint at"), printed.err
    with pytest.raises(UsageError, match="status needs --connect HOST:PORT"):
        coordinator_client(parser.parse_args(["status"]))


def rewritten(checkpoint: pathlib.Path, into: pathlib.Path, change) -> pathlib.Path:
    """A copy of ``checkpoint`` under the root ``into`` whose dense part is ``change``d, committed again."""
    copy = into / checkpoint.name
    shutil.copytree(checkpoint, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    (copy / MANIFEST).unlink()
    dense = torch.load(copy / "dense.pt", weights_only=True)
    change(dense)
    files = [FileRecord.from_json(f) for f in manifest["files"] if f["name"] != "dense.pt"]
    CheckpointStore(into).commit(copy, files + [save_tensors(copy / "dense.pt", dense)], manifest["step"], {})
    return copy


def test_a_checkpoint_that_cannot_be_exported_is_refused_naming_what_is_wrong(trained, tmp_path):
    newest = trained.root / f"ckpt-{STEPS:010d}"
    with pytest.raises(FileNotFoundError, match=f"no valid checkpoint under {tmp_path}"):
        paramserver.export(tmp_path, tmp_path / "out")
    # A damaged file: named; given a root, the newest checkpoint that verifies is exported instead.
    damaged = tmp_path / "damaged"
    shutil.copytree(trained.root, damaged)
    part = damaged / newest.name / "shard-worker0.pt"
    part.write_bytes(part.read_bytes()[:-10])
    with pytest.raises(CorruptCheckpoint, match=f"{part}: size"):
        paramserver.export(damaged / newest.name, tmp_path / "out")
    assert paramserver.export(damaged, tmp_path / "older")["step"] == 20
    # Written before the Trainer recorded the model (an older version's checkpoint).
    old = rewritten(newest, tmp_path / "old", lambda dense: dense.pop("model"))
    with pytest.raises(NotExportable, match=f"checkpoint {old} was written without a model description"):
        paramserver.export(old, tmp_path / "out")
    # A table the description names, without rows in the checkpoint.
    ghost = rewritten(newest, tmp_path / "ghost", lambda dense: dense["model"]["tables"].update(
        ghost=dataclasses.asdict(Table(10, DIM))))
    with pytest.raises(NotExportable, match=r"holds no rows of table 'ghost' \(named exported.ghost on the shards\)"):
        paramserver.export(ghost, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written for a checkpoint that cannot be exported
    # An export never lands among other files.
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds other files and no export"):
        paramserver.export(newest, tmp_path / "busy")


def test_an_export_that_cannot_be_served_is_refused_naming_what_is_wrong(trained, tmp_path):
    out = tmp_path / "model"
    paramserver.export(trained.root, out)
    manifest = json.loads((out / EXPORT_MANIFEST).read_text())
    with pytest.raises(FileNotFoundError, match=f"no export in {tmp_path}: it has no {EXPORT_MANIFEST}"):
        serving.load(tmp_path)

    def with_manifest(change) -> pathlib.Path:
        copy = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(out, copy)
        edited = json.loads(json.dumps(manifest))
        change(edited)
        (copy / EXPORT_MANIFEST).write_text(json.dumps(edited))
        return copy
    # A dense class that cannot be imported here (a job file's, say): a module given instead.
    elsewhere = with_manifest(lambda m: m["dense"].update({"class": "no_such_module:Scorer"}))
    with pytest.raises(NotServable, match=r"class no_such_module:Scorer cannot be imported here .*pass dense="):
        serving.load(elsewhere)
    given = serving.load(elsewhere, dense=Scorer(list(TABLES), DIM, DENSE))
    assert (scores(given, trained.holdout) - trained.scores).abs().max().item() <= 1e-6
    # A dense module without export_kwargs(): its weights are there, its arguments are not.
    bare = with_manifest(lambda m: m["dense"].update({"kwargs": None}))
    with pytest.raises(NotServable, match=r"without its constructor's arguments \(it has no export_kwargs\(\)"):
        serving.load(bare)
    with pytest.raises(NotServable, match="do not fit the Scorer given"):
        serving.load(out, dense=Scorer(list(TABLES), DIM + 1, DENSE))
    with pytest.raises(NotServable, match="export format 9; this version of paramserver reads 1"):
        serving.load(with_manifest(lambda m: m.update(format=9)))
    table = out / manifest["tables"]["video"]["file"]
    data = bytearray(table.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size, altered
    table.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match=f"{table}: sha256 mismatch"):
        serving.load(out)
    # A batch the model cannot score.
    model = serving.load(elsewhere, dense=Scorer(list(TABLES), DIM, DENSE))
    held_out = trained.holdout[0]
    with pytest.raises(ValueError, match="the batch has no ids for table 'video'"):
        model(Batch({k: v for k, v in held_out.sparse.items() if k != "video"}, held_out.dense, held_out.labels))
    with pytest.raises(IndexError, match="table 'user': id 40 is out of range for a table of 40 rows"):
        model(Batch(dict(held_out.sparse, user=torch.full_like(held_out.sparse["user"], 40)), held_out.dense,
                    held_out.labels))


def test_a_dense_module_describes_itself_with_json_or_not_at_all():
    from paramserver.jobs.ctr import Tower
    tower = Tower(["a", "b"], 4, 3, (8, 4))
    rebuilt = Tower(**json.loads(json.dumps(tower.export_kwargs())))
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == {k: v.shape for k, v in tower.state_dict().items()}
    plain = describe_model("m", {"t": Table(5, 2)}, nn.Linear(2, 1))
    assert plain["dense"] == {"class": "torch.nn.modules.linear:Linear", "kwargs_json": None}
    assert plain["tables"]["t"]["num_embeddings"] == 5

    class Odd(nn.Module):
        def export_kwargs(self):
            return {"weights": torch.ones(2)}
    with pytest.raises(TypeError, match=r"Odd.export_kwargs\(\) must return JSON-able values"):
        describe_model("m", {"t": Table(5, 2)}, Odd())


def test_ps_ctl_export_delta_appends_checkpoints_to_a_chain_that_serving_follows(trained, tmp_path, capsys):
    """``ps-ctl export DIR --delta``: a base from the first checkpoint, then deltas of only the rows that differ
    (fixed and dynamic tables); a model refreshed along the chain scores as the Trainer did, and as a fresh
    load of the same chain."""
    parser = argparse.ArgumentParser()
    ctl.add_arguments(parser)
    chain = tmp_path / "chain"

    def append(step):
        checkpoint = trained.root / f"ckpt-{step:010d}"
        code = export_command.run(parser.parse_args(["export", str(chain), "--delta", "--checkpoint-dir",
                                                     str(checkpoint)]))
        printed = capsys.readouterr()
        assert code == 0, printed.err
        return printed.out
    first = append(10)
    assert first.startswith(f"appended step 10 of {trained.root / 'ckpt-0000000010'} to {chain} as a base ")
    model = serving.load(str(chain))
    assert model.step == 10
    plain = paramserver.export(trained.root / "ckpt-0000000010", tmp_path / "plain-10")
    assert plain["step"] == 10
    early = [batch(2000 + index, 128, unseen=True) for index in range(2)]
    assert (scores(model, early) - scores(serving.load(tmp_path / "plain-10"), early)).abs().max().item() == 0

    second = append(20)
    assert " as a delta " in second
    changed, held = map(int, second.rsplit(": ", 1)[1].split(" rows")[0].split(" of "))
    assert (changed, held) == rows_differing(plain, paramserver.export(trained.root / "ckpt-0000000020",
                                                                       tmp_path / "plain-20"), tmp_path)
    again = append(20)  # nothing changed since: an empty delta
    assert again.rstrip().endswith(f": 0 of {held} rows")
    append(STEPS)
    assert model.refresh() and model.step == STEPS
    assert (scores(model, trained.holdout) - trained.scores).abs().max().item() <= 1e-6
    fresh = serving.load(str(chain))
    assert (scores(model, trained.holdout) - scores(fresh, trained.holdout)).abs().max().item() <= 1e-6


def rows_differing(before, after, root: pathlib.Path):
    """Between two plain exports (manifests, under ``root``/plain-<step>): the rows ``after`` holds that are new
    or differ, and the rows it holds."""
    changed = held = 0
    for name, table in after["tables"].items():
        new = torch.load(root / f"plain-{after['step']}" / table["file"], weights_only=True)
        old = torch.load(root / f"plain-{before['step']}" / before["tables"][name]["file"], weights_only=True)
        if table["kind"] == "fixed":
            changed += int((new["weight"] != old["weight"]).any(dim=1).sum())
            held += new["weight"].size(0)
            continue
        previous = dict(zip(old["ids"].tolist(), old["rows"]))
        changed += sum(1 for id_, row in zip(new["ids"].tolist(), new["rows"])
                       if id_ not in previous or not torch.equal(previous[id_], row))
        held += new["ids"].numel()
    return changed, held
