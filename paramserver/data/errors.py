"""What goes wrong with input files, as exception types that name the file and the place.

Owns the errors of ``paramserver.data``: ``MalformedInput`` (a line or
row that does not fit the format: file, line or row, column and why) and
``UnreadableFile`` (a file that cannot be opened or read: its path and
the system's reason).  Both are ``ValueError``s, so that a job can tell
bad data from a bug by type.
"""

from typing import Optional


class MalformedInput(ValueError):
    """A line (text files) or row (Parquet) that does not fit its format."""

    def __init__(self, path: str, place: str, reason: str, column: Optional[str] = None):
        self.path, self.place, self.reason, self.column = path, place, reason, column
        where = f"{path}, {place}" + (f", column {column}" if column else "")
        super().__init__(f"{where}: {reason} (skip_malformed=True skips such input and counts it)")


class UnreadableFile(ValueError):
    """A file that cannot be found, opened or read (``__cause__`` is the system's error)."""

    def __init__(self, path: str, reason: str):
        self.path = path
        super().__init__(f"{path}: cannot read it: {reason}")
