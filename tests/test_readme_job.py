"""The README's first job runs as printed: its fenced ``python`` block that starts with ``# myjob.py`` is
written to a file and run as the cluster's job (``ps-server --shards 2 --job myjob.py:main``, one
``ps-worker``), and it learns."""

import json
import pathlib
import re

import pytest

from commands import errors, job_config, output, start_server, status

pytestmark = pytest.mark.timeout(240)

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 300


def readme_job() -> str:
    blocks = re.findall(r"```python\n(# myjob\.py[^\n]*\n.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1, f"README.md should have one python block starting with '# myjob.py', has {len(blocks)}"
    return blocks[0]


def test_the_readme_job_runs_as_printed(commands, tmp_path):
    job = tmp_path / "myjob.py"
    job.write_text(readme_job())
    server, address = start_server(commands, "--shards", "2", "--group-size", "1", "--job", f"{job}:main",
                                   "--job-config", job_config(steps=200))
    worker = commands.start("ps-worker", "--connect", address)
    assert worker.wait(180) == 0, errors(worker)[-3000:]
    assert "finished" in output(worker) and "at step 200" in output(worker), output(worker)
    figures = status(commands, address)["workers"][0]["metrics"]
    assert figures["steps"] == 200 and figures["sparse_steps"] == 200, json.dumps(figures)
    assert figures["loss"] < figures["first_loss"] and 0.5 < figures["auc"] <= 1, figures
    commands.run("ps-ctl", "--connect", address, "shutdown")
    assert server.wait(30) == 0, errors(server)[-3000:]


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
