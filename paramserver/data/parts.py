"""Which files a reader reads and how they are shared among workers: ``Part``s, and reading a text part.

Owns naming the input (a path, a glob, or a list of them, expanded in
sorted order; nothing found is an error naming the pattern), cutting it
into parts, giving each worker its own (``parts_of``: worker ``w`` of
``n`` takes parts ``w, w + n, ...``; every part goes to exactly one
worker), and reading a text part as chunks of whole lines
(``text_chunks``).

A plain text file is cut by bytes into ranges of at most ``PART_BYTES``
and at least as many as there are workers, so that one large file is
shared by all of them; a line belongs to the range holding its first
byte.  A compressed file (``.gz``, ``.bz2``, ``.zst``, ``.lz4``) cannot be
entered in the middle, so it is one part.  A Parquet file gives one part
per row group.
"""

import glob
import math
import os
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Union

import pyarrow as pa

from .errors import UnreadableFile

#: Text parts are at most this long (bytes), so that workers get similar shares.
PART_BYTES = 256 << 20
#: A text chunk (parsed at once) is about this long (bytes), cut after its last whole line.
CHUNK_BYTES = 4 << 20
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}


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


def expand(paths: Union[str, Sequence[str]]) -> List[str]:
    """The files ``paths`` names (paths or globs), each pattern's matches sorted; ``UnreadableFile`` for a
    pattern that matches nothing."""
    patterns = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not patterns:
        raise ValueError("no input files given")
    files: List[str] = []
    for pattern in map(str, patterns):
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise UnreadableFile(pattern, "no file matches this pattern")
        for path in matches:
            if not os.path.isfile(path):
                raise UnreadableFile(path, "no such file")
        files.extend(matches)
    return files


def compression_of(path: str) -> Optional[str]:
    return COMPRESSIONS.get(os.path.splitext(path)[1].lower())


def text_parts(files: Sequence[str], workers: int) -> List[Part]:
    """Every text file's parts: compressed files whole, plain ones in ranges (see the module's text)."""
    parts: List[Part] = []
    for path in files:
        size = os.path.getsize(path)
        if compression_of(path) is not None or size == 0:
            parts.append(Part(path))
            continue
        length = max(1, min(PART_BYTES, math.ceil(size / workers)))
        parts.extend(Part(path, start, min(start + length, size)) for start in range(0, size, length))
    return parts


def parquet_parts(files: Sequence[str]) -> List[Part]:
    import pyarrow.parquet as pq

    parts: List[Part] = []
    for path in files:
        try:
            groups = pq.ParquetFile(path).num_row_groups
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


def text_chunks(part: Part, offset: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[TextChunk]:
    """The part's lines, in chunks, from ``offset`` (a line's first byte, or ``part.start``)."""
    try:
        stream = _open(part.path)
    except (OSError, pa.ArrowException) as error:
        raise UnreadableFile(part.path, str(error)) from error
    try:
        yield from _chunks(stream, part, offset, chunk_bytes)
    except (OSError, EOFError, pa.ArrowException) as error:
        raise UnreadableFile(part.path, str(error)) from error
    finally:
        stream.close()


def _open(path: str):
    compression = compression_of(path)
    if compression is None:
        return open(path, "rb")
    return pa.input_stream(path, compression=compression)


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
    while stop is None or position < stop:
        # bytes [position, position + chunk_bytes), or on to the first newline: the same chunks from any
        # position, so that a saved position (a chunk's offset and rows taken) means the same lines again
        buffer = carry
        while not ended and (len(buffer) < chunk_bytes or b"\n" not in buffer):
            more = stream.read(max(chunk_bytes - len(buffer), 1 << 16))
            ended = not more
            buffer += more
        if not buffer:
            return
        # up to the last newline in the first chunk_bytes; a longer line whole; the file's last one, maybe
        # without its newline
        end = buffer.rfind(b"\n", 0, chunk_bytes) + 1 or buffer.find(b"\n") + 1 or len(buffer)
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


def line_at(path: str, offset: int) -> int:
    """The number (1-based) of the line starting at byte ``offset`` of ``path`` (uncompressed), counted."""
    stream = _open(path)
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
