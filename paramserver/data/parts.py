"""Which files a reader reads and how they are shared among workers: ``InputFiles``, ``Part``s, and reading
a text part.

Owns naming the input (a path, a glob, a directory or prefix, or a list of them, on any storage fsspec
reaches: ``s3://bucket/data/*/part-*.gz`` as well as a local path; ``InputFiles``), listing it (each
pattern's matches sorted; nothing found is an error naming the pattern, unless the reader follows new
files), cutting it into parts, giving each worker its own (``parts_of``: worker ``w`` of ``n`` takes parts
``w, w + n, ...``; every part goes to exactly one worker), and reading a text part as chunks of whole
lines (``text_chunks``).

A plain text file is cut by bytes into ranges of at most ``PART_BYTES``
and at least as many as there are workers, so that one large file is
shared by all of them; a line belongs to the range holding its first
byte.  A compressed file (``.gz``, ``.bz2``, ``.zst``, ``.lz4``) cannot be
entered in the middle, so it is one part.  A Parquet file gives one part
per row group.

Which listed files are complete (``InputFiles.ready``): writers such as Spark, Flink and Hadoop's tools
write a file under a temporary or hidden name and give it its final name once it is whole, so a file
whose name (or a directory on its way below the pattern's root) starts with ``_`` or ``.``, or ends with
``.tmp``, ``.inprogress`` or ``._COPYING_``, is not read when a glob or directory finds it (naming it
exactly still reads it); an object store shows an object only once its upload completed.  With
``ready_marker`` (for example ``"_SUCCESS"``, which Spark and Hadoop write last), a file is read only once
its directory holds that marker.
"""

import glob
import math
import os
import posixpath
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import pyarrow as pa

from ..filesystems import Location, failures_named, locate
from .errors import UnreadableFile

#: Text parts are at most this long (bytes), so that workers get similar shares.
PART_BYTES = 256 << 20
#: A text chunk (parsed at once) is about this long (bytes), cut after its last whole line.
CHUNK_BYTES = 4 << 20
#: ... except the first one of a reading, so that its first batch is parsed soon (a file that just landed,
#: a job starting): about 4,000 Criteo lines, parsed in a quarter of a 4 MiB chunk's time.
FIRST_CHUNK_BYTES = 1 << 20
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}
#: Names writers give files still being written (see the module's text).
UNFINISHED_SUFFIXES = (".tmp", ".inprogress", "._COPYING_")


@dataclass(frozen=True)
class Part:
    """Bytes ``[start, stop)`` of a text file (``stop`` None: to its end), or row group ``row_group`` of a
    Parquet file."""

    path: str
    start: int = 0
    stop: Optional[int] = None
    row_group: Optional[int] = None

    def describe(self) -> str:
        if self.row_group is not None:
            return f"{self.path} row group {self.row_group}"
        return self.path if self.start == 0 and self.stop is None else f"{self.path} bytes {self.start}-{self.stop}"

    @property
    def key(self) -> str:
        """A name for the part that stays the same however the files are listed (a followed input's position
        names parts by it)."""
        if self.row_group is not None:
            return f"{self.path}#{self.row_group}"
        return self.path if self.start == 0 and self.stop is None else f"{self.path}@{self.start}-{self.stop}"


def _unfinished(relative: str) -> bool:
    """Whether a file found below a pattern's root (``relative``: its path from there) is still being written
    by the usual writers' conventions (see the module's text)."""
    names = [name for name in relative.split("/") if name]
    return any(name.startswith(("_", ".")) for name in names) or relative.endswith(UNFINISHED_SUFFIXES)


class InputFiles:
    """The files ``paths`` names (paths, globs, directories or prefixes; local or URLs, one storage for all of
    them), listed and opened; ``storage_options`` for a remote store (fsspec's own configuration otherwise);
    ``ready_marker``: read a file only once its directory holds a file of that name."""

    def __init__(self, paths: Union[str, Sequence[str]], storage_options: Optional[Mapping[str, Any]] = None,
                 ready_marker: Optional[str] = None):
        patterns = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        if not patterns:
            raise ValueError("no input files given")
        self.patterns: List[Location] = [locate(os.fspath(pattern), storage_options) for pattern in patterns]
        self.ready_marker = ready_marker
        self._sizes: Dict[str, int] = {}
        #: The oldest name the last ``list`` found, complete or not; "" when a pattern found nothing (a file that
        #: lands there first may sort below every other pattern's).
        self.oldest_found = ""

    def list(self, missing_ok: bool = False) -> List[str]:
        """The complete files named now, each pattern's in name order (a file named by two patterns once);
        ``UnreadableFile`` for a pattern that names nothing, unless ``missing_ok`` (a followed input whose
        files are still to come)."""
        files: List[str] = []
        seen = set()
        found: List[str] = []
        for pattern in self.patterns:
            try:
                with failures_named(pattern, "list it"):
                    matches = self._matches(pattern, found)
            except (OSError, pa.ArrowException) as error:
                raise UnreadableFile(pattern.url, f"cannot list it: {error}") from error
            if not matches and not missing_ok:
                raise UnreadableFile(pattern.url, "no file matches this pattern")
            for name in matches:
                if name not in seen:
                    seen.add(name)
                    files.append(name)
        self.oldest_found = min(found) if len(found) == len(self.patterns) else ""
        return files

    def _matches(self, pattern: Location, found_names: List[str]) -> List[str]:
        """The complete files ``pattern`` names, in name order; the oldest name it found, complete or not (still
        written, or in a directory without its ready marker), appended to ``found_names``."""
        fs, path = pattern.fs, pattern.path
        if pattern.is_local and not glob.has_magic(path) and os.path.isfile(path):
            found_names.append(path)
            return [path]
        if not pattern.is_local:
            fs.invalidate_cache()  # a followed input lists again: what was listed before may have grown
        if glob.has_magic(path):
            magic = min(path.index(character) for character in "*?[" if character in path)
            root = path[:magic].rsplit("/", 1)[0]
            found = fs.glob(path, detail=True)
        elif fs.isdir(path):
            root, found = path, fs.find(path, detail=True)
        elif fs.exists(path):
            found_names.append(self._name(pattern, path))
            return found_names[-1:]
        else:
            return []
        every = [name for name, info in found.items() if info.get("type") == "file"]
        if every:
            found_names.append(self._name(pattern, min(every)))
        files = sorted(name for name in every if not _unfinished(posixpath.relpath(name, root) if root else name))
        for name in files:
            if found[name].get("size") is not None:
                self._sizes[self._name(pattern, name)] = int(found[name]["size"])
        if self.ready_marker:
            marked = {directory for directory in {posixpath.dirname(name) for name in files}
                      if fs.exists(posixpath.join(directory, self.ready_marker))}
            files = [name for name in files if posixpath.dirname(name) in marked]
        return [self._name(pattern, name) for name in files]

    @staticmethod
    def _name(pattern: Location, path: str) -> str:
        return path if pattern.is_local else pattern.fs.unstrip_protocol(path)

    def forget_before(self, name: str) -> None:
        """Forget the sizes of the files whose names sort below ``name`` (a followed input's files gone)."""
        self._sizes = {known: size for known, size in self._sizes.items() if known >= name}

    def location(self, name: str) -> Location:
        return locate(name, self.patterns[0].storage_options)

    def size(self, name: str) -> int:
        if name not in self._sizes:
            location = self.location(name)
            try:
                self._sizes[name] = int(location.fs.size(location.path))
            except (OSError, pa.ArrowException) as error:
                raise UnreadableFile(name, str(error)) from error
        return self._sizes[name]

    def open(self, name: str):
        """The file's bytes, decompressed when its name says it is compressed (a binary stream)."""
        compression = compression_of(name)
        location = self.location(name)
        if location.is_local:
            return open(location.path, "rb") if compression is None else pa.input_stream(location.path,
                                                                                      compression=compression)
        raw = location.open("rb")
        return raw if compression is None else pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), compression)

    def parquet(self, name: str):
        """The Parquet file ``name`` (``pyarrow.parquet.ParquetFile``)."""
        import pyarrow.parquet as pq

        location = self.location(name)
        return pq.ParquetFile(location.path if location.is_local else location.open("rb"))


def compression_of(path: str) -> Optional[str]:
    return COMPRESSIONS.get(os.path.splitext(path)[1].lower())


def text_parts(files: Sequence[str], workers: int, inputs: Optional[InputFiles] = None) -> List[Part]:
    """Every text file's parts: compressed files whole, plain ones in ranges (see the module's text)."""
    parts: List[Part] = []
    for path in files:
        size = inputs.size(path) if inputs is not None else os.path.getsize(path)
        if compression_of(path) is not None or size == 0:
            parts.append(Part(path))
            continue
        length = max(1, min(PART_BYTES, math.ceil(size / workers)))
        parts.extend(Part(path, start, min(start + length, size)) for start in range(0, size, length))
    return parts


def parquet_parts(files: Sequence[str], inputs: Optional[InputFiles] = None) -> List[Part]:
    inputs = inputs or InputFiles(list(files))
    parts: List[Part] = []
    for path in files:
        try:
            groups = inputs.parquet(path).num_row_groups
        except (OSError, pa.ArrowException) as error:
            raise UnreadableFile(path, str(error)) from error
        parts.extend(Part(path, row_group=group) for group in range(groups))
    return parts


def parts_of(parts: Sequence[Part], worker: int, workers: int) -> List[Part]:
    """Worker ``worker``'s parts (of ``workers``)."""
    if not 0 <= worker < workers:
        raise ValueError(f"worker must be in [0, {workers}), got {worker}")
    return list(parts[worker::workers])


@dataclass
class TextChunk:
    """Whole lines of a part: bytes ``[offset, next_offset)`` of the (uncompressed) file."""

    offset: int
    next_offset: int
    text: bytes
    last: bool  # the part ends with it


def text_chunks(part: Part, offset: int, chunk_bytes: int = CHUNK_BYTES,
                inputs: Optional[InputFiles] = None) -> Iterator[TextChunk]:
    """The part's lines, in chunks, from ``offset`` (a line's first byte, or ``part.start``): the first of
    about ``min(chunk_bytes, FIRST_CHUNK_BYTES)``, the others about ``chunk_bytes``.  Where the chunks are cut
    depends on where the reading began: a reading position is a line's offset and the lines after it given,
    whatever chunks they were in."""
    try:
        stream = (inputs or InputFiles(part.path)).open(part.path)
    except (OSError, pa.ArrowException) as error:
        raise UnreadableFile(part.path, str(error)) from error
    try:
        yield from _chunks(stream, part, offset, chunk_bytes)
    except (OSError, EOFError, pa.ArrowException) as error:
        raise UnreadableFile(part.path, str(error)) from error
    finally:
        stream.close()


def _chunks(stream, part: Part, offset: int, chunk_bytes: int) -> Iterator[TextChunk]:
    aligning = offset == part.start and part.start > 0
    position = _seek(stream, part.start - 1 if aligning else offset, part.path)
    carry = b""
    if aligning:  # the line under way at the part's first byte belongs to the part before: skip to its end
        while True:
            block = stream.read(chunk_bytes)
            if not block:
                return
            cut = block.find(b"\n")
            if cut >= 0:
                position, carry = position + cut + 1, block[cut + 1:]
                break
            position += len(block)
    stop, ended = part.stop, False
    size = min(chunk_bytes, FIRST_CHUNK_BYTES)
    while stop is None or position < stop:
        # bytes [position, position + size), or on to the first newline
        buffer = carry
        while not ended and (len(buffer) < size or b"\n" not in buffer):
            more = stream.read(max(size - len(buffer), 1 << 16))
            ended = not more
            buffer += more
        if not buffer:
            return
        # up to the last newline in the first size bytes; a longer line whole; the file's last one, maybe
        # without its newline
        end = buffer.rfind(b"\n", 0, size) + 1 or buffer.find(b"\n") + 1 or len(buffer)
        size = chunk_bytes
        last = False
        if stop is not None and position + end >= stop:  # lines from the one holding byte stop - 1 on: not ours
            cut = buffer.find(b"\n", max(0, stop - 1 - position))
            end, last = (cut + 1 if cut >= 0 else len(buffer)), True
        text, carry = buffer[:end], buffer[end:]
        last = last or (ended and not carry)
        yield TextChunk(position, position + end, text if text.endswith(b"\n") else text + b"\n", last)
        position += end
        if last:
            return


def _seek(stream, offset: int, path: str) -> int:
    if stream.seekable():
        stream.seek(offset)
        return offset
    remaining = offset
    while remaining > 0:  # a compressed stream: read up to the offset
        skipped = len(stream.read(min(remaining, CHUNK_BYTES)))
        if skipped == 0:
            raise UnreadableFile(path, f"it ends before byte {offset} (the saved reading position)")
        remaining -= skipped
    return offset


def line_at(path: str, offset: int, inputs: Optional[InputFiles] = None) -> int:
    """The number (1-based) of the line starting at byte ``offset`` of ``path`` (uncompressed), counted."""
    stream = (inputs or InputFiles(path)).open(path)
    try:
        lines, remaining = 1, offset
        while remaining > 0:
            block = stream.read(min(remaining, CHUNK_BYTES))
            if not block:
                break
            lines += block.count(b"\n")
            remaining -= len(block)
        return lines
    finally:
        stream.close()
