"""What does each DDP comm hook send, and what does a step cost with it?  Side by side, in one run, on loopback.

What it measures
    (1) Two trainers in a gloo group (spawned processes on 127.0.0.1), each a
        DDP replica of an MLP of 4 Linear(1024, 1024) layers with ReLU between
        (4.2M parameters, 16.8 MB of float32 gradients), trained with SGD
        (momentum 0.9) on a fixed synthetic regression task (the outputs of a
        random teacher network of the same shape, mean squared error; each
        trainer its own batches), with each hook of
        ``paramserver.ddp.comm_hook`` in turn: the same initial weights and the
        same batches for every hook.  Per hook:
          * bytes/step: payload handed to all-reduce per step, all buckets,
            measured by the hook's state over the timed steps;
          * allreduce/hook: allreduce's bytes per step over this hook's;
          * step ms: mean time of a training step (forward, backward with the
            hook's communication, optimizer step) on trainer 0, over the timed
            steps of every pass (--repeats passes over the hooks, so a burst
            of load elsewhere on the machine does not land on one hook only);
          * vs allreduce: allreduce's step time over this hook's (above 1: faster);
          * final loss: the last step's loss, mean of the two trainers.
        PowerSGD hooks run with start_powerSGD_iter=2 (the least that error feedback and
        warm start allow) and rank 1 unless --powersgd-rank says otherwise; the
        warm-up steps (not timed, not counted) include the uncompressed ones.
    (2) Raw gloo all-reduce of one 16M-element bucket in float32, bfloat16 and
        float16 (rounds alternate the dtypes): median time, and float32's time
        over each.
    Targets: PowerSGD rank 1 sends >= 50x fewer bytes than allreduce on these
    layers; bf16 cuts all-reduce time >= 1.5x vs fp32 (from (2)).

How to run
    ``.venv/bin/python benchmarks/comm_hooks.py [--steps N] [--warmup N]
    [--repeats N] [--batch N] [--hooks allreduce,bf16,...] [--rounds N]
    [--powersgd-rank R] [--lr LR] [--threads N]``; defaults take about 2 minutes
    on 2 idle cores.
    Progress goes to stderr, the results to stdout as markdown tables.

How to read it
    Bytes are exact and repeatable; times are from a shared, noisy machine:
    compare runs, not digits.  ``noop`` sends nothing (its replicas drift
    apart): its step time is the compute without communication, the floor for
    every other hook.  On a machine whose two trainers share few cores, the
    hooks' own compute (casts, PowerSGD's matrix products) competes with the
    model's, so fewer bytes need not mean a faster step.  Each target says
    PASS or BELOW; the script exits 0 either way.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from paramserver.ddp import HOOK_NAMES, comm_hook
from paramserver.processes import Child, free_port, run_children

TRAINERS = 2
WIDTH, LAYERS = 1024, 4
RAW_BUCKET_NUMEL = 16 * 1024 * 1024
RAW_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
POWERSGD_BYTES_TARGET = 50.0
BF16_SPEEDUP_TARGET = 1.5
RUN_TIMEOUT = datetime.timedelta(minutes=15)


def progress(message: str) -> None:
    print(f"[comm_hooks] {message}", file=sys.stderr, flush=True)


def verdict(ratio: float, target: float) -> str:
    return f">= {target:g}x {'PASS' if ratio >= target else 'BELOW'}"


def mlp() -> torch.nn.Sequential:
    layers: List[torch.nn.Module] = []
    for index in range(LAYERS):
        layers.append(torch.nn.Linear(WIDTH, WIDTH))
        if index + 1 < LAYERS:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def batch(rank: int, step: int, size: int, teacher: torch.nn.Module):
    """The same batch for every hook: inputs seeded by trainer and step, targets from the teacher."""
    generator = torch.Generator().manual_seed(1_000 * rank + step)
    inputs = torch.randn(size, WIDTH, generator=generator)
    with torch.no_grad():
        return inputs, teacher(inputs)


def train_with(name: str, options: Dict, args, teacher: torch.nn.Module) -> Dict:
    """Warm-up and timed steps with hook ``name``; returns trainer 0's view of them."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(mlp())
    state, hook = comm_hook(name, **options)
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step_seconds, loss = [], torch.zeros(())
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            bytes_before = state.total_bytes
        inputs, targets = batch(rank, step, args.batch, teacher)
        started = time.perf_counter()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        if step >= args.warmup:
            step_seconds.append(time.perf_counter() - started)
    final_loss = loss.detach().clone()
    dist.all_reduce(final_loss)  # outside the hook: not counted
    return {"bytes_per_step": (state.total_bytes - bytes_before) / args.steps,
            "step_ms": [1e3 * seconds for seconds in step_seconds],
            "final_loss": final_loss.item() / dist.get_world_size()}


def raw_allreduce_ms(rounds: int) -> Dict[str, float]:
    """Median all-reduce time of a 16M-element tensor per dtype; rounds alternate the dtypes."""
    tensors = {label: torch.randn(RAW_BUCKET_NUMEL).to(dtype) for label, dtype in RAW_DTYPES.items()}
    times: Dict[str, List[float]] = {label: [] for label in RAW_DTYPES}
    for label, tensor in tensors.items():  # one untimed round each
        dist.all_reduce(tensor)
    for _ in range(rounds):
        for label, tensor in tensors.items():
            tensor.copy_(torch.randn(RAW_BUCKET_NUMEL))
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(tensor)
            times[label].append(time.perf_counter() - started)
    return {label: 1e3 * statistics.median(seconds) for label, seconds in times.items()}


def trainer(rank: int, port: int, args, results_path: str) -> None:
    """Child body: every hook in turn, then the raw all-reduces; trainer 0 writes the results."""
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TRAINERS,
                            timeout=datetime.timedelta(minutes=5))
    torch.manual_seed(1234)
    teacher = mlp()
    results = {"hooks": {}, "raw_ms": {}}
    for repeat in range(args.repeats):
        for name in args.hooks:
            if rank == 0:
                progress(f"pass {repeat + 1}/{args.repeats}, {name}: {args.warmup} warm-up + {args.steps} timed steps")
            options = (dict(matrix_approximation_rank=args.powersgd_rank, start_powerSGD_iter=2) if "powersgd" in name
                       else {})
            run = train_with(name, options, args, teacher)
            if name in results["hooks"]:
                run["step_ms"] = results["hooks"][name]["step_ms"] + run["step_ms"]
            results["hooks"][name] = run
    if rank == 0:
        progress(f"raw all-reduce of {RAW_BUCKET_NUMEL:,} elements, {args.rounds} rounds")
    results["raw_ms"] = raw_allreduce_ms(args.rounds)
    if rank == 0:
        with open(results_path, "w") as out:
            json.dump(results, out)
    dist.destroy_process_group()


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("inf")


def report(results: Dict, args) -> None:
    hooks = results["hooks"]
    reference = hooks.get("allreduce")
    print(f"# DDP comm hooks: torch {torch.__version__}, gloo on loopback, {TRAINERS} trainers x "
          f"{args.threads} thread(s); MLP {LAYERS} x Linear({WIDTH}, {WIDTH}), batch {args.batch}, "
          f"{args.steps} timed steps after {args.warmup}, {args.repeats} passes; PowerSGD rank {args.powersgd_rank}\n")
    print("| hook | bytes/step | allreduce/hook | step ms | vs allreduce | final loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in hooks.values():
        row["step_ms"] = statistics.mean(row["step_ms"])
    for name, row in hooks.items():
        bytes_ratio = (f"{reference['bytes_per_step'] / row['bytes_per_step']:.1f}x"
                       if reference and row["bytes_per_step"] else "-")
        time_ratio = f"{ratio(reference['step_ms'], row['step_ms']):.2f}x" if reference else "-"
        print(f"| {name} | {row['bytes_per_step']:,.0f} | {bytes_ratio} | {row['step_ms']:.1f} | {time_ratio} "
              f"| {row['final_loss']:.4g} |")
    raw = results["raw_ms"]
    print(f"\n| raw gloo all-reduce, {RAW_BUCKET_NUMEL:,} elements | median ms | fp32/dtype |")
    print("|---|---:|---:|")
    for label, milliseconds in raw.items():
        print(f"| {label} | {milliseconds:.1f} | {ratio(raw['fp32'], milliseconds):.2f}x |")
    print()
    if reference and "powersgd" in hooks:
        fewer = ratio(reference["bytes_per_step"], hooks["powersgd"]["bytes_per_step"])
        print(f"PowerSGD rank {args.powersgd_rank} bytes, allreduce/powersgd: {fewer:.1f}x "
              f"{verdict(fewer, POWERSGD_BYTES_TARGET)}")
    faster = ratio(raw["fp32"], raw["bf16"])
    print(f"bf16 all-reduce time, fp32/bf16: {faster:.2f}x {verdict(faster, BF16_SPEEDUP_TARGET)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="DDP comm hooks side by side: bytes, step time, loss.")
    parser.add_argument("--steps", type=int, default=25, help="timed steps per hook and pass (default 25)")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the hooks (default 2)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per hook first (default 3)")
    parser.add_argument("--batch", type=int, default=64, help="samples per trainer per step (default 64)")
    parser.add_argument("--lr", type=float, default=0.5, help="SGD learning rate, momentum 0.9 (default 0.5)")
    parser.add_argument("--hooks", default=",".join(HOOK_NAMES),
                        help=f"comma-separated hooks (default: all: {','.join(HOOK_NAMES)})")
    parser.add_argument("--powersgd-rank", type=int, default=1, help="PowerSGD's rank (default 1)")
    parser.add_argument("--rounds", type=int, default=9, help="raw all-reduce rounds per dtype (default 9)")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // TRAINERS),
                        help="intra-op threads per trainer (default: cores / trainers)")
    args = parser.parse_args(argv)
    args.hooks = [name.strip() for name in args.hooks.split(",") if name.strip()]
    unknown = [name for name in args.hooks if name not in HOOK_NAMES]
    if unknown:
        parser.error(f"unknown hook(s) {', '.join(unknown)}; the hooks are: {', '.join(HOOK_NAMES)}")
    if args.warmup < 3:
        parser.error("--warmup must be at least 3, so PowerSGD (start_powerSGD_iter=2) is compressing when timing "
                     "starts")
    with tempfile.TemporaryDirectory() as folder:
        results_path = os.path.join(folder, "results.json")
        port = free_port()
        run_children([Child(f"trainer{rank}", trainer, (rank, port, args, results_path))
                      for rank in range(TRAINERS)], RUN_TIMEOUT)
        with open(results_path) as results_file:
            results = json.load(results_file)
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
