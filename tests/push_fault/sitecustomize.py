"""A push that fails inside a shard's optimizer after writing part of its rows, injected for tests.

Put this folder on ``PYTHONPATH`` and name a trigger file in ``PARAMSERVER_TEST_PUSH_FAULT`` (``PUSH_FAULT_ENV``),
for ``ps-server``: Python imports ``sitecustomize`` as it starts, so its fork server, and every shard process
forked from it, runs this; nothing else changes (the hook waits for ``paramserver.shards.server.optimizers`` to be
imported and patches only ``OwnerOptimizer.apply_rows``).  The test writes ``SHARD STEP`` into the trigger file
when it wants the fault: the first push that shard ``SHARD`` receives for step ``STEP`` or later, of a pusher
that numbers its steps, and only one in the whole cluster (the process that removes the file), then fails inside
its kernel: the kernel's call writes NaN into the first half of the push's rows of its first table, which no
step writes, and raises a ``RuntimeError`` (what an internal error or an out-of-memory does, midway).  A row left
NaN in the model afterwards is a half-applied push that survived.
"""

import importlib.abc
import importlib.util
import os
import sys

PUSH_FAULT_ENV = "PARAMSERVER_TEST_PUSH_FAULT"
PATCHED_MODULE = "paramserver.shards.server.optimizers"


class _Trigger:
    """The trigger file: due for a push of ``step`` to this shard once it names this shard and a step at most
    ``step``; claimed (removed) by the one push that fails."""

    def __init__(self, path: str):
        self.path = path
        self.spent = False

    def claim(self, step: int) -> bool:
        if self.spent:
            return False
        try:
            with open(self.path) as file:
                shard, at = file.read().split()
        except FileNotFoundError:  # not written yet (or claimed by a process before this one)
            return False
        import torch.distributed.rpc as rpc
        if shard != rpc.get_worker_info().name or step < int(at):
            return False
        self.spent = True
        try:
            os.unlink(self.path)
        except FileNotFoundError:  # another process claimed it first
            return False
        return True


class _FailsHalfway:
    """An optimizer's compiled step whose next ``apply`` writes NaN into the first half of the rows of the first
    gradient it is given, then raises ``RuntimeError``; everything else is the step's own."""

    def __init__(self, impl, params, names):
        self._impl, self._params, self._names = impl, params, names

    def __getattr__(self, name):
        return getattr(self._impl, name)

    def apply(self, gradients, measure):
        import torch
        index, gradient = next(((i, g) for i, g in enumerate(gradients) if g is not None), (0, None))
        if gradient is None:
            raise RuntimeError("injected fault: the kernel failed on a push of no rows")
        rows = gradient.coalesce().indices()[0]
        written = rows[:(rows.numel() + 1) // 2]
        with torch.no_grad():
            self._params[index].index_fill_(0, written, float("nan"))
        raise RuntimeError(f"injected fault: the kernel failed after writing {written.numel()} of the "
                           f"{rows.numel()} rows pushed to {self._names[index]}")


def _patch(module) -> None:
    trigger = _Trigger(os.environ[PUSH_FAULT_ENV])
    apply_rows = module.OwnerOptimizer.apply_rows

    def apply_rows_failing_once(self, params, ids, gradients, peer, once=None, **options):
        if once is not None and trigger.claim(once[1]):
            self._impl = _FailsHalfway(self._impl, self.params, self.names)
            self._native = False  # the push goes to the step module (not the native row kernel), which fails
        return apply_rows(self, params, ids, gradients, peer, once, **options)

    module.OwnerOptimizer.apply_rows = apply_rows_failing_once


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Lets ``PATCHED_MODULE`` import as usual, then patches it (before anything uses it)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != PATCHED_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


if os.environ.get(PUSH_FAULT_ENV):
    sys.meta_path.insert(0, _PatchOnImport())
