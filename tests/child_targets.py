"""Child-process targets for the process-launcher tests (stdlib only, so children start fast)."""

import sys
import time


def exit_with(code: int) -> None:
    sys.exit(code)


def sleep_for(seconds: float) -> None:
    time.sleep(seconds)


def exit_with_variable(name: str) -> None:
    """Exit with the integer in environment variable ``name`` (0 when unset)."""
    import os
    sys.exit(int(os.environ.get(name, "0")))
