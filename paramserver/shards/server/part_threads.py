"""The threads that apply a large push's parts beside the thread that received it.

Owns ``PartThreads``: a shard process's pool of threads for the native row
kernel's parts of a push (``optimizers.NativeRows``), made on first use and
sized by the parts a push is cut into (the shard's inter-op threads, its
cores' share).  The kernel releases the GIL, so the parts run at once; each
part writes only its own rows and their state, so they share nothing they
write.  A part that does not finish within ``PART_WITHIN`` is a failure of
the shard (a ``RuntimeError``), not a wait without end.
"""

import concurrent.futures
import threading
from typing import Callable, List, Optional, Sequence

#: The longest a push waits for one of its parts (each is a bounded loop over its rows).
PART_WITHIN = 300.0


class PartThreads:
    """``run(calls)``: ``calls[0]`` on the calling thread, the others on this pool's threads, all at once;
    returns when every call has returned (raising the first failure).  Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._size = 0

    def _pool_of(self, size: int) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._size < size:
                # (a smaller pool another push may still be handing parts to is left to end when it is dropped)
                self._pool = concurrent.futures.ThreadPoolExecutor(size, thread_name_prefix="push-part")
                self._size = size
            return self._pool

    def run(self, calls: Sequence[Callable[[], None]]) -> None:
        if len(calls) < 2:
            for call in calls:
                call()
            return
        pool = self._pool_of(len(calls) - 1)
        futures: List[concurrent.futures.Future] = [pool.submit(call) for call in calls[1:]]
        try:
            calls[0]()
        finally:
            done, late = concurrent.futures.wait(futures, timeout=PART_WITHIN)
        if late:
            raise RuntimeError(f"{len(late)} of a push's parts did not finish within {PART_WITHIN:.0f} s")
        for future in futures:
            future.result()  # (done: raises its failure, if any)
