"""How much does a live export's delta cost against a base?  Bytes and seconds, one shard, one run.

What it measures
    One shard's part of a fixed table of ``--rows`` rows (10,000,000 by default) of ``--dim`` float32 (16),
    with the owner-side QHM optimizer over it (``OwnerOptimizer``, as a shard server holds it), written as a
    live export part (``paramserver.shards.server.export_part.write_export_part``) into ``--to`` (a local
    directory by default; any fsspec URL):

    * base: the whole table (what the first export of a chain, and every ``export_base_every``-th, writes);
    * delta: after pushes that changed ``--changed`` of the rows (1%: 100,000 rows, in pushes of 8,192
      distinct rows drawn at random), only those rows.

    Each is written ``--repeats`` times (alternately, so that drifting load hits both alike; the median time
    is reported); a delta's rows are pushed again before each of its writes.

Targets
    A delta after 1% of the rows changed is at most 2% of the base's bytes and written in at most 5% of its
    time.  Each says PASS or BELOW; the script exits 0 either way.

How to run
    ``.venv/bin/python benchmarks/live_export.py [--rows N] [--changed F] [--to DIR_OR_URL]``; the results go
    to stdout as a markdown table.  Writing to a page-cache-backed disk measures serialisation and copying
    more than the disk: that is what both sides pay alike.
"""

import argparse
import statistics
import sys
import tempfile
import time

import torch

from paramserver.filesystems import locate
from paramserver.optim import QHM, functional_optim_map
from paramserver.shards.server.export_part import write_export_part
from paramserver.shards.server.optimizers import OwnerOptimizer
from paramserver.shards.server.state import ShardState

PUSH_ROWS = 8192


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--changed", type=float, default=0.01, help="share of the rows a delta carries")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--to", default=None, help="where the parts go (default: a temporary directory)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="live-export-") as scratch:
        root = locate(args.to or scratch)
        state = ShardState()
        table = state.shared_table(f"bench.t[0:{args.rows}]", lambda: torch.randn(args.rows, args.dim))
        optimizer = OwnerOptimizer(QHM, functional_optim_map[QHM], [table], ["t"], (),
                                   dict(lr=0.1, momentum=0.9, nu=0.7), state)
        changed = int(args.rows * args.changed)
        generator = torch.Generator().manual_seed(0)
        print(f"table {args.rows:,} x {args.dim} float32 ({table.numel() * 4 / 1e6:,.0f} MB); a delta after "
              f"{changed:,} rows changed; {args.repeats} repeats", file=sys.stderr)
        base_times, delta_times, base_bytes, delta_bytes = [], [], 0, 0
        for repeat in range(args.repeats):
            started = time.perf_counter()
            record = write_export_part(state, root.join(f"base-{repeat}").url, None, "shard0", whole=True)
            base_times.append(time.perf_counter() - started)
            base_bytes = record.bytes
            rows = torch.randperm(args.rows, generator=generator)[:changed]
            for start in range(0, changed, PUSH_ROWS):
                chunk = rows[start:start + PUSH_ROWS].sort().values
                optimizer.apply_rows([0], [chunk], [torch.randn(chunk.numel(), args.dim, generator=generator)], "b")
            started = time.perf_counter()
            record = write_export_part(state, root.join(f"delta-{repeat}").url, None, "shard0", whole=False)
            delta_times.append(time.perf_counter() - started)
            delta_bytes = record.bytes
            print(f"repeat {repeat + 1}: base {base_times[-1]:.2f} s, delta {delta_times[-1]:.3f} s", file=sys.stderr)
        base_s, delta_s = statistics.median(base_times), statistics.median(delta_times)
        byte_share, time_share = delta_bytes / base_bytes, delta_s / base_s
        print(f"\nlive export part of a {args.rows:,} x {args.dim} table, {args.changed:.0%} of its rows changed "
              f"(medians of {args.repeats})\n")
        print("| export | bytes | seconds | vs base |")
        print("|---|---:|---:|---|")
        print(f"| base (whole table) | {base_bytes:,} | {base_s:.3f} | 1 |")
        print(f"| delta | {delta_bytes:,} | {delta_s:.3f} | bytes {byte_share:.2%}, time {time_share:.2%} |")
        print(f"\ntarget: delta bytes <= 2% of the base's: {byte_share:.2%} "
              f"{'PASS' if byte_share <= 0.02 else 'BELOW'}")
        print(f"target: delta time <= 5% of the base's: {time_share:.2%} {'PASS' if time_share <= 0.05 else 'BELOW'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
