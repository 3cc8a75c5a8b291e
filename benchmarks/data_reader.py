"""How fast are files read, and does a training step wait for them?

What it measures
    (1) Criteo-format lines parsed per second on one core: the planted
        data written as ``--lines`` lines (300,000 by default; about 250
        bytes each, 8-digit hashes, 5% of fields empty), parsed chunk by
        chunk (``parts.CHUNK_BYTES``) by ``paramserver.data.criteo.parse``
        in one thread.  Reference, in the same run on the same bytes: a
        plain Python parser of the same lines (``str.split``, ``int``,
        ``int(hash, 16)``, ``math.log1p`` per field), the straightforward
        way to read such files.  Then the whole ``FileReader`` (reading,
        gzip where the file is compressed, parsing in ``threads`` threads,
        cutting batches of 1024): lines/s over every core of the machine.
        Target: at least 500,000 lines/s per core (the one-thread parse).
    (2) The share of step time spent waiting for data in the default job
        on files: ``paramserver/jobs/ctr.py`` with ``data={"format": "criteo", ...}``
        over gzip files, in one process (``JobContext.local``: it is its own
        shard and a trainer group of one), ``--steps`` steps of 1024; the
        Trainer's ``phase_ms.data`` (the wait for a step's batch) over the
        sum of its phases.  Target: under 5%.

How to run
    ``.venv/bin/python benchmarks/data_reader.py`` (as ``make bench`` runs
    it; about a minute on 2 cores).  ``--quick``: 60,000 lines, 60 steps.
    Progress goes to stderr, results to stdout as markdown.  Shared, noisy
    machines: compare runs, not digits.
"""

import argparse
import math
import os
import sys
import tempfile
import time
from typing import List, Optional, Sequence

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from paramserver.data import FileReader  # noqa: E402
from paramserver.data import criteo, parts  # noqa: E402
from paramserver.jobs.ctr_files import PlantedFiles  # noqa: E402

TARGET_LINES_PER_CORE = 500_000
TARGET_DATA_SHARE = 0.05
ROUNDS = 3


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def python_parse(text: bytes):
    """The reference: every field of every line in Python."""
    labels, dense, ids = [], [], []
    for line in text.decode().splitlines():
        fields = line.split("\t")
        labels.append(float(fields[0]))
        dense.append([math.log1p(max(int(v), 0)) if v else 0.0 for v in fields[1:14]])
        ids.append([int(v, 16) if v else criteo.MISSING_ID for v in fields[14:40]])
    return torch.tensor(labels), torch.tensor(dense), torch.tensor(ids)


def chunks_of(path: str) -> List[bytes]:
    return [chunk.text for chunk in parts.text_chunks(parts.Part(path), 0)]


def best_seconds(call, rounds: int = ROUNDS) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def parse_case(args, directory: str) -> dict:
    files = PlantedFiles(seed=1)
    plain, packed = os.path.join(directory, "day.txt"), os.path.join(directory, "day.gz")
    progress(f"writing {args.lines:,} Criteo-format lines (plain and gzip) ...")
    files.write_criteo(plain, 0, args.lines)
    files.write_criteo(packed, 0, args.lines)
    chunks = chunks_of(plain)
    lines = sum(chunk.count(b"\n") for chunk in chunks)
    torch.set_num_threads(1)
    progress("parsing in one thread ...")
    vectorized = best_seconds(lambda: [criteo.parse(chunk) for chunk in chunks])
    reference_lines = min(lines, args.reference_lines)
    reference_chunks, counted = [], 0
    for chunk in chunks:
        if counted >= reference_lines:
            break
        reference_chunks.append(chunk)
        counted += chunk.count(b"\n")
    progress(f"the Python reference on {counted:,} lines ...")
    reference = best_seconds(lambda: [python_parse(chunk) for chunk in reference_chunks], rounds=1)
    result = {"lines": lines, "bytes_per_line": os.path.getsize(plain) / lines,
              "parse_lines_per_s": lines / vectorized, "python_lines_per_s": counted / reference}
    for label, path in (("plain", plain), ("gzip", packed)):
        for threads in (1, os.cpu_count() or 1):
            progress(f"FileReader over the {label} file, {threads} parsing thread(s) ...")
            seconds = best_seconds(lambda: sum(len(b) for b in FileReader(path, 1024, threads=threads)))
            result[f"reader_{label}_{threads}"] = lines / seconds
    return result


def step_case(args, directory: str) -> dict:
    from paramserver.runtime.context import JobContext
    from paramserver.jobs import ctr

    files = PlantedFiles(seed=2)
    progress(f"writing train files for {args.steps} steps and an eval file ...")
    rows = args.steps * 1024 // 2 + 1024
    for day in range(2):
        files.write_criteo(os.path.join(directory, f"train_{day}.gz"), 10 + day, rows)
    files.write_criteo(os.path.join(directory, "eval.gz"), 99, 20_000)
    data = {"format": "criteo", "train": os.path.join(directory, "train_*.gz"),
            "eval": os.path.join(directory, "eval.gz")}
    ctx = JobContext.local()
    try:
        progress(f"the CTR job on files, {args.steps} steps of 1024, in one process ...")
        started = time.perf_counter()
        result = ctr.main(ctx, steps=args.steps, batch_size=1024, hook="allreduce", eval_every=10 ** 9,
                          log_every=max(1, args.steps // 2), table_name="bench-files", data=data)
        wall = time.perf_counter() - started
    finally:
        ctx.close()
    phases = {key[len("phase_ms."):]: value for key, value in result.items() if key.startswith("phase_ms.")}
    return {"phases": phases, "samples_per_s": result["samples_per_s"], "auc": result["auc"],
            "wall_s": wall, "steps": result["steps"]}


def met(value: float, target: float, at_most: bool = False) -> str:
    return "met" if (value <= target if at_most else value >= target) else "NOT met"


def report(args, parsed: dict, stepped: Optional[dict]) -> None:
    cores = os.cpu_count() or 1
    print(f"# Data reader: torch {torch.__version__}, {parsed['lines']:,} Criteo-format lines of "
          f"{parsed['bytes_per_line']:.0f} bytes, {cores} cores{', --quick' if args.quick else ''}")
    print()
    print("| Criteo-format lines | lines/s | vs Python |")
    print("|---|---:|---:|")
    python_rate = parsed["python_lines_per_s"]
    print(f"| plain Python parser, one thread (reference) | {python_rate:,.0f} | 1.0x |")
    print(f"| `criteo.parse`, one thread | {parsed['parse_lines_per_s']:,.0f} | "
          f"{parsed['parse_lines_per_s'] / python_rate:.1f}x |")
    for label in ("plain", "gzip"):
        for threads in sorted({1, cores}):
            rate = parsed[f"reader_{label}_{threads}"]
            print(f"| `FileReader`, {label} file, {threads} parsing thread(s), batches of 1024 | {rate:,.0f} | "
                  f"{rate / python_rate:.1f}x |")
    print()
    if stepped:
        phases = stepped["phases"]
        total = sum(phases.values())
        print(f"| default job on gzip files, {stepped['steps']} steps of 1024, one process | ms per step |")
        print("|---|---:|")
        for phase, ms in phases.items():
            print(f"| {phase} | {ms:.2f} |")
        print(f"| all | {total:.2f} |")
        print()
        print(f"{stepped['samples_per_s']:,.0f} samples/s; held-out AUC {stepped['auc']:.4f}; "
              f"{stepped['wall_s']:.1f} s in all.")
        print()
    print("Targets:")
    print(f"* lines parsed per core at least {TARGET_LINES_PER_CORE:,}/s (one thread): "
          f"{parsed['parse_lines_per_s']:,.0f}, {met(parsed['parse_lines_per_s'], TARGET_LINES_PER_CORE)}")
    if stepped:
        share = stepped["phases"].get("data", 0.0) / sum(stepped["phases"].values())
        print(f"* step time waiting for data under {TARGET_DATA_SHARE:.0%}: {share:.1%}, "
              f"{met(share, TARGET_DATA_SHARE, at_most=True)}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Criteo-format parsing speed and the data wait of a job on files.")
    parser.add_argument("--lines", type=int, default=300_000)
    parser.add_argument("--reference-lines", type=int, default=60_000,
                        help="lines the Python reference parses (it is slow; its rate hardly depends on it)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--no-job", action="store_true", help="skip (2), the job on files")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.lines, args.steps, args.reference_lines = 60_000, 60, 20_000
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="data-reader-") as directory:
        parsed = parse_case(args, directory)
        stepped = None if args.no_job else step_case(args, directory)
    report(args, parsed, stepped)
    progress(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
