"""TorchScript compiling, one compile at a time in a process.

The TorchScript compiler is not thread-safe: two compiles at once (an RPC
thread building an owner-side optimizer while another builds one for a
second trainer, or while the main thread compiles its step sender) corrupt
the process's operator registry and fail with errors such as
``schema_->schema.operator_name() == name_ INTERNAL ASSERT FAILED`` or a
``UnicodeDecodeError`` from a garbled name.  torch's own
``DistributedOptimizer`` serializes its compiles with a lock for the same
reason.  Every compile in paramserver goes through ``script`` (or holds
``compiling()``), so one lock covers them all.  The compiler is one per
process, so its lock is too: a module-level object by necessity.  It is
re-entrant, because compiling one function may import a module that
compiles its own at import.
"""

import contextlib
import threading
from typing import Iterator

import torch

_COMPILE_LOCK = threading.RLock()


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Hold the process's compile lock for a block that compiles (``torch.jit.CompilationUnit().define``, a
    ``script`` call made through a torch helper)."""
    with _COMPILE_LOCK:
        yield


def script(obj, _frames_up: int = 0, **kwargs):
    """``torch.jit.script(obj, ...)`` holding the process's compile lock; usable as a decorator.  Names in a
    scripted class resolve in the caller's frame, as with ``torch.jit.script`` itself."""
    with _COMPILE_LOCK:
        return torch.jit.script(obj, _frames_up=_frames_up + 1, **kwargs)
