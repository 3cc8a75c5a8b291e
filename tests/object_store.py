"""A real S3 API on loopback for the tests: moto's server in a thread of the test process.

``S3Store`` starts one server (a free port, credentials that it accepts, one bucket per test) and
says how to reach it: ``storage_options`` for a call that takes them, ``environment`` for child
processes (fsspec reads ``FSSPEC_S3_ENDPOINT_URL`` and the standard ``AWS_*`` variables), and
``url(...)`` for a path in the test's bucket.  ``stop()`` takes the server away (unreachable storage).
"""

import itertools
import logging
from typing import Dict

from moto.server import ThreadedMotoServer

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "paramserver-test", "AWS_SECRET_ACCESS_KEY": "paramserver-test",
               "AWS_DEFAULT_REGION": "us-east-1"}


class S3Store:
    """One moto S3 server on 127.0.0.1; ``new_bucket()`` gives each test a bucket of its own."""

    _buckets = itertools.count()

    def __init__(self):
        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access line per request otherwise
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.running = True

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
        if self.running:
            self._server.stop()
            self.running = False
