"""Optimizers built by several threads at once compile one at a time.

An owner's RPC threads build owner-side optimizers for several trainers at
once while its main thread may compile a local optimizer or a step sender;
TorchScript's compiler is not thread-safe, and each class compiles once per
process.  The check runs in a fresh interpreter (a process of its own, so
nothing is compiled yet): threads released together build every built-in
optimizer's owner-side form and its local form; each must compile and step.
"""

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import threading

    import torch

    from paramserver.optim import QHM, RowWiseAdagrad
    from paramserver.optim.registry import functional_optim_map
    from paramserver.optim.scripted import ScriptedOptimizer
    from paramserver.shards.server import ShardState
    from paramserver.shards.server.hosted import host_rows
    from paramserver.shards.server.optimizers import owner_optimizer_for

    CLASSES = [torch.optim.RMSprop, torch.optim.Adam, torch.optim.Adagrad, torch.optim.SGD, QHM, RowWiseAdagrad]
    ROWS = {torch.optim.Adam, torch.optim.Adagrad, torch.optim.SGD, QHM, RowWiseAdagrad}  # with a table's rows
    OPTIONS = {QHM: dict(lr=0.1, momentum=0.9, nu=0.7)}
    state = ShardState()
    start = threading.Barrier(2 * len(CLASSES))
    failures = []

    def owner_side(index, cls):
        table = host_rows(state, f"job.t{index}[0:8]", 8, 4, torch.float32, 0, 0, shared=True, init_std=0.1)
        dense = torch.zeros(4, 3)
        params = [table, dense] if cls in ROWS else [dense]
        start.wait(timeout=60)
        owner_optimizer_for(state, cls, params, list(range(len(params))), (), OPTIONS.get(cls, dict(lr=0.1)))

    def local_side(index, cls):
        parameter = torch.zeros(4, 3)
        start.wait(timeout=60)
        optimizer = ScriptedOptimizer(functional_optim_map[cls], [parameter], **OPTIONS.get(cls, dict(lr=0.1)))
        optimizer.step([torch.ones(4, 3)])
        assert parameter.abs().sum() > 0, cls

    def run(target, index, cls):
        try:
            target(index, cls)
        except BaseException as error:  # noqa: BLE001 - every thread's failure is reported
            failures.append(f"{target.__name__} {cls.__name__}: {type(error).__name__}: {str(error)[:300]}")

    threads = [threading.Thread(target=run, args=(target, index, cls))
               for index, cls in enumerate(CLASSES) for target in (owner_side, local_side)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a compiling thread did not finish in 120 s"
    assert not failures, "\\n".join(failures)
    print("compiled", len(threads))
""")


def test_optimizers_built_by_threads_at_once_all_compile_in_a_fresh_process():
    process = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=180)
    assert process.returncode == 0, process.stderr[-4000:]
    assert "compiled 12" in process.stdout
