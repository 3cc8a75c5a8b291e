"""The wheel installs ``paramserver`` alone: no top-level ``workers`` (or any other name) in site-packages.

The default job ships inside the package (``paramserver.jobs``); ``workers/`` stays in the checkout as the
place for a cluster's own jobs and must not be installed, where it would shadow a user's module of that name.
"""

import importlib.util
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: What a build reads, copied so that the checkout's own build/ (stale files land in a wheel) plays no part.
SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "protos", "paramserver", "workers")
#: pip's words when a build requirement cannot be fetched (no index reachable): the test cannot run here.
OFFLINE = ("No matching distribution found", "Could not find a version", "Failed to establish a new connection")


def build_wheel(tmp_path: pathlib.Path) -> pathlib.Path:
    source = tmp_path / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    # Without isolation where this environment has the build requirements (grpcio-tools makes the stubs).
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("grpc_tools") else []
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-q",
                           "--disable-pip-version-check", "-w", str(tmp_path / "dist"), *isolation],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    if done.returncode != 0 and any(words in done.stdout + done.stderr for words in OFFLINE):
        pytest.skip("the wheel's build requirements (pyproject.toml) cannot be fetched here: "
                    + (done.stdout + done.stderr).strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = list((tmp_path / "dist").glob("paramserver-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.timeout(600)
def test_the_wheel_installs_paramserver_alone(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        top_level = [name for name in names if name.endswith(".dist-info/top_level.txt")]
        declared = set(archive.read(top_level[0]).decode().split()) if top_level else None
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"paramserver"}, tops
    assert declared in (None, {"paramserver"}), declared
    # The default job ships inside the package; a cluster's own jobs (workers/) do not ship at all.
    assert "paramserver/jobs/ctr.py" in names and "paramserver/jobs/__init__.py" in names
    assert not any(name.startswith("workers/") for name in names)
