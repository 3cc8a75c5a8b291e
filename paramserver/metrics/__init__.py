"""Prometheus metrics of every paramserver process (``--metrics-port``).

``exporter`` serves a process's own registry over HTTP on its ``--host``;
``process`` decides which metric sets each kind of process serves;
``data_plane`` (RPCs and bytes per peer, optimizer steps on the owners),
``training`` (steps, comm-hook bytes, trainer group, the job's figures),
``dynamic_tables`` (a shard's dynamic table rows and bytes) and
``cluster`` (the coordinator's membership table) define the metrics.
Instrumented code reads ``data_plane.slot.active`` / ``training.slot.active``,
which stay ``None`` unless the process serves metrics.  Nothing here sends
RPCs, touches tensors or changes the cluster's state.

This package root imports nothing: the data plane imports ``data_plane``
without loading the control plane, which ``cluster`` reads.
"""
