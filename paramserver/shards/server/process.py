"""The shard server process: an RPC peer that owns parameter shards.

Owns a shard server's life: install its ``ShardState`` (what it serves,
made by the caller or here) in the shard service, join the data plane,
serve (every request runs in an RPC thread, see ``service``), and leave when
asked, by an RPC (``service.request_stop``) or by SIGTERM/SIGINT (in an open
group: together with the other members that leave then, ``peer.leave_together``).  ``run_shard_server`` is a plain
function, so tests can start it with ``torch.multiprocessing`` and the
``ps-server`` command can supervise it.

A shard receives a buffer per message (a push's ids and gradients) and
frees it when the push is applied.  glibc serves buffers of a few MB from
fresh ``mmap``s, whose pages fault in on every message; a shard keeps
them on its heap instead (``keep_message_buffers``: glibc's
``M_MMAP_THRESHOLD`` at its largest, 32 MiB, and ``M_TRIM_THRESHOLD``
above it): with glibc's ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set higher still, a
push of 1,000 rows of 128 cost the shard about a third less CPU (``benchmarks/shard_throughput.py``).
"""

import ctypes
import ctypes.util
import datetime
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch.distributed.rpc as rpc

from ...logs import configure_logging
from ..peer import PeerOptions, join, leave, leave_together
from . import service
from .state import RestoreSource, ShardState

logger = logging.getLogger(__name__)

_ANSWER_GRACE = datetime.timedelta(seconds=0.2)
#: How long a shard that stops with the rest of its cluster waits for the others to count as leaving too
#: (below ps-server's 3 s before it kills its shards).
LEAVE_TOGETHER_WITHIN = datetime.timedelta(seconds=1.5)


@dataclass(frozen=True)
class ShardServerOptions:
    """A shard server's settings.  ``peer.intra_op_threads`` defaults to 1 here."""

    peer: PeerOptions = field(default_factory=lambda: PeerOptions(intra_op_threads=1))
    shutdown_timeout: datetime.timedelta = datetime.timedelta(seconds=60)


def run_shard_server(name: str, rank: int, world_size: Optional[int], init_method: str,
                     options: Optional[ShardServerOptions] = None, bind_host: Optional[str] = None,
                     on_serving: Optional[Callable[[], None]] = None,
                     restore_source: Optional[RestoreSource] = None, state: Optional[ShardState] = None) -> None:
    """Join as RPC peer ``name``, serve until asked to stop, leave.  Returns normally on a clean stop.

    ``world_size`` ``None`` joins an open group (see ``peer.join``);
    ``bind_host`` keeps the data plane on that address's interface;
    ``on_serving()`` runs once peers can reach this shard; ``restore_source``:
    where the tables it is asked for come from (a checkpoint), if not drawn afresh;
    ``state``: what it serves (made by the caller, who may read it meanwhile: a
    fresh one with ``restore_source`` otherwise).
    """
    options = options or ShardServerOptions()
    configure_logging(name, replace=False)
    keep_message_buffers()
    if state is None:
        state = ShardState(restore_source)
    elif restore_source is not None:
        state.restore_source = restore_source
    service.install(state)
    previous = {sig: signal.signal(sig, lambda signum, _frame: _on_signal(state, signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        join(name, rank, world_size, init_method, options.peer, bind_host=bind_host)
        logger.info("shard %s serving (rank %d%s)", name, rank,
                    f" of {world_size}" if world_size is not None else " in an open group")
        if on_serving is not None:
            on_serving()
        graceful = state.wait_for_stop()
        together = state.stop_together and not graceful
        logger.info("shard %s leaving (%s)", name,
                    "graceful" if graceful else "with the others that leave" if together else "immediately")
        if together and leave_together(LEAVE_TOGETHER_WITHIN):
            return
        if not graceful:
            time.sleep(_ANSWER_GRACE.total_seconds())  # let the answer to request_stop leave first
        leave(graceful=graceful, timeout=options.shutdown_timeout if graceful else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


#: glibc's ``mallopt`` parameters, and the values a shard sets (``keep_message_buffers``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MESSAGE_BUFFERS_FROM_HEAP_BELOW = 32 << 20
HEAP_KEPT_FREE = 256 << 20


def keep_message_buffers() -> bool:
    """Serve allocations under 32 MiB from the heap and keep up to 256 MiB of it free (glibc only): a push's
    buffers are reused instead of mapped and faulted in afresh.  Returns whether it applied."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        applied = libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, MESSAGE_BUFFERS_FROM_HEAP_BELOW) == 1 and \
            libc.mallopt(_M_TRIM_THRESHOLD, HEAP_KEPT_FREE) == 1
    except (OSError, AttributeError):  # not glibc
        applied = False
    if not applied:
        logger.debug("message buffers: mallopt unavailable, the allocator's defaults stay")
    return applied


def _on_signal(state: ShardState, signum) -> None:
    logger.info("shard server got %s", signal.Signals(signum).name)
    # A signal stops a cluster's shards all at once: in an open group they leave together, so that none
    # logs the others' closing pipes.
    state.request_stop(graceful=False, together=True)


def stop_shards(names, graceful: bool = True) -> None:
    """Ask the named shard servers to leave (called from a trainer or driver).

    Not graceful: a shard that is gone already, or leaves before its answer
    arrives, counts as stopped.
    """
    futures = [rpc.rpc_async(name, service.request_stop, args=(graceful,)) for name in names]
    for future in futures:
        try:
            future.wait()
        except RuntimeError:
            if graceful:
                raise
