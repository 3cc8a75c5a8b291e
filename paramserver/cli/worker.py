"""``ps-worker``: join a cluster and run its job.

    ps-worker --connect HOST:PORT [--token-file F] [--tls-ca PEM] [--host H]

Retries an unreachable coordinator with bounded backoff (``--retry-for``),
then exits non-zero with a one-line reason.  Exit codes: 0 the job
finished, 1 it or the cluster failed, 2 refused (wrong token, bad job,
bad flags).
"""

import argparse
import datetime
import sys

from ..runtime.worker import EXIT_REFUSED, WorkerOptions, run_worker
from .common import (UsageError, add_connect, add_log_level, client_tls, command_main, coordinator_address,
                     data_plane_host, setup_logging, token_from)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connect(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="this machine's address as the shards reach it; the data plane listens there "
                             "(default 127.0.0.1)")
    parser.add_argument("--retry-for", type=float, default=30.0, metavar="SECONDS",
                        help="keep trying an unreachable coordinator this long (default 30)")
    add_log_level(parser)


def run(args) -> int:
    setup_logging("ps-worker", args)
    try:
        options = WorkerOptions(address=coordinator_address(args.connect), host=data_plane_host("--host", args.host), token=token_from(args),
                                tls=client_tls(args), retry_for=datetime.timedelta(seconds=args.retry_for))
    except UsageError as error:
        print(f"ps-worker: {error}", file=sys.stderr)
        return EXIT_REFUSED
    return run_worker(options, say=lambda line: print(line, flush=True))


def main(argv=None) -> int:
    return command_main("ps-worker", __doc__, add_arguments, run, argv)
