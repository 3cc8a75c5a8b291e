"""Prometheus metrics (``--metrics-port``): the exporter, each metric set's logic
in one process (a shard's dynamic tables and their heartbeat figures too), the
flags, and one run of the real commands scraped while the default job trains
(coordinator, both shards, both workers)."""

import datetime
import types
import logging
import os
import pathlib
import pickle
import re
import signal
import socket
import time
import urllib.request
from typing import Dict, List, Tuple

import prometheus_client
import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from commands import errors, job_config, start_server, status

from paramserver.cli import server as server_cli
from paramserver.cli import worker as worker_cli
from paramserver.control import validation
from paramserver.control.membership import Membership
from paramserver.control.protocol import pb
from paramserver.ddp import hooks
from paramserver.metrics import data_plane, training
from paramserver.metrics.cluster import ClusterCollector
from paramserver.metrics.exporter import MetricsExporter, new_registry, shard_metrics_port
from paramserver.metrics.process import ProcessMetrics, shard_metrics, worker_metrics
from paramserver.shards.server.optimizers import UNKNOWN_PEER, context_peer, gradient_stats
from paramserver.runtime.context import GroupChannel, Inbox, JobContext, Recorders
from paramserver.shards.server.figures import dynamic_figures, dynamic_parts
from paramserver.shards.server.dynamic import DynamicRows
from paramserver.shards.server.hosted import host_dynamic
from paramserver.shards.server.row_store.latency import READ_SECONDS_BUCKETS
from paramserver.shards.server.row_store.stores import RowStoreOptions, RowStores
from paramserver.tables import DynamicOptions, part_name
from paramserver.shards.server import ShardState

pytestmark = pytest.mark.timeout(90)

Samples = Dict[str, List[Tuple[Dict[str, str], float]]]


def parse(text: str) -> Samples:
    """Every sample by name (``_total``, ``_count``... included): ``[(labels, value)]``."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse(response.read().decode())


def value(samples: Samples, name: str, **labels) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    matching = [v for have, v in samples.get(name, []) if labels.items() <= have.items()]
    assert len(matching) == 1, f"{name}{labels}: {samples.get(name)}"
    return matching[0]


def by_label(samples: Samples, name: str, label: str, **labels) -> Dict[str, float]:
    return {have[label]: v for have, v in samples.get(name, []) if labels.items() <= have.items()}


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def listening_on(port: int) -> set:
    """The local IPv4 addresses with a socket listening on TCP ``port`` (from /proc/net/tcp)."""
    found = set()
    for line in pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        address, hex_port = fields[1].split(":")
        if fields[3] == "0A" and int(hex_port, 16) == port:
            found.add(".".join(str(b) for b in reversed(bytes.fromhex(address))))
    return found


# -- the exporter ---------------------------------------------------------------

def test_the_exporter_serves_its_own_registry_on_the_given_host_only(caplog):
    registry = new_registry()
    prometheus_client.Counter("paramserver_test_things_total", "things", registry=registry).inc(3)
    with caplog.at_level(logging.INFO, logger="paramserver.metrics.exporter"):
        exporter = MetricsExporter("127.0.0.1", 0, registry, "a test")
    try:
        assert exporter.port > 0 and exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
        assert f"metrics of a test at {exporter.url}" in caplog.text
        samples = scrape(exporter.url)
        assert value(samples, "paramserver_test_things_total") == 3
        assert value(samples, "process_cpu_seconds_total") > 0  # the standard process metrics come along
        assert listening_on(exporter.port) == {"127.0.0.1"}
        assert refused("127.0.0.2", exporter.port)  # another loopback address: nothing listens there
    finally:
        exporter.close()
    assert refused("127.0.0.1", exporter.port)
    exporter.close()  # twice is fine
    # Nothing went to prometheus-client's global registry.
    assert prometheus_client.REGISTRY.get_sample_value("paramserver_test_things_total") is None


def test_a_port_in_use_and_a_wildcard_are_refused():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"--metrics-port: cannot serve metrics on 127\.0\.0\.1:{port}"):
            MetricsExporter("127.0.0.1", port, CollectorRegistry(), "a test")
    with pytest.raises(ValueError, match="not the wildcard"):
        MetricsExporter("0.0.0.0", 0, CollectorRegistry(), "a test")


def test_the_shard_port_rule():
    assert [shard_metrics_port(9100, i) for i in range(3)] == [9101, 9102, 9103]
    assert [shard_metrics_port(0, i) for i in range(3)] == [0, 0, 0]


def test_process_metrics_hand_out_their_sets_and_install_nothing_process_wide():
    off = Recorders()
    assert off.data_plane is None and off.training is None  # off unless a process serves them
    first = worker_metrics("127.0.0.1", 0)
    second = ProcessMetrics("127.0.0.1", 0, "a shard", serves_data_plane=True)
    try:
        assert first.data_plane is not None and first.training is not None  # a worker: both, to hand down
        assert second.data_plane is not None and second.training is None and second.data_plane is not first.data_plane
        second.data_plane.client_request("shard0", "step")
        assert value(scrape(second.url), "paramserver_rpc_client_requests_total", peer="shard0") == 1
        assert "paramserver_rpc_client_requests_total" not in scrape(first.url)  # registries of their own
    finally:
        second.close()
    assert refused("127.0.0.1", second.port)
    first.data_plane.client_request("shard1", "step")  # the first one serves on, unchanged by the second's close
    assert value(scrape(first.url), "paramserver_rpc_client_requests_total", peer="shard1") == 1
    first.close()
    assert refused("127.0.0.1", first.port)


# -- the metric sets ------------------------------------------------------------

def test_data_plane_metrics_count_per_peer():
    registry = CollectorRegistry()
    metrics = data_plane.DataPlaneMetrics(registry)
    metrics.lookup("shard0", rows=10, sent_bytes=80, received_bytes=640)
    metrics.lookup("shard0", rows=5, sent_bytes=40, received_bytes=320)
    metrics.lookup("shard1", rows=1, sent_bytes=8, received_bytes=64)
    metrics.client_request("shard1", "step")
    metrics.owner_step("QHM", 0.002, "worker0", rows=7, gradient_bytes=448)
    metrics.owner_step("QHM", 0.004, "worker1", rows=0, gradient_bytes=1024)  # dense gradients only
    sample = registry.get_sample_value
    assert sample("paramserver_rpc_client_requests_total", {"peer": "shard0", "rpc": "lookup"}) == 2
    assert sample("paramserver_rpc_client_sent_bytes_total", {"peer": "shard0", "rpc": "lookup"}) == 120
    assert sample("paramserver_rpc_client_received_bytes_total", {"peer": "shard0", "rpc": "lookup"}) == 960
    assert sample("paramserver_lookup_rows_total", {"peer": "shard0"}) == 15
    assert sample("paramserver_lookup_rows_total", {"peer": "shard1"}) == 1
    assert sample("paramserver_rpc_client_requests_total", {"peer": "shard1", "rpc": "step"}) == 1
    assert sample("paramserver_rpc_client_sent_bytes_total", {"peer": "shard1", "rpc": "step"}) == 0
    assert sample("paramserver_optimizer_step_seconds_count", {"optimizer": "QHM"}) == 2
    assert sample("paramserver_optimizer_step_seconds_sum", {"optimizer": "QHM"}) == pytest.approx(0.006)
    assert sample("paramserver_optimizer_step_seconds_bucket", {"optimizer": "QHM", "le": "0.0025"}) == 1
    assert sample("paramserver_optimizer_step_rows_count", {"optimizer": "QHM"}) == 1  # sparse steps only
    assert sample("paramserver_optimizer_step_rows_sum", {"optimizer": "QHM"}) == 7
    assert sample("paramserver_rpc_server_requests_total", {"peer": "worker1", "rpc": "step"}) == 1
    assert sample("paramserver_gradient_received_bytes_total", {"peer": "worker0"}) == 448
    assert sample("paramserver_gradient_rows_total", {"peer": "worker0"}) == 7
    assert sample("paramserver_gradient_rows_total", {"peer": "worker1"}) == 0


def test_gradient_stats_count_sparse_rows_and_value_bytes():
    table = torch.randn(100, 16, requires_grad=True)
    torch.embedding(table, torch.tensor([3, 7, 50]), -1, False, True).sum().backward()
    dense = torch.zeros(4, 5, dtype=torch.float64)
    assert table.grad.is_sparse
    assert gradient_stats([table.grad, None, dense]) == (3, 3 * 16 * 4 + 20 * 8)
    assert gradient_stats([None]) == (0, 0)


def test_a_context_of_no_known_peer_is_labelled_unknown():
    assert context_peer(5 << 48) == UNKNOWN_PEER  # no RPC agent in this process


class _Bucket:
    def __init__(self, last: bool):
        self._last = last

    def is_last(self) -> bool:
        return self._last


def test_comm_hook_bytes_and_steps_are_counted_together(monkeypatch):
    monkeypatch.setattr(hooks.dist, "all_reduce", lambda tensor, group=None, async_op=False: None)
    registry = CollectorRegistry()
    metrics = training.TrainingMetrics(registry)
    state = hooks.comm_hook("allreduce", recorder=metrics).state
    for _ in range(3):  # a step of two buckets: 10 float32 and 6 bfloat16 elements
        state.all_reduce(torch.zeros(10))
        state.end_bucket(_Bucket(last=False))
        state.all_reduce(torch.zeros(6, dtype=torch.bfloat16))
        state.end_bucket(_Bucket(last=True))
    hooks.CommHookState("noop", recorder=metrics).end_bucket(_Bucket(last=True))
    assert state.last_step_bytes == 52
    state = pickle.loads(pickle.dumps(state))  # as a checkpoint keeps it: without its recorder
    assert state.recorder is None and state.steps == 3
    state.all_reduce(torch.zeros(10))
    state.end_bucket(_Bucket(last=True))  # metrics off again: not counted
    hooks.CommHookState("allreduce").end_bucket(_Bucket(last=True))  # never handed a recorder: not counted
    samples = parse(prometheus_client.generate_latest(registry).decode())
    assert by_label(samples, "paramserver_comm_hook_steps_total", "hook") == {"allreduce": 3, "noop": 1}
    assert by_label(samples, "paramserver_comm_hook_bytes_total", "hook") == {"allreduce": 3 * 52, "noop": 0}


def test_training_steps_group_generation_and_the_job_figures():
    registry = CollectorRegistry()
    metrics = training.TrainingMetrics(registry)
    inbox = Inbox()
    context = JobContext(rpc_name="worker0", worker_index=0, trainer_group=0, shards=["shard0"], inbox=inbox,
                         group=GroupChannel("worker0", 0, 0, "127.0.0.1", 1, inbox))
    registry.register(training.JobCollector(context))
    samples = parse(prometheus_client.generate_latest(registry).decode())
    assert value(samples, "paramserver_job_step") == 0 and "paramserver_job_figure" not in samples
    for _ in range(4):
        metrics.step_finished()
    metrics.group_formed(0, 1)
    metrics.group_formed(0, 2)
    context.report(40, loss=0.5, samples_per_s=1234.5)
    samples = parse(prometheus_client.generate_latest(registry).decode())
    assert value(samples, "paramserver_training_steps_total") == 4
    assert value(samples, "paramserver_trainer_group_generation", group="0") == 2
    assert value(samples, "paramserver_job_step") == 40
    assert by_label(samples, "paramserver_job_figure", "figure") == {"loss": 0.5, "samples_per_s": 1234.5}


class _Clock:
    now = 100.0

    def __call__(self):
        return self.now


class _Checkpoints:
    committed = 2
    newest = None


def test_the_cluster_collector_reads_the_membership_table():
    clock = _Clock()
    membership = Membership(datetime.timedelta(seconds=5), clock=clock)
    registry = CollectorRegistry()
    registry.register(ClusterCollector(membership, _Checkpoints()))

    def join(role, name):
        return membership.join(pb.JoinRequest(role=role, name=name, host="127.0.0.1",
                                              capabilities=pb.Capabilities(pid=42)))

    join(pb.ROLE_SHARD, "shard0")
    join(pb.ROLE_SHARD, "shard1")
    workers = [join(pb.ROLE_WORKER, "w") for _ in range(3)]
    for worker in workers[1:]:
        membership.heartbeat(pb.HeartbeatRequest(member_id=worker.member_id, sequence=1))
    membership.leave(pb.LeaveRequest(member_id=workers[1].member_id))
    clock.now += 5.1
    membership.sweep()  # the four still alive: silent for 5.1 s (the last heartbeat was at 100.0 too)
    samples = parse(prometheus_client.generate_latest(registry).decode())
    assert value(samples, "paramserver_cluster_generation") == membership.generation == 5 + 1 + 4
    assert by_label(samples, "paramserver_members_alive", "role") == {"shard": 0, "worker": 0, "client": 0}
    assert by_label(samples, "paramserver_members_joined_total", "role") == {"shard": 2, "worker": 3, "client": 0}
    assert by_label(samples, "paramserver_members_ended_total", "state", role="worker") == {
        "left": 1, "dead": 2, "exited": 0}
    assert by_label(samples, "paramserver_members_ended_total", "state", role="shard") == {
        "left": 0, "dead": 2, "exited": 0}
    assert value(samples, "paramserver_checkpoints_committed_total") == 2
    assert value(samples, "paramserver_trainer_groups_gone") == 0  # its last worker went 5 s ago: within the grace
    # Counts survive the table forgetting former members; a process exit counts as "exited".
    clock.now += 1
    again = join(pb.ROLE_SHARD, "shard0")
    membership.process_exited(again.rpc_name, -9)
    samples = parse(prometheus_client.generate_latest(registry).decode())
    assert value(samples, "paramserver_members_ended_total", role="shard", state="exited") == 1
    clock.now += 60  # group 0 has had no live worker for a minute: gone
    assert value(parse(prometheus_client.generate_latest(registry).decode()), "paramserver_trainer_groups_gone") == 1
    assert value(samples, "paramserver_checkpoints_committed_total") == 2
    assert not [name for name in samples if name.startswith("paramserver_checkpoint_newest")]  # none yet
    _Checkpoints.newest = types.SimpleNamespace(step=40, manifest={"created_unix": 1.8e9})
    try:
        samples = parse(prometheus_client.generate_latest(registry).decode())
    finally:
        _Checkpoints.newest = None
    assert value(samples, "paramserver_checkpoint_newest_step") == 40
    assert value(samples, "paramserver_checkpoint_newest_timestamp_seconds") == 1.8e9


def dynamic_part(state: ShardState, table: str, index: int, count: int, options: DynamicOptions) -> DynamicRows:
    name = part_name(table, index, count)
    return state.shared_dynamic(name, lambda: DynamicRows(name, 4, torch.float32, 1, 0.1, options,
                                                          lambda t: state.lock_for(t)[1],
                                                          kernel=state.kernels.chosen(), huge_pages=state.huge_pages))


def test_a_shard_serves_its_dynamic_tables_rows_and_heartbeats_their_sums():
    """Read from the parts' own figures at scrape time: labelled by table and part, nothing before a state is
    installed, fixed tables left out; the heartbeat figures are their sums, as the coordinator accepts them."""
    assert dynamic_parts(None) == [] and dynamic_figures(None) == {}
    state = ShardState()
    state.shared_table("fixed", lambda: torch.zeros(10, 4))
    assert dynamic_parts(state) == [] and dynamic_figures(state) == {}  # a shard without dynamic tables
    clicks = dynamic_part(state, "clicks", 1, 2, DynamicOptions(capacity=100))
    users = dynamic_part(state, "users", 0, 2, DynamicOptions(admit_after=2))
    for step in range(3):  # 3 x 80 new ids into room for 100: the oldest rows make room
        clicks.lookup(torch.arange(step * 80, (step + 1) * 80), step)
    users.lookup(torch.arange(50), 0)  # seen once: not admitted yet
    users.lookup(torch.arange(20), 1)  # seen twice: admitted
    expected = {("clicks", "1/2"): clicks.stats(), ("users", "0/2"): users.stats()}
    assert expected[("clicks", "1/2")]["evicted"] >= 140 and expected[("users", "0/2")]["rows"] == 20
    assert expected[("users", "0/2")]["not_admitted"] == 50
    assert {(table, part): stats for table, part, stats in dynamic_parts(state)} == expected

    metrics = shard_metrics("127.0.0.1", 0, "shard1", dynamic_tables=lambda: dynamic_parts(state))
    try:
        samples = scrape(metrics.url)
    finally:
        metrics.close()
    for (table, part), stats in expected.items():
        labels = dict(table=table, part=part)
        assert value(samples, "paramserver_dynamic_rows", **labels) == stats["rows"] > 0
        assert value(samples, "paramserver_dynamic_rows_admitted_total", **labels) == stats["admitted"]
        assert value(samples, "paramserver_dynamic_rows_evicted_total", **labels) == stats["evicted"]
        assert value(samples, "paramserver_dynamic_rows_not_admitted_total", **labels) == stats["not_admitted"]
        assert value(samples, "paramserver_dynamic_bytes", **labels) == stats["bytes"] > 0
    assert len(samples["paramserver_dynamic_rows"]) == 2  # the fixed table is no dynamic part

    figures = dynamic_figures(state)
    assert figures == {f"dynamic.{key}": sum(stats[key] for stats in expected.values())
                       for key in ("rows", "admitted", "evicted", "bytes")}
    validation.check_metrics("metrics", figures)  # what the coordinator checks every heartbeat's figures against


def test_a_shard_with_a_row_store_serves_its_hits_reads_writes_and_disk_figures(tmp_path):
    """A table part with a row store: the rows that spill past its capacity are counted written, the ids that
    come back read, the others found in memory; the engine's records and bytes, and the reads' times as a
    histogram, are its metrics; the heartbeat adds the rows and bytes on disk."""
    state = ShardState()
    state.row_stores = RowStores(RowStoreOptions(str(tmp_path), "rocksdb"), "shard0")
    try:
        slab = host_dynamic(state, "t", 4, torch.float32, 3, 0.1, DynamicOptions(capacity=64), 0, 1)
        rows = state.dynamic_rows(slab)
        for step in range(4):  # 4 x 48 new ids into room for 64: the older rows go to disk
            rows.lookup(torch.arange(step * 48, (step + 1) * 48), step)
        rows.lookup(torch.arange(0, 40), 4)  # the first 40: on disk, read back
        rows.lookup(torch.arange(0, 40), 5)  # now in memory: hits
        rows.lookup(torch.arange(0, 40), -1)  # read only: counted nowhere
        stats = rows.stats()
        record = 8 + 4 * 4  # the last touch and 4 float32 values: no optimizer state yet
        assert stats["rows"] <= 64 and stats["rows"] + stats["rows_on_disk"] == 4 * 48
        assert stats["memory_hits"] == 40 and stats["store_reads"] == 40
        assert stats["store_writes"] == stats["evicted"] >= 4 * 48 - 64
        assert stats["store_written_bytes"] == stats["store_writes"] * record
        assert stats["store_read_bytes"] == 40 * record
        assert stats["disk_bytes"] > 0
        latency = stats["store_read_latency"]
        reads = rows.store.read_calls
        assert reads > 0 and latency.count == reads and latency.sum_seconds > 0
        assert [bound for bound, _ in latency.buckets] == [*READ_SECONDS_BUCKETS, float("inf")]
        assert [count for _, count in latency.buckets] == sorted(count for _, count in latency.buckets)

        metrics = shard_metrics("127.0.0.1", 0, "shard0", dynamic_tables=lambda: dynamic_parts(state))
        try:
            samples = scrape(metrics.url)
        finally:
            metrics.close()
        labels = dict(table="t", part="0/1")
        for name, key in (("paramserver_row_store_memory_hits_total", "memory_hits"),
                          ("paramserver_row_store_rows_read_total", "store_reads"),
                          ("paramserver_row_store_rows_written_total", "store_writes"),
                          ("paramserver_row_store_read_bytes_total", "store_read_bytes"),
                          ("paramserver_row_store_written_bytes_total", "store_written_bytes"),
                          ("paramserver_row_store_rows", "rows_on_disk")):
            assert value(samples, name, **labels) == stats[key], name
        assert value(samples, "paramserver_row_store_disk_bytes", **labels) > 0  # compactions may change it
        assert value(samples, "paramserver_row_store_read_seconds_count", **labels) == reads
        assert value(samples, "paramserver_row_store_read_seconds_sum", **labels) == pytest.approx(
            latency.sum_seconds)
        assert by_label(samples, "paramserver_row_store_read_seconds_bucket", "le", **labels) == {
            prometheus_client.utils.floatToGoString(bound): count for bound, count in latency.buckets}

        figures = dynamic_figures(state)
        assert {key: figures[key] for key in ("dynamic.rows", "dynamic.rows_on_disk")} == {
            "dynamic.rows": stats["rows"], "dynamic.rows_on_disk": stats["rows_on_disk"]}
        assert figures["dynamic.disk_bytes"] > 0 and set(figures) == {
            "dynamic.rows", "dynamic.admitted", "dynamic.evicted", "dynamic.bytes", "dynamic.rows_on_disk",
            "dynamic.disk_bytes"}
        validation.check_metrics("metrics", figures)
    finally:
        state.row_stores.close()


# -- the flags ----------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--metrics-port", "70000"], "--metrics-port must be 0-65535, got 70000"),
    (["--metrics-port", "-1"], "--metrics-port must be 0-65535, got -1"),
    (["--metrics-port", "65534", "--shards", "2"], "--metrics-port 65534 needs ports 65534-65536"),
])
def test_server_metrics_port_is_checked(argv, message):
    parser = server_cli.argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    with pytest.raises(server_cli.UsageError, match=message):
        server_cli.options_from(parser.parse_args(argv))


def test_server_metrics_port_reaches_the_options():
    parser = server_cli.argparse.ArgumentParser()
    server_cli.add_arguments(parser)
    assert server_cli.options_from(parser.parse_args(["--shards", "2", "--metrics-port", "9100"])).metrics_port == 9100
    assert server_cli.options_from(parser.parse_args([])).metrics_port is None


def test_worker_metrics_port_is_checked(capsys):
    assert worker_cli.main(["--connect", "127.0.0.1:1", "--metrics-port", "65536"]) == 2
    assert "ps-worker: --metrics-port must be 0-65535, got 65536" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        worker_cli.main(["--connect", "127.0.0.1:1", "--metrics-port", "ninety"])
    assert exit_info.value.code == 2
    assert "argument --metrics-port: invalid int value: 'ninety'" in capsys.readouterr().err


# -- the real commands ----------------------------------------------------------

SMALL = dict(spec={"vocab_sizes": [2000, 500, 200, 50], "bag_sizes": [1, 2, 1, 1], "num_dense": 4},
             batch_size=256, holdout_size=1024, log_every=5, eval_every=1_000_000, row_wise_min_rows=1000,
             sparse_lr=64.0, steps=1_000_000, hook="allreduce")
#: The job's dense tower for SMALL: (4 tables x 16 + 4 dense) -> 128 -> 64 -> 1, float32; allreduce sends it all.
DENSE_BYTES_PER_STEP = 4 * ((4 * 16 + 4) * 128 + 128 + 128 * 64 + 64 + 64 + 1)

_METRICS_LINE = re.compile(r" INFO paramserver\.metrics\.exporter: metrics of (.+?) at (http://\S+)")


def metrics_lines(process, expected: int, timeout: float = 60) -> List[Tuple[str, str]]:
    """``[(process, url)]`` from the log lines of ``process`` (and its children), once there are ``expected``."""
    deadline = time.monotonic() + timeout
    while True:
        found = _METRICS_LINE.findall(errors(process))
        if len(found) >= expected:
            return found
        assert process.poll() is None and time.monotonic() < deadline, errors(process)[-3000:]
        time.sleep(0.2)


def wait_for_metric(url: str, name: str, at_least: float, timeout: float = 60, **labels) -> Samples:
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if sum(v for have, v in samples.get(name, []) if labels.items() <= have.items()) >= at_least:
            return samples
        assert time.monotonic() < deadline, f"{name}{labels} stayed below {at_least} at {url}"
        time.sleep(0.5)


def test_every_process_serves_its_metrics_while_the_job_runs(commands, tmp_path):
    began = time.monotonic()
    # --checkpoint-dir: a killed shard is restarted (below), on its metrics port.
    # --group-settle: the group forms once both workers joined, however far apart a loaded machine starts them
    # (with the default 2 s, the first to join trained alone in generation 1 once in CI).
    server, address = start_server(commands, "--shards", "2", "--group-size", "2", "--group-settle", "600",
                                   "--metrics-port", "0",
                                   "--checkpoint-dir", str(tmp_path / "checkpoints"),
                                   "--job-config", job_config(**SMALL))
    urls = dict(metrics_lines(server, 3))
    workers = [commands.start("ps-worker", "--connect", address, "--metrics-port", "0") for _ in range(2)]
    worker_urls = [dict(metrics_lines(worker, 1))["this worker"] for worker in workers]
    assert set(urls) == {"the coordinator", "shard0", "shard1"}
    ports = [int(url.rsplit(":", 1)[1].split("/")[0]) for url in list(urls.values()) + worker_urls]
    assert len(set(ports)) == 5

    # Training has started on both workers (the group of two forms at once: it is full).
    for url in worker_urls:
        wait_for_metric(url, "paramserver_training_steps_total", 10)

    # Which worker is which: the coordinator names them in join order, not in the order they were started.
    names = [re.search(r"joined \S+ as (worker\d+)", errors(worker)).group(1) for worker in workers]
    assert sorted(names) == ["worker0", "worker1"], names
    # Shards first, then workers: what a shard applied was looked up before.
    shards = {name: scrape(urls[name]) for name in ("shard0", "shard1")}
    worker_samples = [scrape(worker_urls[names.index(name)]) for name in ("worker0", "worker1")]
    coordinator = scrape(urls["the coordinator"])

    assert value(coordinator, "paramserver_cluster_generation") >= 1
    assert by_label(coordinator, "paramserver_members_alive", "role") == {"shard": 2, "worker": 2, "client": 0}
    assert by_label(coordinator, "paramserver_members_joined_total", "role") == {"shard": 2, "worker": 2, "client": 0}
    assert sum(v for _, v in coordinator["paramserver_members_ended_total"]) == 0

    for name, samples in shards.items():
        assert value(samples, "paramserver_optimizer_step_seconds_count", optimizer="QHM") > 0, name
        assert 0 < value(samples, "paramserver_optimizer_step_seconds_sum", optimizer="QHM") < 60, name
        assert value(samples, "paramserver_optimizer_step_rows_sum", optimizer="QHM") > 0, name
        # A Trainer's step pushes its row gradients (one fused push per shard), applied on arrival.
        pushes = by_label(samples, "paramserver_rpc_server_requests_total", "peer", rpc="push")
        assert set(pushes) == {"worker0", "worker1"} and min(pushes.values()) > 0, (name, pushes)
        rows = by_label(samples, "paramserver_gradient_rows_total", "peer")
        sent = by_label(samples, "paramserver_gradient_received_bytes_total", "peer")
        for index, peer in enumerate(("worker0", "worker1")):
            # Both sides count rows, but not the same ones to the row: once in a clean-clone run the shard had
            # counted 1696 gradient rows from worker1 and worker1 1680 rows looked up there (not explained yet).
            assert rows[peer] > 0 and value(worker_samples[index], "paramserver_lookup_rows_total", peer=name) > 0
            assert sent[peer] == rows[peer] * 16 * 4  # row-sparse float32 gradients of 16 columns
            assert pushes[peer] <= value(worker_samples[index], "paramserver_rpc_client_requests_total", peer=name,
                                         rpc="push")

    for index, samples in enumerate(worker_samples):
        for rpc in ("lookup", "push"):
            assert set(by_label(samples, "paramserver_rpc_client_requests_total", "peer", rpc=rpc)) == {
                "shard0", "shard1"}
        for shard in ("shard0", "shard1"):
            assert value(samples, "paramserver_rpc_client_requests_total", peer=shard, rpc="lookup") > 0
            assert value(samples, "paramserver_rpc_client_received_bytes_total", peer=shard, rpc="lookup") == \
                value(samples, "paramserver_lookup_rows_total", peer=shard) * 16 * 4
        assert value(samples, "paramserver_training_steps_total") >= 10
        assert value(samples, "paramserver_trainer_group_generation", group="0") == 1
        hook_steps = value(samples, "paramserver_comm_hook_steps_total", hook="allreduce")
        assert hook_steps >= 10
        # Every backward pass all-reduced the whole dense tower: the hook's bytes are exactly that per step.
        assert value(samples, "paramserver_comm_hook_bytes_total", hook="allreduce") == \
            hook_steps * DENSE_BYTES_PER_STEP
        assert value(samples, "paramserver_job_step") >= 5
        assert value(samples, "paramserver_job_figure", figure="bytes_per_step") == DENSE_BYTES_PER_STEP
        assert value(samples, "paramserver_job_figure", figure="loss") > 0

    for port in ports:  # each exporter listens on --host (127.0.0.1) only
        assert listening_on(port) == {"127.0.0.1"}, port
        assert refused("127.0.0.2", port)

    # SIGTERM to one worker stops the group: both leave, and the coordinator counts them out.
    workers[1].terminate()
    for worker in workers:
        assert worker.wait(60) == 0, errors(worker)[-3000:]
    # A killed shard comes back (--checkpoint-dir) on the same port, though it had picked a free one.
    shard1 = next(s for s in status(commands, address)["shards"] if s["name"] == "shard1")
    os.kill(shard1["pid"], signal.SIGKILL)
    assert metrics_lines(server, 4)[3] == ("shard1", urls["shard1"])
    coordinator = wait_for_metric(urls["the coordinator"], "paramserver_members_joined_total", 3, role="shard")
    assert value(coordinator, "paramserver_members_ended_total", role="shard", state="exited") == 1
    assert by_label(coordinator, "paramserver_members_ended_total", "state", role="worker") == {
        "left": 2, "dead": 0, "exited": 0}
    assert by_label(coordinator, "paramserver_members_alive", "role") == {"shard": 2, "worker": 0, "client": 0}
    assert "paramserver_rpc_server_requests_total" not in scrape(urls["shard1"])  # a new process counts afresh

    assert commands.run("ps-ctl", "--connect", address, "shutdown").returncode == 0
    assert server.wait(30) == 0, errors(server)[-3000:]
    print(f"metrics end to end: {time.monotonic() - began:.1f} s")
