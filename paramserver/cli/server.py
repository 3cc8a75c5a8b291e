"""``ps-server``: start a cluster's coordinator and its shard servers on this machine.

    ps-server --shards 4 [--host H] [--port P] [--job JOB] [--job-config JSON] [--group-size N]
              [--checkpoint-dir D [--checkpoint-every STEPS|SECONDSs] [--checkpoint-keep K]] [--restore D]
              [--token-file F] [--tls-cert C --tls-key K] [--heartbeat-timeout S] [--metrics-port P]

Prints ``ps-server ready at HOST:PORT (...)`` once every shard has joined;
SIGTERM/SIGINT (or ``ps-ctl shutdown``) stops members, shards and itself.
"""

import argparse
import datetime
import math
import sys
from typing import Optional

from ..control import DEFAULT_PORT, CoordinatorSettings, TlsFiles
from ..control.checkpoints import CheckpointOptions
from ..control.protocol import HEARTBEAT_INTERVAL
from ..runtime.job import DEFAULT_JOB, JobError, pack_job
from ..runtime.server import ServerOptions, serve
from .common import (UsageError, add_log_level, add_metrics_port, add_token_file, command_main, data_plane_host,
                     job_config_from, metrics_port_from, setup_logging, token_from)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shards", type=int, default=1, metavar="N", help="shard server processes to run (default 1)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on, for the coordinator, the store and the shards (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"coordinator port (default {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--job", default=DEFAULT_JOB,
                        help=f"what workers run: package.module:function or file.py:function (default {DEFAULT_JOB})")
    parser.add_argument("--job-config", default="{}", metavar="JSON",
                        help="keyword arguments for the job, a JSON object")
    parser.add_argument("--group-size", type=int, default=0, metavar="N",
                        help="workers per trainer group, each one DDP process group (default 0: every worker "
                             "in one group)")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="write checkpoints under DIR (one path every member reaches); a shard process "
                             "that dies is restarted from the newest one")
    parser.add_argument("--checkpoint-every", metavar="N|Ns", default=None,
                        help="checkpoint every N training steps (500) or every N seconds (300s)")
    parser.add_argument("--checkpoint-keep", type=int, default=3, metavar="K",
                        help="complete checkpoints to keep (default 3); older ones are deleted")
    parser.add_argument("--restore", metavar="DIR",
                        help="start from a checkpoint: a checkpoint directory, or a checkpoint root (its newest "
                             "valid checkpoint); the number of shards may differ from the one that wrote it")
    add_token_file(parser)
    parser.add_argument("--tls-cert", metavar="PEM", help="serve TLS only, with this certificate")
    parser.add_argument("--tls-key", metavar="PEM", help="the certificate's private key")
    parser.add_argument("--heartbeat-timeout", type=float, default=None, metavar="SECONDS",
                        help="declare a member dead after this long without a heartbeat "
                             "(default 5, or $PARAMSERVER_HEARTBEAT_TIMEOUT)")
    add_metrics_port(parser, "the coordinator on P, shard i on P+1+i")
    add_log_level(parser)


def options_from(args) -> ServerOptions:
    data_plane_host("--host", args.host)
    if args.shards < 1:
        raise UsageError(f"--shards must be at least 1, got {args.shards}")
    if not 0 <= args.port < 65536:
        raise UsageError(f"--port must be 0-65535, got {args.port}")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise UsageError("--tls-cert and --tls-key go together")
    config = job_config_from(args.job_config)
    if args.group_size < 0:
        raise UsageError(f"--group-size must be 0 (one group of every worker) or positive, got {args.group_size}")
    try:
        job = pack_job(args.job, config, group_size=args.group_size)
    except JobError as error:
        raise UsageError(f"--job: {error}") from error
    settings = dict(host=args.host, port=args.port, token=token_from(args), job=job,
                    tls=TlsFiles(cert=args.tls_cert, key=args.tls_key) if args.tls_cert else None,
                    checkpoints=checkpoint_options_from(args))
    if args.heartbeat_timeout is not None:
        timeout = datetime.timedelta(seconds=args.heartbeat_timeout)
        if timeout <= HEARTBEAT_INTERVAL:
            raise UsageError(f"--heartbeat-timeout must exceed the {HEARTBEAT_INTERVAL.total_seconds():.0f} s "
                             f"heartbeat interval, got {args.heartbeat_timeout}")
        settings["heartbeat_timeout"] = timeout
    return ServerOptions(num_shards=args.shards, coordinator=CoordinatorSettings(**settings),
                         log_level=args.log_level, metrics_port=metrics_port_from(args, 1 + args.shards))


def checkpoint_options_from(args) -> Optional[CheckpointOptions]:
    if args.checkpoint_keep < 1:
        raise UsageError(f"--checkpoint-keep must be at least 1, got {args.checkpoint_keep}")
    if not args.checkpoint_dir and not args.restore:
        if args.checkpoint_every is not None:
            raise UsageError("--checkpoint-every needs --checkpoint-dir")
        return None
    every_steps, every_seconds = 0, 0.0
    if args.checkpoint_every is not None:
        text = args.checkpoint_every.strip()
        try:
            if text.endswith("s"):
                every_seconds = float(text[:-1])
                valid = every_seconds > 0 and math.isfinite(every_seconds)
            else:
                every_steps = int(text)
                valid = every_steps > 0
        except ValueError:
            valid = False
        if not valid:
            raise UsageError(f"--checkpoint-every must be a positive number of steps (500) or seconds (300s), "
                             f"got {args.checkpoint_every!r}")
    return CheckpointOptions(directory=args.checkpoint_dir, every_steps=every_steps, every_seconds=every_seconds,
                             keep=args.checkpoint_keep, restore=args.restore)


def run(args) -> int:
    setup_logging("ps-server", args)
    try:
        options = options_from(args)
    except UsageError as error:
        print(f"ps-server: {error}", file=sys.stderr)
        return 2
    try:
        return serve(options)
    except (OSError, ValueError) as error:
        print(f"ps-server: {error}", file=sys.stderr)
        return 1


def main(argv=None) -> int:
    return command_main("ps-server", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
