"""``ps-ctl export``: write the trained model as plain files, from a checkpoint or from a live cluster.

    ps-ctl export DIR --checkpoint-dir D [--delta] [--storage-options JSON]
    ps-ctl --connect HOST:PORT [--token-file F] [--admin-token-file A] [--tls-ca PEM] export DIR [--delta] [--timeout S] [--storage-options JSON]

Owns the command's flags and what it prints; the export itself is
``paramserver.checkpoint.export``'s.  With ``--checkpoint-dir`` (a
checkpoint directory, or a root as ``ps-server --checkpoint-dir`` writes
them: its newest valid checkpoint) no cluster is needed; with
``--connect`` the cluster writes a checkpoint now, waited for up to
``--timeout``, and that one is exported (read where the cluster wrote it).
``DIR`` and ``D`` are paths or fsspec URLs (``s3://bucket/models/ctr``);
``--storage-options`` configures their filesystem (both alike).

``--delta``: ``DIR`` is a chain of live exports (as ``ps-server --export-dir``
writes, and ``serving.load``/``refresh()`` follow): the checkpoint is
appended to it as a delta holding only the rows that differ from what the
chain serves now (a base when ``DIR`` has no chain yet;
``paramserver.checkpoint.chain_append``).

Prints ``exported step N of CHECKPOINT to DIR: ...`` (with ``--delta``:
``appended step N of CHECKPOINT to DIR as a delta NAME: K of M rows``).  Exit codes: 0
exported, 1 not exported (no checkpoint, a damaged file, a checkpoint that
cannot be exported, the cluster failed or gave no answer), 2 refused (bad
flags, a missing or wrong token, no ``--admin-token-file`` where the cluster
has an admin token).
"""

import argparse
import sys

from ..control import CoordinatorError
from ..control.protocol import CHECKPOINT_WAIT
from ..runtime.exit_codes import EXIT_FAILED, EXIT_OK, EXIT_REFUSED
from .common import (UsageError, add_connect, add_log_level, add_storage_options, command_main, coordinator_client,
                     exit_code_for, location_from, setup_logging, timeout_from)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR",
                        help="where to write the export (made if missing; an earlier export there is replaced)")
    parser.add_argument("--checkpoint-dir", metavar="D",
                        help="export this checkpoint directory, or the newest valid checkpoint under this root "
                             "(ps-server's --checkpoint-dir); without it, ask the cluster at --connect for one")
    parser.add_argument("--timeout", type=float, default=CHECKPOINT_WAIT.total_seconds(), metavar="SECONDS",
                        help="with --connect: how long to wait for the checkpoint (default "
                             f"{CHECKPOINT_WAIT.total_seconds():.0f})")
    parser.add_argument("--delta", action="store_true",
                        help="append to the chain of live exports in DIR: a delta of the rows changed since its "
                             "newest export (a base when DIR has none), which serving.load and refresh() follow")
    add_storage_options(parser, "DIR and --checkpoint-dir")


def run(args) -> int:
    try:
        if args.checkpoint_dir and args.connect:
            raise UsageError("export takes --checkpoint-dir or --connect, not both")
        if not args.checkpoint_dir and not args.connect:
            raise UsageError("export needs --checkpoint-dir D (a checkpoint, or a root of them), or --connect "
                             "HOST:PORT (a live cluster)")
        timeout = timeout_from(args)
        out = location_from("export DIR", args.directory, args)
        source = location_from("--checkpoint-dir", args.checkpoint_dir, args) if args.checkpoint_dir else None
        client = None if args.checkpoint_dir else coordinator_client(args)
    except UsageError as error:
        print(f"ps-ctl: {error}", file=sys.stderr)
        return EXIT_REFUSED
    # torch and the checkpoint formats load here, for this command only: ps-ctl's others start in a fraction
    # of the time without them.
    from ..checkpoint.chain_append import append_checkpoint
    from ..checkpoint.export import export_checkpoint, export_from_cluster
    write = append_checkpoint if args.delta else export_checkpoint
    try:
        if client is None:
            manifest = write(source, out)
        else:
            manifest = export_from_cluster(client, out, timeout, out.storage_options, write=write)
    except (CoordinatorError, OSError, ValueError) as error:  # ValueError: CorruptCheckpoint, NotExportable
        print(f"ps-ctl: export failed: {error}", file=sys.stderr)
        return exit_code_for(error) if isinstance(error, CoordinatorError) else EXIT_FAILED
    finally:
        if client is not None:
            client.close()
    if args.delta:
        print(f"appended step {manifest['step']} of {manifest['checkpoint']} to {args.directory} as a "
              f"{manifest['kind']} {manifest['name']}: "
              f"{manifest['changed_rows']} of {manifest['rows']} rows")
        return EXIT_OK
    tables = ", ".join(f"{name} ({table['kind']}, {table['rows']} x {table['dim']})"
                       for name, table in manifest["tables"].items())
    print(f"exported step {manifest['step']} of {manifest['checkpoint']} to {args.directory}: {tables}; dense "
          f"{manifest['dense']['class']}")
    return EXIT_OK


def add_standalone_arguments(parser: argparse.ArgumentParser) -> None:
    """``python -m paramserver export``'s flags: ``ps-ctl``'s connection flags, then export's own."""
    add_connect(parser, required=False, when=" (unless --checkpoint-dir)")
    add_log_level(parser)
    add_arguments(parser)
    parser.set_defaults(command="export")


def run_standalone(args) -> int:
    setup_logging("ps-ctl", args)
    return run(args)


def main(argv=None) -> int:
    """``python -m paramserver export`` / ``python -m paramserver.cli.export``: ``ps-ctl export`` with the
    connection flags after ``export``."""
    return command_main("python -m paramserver export", __doc__, add_standalone_arguments, run_standalone, argv)


if __name__ == "__main__":
    sys.exit(main())
