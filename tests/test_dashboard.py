"""The Grafana dashboard (deploy/grafana/paramserver.json) over the metrics the processes export: every
panel's query names metrics that exist, and, where a real Prometheus is installed (Debian's ``prometheus``
package), every query returns data from a running cluster (dynamic tables with a row store) scraped with
deploy/prometheus/prometheus.yml.
"""

import json
import pathlib
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from commands import start_server
from paramserver.processes import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "paramserver.json"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"


def queries():
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_panel_queries_metrics_that_the_processes_export():
    documented = set(re.findall(r"`(paramserver_[a-z_]+)`", (ROOT / "docs" / "metrics.md").read_text()))
    assert len(queries()) >= 10
    for title, expr in queries():
        for name in re.findall(r"paramserver_[a-z_]+", expr):
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert base in documented or f"{base}_total" in documented, (title, name)


@pytest.mark.timeout(300)
def test_every_panel_returns_data_from_a_running_cluster(commands, tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("no prometheus binary to check the dashboard against: Debian's prometheus package "
                    "(apt-get install prometheus; .ci/run installs it)")
    metrics = free_port()
    (tmp_path / "rows").mkdir()  # a row store, its memory small enough that rows spill to disk and come back
    job = {"steps": 10 ** 6, "batch_size": 256, "dynamic_tables": True, "hook": "allreduce", "log_every": 5,
           "eval_every": 10 ** 9, "holdout_size": 1000}
    server, address = start_server(commands, "--shards", "2", "--metrics-port", str(metrics), "--job-config",
                                   json.dumps(job), "--checkpoint-dir", str(tmp_path / "ckpt"),
                                   "--checkpoint-every", "20", "--row-store", str(tmp_path / "rows"),
                                   "--row-memory", "1M")
    worker_metrics = free_port()
    worker = commands.start("ps-worker", "--connect", address, "--metrics-port", str(worker_metrics))
    targets = [f"127.0.0.1:{port}" for port in (metrics, metrics + 1, metrics + 2, worker_metrics)]
    (tmp_path / "targets.json").write_text(json.dumps([{"targets": targets, "labels": {"job": "paramserver"}}]))
    config = SCRAPE_CONFIG.read_text().replace("scrape_interval: 15s", "scrape_interval: 1s") \
        .replace("refresh_interval: 30s", "refresh_interval: 1s")
    (tmp_path / "prometheus.yml").write_text(config)
    web = free_port()
    scraper = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.err", "w"))
    try:
        missing = dict(queries())
        deadline = time.monotonic() + 180
        while missing and time.monotonic() < deadline:
            time.sleep(0.5)  # prometheus scrapes every 1 s
            for title, expr in list(missing.items()):
                if _answers(web, expr):
                    del missing[title]
        assert not missing, f"panels without data after 180 s: {missing}"
    finally:
        scraper.terminate()
        scraper.wait(20)
        commands.run("ps-ctl", "--connect", address, "shutdown")
        assert server.wait(60) == 0 and worker.wait(60) == 0


def _answers(port: int, expr: str) -> bool:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            body = json.loads(answer.read())
    except OSError:
        return False  # not serving yet
    return body.get("status") == "success" and bool(body["data"]["result"])
