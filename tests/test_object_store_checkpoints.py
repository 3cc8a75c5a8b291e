"""Checkpoints and exports on an object store: a real S3 server on loopback (SeaweedFS, fixture ``s3``).

Single-process: a ``CheckpointStore`` under ``s3://`` commits by writing the manifest last, keeps the newest
``keep``, refuses a damaged file naming its URL and falls back to the previous checkpoint; a writer stopped
mid-checkpoint leaves nothing committed (an upload that fails is never completed; a directory of parts without a
manifest is ignored, and removed when a coordinator starts); storage that cannot be reached is one
``StorageUnavailable`` naming the URL, a refusal of ``ps-server`` at start, and a failed periodic checkpoint of
a Trainer that trains on.

End to end, on one cluster and then one restored from it: a job trains with ``--checkpoint-dir s3://...``, a
shard is SIGKILLed and comes back from the remote checkpoint, the job is restored from it onto another number
of shards, its model exported to ``s3://...`` with ``ps-ctl export`` and ``serving.load("s3://...")`` scores
the held-out batches as the restored Trainer's last evaluation did.
"""

import dataclasses
import json
import logging
import os
import pathlib
import re
import signal
import socket
import sys
import time

import pytest
import torch
from torch import nn

from commands import errors, job_config, start_server, status
from paramserver import Trainer, serving
from paramserver.checkpoint import CheckpointStore, CorruptCheckpoint, atomic_write, save_tensors
from paramserver.checkpoint.object_upload import PartUpload, open_for_upload
from paramserver.checkpoint.records import CheckpointSettings
from paramserver.checkpoint.storage import first_usable, load_tensors, open_checkpoint, read_manifest
from paramserver.control.checkpoints import CheckpointCoordinator
from paramserver.filesystems import StorageUnavailable, locate
from paramserver.optim import QHM
from paramserver.runtime.context import JobContext

sys.path.insert(0, str(pathlib.Path(__file__).parent / "jobs"))
from watch_next import FactorizationMachine, Planted  # noqa: E402
from test_export import DENSE, DIM, TABLES, Scorer, batch  # noqa: E402

pytestmark = pytest.mark.timeout(400)

WATCH_NEXT = f"{pathlib.Path(__file__).parent / 'jobs' / 'watch_next.py'}:main"


def write_checkpoint(store, step, value):
    directory = store.new_directory(step)
    record = save_tensors(directory / "part.pt", {"value": torch.full((4, 3), float(value))})
    return store.commit(directory, [record], step, {"note": value})


def objects(s3, prefix):
    fs = s3.filesystem()
    fs.invalidate_cache()
    return sorted(path[len(f"{s3.bucket}/{prefix}/"):] for path in fs.find(f"{s3.bucket}/{prefix}"))


def dead_endpoint():
    """Storage options naming an S3 endpoint where nothing listens (botocore tries each call once, not 5 times)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s", "skip_instance_cache": True,
            "config_kwargs": {"retries": {"max_attempts": 1}}}


def test_a_store_on_s3_commits_by_its_manifest_keeps_the_newest_and_refuses_a_damaged_file(s3):
    root = f"s3://{s3.bucket}/ckpt"
    store = CheckpointStore(root, keep=2)
    assert store.complete() == [] and store.newest_valid() is None  # no prefix yet: no checkpoint
    first = write_checkpoint(store, 10, 1.0)
    assert first.path.url == f"{root}/ckpt-0000000010" and store.new_directory(10).name == "ckpt-0000000010-1"
    assert objects(s3, "ckpt") == ["ckpt-0000000010/MANIFEST.json", "ckpt-0000000010/part.pt"]
    for step in (20, 30):
        write_checkpoint(store, step, step)
    assert [c.step for c in store.complete()] == [30, 20]  # pruned: the newest 2 kept, remotely too
    assert {name.split("/")[0] for name in objects(s3, "ckpt")} == {"ckpt-0000000020", "ckpt-0000000030"}
    newest = store.newest_valid()
    assert newest.step == 30 and torch.equal(load_tensors(newest.file("part.pt"), newest.files[0])["value"],
                                             torch.full((4, 3), 30.0))
    assert open_checkpoint(root).step == 30 and open_checkpoint(f"{root}/ckpt-0000000020").step == 20

    # Damaged after its commit: refused, naming the object's URL; the previous checkpoint is used.
    part = newest.file("part.pt")
    s3.filesystem().pipe(part.path, s3.filesystem().cat(part.path)[:-10])
    refusals = []
    assert store.newest_valid(refusals.append).step == 20
    assert refusals[0].startswith(f"refusing checkpoint {root}/ckpt-0000000030: {part.url}: size ")
    with pytest.raises(CorruptCheckpoint, match=re.escape(f"{part.url}: size")):
        load_tensors(part, newest.files[0])
    checkpoint, _ = first_usable(newest.path, 30, lambda c: c.verify(), "shard shard1")
    assert checkpoint.step == 20


def test_a_writer_stopped_mid_checkpoint_commits_nothing_and_its_parts_are_removed_at_start(s3):
    root = f"s3://{s3.bucket}/ckpt"
    store = CheckpointStore(root)
    write_checkpoint(store, 10, 1.0)
    interrupted = store.new_directory(20)
    save_tensors(interrupted / "shard-shard0.pt", {"rows": torch.zeros(10)})  # one part written, then stopped

    def stopped_midway(file):  # 12 MB: a multipart upload, one part of it sent when the writer stops
        file.write(b"\0" * (12 << 20))
        raise KeyboardInterrupt("stopped")
    with pytest.raises(KeyboardInterrupt):
        atomic_write(interrupted / "shard-shard1.pt", stopped_midway)
    assert objects(s3, "ckpt/ckpt-0000000020") == ["shard-shard0.pt"]  # the upload was never completed
    fs = s3.filesystem()
    assert fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads", []) == []  # and it was aborted
    assert [c.step for c in store.complete()] == [10] and store.newest_valid().step == 10
    with pytest.raises(FileNotFoundError, match="incomplete"):
        open_checkpoint(interrupted)
    with pytest.raises(FileNotFoundError):
        read_manifest(interrupted)

    coordinator = CheckpointCoordinator(store, command_workers=lambda command: 0).start()  # a cluster starting
    coordinator.stop()
    assert {name.split("/")[0] for name in objects(s3, "ckpt")} == {"ckpt-0000000010"}


def test_an_object_written_in_parts_reads_back_whole_and_holds_only_its_part_buffers(s3):
    fs = s3.filesystem()
    path = f"{s3.bucket}/parts/object"
    upload = PartUpload(fs, path, part_bytes=5 << 20, in_flight=2)
    pieces = [os.urandom(size) for size in (3, 7 << 20, 1, (9 << 20) + 5, 100, 5 << 20)]  # across part bounds
    for piece in pieces:
        assert upload.write(piece) == len(piece)
    assert not fs.exists(path)  # nothing visible before the upload completes
    upload.close()
    assert fs.cat(path) == b"".join(pieces) and upload.bytes == sum(map(len, pieces))
    assert upload.buffer_bytes == 2 * (5 << 20)  # 21 MB went through two buffers of one part each

    small = PartUpload(fs, f"{s3.bucket}/parts/small", part_bytes=5 << 20)
    small.write(b"manifest")
    small.close()  # smaller than a part: one PUT
    assert fs.cat(f"{s3.bucket}/parts/small") == b"manifest"
    assert fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads", []) == []
    assert isinstance(open_for_upload(locate(f"s3://{path}")), PartUpload)


def test_a_part_that_fails_aborts_the_upload_and_names_the_url(s3, monkeypatch):
    fs = locate(f"s3://{s3.bucket}/ckpt/part.pt").fs
    call_s3 = fs.call_s3

    def second_part_refused(method, *args, **kwargs):
        if method == "upload_part" and kwargs["PartNumber"] == 2:
            raise PermissionError("Access Denied")
        return call_s3(method, *args, **kwargs)
    monkeypatch.setattr(fs, "call_s3", second_part_refused)
    with pytest.raises(StorageUnavailable, match=re.escape(f"s3://{s3.bucket}/ckpt/part.pt: cannot write: ")):
        atomic_write(f"s3://{s3.bucket}/ckpt/part.pt", lambda file: file.write(b"\1" * (40 << 20)))
    assert not s3.filesystem().exists(f"{s3.bucket}/ckpt/part.pt")
    assert fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads", []) == []


def test_unreachable_storage_is_one_error_naming_the_url(s3, commands, tmp_path):
    url = f"s3://{s3.bucket}/ckpt"
    store = CheckpointStore(locate(url, dead_endpoint()))
    with pytest.raises(StorageUnavailable, match=rf"^{re.escape(url)}: cannot write a checkpoint: "
                                                 r"EndpointConnectionError: Could not connect"):
        store.new_directory(10)
    with pytest.raises(StorageUnavailable, match=rf"^{re.escape(url)}/model/export.json: cannot read the export"):
        serving.load(f"{url}/model", storage_options=dead_endpoint())
    # ps-server: a missing extra or an unknown protocol refused at once (exit 2); unreachable storage (exit 1).
    done = commands.run("ps-server", "--port", "0", "--shards", "0", "--checkpoint-dir", "oci://bucket/ckpt")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("ps-server: --checkpoint-dir: oci://bucket/ckpt: the oci:// protocol needs a package")
    done = commands.run("ps-server", "--port", "0", "--shards", "0", "--checkpoint-dir", url,
                        "--storage-options", json.dumps(dead_endpoint()), timeout=90)
    assert done.returncode == 1, done.stderr
    assert re.search(rf"^ps-server: {re.escape(url)}: cannot list checkpoints: EndpointConnectionError",
                     done.stderr, re.M), done.stderr[-2000:]


def test_a_trainer_whose_checkpoints_cannot_reach_the_storage_trains_on(s3, caplog):
    url = f"s3://{s3.bucket}/ckpt"
    ctx = JobContext.local()
    try:
        ctx = dataclasses.replace(ctx, checkpoint=CheckpointSettings(directory=url, every_steps=5,
                                                                     storage_options=dead_endpoint()),
                                  _commit_checkpoint=lambda written: pytest.fail("nothing was written"))
        torch.manual_seed(5)
        trainer = Trainer(ctx, tables=TABLES, dense=Scorer(list(TABLES), DIM, DENSE),
                          sparse_optimizer=(QHM, dict(lr=8.0, momentum=0.9, nu=0.7)),
                          dense_optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
                          loss=nn.BCEWithLogitsLoss(), name="unreachable", seed=3)
        with caplog.at_level(logging.ERROR):
            figures = trainer.fit((batch(index, 64) for index in range(10 ** 6)), steps=6, log_every=10 ** 9,
                                  eval_every=10 ** 9)
    finally:
        ctx.close()
    assert figures["steps"] == 6 and figures["checkpoints"] == 0, figures
    failed = [r.getMessage() for r in caplog.records if "failed, not committed" in r.getMessage()]
    assert len(failed) == 1 and f"{url}: cannot write a checkpoint: EndpointConnectionError" in failed[0], failed


def test_a_job_checkpoints_to_s3_survives_a_lost_shard_is_restored_on_3_shards_and_its_export_served_from_s3(
        s3, commands, tmp_path):
    first, second, model = (f"s3://{s3.bucket}/{name}" for name in ("first", "second", "model"))
    job = dict(log_every=10, eval_every=1000, dynamic_video=True, row_wise_min_rows=500)
    server, address = start_server(commands, "--shards", "2", "--group-size", "1", "--checkpoint-dir", first,
                                   "--checkpoint-every", "20", "--keep-checkpoints", "2", "--job", WATCH_NEXT,
                                   "--job-config", job_config(steps=100, **job))
    worker = commands.start("ps-worker", "--connect", address)
    store = CheckpointStore(first)
    deadline = time.monotonic() + 150
    while not store.complete():  # a checkpoint committed remotely: then a shard is lost
        assert time.monotonic() < deadline and worker.poll() is None, errors(worker)[-3000:]
        time.sleep(0.2)
    shard1 = next(s for s in status(commands, address)["shards"] if s["name"] == "shard1")
    os.kill(shard1["pid"], signal.SIGKILL)
    assert worker.wait(240) == 0, errors(worker)[-4000:]
    figures = next(w for w in status(commands, address)["workers"] if w["name"] == "worker0")["metrics"]
    assert figures["steps"] == 100 and figures["shard_rebuilds"] >= 1, figures
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert server.wait(30) == 0, errors(server)[-3000:]
    log = errors(server)
    assert re.search(rf"shard1 restores its tables from {re.escape(first)}/ckpt-\d{{10}} \(step \d+\)", log), \
        log[-3000:]
    assert [c.step for c in store.complete()] == [100, 80]  # --keep-checkpoints 2, on the object store
    assert {name.split("/")[0] for name in objects(s3, "first")} == {"ckpt-0000000080", "ckpt-0000000100"}

    # Restored from the remote root onto 3 shards, on to step 120, its scores of the held-out batches saved.
    evaluated = tmp_path / "scores.pt"
    server, address = start_server(commands, "--shards", "3", "--group-size", "1", "--restore", first,
                                   "--checkpoint-dir", second, "--checkpoint-every", "20", "--job", WATCH_NEXT,
                                   "--job-config", job_config(steps=120, eval_scores=str(evaluated), **job))
    worker = commands.start("ps-worker", "--connect", address)
    assert worker.wait(240) == 0, errors(worker)[-4000:]
    assert "starts from checkpoint ckpt-0000000100 at step 100" in errors(worker)
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert server.wait(30) == 0, errors(server)[-3000:]
    assert f"restoring from checkpoint {first}/ckpt-0000000100 (step 100)" in errors(server)

    # Exported to the object store offline, and served from there: the restored Trainer's own scores.
    done = commands.run("ps-ctl", "export", model, "--checkpoint-dir", second, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"exported step 120 of {second}/ckpt-0000000120 to {model}: "), done.stdout
    assert objects(s3, "model")[0] == "dense.pt" and "export.json" in objects(s3, "model")
    manifest = json.loads(s3.filesystem().cat(f"{s3.bucket}/model/export.json"))
    served = serving.load(model, dense=FactorizationMachine(**manifest["dense"]["kwargs"]))
    assert served.step == 120
    with torch.no_grad():
        scores = torch.cat([served(Planted(7, hashed_videos=True).batch(999, index, 1024)) for index in range(2)])
    assert (scores - torch.load(evaluated, weights_only=True)).abs().max().item() <= 1e-6


def test_a_checkpoint_into_a_bucket_that_does_not_exist_is_named(s3):
    store = CheckpointStore(f"s3://{s3.bucket}-missing/ckpt")
    directory = store.new_directory(10)  # nothing is there: a free name
    with pytest.raises(StorageUnavailable, match=rf"^{re.escape(directory.url)}/dense.pt: cannot write: "
                                                 r"FileNotFoundError: The specified bucket does not exist"):
        save_tensors(directory / "dense.pt", {"step": 10})
