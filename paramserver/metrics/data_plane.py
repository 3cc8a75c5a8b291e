"""Metrics of the data plane: RPCs and bytes per peer, optimizer steps on the owners.

Owns the metric definitions and the recording functions that the data
plane's hot paths call when this process serves metrics and they were
handed a ``DataPlaneMetrics``: on a worker ``paramserver.shards.client``'s
``EmbeddingCollection`` and ``ShardedEmbeddingBag`` (``lookup``,
``client_request``), ``paramserver.train.pipeline``'s row cache
(``row_cache``) and ``paramserver.optim.DistributedOptimizer``
(``client_request``); on a shard ``paramserver.shards.server.optimizers``
(``owner_step``, through ``ShardState.recorder``).  Each of them names the
part it calls as a recorder protocol of its own; this class has them all.
Recording is a few counter increments on label children cached per peer:
no lock of ours, no I/O.  It never sends RPCs and never touches a tensor;
callers measure and pass plain numbers (the peer of an owner's step too).

Bytes are tensor payload bytes (``numel * element_size``), not wire bytes.
"""

from typing import Dict, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

STEP_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                        2.5, 10.0)
STEP_ROWS_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)


class DataPlaneMetrics:
    """The data plane's metrics in ``registry``; the trainer's side and the owner's side."""

    def __init__(self, registry: CollectorRegistry):
        def counter(name: str, documentation: str, *labels: str) -> Counter:
            return Counter(name, documentation, labels, registry=registry)

        # The trainer's side (client): what it asked of each peer.
        self.client_requests = counter("paramserver_rpc_client_requests_total",
                                       "Data-plane RPCs sent, by peer and kind (lookup, step)", "peer", "rpc")
        self.client_sent_bytes = counter("paramserver_rpc_client_sent_bytes_total",
                                         "Tensor bytes sent in data-plane RPCs, by peer and kind", "peer", "rpc")
        self.client_received_bytes = counter(
            "paramserver_rpc_client_received_bytes_total",
            "Tensor bytes asked for in data-plane RPCs (the rows a lookup returns), by peer and kind", "peer", "rpc")
        self.lookup_rows = counter("paramserver_lookup_rows_total",
                                   "Embedding rows looked up (distinct per lookup), by peer", "peer")
        # The trainer's row cache (paramserver.train.pipeline): rows read, hits, bytes saved, evictions, held.
        self.cache_rows_read = Counter("paramserver_row_cache_rows_read_total",
                                       "Rows the worker's row cache read from the shards", registry=registry)
        self.cache_hits = Counter("paramserver_row_cache_hits_total",
                                  "Rows a step needed that its row cache window had read already", registry=registry)
        self.cache_bytes_saved = Counter("paramserver_row_cache_saved_bytes_total",
                                         "Row bytes the row cache's hits kept off the wire", registry=registry)
        self.cache_evictions = Counter("paramserver_row_cache_evictions_total",
                                       "Rows the row cache dropped (their window ended or was dropped)",
                                       registry=registry)
        self.cache_rows_held = Gauge("paramserver_row_cache_rows", "Rows the row cache holds now", registry=registry)
        # The owner's side (server): optimizer steps applied here.
        self.server_requests = counter("paramserver_rpc_server_requests_total",
                                       "Data-plane RPCs served, by calling peer and kind (step, push)", "peer", "rpc")
        self.gradient_bytes = counter(
            "paramserver_gradient_received_bytes_total",
            "Gradient bytes applied by optimizer steps here, by the peer whose backward pass sent them", "peer")
        self.gradient_rows = counter(
            "paramserver_gradient_rows_total",
            "Rows of row-sparse gradients applied by optimizer steps here, by the peer that sent them", "peer")
        self.step_seconds = Histogram(
            "paramserver_optimizer_step_seconds",
            "Time of one optimizer step on this shard (the scripted step; waiting for parameter locks excluded)",
            ["optimizer"], buckets=STEP_SECONDS_BUCKETS, registry=registry)
        self.step_rows = Histogram(
            "paramserver_optimizer_step_rows", "Rows updated by one optimizer step with row-sparse gradients",
            ["optimizer"], buckets=STEP_ROWS_BUCKETS, registry=registry)
        self._client_children: Dict[Tuple[str, str], tuple] = {}
        self._server_children: Dict[str, tuple] = {}
        self._optimizer_children: Dict[str, tuple] = {}

    # -- the trainer's side ------------------------------------------------
    def client_request(self, peer: str, rpc: str, sent_bytes: int = 0, received_bytes: int = 0) -> None:
        """One RPC to ``peer``, of kind ``rpc``, carrying these tensor bytes each way."""
        children = self._client_children.get((peer, rpc))
        if children is None:
            children = self._client_children[(peer, rpc)] = (
                self.client_requests.labels(peer, rpc), self.client_sent_bytes.labels(peer, rpc),
                self.client_received_bytes.labels(peer, rpc), self.lookup_rows.labels(peer))
        requests, sent, received, _ = children
        requests.inc()
        if sent_bytes:
            sent.inc(sent_bytes)
        if received_bytes:
            received.inc(received_bytes)

    def lookup(self, peer: str, rows: int, sent_bytes: int, received_bytes: int) -> None:
        """An embedding lookup of ``rows`` distinct rows on ``peer``."""
        self.client_request(peer, "lookup", sent_bytes, received_bytes)
        self._client_children[(peer, "lookup")][3].inc(rows)

    def row_cache(self, rows_read: int, hits: int, bytes_saved: int, evictions: int, rows_held: int) -> None:
        """The row cache read, hit, saved and evicted these since the last call, and holds ``rows_held`` rows."""
        if rows_read:
            self.cache_rows_read.inc(rows_read)
        if hits:
            self.cache_hits.inc(hits)
        if bytes_saved:
            self.cache_bytes_saved.inc(bytes_saved)
        if evictions:
            self.cache_evictions.inc(evictions)
        self.cache_rows_held.set(rows_held)

    # -- the owner's side --------------------------------------------------
    def owner_step(self, optimizer: str, seconds: float, peer: str, rows: int, gradient_bytes: int,
                   rpc: str = "step") -> None:
        """An optimizer step applied here for ``peer`` (by a ``step`` RPC, or a fused ``push``): its time, and
        the gradients it applied."""
        timing = self._optimizer_children.get(optimizer)
        if timing is None:
            timing = self._optimizer_children[optimizer] = (self.step_seconds.labels(optimizer),
                                                            self.step_rows.labels(optimizer))
        served = self._server_children.get((peer, rpc))
        if served is None:
            served = self._server_children[(peer, rpc)] = (self.server_requests.labels(peer, rpc),
                                                    self.gradient_bytes.labels(peer), self.gradient_rows.labels(peer))
        timing[0].observe(seconds)
        served[0].inc()
        if gradient_bytes:
            served[1].inc(gradient_bytes)
        if rows:  # steps of dense gradients only touch no rows: they would only crowd the first bucket
            timing[1].observe(rows)
            served[2].inc(rows)
