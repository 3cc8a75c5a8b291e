"""Where a path or URL points: a ``Location`` (an fsspec filesystem and a path on it).

Owns turning what a user names (a local path, ``file://...``, ``s3://bucket/prefix``, ``gs://...``, any
protocol fsspec knows) into one object that every reader and writer of the framework takes, so that
checkpoints, data, exports and serving accept the same names.  A plain path is made absolute here (a
relative path means the caller's working directory, wherever the name is handed on to); a URL is kept
as given.

Options for a remote filesystem come from fsspec's own configuration (``FSSPEC_S3_ENDPOINT_URL``, the
standard ``AWS_*`` variables, fsspec's config files) and from ``storage_options`` (a mapping, or the JSON
text of a ``--storage-options`` flag, ``parse_storage_options``); explicit options win.  A protocol whose
implementation is not installed is a ``MissingStorageExtra`` naming the URL and the ``pip install`` that
brings it.  A remote filesystem's own failures (unreachable, credentials refused: an ``OSError`` or its
client's error, ``botocore``'s for S3) become one ``StorageUnavailable`` naming the URL and what was being
done (``failures_named``).  Imports nothing of the package: every floor may use it.
"""

import contextlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple, Union

import fsspec
from fsspec.core import split_protocol, url_to_fs
from fsspec.implementations.local import LocalFileSystem

PathOrUrl = Union[str, "os.PathLike[str]", "Location"]

#: The package extra that brings a protocol's implementation (``pip install 'paramserver[s3]'``).
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


class MissingStorageExtra(ImportError):
    """A URL's protocol needs a package that is not installed (``s3fs`` for ``s3://``, ...)."""


class StorageUnavailable(OSError):
    """A remote filesystem failed an operation: unreachable, credentials refused, ...; the message names the URL."""


@dataclass(frozen=True)
class Location:
    """A file or directory: ``url`` as the user would write it, ``fs`` (an fsspec filesystem), ``path`` on it.

    ``storage_options`` are kept so that a location can be handed to another process as
    ``(url, storage_options)`` and found there again with ``locate``.
    """

    url: str
    fs: Any = field(compare=False, repr=False)
    path: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_local(self) -> bool:
        """On this host's file system (where ``os``/``open`` see the same file)."""
        return isinstance(self.fs, LocalFileSystem)

    @property
    def name(self) -> str:
        """The last part of the path (a file's or directory's own name)."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def join(self, *parts: str) -> "Location":
        """The location ``parts`` below this one (``/``-separated, whatever the filesystem)."""
        suffix = "/".join(str(part).strip("/") for part in parts if str(part))
        if not suffix:
            return self
        return Location(url=f"{self.url.rstrip('/')}/{suffix}", fs=self.fs,
                        path=f"{self.path.rstrip('/')}/{suffix}", storage_options=self.storage_options)

    def parent(self) -> "Location":
        """The directory holding this location."""
        url, path = self.url.rstrip("/"), self.path.rstrip("/")
        return Location(url=url.rsplit("/", 1)[0] or "/", fs=self.fs, path=path.rsplit("/", 1)[0] or "/",
                        storage_options=self.storage_options)

    def open(self, mode: str = "rb", **kwargs):
        """The file here, opened through its filesystem (a plain file object for a local path)."""
        return self.fs.open(self.path, mode, **kwargs)

    def exists(self) -> bool:
        return self.fs.exists(self.path)

    def __truediv__(self, part: str) -> "Location":
        return self.join(part)

    def __fspath__(self) -> str:
        """The local path (so that ``open``, ``os`` and ``pathlib`` take a local location); a remote one has none."""
        if not self.is_local:
            raise TypeError(f"{self.url} is not on this host's file system")
        return self.path

    def __str__(self) -> str:
        return self.url


def parse_storage_options(text: Optional[str]) -> Dict[str, Any]:
    """The options of a ``--storage-options JSON`` flag: a JSON object (``{}`` for nothing given)."""
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--storage-options must be a JSON object, got {text!r}: {error}") from None
    if not isinstance(options, dict):
        raise ValueError(f"--storage-options must be a JSON object, got {type(options).__name__}: {text!r}")
    return options


def locate(name: PathOrUrl, storage_options: Optional[Mapping[str, Any]] = None) -> Location:
    """The ``Location`` ``name`` points at; a ``Location`` is returned as it is.

    A plain path (or ``file://``) becomes an absolute local path; a URL keeps its protocol.  Raises
    ``MissingStorageExtra`` when the protocol's package is missing and ``ValueError`` for a protocol
    fsspec does not know or an empty name.
    """
    if isinstance(name, Location):
        return name
    text = os.fspath(name)
    if not text:
        raise ValueError("an empty path names no file or directory")
    options = dict(storage_options or {})
    protocol, rest = split_protocol(text)
    if protocol in (None, "file", "local"):
        path = os.path.abspath(os.path.expanduser(rest))
        return Location(url=path, fs=LocalFileSystem(), path=path, storage_options=options)
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as error:
        extra = EXTRAS.get(protocol)
        hint = f"pip install 'paramserver[{extra}]'" if extra else f"install fsspec's package for {protocol!r}"
        raise MissingStorageExtra(f"{text}: the {protocol}:// protocol needs a package that is not installed "
                                  f"({hint}): {error}") from error
    except ValueError as error:
        raise ValueError(f"{text}: unknown storage protocol {protocol!r} ({error})") from None
    fs, path = url_to_fs(text, **options)
    return Location(url=text, fs=fs, path=path, storage_options=options)


def _client_failures() -> Tuple[type, ...]:
    """The error types remote filesystems' clients raise besides ``OSError`` (those of the installed ones)."""
    failures: Tuple[type, ...] = (OSError,)
    with contextlib.suppress(ImportError):
        import botocore.exceptions
        failures += (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
    return failures


@contextlib.contextmanager
def failures_named(location: Location, doing: str, absent_is_failure: bool = False) -> Iterator[None]:
    """Inside it, a remote filesystem's failure is a ``StorageUnavailable``: ``"<url>: cannot <doing>: <why>"``.

    ``FileNotFoundError`` (something absent, an answer the caller acts on; unless ``absent_is_failure``: a
    write into a bucket that does not exist) and a local location's errors (they name their path already)
    pass as they are.
    """
    if location.is_local:
        yield
        return
    try:
        yield
    except StorageUnavailable:
        raise
    except FileNotFoundError as error:
        if not absent_is_failure:
            raise
        raise _unavailable(location, doing, error) from error
    except _client_failures() as error:
        raise _unavailable(location, doing, error) from error


def _unavailable(location: Location, doing: str, error: BaseException) -> StorageUnavailable:
    why = " ".join(str(error).split()) or "no reason given"
    return StorageUnavailable(f"{location.url}: cannot {doing}: {type(error).__name__}: {why}")
