"""The README's first job runs as printed: its fenced ``python`` block that starts with ``# myjob.py`` is
written to a file and run as the cluster's job, started by hand as the README says (``ps-server --shards 2
--job myjob.py:main``, two ``ps-worker``, nothing in the environment): it learns, each worker's threads are
those ``ps-demo`` would give it, and its normal end prints no error or warning anywhere."""

import json
import pathlib
import re

import pytest

from commands import errors, job_config, output, start_server, status
from paramserver.logs import CPP_LOG_LEVEL_ENV
from paramserver.runtime.threads import HOST_PROCESSES_ENV, INTEROP_THREADS_ENV, THREADS_ENV, choose_threads

pytestmark = pytest.mark.timeout(240)

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 300


def readme_job() -> str:
    blocks = re.findall(r"```python\n(# myjob\.py[^\n]*\n.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1, f"README.md should have one python block starting with '# myjob.py', has {len(blocks)}"
    return blocks[0]


def test_the_readme_job_runs_as_printed(commands, tmp_path, monkeypatch):
    for name in (HOST_PROCESSES_ENV, THREADS_ENV, INTEROP_THREADS_ENV, CPP_LOG_LEVEL_ENV):
        monkeypatch.delenv(name, raising=False)  # started by hand, as a new user would: nothing set
    job = tmp_path / "myjob.py"
    job.write_text(readme_job())
    server, address = start_server(commands, "--shards", "2", "--job", f"{job}:main",
                                   "--job-config", job_config(steps=200))
    workers = [commands.start("ps-worker", "--connect", address) for _ in range(2)]
    for worker in workers:
        assert worker.wait(180) == 0, errors(worker)[-3000:]
        assert "finished" in output(worker) and "at step 200" in output(worker), output(worker)
    figures = {w["name"]: w["metrics"] for w in status(commands, address)["workers"]}
    for figure in figures.values():
        assert figure["steps"] == 200 and figure["sparse_steps"] == 200, json.dumps(figure)
        assert figure["loss"] < figure["first_loss"], figure
    assert 0.5 < figures["worker0"]["auc"] <= 1, figures  # group rank 0 evaluates
    # Each worker's threads are those ps-demo gives on this host (coordinator, 2 shards, 2 workers): the
    # coordinator counted the processes that share it, though each was started alone.
    demo = choose_threads("worker", {HOST_PROCESSES_ENV: "5"})
    for worker in workers:
        counts = re.findall(r"ps-worker: (?:now )?(\d+) intra-op and \d+ inter-op threads", errors(worker))
        assert counts and int(counts[-1]) == demo.intra_op, errors(worker)[-3000:]
    shutdown = commands.run("ps-ctl", "--connect", address, "shutdown")
    assert shutdown.returncode == 0, shutdown.stderr
    assert server.wait(30) == 0, errors(server)[-3000:]
    # A normal end prints no error and no warning, in any process (the shards log to the server's stderr).
    for process, text in ((server, output(server) + errors(server)), (shutdown, shutdown.stdout + shutdown.stderr),
                          *((worker, output(worker) + errors(worker)) for worker in workers)):
        noise = [line for line in text.splitlines() if "error" in line or "Warning" in line or " WARNING " in line]
        assert noise == [], (getattr(process, "args", process), noise[:5])


def heading_anchors(page: pathlib.Path) -> set:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.timeout(30)
def test_the_readme_is_short_and_its_links_and_the_docs_links_hold():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) > 1, "docs/ has the reference pages"
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # an external address
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.relative_to(ROOT)} links to {target}, which does not exist"
            if anchor and linked.suffix == ".md":
                assert anchor in heading_anchors(linked), f"{page.relative_to(ROOT)} links to {target}: no such heading"
