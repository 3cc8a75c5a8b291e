"""An open RPC group's connection to the coordinator's store, made again when the coordinator comes back.

Owns the c10d store a member of an open group hands torch RPC.  torch's
TensorPipe agent keeps the store it joined with for the process's life and
reads it again whenever a member joins later (the newcomer's address) or
leaves (the group's membership token).  A plain ``TCPStore`` client never
connects again once its server went away, so after the coordinator hosting
the store was started again every later join would fail on each member that
was there before.  ``ReconnectingStore`` connects again, to the same host
and port (a coordinator taken back by ``ps-server --state-dir`` listens on
them again), the first time an operation finds its connection broken, or at
once when told (``reconnect``: a member that re-attached knows the store is
back).  What the store holds is rebuilt by the coordinator (from its
journal) and by the members as they re-attach (``peer.republish``).

It knows nothing of what members host or compute, nor of the control plane.
"""

import datetime
import logging
import threading
from typing import Callable, List, Optional
from urllib.parse import urlparse

import torch.distributed as dist
from torch.distributed.rendezvous import register_rendezvous_handler

from ..logs import one_line

logger = logging.getLogger(__name__)

#: The URL scheme of an open group's store (``paramserver-tcp://HOST:PORT``).
SCHEME = "paramserver-tcp"
#: How long connecting again waits for the store's server (an operation during an outage fails after it).
RECONNECT_WITHIN = datetime.timedelta(seconds=5)


class ReconnectingStore(dist.Store):
    """A ``TCPStore`` client of ``host``:``port`` that connects again when its connection broke.

    An operation that fails with ``DistNetworkError`` (the server closed
    the connection: it was restarted) connects again, waiting up to
    ``reconnect_within`` (``RECONNECT_WITHIN``) for the server, and is retried once on the new
    connection; if the server is not back, the error of connecting is
    raised.  An operation retried may have reached the old server before it
    died: the store's contents went with it, so nothing is applied twice.
    """

    def __init__(self, host: str, port: int, timeout: datetime.timedelta,
                 reconnect_within: datetime.timedelta = RECONNECT_WITHIN):
        super().__init__()
        self.host, self.port = host, port
        self._timeout = timeout
        #: How long connecting again waits for the store's server.
        self.reconnect_within = reconnect_within
        self._lock = threading.Lock()
        #: How many times this store connected again.
        self.reconnections = 0
        #: This member's own address in the group, as torch's agent published it (``peer.join`` reads it).
        self.own_address: Optional[str] = None
        self._client = dist.TCPStore(host, port, is_master=False, timeout=timeout)

    def reconnect(self, broken: Optional[dist.Store] = None) -> None:
        """Connect again (unless ``broken`` is given and was replaced already by another thread)."""
        with self._lock:
            if broken is not None and self._client is not broken:
                return
            client = dist.TCPStore(self.host, self.port, is_master=False, timeout=self.reconnect_within)
            client.set_timeout(self._timeout)
            self._client = client
            self.reconnections += 1
        logger.info("connected again to the RPC group's store at %s:%d", self.host, self.port)

    def _call(self, operation: Callable[[dist.Store], object]):
        client = self._client
        try:
            return operation(client)
        except dist.DistNetworkError as error:
            logger.info("the RPC group's store connection broke (%s); connecting again", one_line(error))
        self.reconnect(broken=client)
        return operation(self._client)

    # The operations torch's RPC agent, its join and leave, and paramserver's own upkeep use.
    def set(self, key, value):
        return self._call(lambda client: client.set(key, value))

    def get(self, key):
        return self._call(lambda client: client.get(key))

    def add(self, key, amount):
        return self._call(lambda client: client.add(key, amount))

    def compare_set(self, key, expected, desired):
        return self._call(lambda client: client.compare_set(key, expected, desired))

    def check(self, keys):
        return self._call(lambda client: client.check(keys))

    def wait(self, keys, timeout=None):
        if timeout is None:
            return self._call(lambda client: client.wait(keys))
        return self._call(lambda client: client.wait(keys, timeout))

    def delete_key(self, key):
        return self._call(lambda client: client.delete_key(key))

    def num_keys(self):
        return self._call(lambda client: client.num_keys())

    def set_timeout(self, timeout):
        self._timeout = timeout
        self._client.set_timeout(timeout)


class _Rendezvous:
    """torch's rendezvous handler for ``SCHEME``: each join's ``ReconnectingStore``, kept alive here (torch holds
    only its C++ side, whose Python methods go with the Python object)."""

    def __init__(self):
        self.stores: List[ReconnectingStore] = []

    def __call__(self, url: str, **kwargs):
        parsed = urlparse(url)
        store = ReconnectingStore(parsed.hostname, parsed.port, datetime.timedelta(seconds=60))
        self.stores.append(store)
        yield store, kwargs.get("rank", -1), kwargs.get("world_size", -1)


def open_group_url(host: str, port: int) -> str:
    """The ``init_method`` of an open group meeting at the store on ``host``:``port``, through a
    ``ReconnectingStore`` (registers its rendezvous handler with torch the first time)."""
    try:
        register_rendezvous_handler(SCHEME, _Rendezvous())
    except RuntimeError:  # registered already, by an earlier join of this process
        pass
    host = f"[{host}]" if ":" in host else host
    return f"{SCHEME}://{host}:{port}"


def store_of(agent) -> Optional[ReconnectingStore]:
    """The ``ReconnectingStore`` under ``agent``'s store, or None (a static group's, or a plain TCP one)."""
    store = agent.store
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, ReconnectingStore) else None
