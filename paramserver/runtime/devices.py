"""Which device a worker trains on: a GPU of its own on its host, or the CPU.

Owns claiming a GPU for one worker process.  A worker takes the first GPU
of its host that no other worker of the host holds, by an exclusive lock
(``flock``) on a file named after the GPU (its UUID, so that processes
with different ``CUDA_VISIBLE_DEVICES`` still agree) in a directory the
host's workers share (``PARAMSERVER_GPU_LOCK_DIR``, default
``/tmp/paramserver-gpus-<uid>``: one user's workers share it).  The lock is held for the process's life and
the kernel releases it when the process ends, however it ends, so a
restarted worker finds its GPU free again.

A worker that finds no GPU free trains on the CPU and says so in one log
line.  It reports whether it holds a GPU when it joins; the coordinator
gives a trainer group nccl only when every member holds one
(``paramserver.control.groups``), else gloo, so two ranks of an NCCL group
never share a device.  It knows nothing of groups or of the cluster.
"""

import errno
import fcntl
import logging
import os
from dataclasses import dataclass
from typing import IO, List, Optional

logger = logging.getLogger(__name__)

GPU_LOCK_DIR_ENV = "PARAMSERVER_GPU_LOCK_DIR"
DEFAULT_GPU_LOCK_DIR = f"/tmp/paramserver-gpus-{os.getuid()}"


@dataclass
class GpuClaim:
    """The GPU this process holds (``index``, as torch numbers the visible ones), or ``None``: the CPU."""

    index: Optional[int]
    host_gpus: int
    _lock: Optional[IO] = None

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file drops the flock
            self._lock = None

    def describe(self) -> str:
        if self.index is not None:
            return f"GPU {self.index} of this host's {self.host_gpus}"
        if self.host_gpus:
            return f"the CPU: every GPU of this host ({self.host_gpus}) is held by another worker"
        return "the CPU: this host has no GPU"


def visible_gpus() -> List[str]:
    """Stable names of the GPUs this process sees, in torch's index order (UUIDs where torch gives them)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - workers always have torch
        return []
    if not torch.cuda.is_available():
        return []
    names = []
    for index in range(torch.cuda.device_count()):
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
        names.append(f"GPU-{uuid}" if uuid is not None else f"index-{index}")
    return names


def claim_gpu(gpus: Optional[List[str]] = None, lock_dir: Optional[str] = None, name: str = "worker") -> GpuClaim:
    """Hold the first of ``gpus`` (default: ``visible_gpus()``) that no other process of this host holds.

    Logs one line saying what this process trains on.
    """
    gpus = visible_gpus() if gpus is None else list(gpus)
    claim = GpuClaim(None, len(gpus))
    if gpus:
        directory = lock_dir or os.environ.get(GPU_LOCK_DIR_ENV) or DEFAULT_GPU_LOCK_DIR
        os.makedirs(directory, exist_ok=True)
        for index, gpu in enumerate(gpus):
            lock = open(os.path.join(directory, f"{gpu}.lock"), "a")  # noqa: SIM115 - held for the process's life
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                lock.close()
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                continue
            claim = GpuClaim(index, len(gpus), lock)
            break
    if claim.index is None and gpus:
        logger.warning("%s trains on %s; its trainer group uses gloo", name, claim.describe())
    else:
        logger.info("%s trains on %s", name, claim.describe())
    return claim
