"""Writing one object to an S3-compatible store in parts, from a few reusable buffers, while the writer goes on.

Owns the write side of an object on ``s3://`` (s3fs): ``PartUpload`` is a write-only file.  What is
written is copied into one of at most ``in_flight`` part buffers of ``part_bytes``; a full buffer goes
up as one part of a multipart upload (s3fs's ``call_s3``, from a thread of the upload's own) while the
writer fills the next, so serialising and hashing overlap the upload, and an object of any size holds
at most ``in_flight`` x ``part_bytes`` of memory (32 MiB by default: s3fs's own file holds every byte
of a write until its block fills, 128 MB for a 2M x 16 table, and copies it twice).  An object smaller
than one part is one PUT.  Nothing of it is visible until ``close`` completes the upload; ``discard``
(what a failed write calls) aborts it, so a failed object is never half there.
``open_for_upload(location)`` gives one for an s3fs location and the filesystem's own writer for any
other.

The sizes were measured with a script like ``benchmarks/checkpoint_storage.py`` (docs/benchmarks.md):
on a SeaweedFS server on loopback, 8 MiB parts with 4 in flight wrote a 128 MB file in 1.26-1.36 s
against 1.59-1.68 s through s3fs's file; fewer or larger buffers did no better (16 MiB: 1.45 s, 64 MiB:
1.82 s).  Parts of at least 5 MiB are what S3 asks of every part but the last.
"""

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple

from ..filesystems import Location

#: The size of every part but the last (S3 asks at least 5 MiB of them).
PART_BYTES = 8 << 20
#: How many parts may be uploading (or filling) at once: the memory an upload holds is this many parts.
IN_FLIGHT = 4
#: The longest wait for one part's upload (s3fs's own retries and timeouts come first).
PART_TIMEOUT_SECONDS = 600.0


def open_for_upload(location: Location) -> Any:
    """A write-only file for ``location``: a ``PartUpload`` on an s3fs filesystem, else the filesystem's own
    file (``discard()`` abandons either)."""
    try:
        from s3fs import S3FileSystem
    except ImportError:  # not the s3 extra: no s3fs location either
        S3FileSystem = None
    if S3FileSystem is not None and isinstance(location.fs, S3FileSystem):
        return PartUpload(location.fs, location.path)
    return location.open("wb")


class PartUpload:
    """One object written to S3 through s3fs: a multipart upload fed from a bounded pool of part buffers."""

    def __init__(self, fs: Any, path: str, part_bytes: int = PART_BYTES, in_flight: int = IN_FLIGHT):
        if part_bytes < 1 or in_flight < 1:
            raise ValueError(f"part_bytes and in_flight must be positive, got {part_bytes} and {in_flight}")
        self._fs = fs
        self._bucket, self._key, _ = fs.split_path(path)
        self._part_bytes = part_bytes
        self._in_flight = in_flight
        self._buffers: List[bytearray] = []  # made when needed, at most ``in_flight``
        self._free: List[bytearray] = []
        self._filling: Optional[bytearray] = None
        self._filled = 0
        self._upload_id: Optional[str] = None
        self._sent: List[Tuple[int, Future, Optional[bytearray]]] = []  # (part number, its upload, its buffer)
        self._senders: Optional[ThreadPoolExecutor] = None
        self._parts: List[Dict] = []
        self.bytes = 0
        self.closed = False

    @property
    def buffer_bytes(self) -> int:
        """The memory this upload holds in part buffers (at most ``in_flight`` x ``part_bytes``)."""
        return len(self._buffers) * self._part_bytes

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = len(view)
        while len(view):
            if self._filling is None:
                self._filling = self._free_buffer()
            take = min(len(view), self._part_bytes - self._filled)
            self._filling[self._filled:self._filled + take] = view[:take]
            self._filled += take
            view = view[take:]
            if self._filled == self._part_bytes:
                self._send(self._filling, self._filling)
                self._filling, self._filled = None, 0
        self.bytes += written
        return written

    def flush(self) -> None:
        """Nothing to do: a part goes up when full, the rest at ``close``."""

    def close(self) -> None:
        """Complete the upload: the object appears whole (one PUT if it never filled a part)."""
        if self.closed:
            return
        try:
            self._complete()
        except BaseException:
            self.discard()
            raise
        self.closed = True

    def _complete(self) -> None:
        if self._upload_id is None:  # smaller than one part
            body = bytes(self._filling[:self._filled]) if self._filling is not None else b""
            self._fs.call_s3("put_object", Bucket=self._bucket, Key=self._key, Body=body)
            return
        if self._filled:
            self._send(bytes(self._filling[:self._filled]), None)
            self._filled = 0
        self._collect(len(self._sent))
        self._senders.shutdown()
        self._parts.sort(key=lambda part: part["PartNumber"])
        self._fs.call_s3("complete_multipart_upload", Bucket=self._bucket, Key=self._key, UploadId=self._upload_id,
                         MultipartUpload={"Parts": self._parts})

    def discard(self) -> None:
        """Abandon the object: parts still uploading are cancelled and the multipart upload aborted."""
        if self.closed:
            return
        self.closed = True
        for _, upload, _ in self._sent:
            upload.cancel()
        for _, upload, _ in self._sent:
            with contextlib.suppress(BaseException):
                upload.result(PART_TIMEOUT_SECONDS)
        self._sent.clear()
        if self._senders is not None:
            self._senders.shutdown(wait=False, cancel_futures=True)
        if self._upload_id is not None:
            with contextlib.suppress(Exception):  # an upload never completed is not an object either way
                self._fs.call_s3("abort_multipart_upload", Bucket=self._bucket, Key=self._key,
                                 UploadId=self._upload_id)

    def _free_buffer(self) -> bytearray:
        if not self._free and len(self._buffers) < self._in_flight:
            self._buffers.append(bytearray(self._part_bytes))
            return self._buffers[-1]
        if not self._free:
            self._collect(1)  # the oldest part's upload gives its buffer back
        return self._free.pop()

    def _send(self, body, buffer: Optional[bytearray]) -> None:
        """Start uploading ``body`` as the next part; ``buffer`` is free again once it is up."""
        if self._upload_id is None:
            self._upload_id = self._fs.call_s3("create_multipart_upload", Bucket=self._bucket,
                                               Key=self._key)["UploadId"]
            self._senders = ThreadPoolExecutor(self._in_flight, thread_name_prefix="part-upload")
        number = len(self._parts) + len(self._sent) + 1
        upload = self._senders.submit(self._fs.call_s3, "upload_part", Bucket=self._bucket, Key=self._key,
                                      PartNumber=number, UploadId=self._upload_id, Body=body)
        self._sent.append((number, upload, buffer))

    def _collect(self, count: int) -> None:
        """Wait for the ``count`` oldest parts in flight; record them and free their buffers."""
        for _ in range(count):
            number, upload, buffer = self._sent[0]
            answer = upload.result(PART_TIMEOUT_SECONDS)
            self._sent.pop(0)
            part = {"PartNumber": number, "ETag": answer["ETag"]}
            if "ChecksumSHA256" in answer:  # a store that asked for one wants it back (as s3fs's own file does)
                part["ChecksumSHA256"] = answer["ChecksumSHA256"]
            self._parts.append(part)
            if buffer is not None:
                self._free.append(buffer)
