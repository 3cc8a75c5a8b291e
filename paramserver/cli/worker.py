"""``ps-worker``: join a cluster and run its job.

    ps-worker --connect HOST:PORT [--token-file F] [--tls-ca PEM] [--host H] [--coordinator-grace S]
              [--comm-hook NAME [--comm-hook-option KEY=VALUE ...]] [--metrics-port P]

Retries an unreachable coordinator with bounded backoff (``--retry-for``),
then exits non-zero with a one-line reason.  Once joined, the job trains on
while the coordinator does not answer, for ``--coordinator-grace`` (60 s by
default: a coordinator started again takes the worker back), then exits 1
saying the cluster was lost.  Exit codes: 0 the job
finished, 1 it or the cluster failed, 2 refused (wrong token, bad job,
bad flags).  ``--comm-hook`` overrides the job's ``hook`` (the DDP comm
hook of its trainer group: every member of a group must use the same).
"""

import argparse
import datetime
import json
import sys

from ..logs import exit_now
from ..runtime.exit_codes import EXIT_REFUSED
from ..runtime.worker import WorkerOptions, run_worker
from .common import (UsageError, add_connect, add_coordinator_grace, coordinator_grace_from, add_log_level, add_metrics_port, add_threads, client_tls,
                     command_main, coordinator_address, metrics_port_from, own_host, setup_logging, threads_from,
                     token_from)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connect(parser)
    parser.add_argument("--host", default=None,
                        help="this machine's address as the shards reach it; the data plane listens there "
                             "(default: the address of the interface facing the coordinator)")
    parser.add_argument("--retry-for", type=float, default=None, metavar="SECONDS",
                        help="keep trying to join an unreachable coordinator this long (default: the "
                             "--coordinator-grace, so a worker started while the coordinator is being started "
                             "again joins once it is back)")
    add_coordinator_grace(parser, "the job trains on")
    parser.add_argument("--comm-hook", metavar="NAME",
                        help="DDP comm hook for the job's trainer group (allreduce, fp16, bf16, powersgd, "
                             "batched_powersgd, fp16_powersgd, bf16_powersgd, noop); default: the job's")
    parser.add_argument("--comm-hook-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of the comm hook (matrix_approximation_rank=2, start_powerSGD_iter=10...: torch's PowerSGDState names); repeatable")
    add_metrics_port(parser, "this worker's RPCs, training and job figures")
    add_threads(parser, "this worker")
    add_log_level(parser)


def run(args) -> int:
    setup_logging("ps-worker", args)
    try:
        threads_from(args)
        address = coordinator_address(args.connect)
        options = WorkerOptions(address=address, host=own_host(args.host, address),
                                token=token_from(args), tls=client_tls(args),
                                retry_for=(datetime.timedelta(seconds=args.retry_for)
                                           if args.retry_for is not None else None),
                                config_overrides=hook_overrides(args.comm_hook, args.comm_hook_option),
                                metrics_port=metrics_port_from(args),
                                coordinator_grace=coordinator_grace_from(args))
    except UsageError as error:
        print(f"ps-worker: {error}", file=sys.stderr)
        return EXIT_REFUSED
    code = run_worker(options, say=lambda line: print(line, flush=True))
    # The worker has left everything by now (coordinator, data plane, trainer group): end without the
    # interpreter's teardown, where a torch thread left joinable can abort the process (seen once on a loaded
    # machine after a clean finish: "terminate called without an active exception", exit -6).
    exit_now(code)
    return code  # not reached


def hook_overrides(hook, options) -> dict:
    """The job arguments that ``--comm-hook`` and ``--comm-hook-option`` set."""
    if options and not hook:
        raise UsageError("--comm-hook-option needs --comm-hook")
    if not hook:
        return {}
    from ..ddp.hooks import HOOK_NAMES
    if hook not in HOOK_NAMES:
        raise UsageError(f"--comm-hook {hook!r}: choose one of {', '.join(HOOK_NAMES)}")
    parsed = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key:
            raise UsageError(f"--comm-hook-option {option!r} is not KEY=VALUE")
        try:
            parsed[key] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key] = value
    return {"hook": hook, "hook_options": parsed}


def main(argv=None) -> int:
    return command_main("ps-worker", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
