"""Serving one process's metrics over HTTP, for Prometheus to scrape.

Owns the exporter: a fresh ``CollectorRegistry`` per process (with
prometheus-client's process, platform and garbage-collector collectors),
the HTTP server (``/metrics``) bound to the process's ``--host`` address
only, never to every interface, port 0 picking a free one, the one log
line that says where it serves, and closing it.  Also the rule that gives
``ps-server``'s shard processes their ports (``shard_metrics_port``).

It defines no paramserver metric (``data_plane``, ``training``,
``cluster`` do) and does not decide which process serves what (the
runtime does).
"""

import logging
import threading
from typing import Optional

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, start_http_server

logger = logging.getLogger(__name__)


def new_registry() -> CollectorRegistry:
    """A registry of its own (never prometheus-client's global one), with the standard process metrics."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry


def shard_metrics_port(base: int, index: int) -> int:
    """``ps-server --metrics-port base``: shard ``index`` serves on ``base + 1 + index``; 0 stays 0 (a free port)."""
    return base + 1 + index if base else 0


class MetricsExporter:
    """``registry`` served at ``http://host:port/metrics`` from a daemon thread until ``close()``.

    ``host`` is bound as given (an address or a name of this machine);
    ``port`` 0 picks a free one (``self.port`` says which).  A port that
    cannot be bound raises ``OSError`` naming the address and ``--metrics-port``.
    """

    def __init__(self, host: str, port: int, registry: CollectorRegistry, process: str):
        if host in ("", "0.0.0.0", "::"):
            raise ValueError(f"metrics must bind this process's address, not the wildcard {host!r}")
        self.host = host
        self.registry = registry
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as error:
            raise OSError(error.errno, f"--metrics-port: cannot serve metrics on {_address(host, port)}: "
                                       f"{error.strerror or error}") from error
        self.port: int = self._server.server_port
        self.url = f"http://{_address(host, self.port)}/metrics"
        self._closed = threading.Event()
        logger.info("metrics of %s at %s", process, self.url)

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def _address(host: str, port: Optional[int]) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
