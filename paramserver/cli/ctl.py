"""``ps-ctl``: look at and steer a running cluster.

    ps-ctl --connect HOST:PORT [--token-file F] [--admin-token-file A] [--tls-ca PEM] status [--json]
    ps-ctl --connect HOST:PORT ... checkpoint [--timeout S]
    ps-ctl --connect HOST:PORT ... shutdown
    ps-ctl [--connect HOST:PORT ...] export DIR [--checkpoint-dir D] [--timeout S]

``checkpoint`` prints the checkpoint written, or at once why it was not
(the writer's one-line reason), or that no answer came in time.  With no
trainer training (the job ended, or none joined yet) it answers at once
with the newest committed checkpoint, saying so; ``export`` through the
cluster exports that one.
``export`` is ``paramserver.cli.export``'s; it needs no ``--connect``
when given ``--checkpoint-dir``.  ``checkpoint``, ``shutdown`` and
``export`` through the cluster need ``--admin-token-file`` where the
coordinator has an admin token; ``status`` needs the cluster token alone.

Exit codes (``runtime.exit_codes``): 0 done; 1 the coordinator failed the
command (a checkpoint not written), was unreachable or gave no answer; 2
refused: bad flags, a missing or wrong token, no admin token for a command
that needs it.  This module imports neither torch nor the data plane (only
``export`` loads them, when it runs).
"""

import argparse
import json
import sys

from google.protobuf.json_format import MessageToDict

from ..control import CoordinatorError, pb
from ..control.protocol import CHECKPOINT_WAIT, ROLE_NAMES
from ..runtime.exit_codes import EXIT_OK, EXIT_REFUSED
from . import export
from .common import (UsageError, add_admin_token_file, add_connect, add_log_level, command_main,
                     coordinator_client, exit_code_for, setup_logging, timeout_from)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_connect(parser, required=False, when=" (every command needs it but export --checkpoint-dir)")
    add_admin_token_file(parser, "file holding the admin token, which checkpoint, shutdown and export through "
                                 "the cluster carry (where the coordinator has one; status needs none)")
    add_log_level(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status = commands.add_parser("status", help="members, their liveness and progress; the generation")
    status.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    checkpoint = commands.add_parser("checkpoint", help="write a checkpoint now; waits until it is committed")
    checkpoint.add_argument("--timeout", type=float, default=CHECKPOINT_WAIT.total_seconds(), metavar="SECONDS",
                            help=f"give up after this long (default {CHECKPOINT_WAIT.total_seconds():.0f})")
    commands.add_parser("shutdown", help="stop the workers, the shards and the server")
    export.add_arguments(commands.add_parser(
        "export", help="write the trained model as plain files (from --checkpoint-dir, or the live cluster)"))


def status_as_dict(response: pb.StatusResponse) -> dict:
    """The JSON shape of ``status --json``: every field, names as in the proto, defaults included;
    64-bit counters as JSON numbers (protobuf's JSON mapping would quote them)."""
    status = MessageToDict(response, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    status["generation"] = response.generation
    for key in ("shards", "workers", "clients"):
        for entry, member in zip(status[key], getattr(response, key)):
            entry.update(step=member.step, joined_generation=member.joined_generation,
                         role=ROLE_NAMES[member.role])
    return status


def format_status(response: pb.StatusResponse) -> str:
    lines = [f"generation {response.generation}{'  (shutting down)' if response.stopping else ''}"
             f"   job {response.job or '-'}   store {response.store.host}:{response.store.port}"]
    for title, members in (("shards", response.shards), ("workers", response.workers), ("clients", response.clients)):
        # Counted by name: a restarted shard's exited process is listed too, under the name its new one serves.
        named, alive = {m.name for m in members}, {m.name for m in members if m.alive}
        lines.append(f"{title} ({len(alive)} alive of {len(named)})")
        for m in members:
            figures = " ".join(f"{k}={_figure(v)}" for k, v in sorted(m.metrics.items()))
            if not m.alive and m.reason:
                figures = f"{figures}  ({m.reason})".lstrip()
            lines.append(f"  {m.name:<10} {m.state:<7} {m.host:<15} pid {m.pid:<7} step {m.step:<7} "
                         f"last heartbeat {m.seconds_since_heartbeat:5.1f} s ago  {figures}".rstrip())
    gone = set(response.trainer_groups_gone)
    for view in response.groups:
        lines.append(f"trainer group {view.group}: generation {view.generation}, {view.backend}, "
                     f"ranks {', '.join(view.members) or '-'}"
                     + ("  (gone: no live worker; others take over its followed parts)" if view.group in gone else ""))
    return "\n".join(lines)


def _figure(value: float) -> str:
    """A whole number in full (a shard's ``dynamic.rows`` in memory, ``dynamic.rows_on_disk`` in its row store,
    ``dynamic.bytes``...), anything else to 4 digits."""
    return f"{value:.0f}" if value.is_integer() and abs(value) < 1e15 else f"{value:.4g}"


def run(args) -> int:
    setup_logging("ps-ctl", args)
    if args.command == "export":
        return export.run(args)
    try:
        timeout = timeout_from(args) if args.command == "checkpoint" else None
        client = coordinator_client(args)
    except UsageError as error:
        print(f"ps-ctl: {error}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        if args.command == "status":
            response = client.status()
            print(json.dumps(status_as_dict(response)) if args.json else format_status(response))
        elif args.command == "checkpoint":
            done = client.checkpoint(timeout.total_seconds())
            if done.no_group_training:
                print(f"no trainer group is training: the newest checkpoint is {done.checkpoint_id}, written at "
                      f"step {done.step}: {done.directory}")
            else:
                print(f"checkpoint {done.checkpoint_id} written at step {done.step}: {done.directory}")
        elif args.command == "shutdown":
            client.shutdown("ps-ctl shutdown")
            print(f"cluster at {client.address} is shutting down")
    except CoordinatorError as error:
        print(f"ps-ctl: {error}", file=sys.stderr)
        return exit_code_for(error)
    finally:
        client.close()
    return EXIT_OK


def main(argv=None) -> int:
    return command_main("ps-ctl", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
