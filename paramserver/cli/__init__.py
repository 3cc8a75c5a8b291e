"""The command-line tools: ``ps-server``, ``ps-worker``, ``ps-ctl``.

One module per command, each with ``add_arguments(parser)``, ``run(args)``
(returns the exit code) and ``main()``; ``common`` holds the options they
share.  Commands parse and report; the work happens in
``paramserver.runtime`` and ``paramserver.control``.  Every module ends in an
``if __name__ == "__main__":`` guard, so ``python -m paramserver.cli.X`` runs
what its console script runs (``python -m paramserver COMMAND``:
``paramserver/__main__.py``).
"""

from ..logs import quiet_cpp_warnings

# Before any command imports torch: a normal end prints no C++ warnings (``logs.quiet_cpp_warnings`` says why).
quiet_cpp_warnings()
