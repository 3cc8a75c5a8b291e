"""``python -m paramserver COMMAND [ARGS...]``: the console scripts, reached through the interpreter.

Owns only the table of commands and the dispatch: ``server`` runs what
``ps-server`` runs, ``worker`` ``ps-worker``, ``ctl`` ``ps-ctl``, ``demo``
``ps-demo``, and ``export`` what ``ps-ctl export`` does (with ``--connect``
and the other connection flags after ``export``).  Each command's module is
imported only when named, so ``python -m paramserver ctl`` starts as fast as
``ps-ctl``.  ``python -m paramserver.cli.X`` runs the same ``main``.

Exit codes are the command's; 2 for a command not in the table.
"""

import importlib
import sys

#: Command -> the module whose ``main(argv)`` runs it.
COMMANDS = {
    "server": "paramserver.cli.server",
    "worker": "paramserver.cli.worker",
    "ctl": "paramserver.cli.ctl",
    "demo": "paramserver.cli.demo",
    "export": "paramserver.cli.export",
}

USAGE = (f"usage: python -m paramserver {{{','.join(COMMANDS)}}} [ARGS...]\n"
         "  server  ps-server: the coordinator and its shards\n"
         "  worker  ps-worker: a trainer that joins a cluster\n"
         "  ctl     ps-ctl: look at and steer a running cluster\n"
         "  demo    ps-demo: a whole cluster on this machine\n"
         "  export  ps-ctl export: write the trained model as plain files\n"
         "`python -m paramserver COMMAND --help` for a command's flags.")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"python -m paramserver: unknown command {command!r}; choose one of {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[command]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
