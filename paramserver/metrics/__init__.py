"""Prometheus metrics of every paramserver process (``--metrics-port``).

``exporter`` serves a process's own registry over HTTP on its ``--host``;
``process`` decides which metric sets each kind of process serves;
``data_plane`` (RPCs and bytes per peer, optimizer steps on the owners),
``training`` (steps, comm-hook bytes, trainer group, the job's figures),
``dynamic_tables`` (a shard's dynamic table rows and bytes) and
``cluster`` (the coordinator's membership table) define the metrics.
Nothing here is process-wide: the runtime hands a process's metric sets
down to what records into them (a shard's ``ShardState.recorder``; a
worker's ``JobContext.recorders``, which a ``Trainer`` hands to its
collection, trainer group, dense replica and comm hook), each of which
names the small recorder interface it needs and never imports this
package.  Nothing here sends RPCs, touches tensors or changes the
cluster's state.

This package root imports nothing: importing one metric set loads none of
the others (``cluster`` reads the control plane).
"""
