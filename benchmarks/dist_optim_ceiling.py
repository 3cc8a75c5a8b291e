"""How fast could benchmark (1) of ``dist_optim.py`` be?  Ours, torch's, and an owner that only runs the kernel.

What it measures
    The workload of ``dist_optim.py`` (1): one step of SGD (momentum 0.9) over 64 parameters of 256x256
    float32 on 4 shards, one trainer, the same gradients (one dist_autograd context), contestants
    alternating.  Besides ours and torch's ``DistributedOptimizer`` it times the ceiling of any owner-side
    implementation that sends one step RPC per owner: an RPC per owner whose target runs PyTorch's fused
    SGD kernel over lists made beforehand (no gradient lookup, checks, locks or timing), and the same RPCs
    doing nothing.  ``torch / ceiling`` is the most that (1) can show for ours on this machine while the
    math is one pass over parameter, gradient and buffer.

How to run
    ``.venv/bin/python benchmarks/dist_optim_ceiling.py [--rounds N]`` (default 150).  Results to stdout.
"""

import argparse
import datetime
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch.distributed.optim import DistributedOptimizer as TorchDistributedOptimizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_optim_ceiling_targets as targets  # noqa: E402

from paramserver.optim import DistributedOptimizer  # noqa: E402
from paramserver.shards import gather, place_parameters  # noqa: E402
from paramserver.shards.local import run_local_cluster, shard_names  # noqa: E402


def trainer(rounds: int) -> None:
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    params = list(place_parameters([(f"p{i}", torch.randn(256, 256) * 0.01) for i in range(64)], shard_names(4),
                                   prefix="ceiling.").values())
    ours = DistributedOptimizer(torch.optim.SGD, params, lr=1e-6, momentum=0.9)
    theirs = TorchDistributedOptimizer(torch.optim.SGD, params, lr=1e-6, momentum=0.9)
    send = torch.jit.script(targets.send)
    owners, handles = ours._owner_names, ours._owner_handles
    with dist_autograd.context() as context_id:
        dist_autograd.backward(context_id, [sum((v * v).sum() for v in gather(params))])
        for owner, handle in zip(owners, handles):
            rpc.rpc_sync(owner, targets.prepare, args=(handle, context_id))
        cases = {
            "ours (paramserver.optim.DistributedOptimizer)": lambda: ours.step(context_id),
            "torch.distributed.optim.DistributedOptimizer": lambda: theirs.step(context_id),
            "ceiling: owners run the fused kernel only": lambda: [f.wait() for f in send(owners, handles,
                                                                                           context_id, True)],
            "the same RPCs doing nothing": lambda: [f.wait() for f in send(owners, handles, context_id, False)],
        }
        samples = {name: [] for name in cases}
        for round_index in range(rounds + 5):
            for name, step in cases.items():
                started = time.perf_counter()
                step()
                if round_index >= 5:
                    samples[name].append(time.perf_counter() - started)
    reference = statistics.median(samples["torch.distributed.optim.DistributedOptimizer"])
    print(f"| one step, 64 x 256x256 SGD momentum on 4 shards, median of {rounds} | ms | torch / this |")
    print("|---|---:|---:|")
    for name, values in samples.items():
        print(f"| {name} | {1e3 * statistics.median(values):.2f} | {reference / statistics.median(values):.2f}x |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=150)
    args = parser.parse_args()
    run_local_cluster([(trainer, (args.rounds,))], num_shards=4, timeout=datetime.timedelta(minutes=10))
    return 0


if __name__ == "__main__":
    sys.exit(main())
