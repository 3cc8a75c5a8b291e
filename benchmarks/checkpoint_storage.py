"""What does a checkpoint on an object store cost against local disk?  One shard's checkpoint, both ways.

What it measures
    One shard's checkpoint as the cluster writes it: a ``ShardState`` hosting a fixed table of ``--rows``
    rows (2,000,000) of ``--dim`` float32 (16) with its QHM optimizer (value and momentum: about 256 MB at
    the defaults), written by ``checkpoint_part.write_part`` into a new checkpoint directory and committed
    (``CheckpointStore.new_directory`` / ``commit``: the manifest written last), then read back and verified
    (``open_checkpoint`` + ``load_tensors``), into

    * local: a directory on this machine's disk (``--local``, a temporary one by default), files fsynced
      and renamed as the cluster writes them;
    * S3: a real S3 API on loopback, moto's server started as its own process (``moto_server``), through
      s3fs: each file one object (multipart upload), the manifest last.

    The two alternate ``--repeats`` times (3); medians are reported.  Beside them, the store's floor: the
    same number of random bytes written raw, in one PUT (``pipe_file``) and in one fsynced local write.

Target (issue 30)
    A checkpoint to the loopback S3 server within 2x of the same checkpoint to local disk (written and
    committed).  PASS or BELOW; exit 0 either way.  Loopback S3 measures the client's cost (serialising,
    hashing, HTTP, multipart) more than a network's; a remote store adds its bandwidth.

How to run
    ``.venv/bin/python benchmarks/checkpoint_storage.py [--rows N] [--repeats R]`` (needs the s3 extra and
    moto's server, both in the test extra); a markdown table on stdout.
"""

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from paramserver.checkpoint.storage import CheckpointStore, load_tensors, open_checkpoint
from paramserver.filesystems import locate
from paramserver.optim import QHM, functional_optim_map
from paramserver.shards.server.checkpoint_part import write_part
from paramserver.shards.server.optimizers import OwnerOptimizer
from paramserver.shards.server.state import ShardState

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_moto() -> tuple:
    port = free_port()
    server = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "moto_server"), "-H", "127.0.0.1",
                               "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return server, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    server.kill()
    raise RuntimeError("moto_server did not start within 30 s")


def checkpoint_once(state: ShardState, root, step: int) -> tuple:
    """Write and commit one checkpoint under ``root``; then read it back, verified; the seconds of each."""
    store = CheckpointStore(root, keep=2)
    started = time.perf_counter()
    directory = store.new_directory(step)
    record = write_part(state, directory, "shard0")
    store.commit(directory, [record], step, {})
    written = time.perf_counter() - started
    started = time.perf_counter()
    checkpoint = open_checkpoint(directory)
    load_tensors(checkpoint.file(record.name), record)
    return written, time.perf_counter() - started, record.bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--local", default=None, help="the local checkpoint root (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.update(CREDENTIALS)
    server, endpoint = start_moto()
    scratch = tempfile.mkdtemp(prefix="ckpt-bench-")
    try:
        state = ShardState()
        table = state.shared_table(f"bench.t[0:{args.rows}]", lambda: torch.randn(args.rows, args.dim))
        optimizer = OwnerOptimizer(QHM, functional_optim_map[QHM], [table], ["t"], (),
                                   dict(lr=0.1, momentum=0.9, nu=0.7), state)
        optimizer.apply_rows([0], [torch.arange(args.rows)], [torch.randn(args.rows, args.dim)], "bench")  # momentum
        options = {"endpoint_url": endpoint, "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
                   "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}
        remote = locate("s3://bench/ckpt", options)
        remote.fs.mkdir("bench")
        local = locate(args.local or os.path.join(scratch, "ckpt"))
        results = {"local": [], "s3": []}
        raw = {"local": [], "s3": []}
        size = 0
        for repeat in range(args.repeats):
            for name, root in (("local", local), ("s3", remote)):
                written, read, size = checkpoint_once(state, root, repeat + 1)
                results[name].append((written, read))
                print(f"repeat {repeat + 1} {name}: written {written:.2f} s, read {read:.2f} s", file=sys.stderr)
            blob = os.urandom(size)  # the store's own floor: the same bytes in one PUT / one fsynced write
            started = time.perf_counter()
            remote.fs.pipe_file(remote.join("raw").path, blob)
            raw["s3"].append(time.perf_counter() - started)
            started = time.perf_counter()
            with open(os.path.join(scratch, "raw"), "wb") as file:
                file.write(blob)
                file.flush()
                os.fsync(file.fileno())
            raw["local"].append(time.perf_counter() - started)
        medians = {name: (statistics.median(w for w, _ in runs), statistics.median(r for _, r in runs))
                   for name, runs in results.items()}
        ratio = medians["s3"][0] / medians["local"][0]
        print(f"\none shard's checkpoint ({size / 1e6:,.0f} MB: a {args.rows:,} x {args.dim} table with its QHM "
              f"momentum), medians of {args.repeats}\n")
        print("| where | written and committed (s) | read back and verified (s) | the same bytes written raw (s) |")
        print("|---|---:|---:|---:|")
        for name, label in (("local", "local disk"), ("s3", "S3 API on loopback (moto, s3fs)")):
            print(f"| {label} | {medians[name][0]:.2f} | {medians[name][1]:.2f} | {statistics.median(raw[name]):.2f} |")
        floor = statistics.median(raw["s3"]) / statistics.median(raw["local"])
        print(f"\ntarget: S3 within 2x of local disk (written): {ratio:.2f}x {'PASS' if ratio <= 2 else 'BELOW'} "
              f"(the raw bytes alone: {floor:.2f}x, the loopback server's own cost)")
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
