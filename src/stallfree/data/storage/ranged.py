"""An object read as a file: seekable, with `pread`, in large ranged GETs."""

from __future__ import annotations

import os

import stallfree.data.storage.objects as objects


class RangedFile:
    """A read-only, seekable file over an s3:// object, fetched in large ranged GETs (one window
    of SPAN bytes held at a time, bounded memory): a shard read front to back, by `tarfile` or
    by `pread`, costs one request per window, not one or two per member."""

    SPAN = 64 << 20

    def __init__(self, url: str, size: int | None = None) -> None:
        self.name, self.size, self.pos = url, size, 0
        self.start, self.data = 0, b""

    def pread(self, length: int, offset: int) -> bytes:
        """`length` bytes from `offset` (fewer at the end of the object); no position moved."""
        if self.size is not None:
            length = max(0, min(length, self.size - offset))
        if length <= 0:
            return b""
        if not (self.start <= offset and offset + length <= self.start + len(self.data)):
            span = max(self.SPAN, length)
            if self.size is not None:
                span = min(span, self.size - offset)
            self.start, self.data = offset, objects.read_range(self.name, offset, span)
        return self.data[offset - self.start : offset - self.start + length]

    def read(self, length: int = -1) -> bytes:
        """Up to `length` bytes from the position (all the rest when negative)."""
        if length < 0:
            length = (self.size if self.size is not None else self.pos + self.SPAN) - self.pos
        data = self.pread(length, self.pos)
        self.pos += len(data)
        return data

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        """Move the position (SEEK_END needs the size)."""
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.size or 0}[whence]
        self.pos = base + offset
        return self.pos

    def tell(self) -> int:
        """The position."""
        return self.pos

    def close(self) -> None:
        """Drop the window held."""
        self.data = b""

    def __enter__(self) -> RangedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
