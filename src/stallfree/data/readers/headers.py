"""Byte-level reads: a file or a tar member read in place, and the header walks PIL does not do
(segment, chunk and directory structure that DALI's parsers are stricter about)."""

from __future__ import annotations

import io
import os
import struct
from typing import BinaryIO

from stallfree.data import storage

# How an EXIF block (APP1 segment) starts, in a JPEG.
EXIF_HEADER = b"Exif\x00\x00"


def read_bytes(path: str, limit: int | None = None) -> bytes:
    """The file's bytes (at most `limit`), for a file or a tar member reference, local or in an
    object store."""
    return storage.read_sample(path, limit)


def tiff_ifds_loop(fp: BinaryIO) -> bool:
    """Whether a classic TIFF's chain of image directories points back into itself."""
    fp.seek(0)
    head = fp.read(8)
    order = "<" if head[:2] == b"II" else ">"
    offset, seen = struct.unpack(order + "I", head[4:8])[0], set[int]()
    while offset and offset not in seen and len(seen) < 1024:
        seen.add(offset)
        fp.seek(offset)
        raw = fp.read(2)
        if len(raw) < 2:
            return False
        fp.seek(offset + 2 + 12 * struct.unpack(order + "H", raw)[0])
        raw = fp.read(4)
        offset = struct.unpack(order + "I", raw)[0] if len(raw) == 4 else 0
    return bool(offset)


def png_is_animated(path: str, data: bytes | None = None) -> bool:
    """Whether a PNG has an animation-control chunk (acTL) before its image data: PIL ignores
    a malformed one, on which DALI fails. `data`: the file's bytes, already read."""
    with io.BytesIO(read_bytes(path, 1 << 20) if data is None else data[: 1 << 20]) as f:
        f.seek(8)
        while len(header := f.read(8)) == 8:
            size, kind = struct.unpack(">I", header[:4])[0], header[4:]
            if kind in (b"acTL", b"IDAT"):
                return kind == b"acTL"
            f.seek(size + 4, os.SEEK_CUR)  # data and CRC
    return False


def jpeg_marker_problem(path: str, data: bytes | None = None) -> str:
    """Walk a JPEG's header segments up to the scan: DALI's parser stops at junk between them,
    which PIL skips over. "" when every segment starts where the previous one ended. `data`:
    the file's bytes, already read."""
    # Headers mostly sit in the first 64 KiB.
    head = read_bytes(path, 1 << 16) if data is None else data[: 1 << 16]
    problem, end = jpeg_header_walk(head)
    if not problem and end >= len(head) == 1 << 16:  # longer ones: big ICC, XMP or EXIF blocks
        problem, _ = jpeg_header_walk(read_bytes(path) if data is None else data)
    return problem


def jpeg_header_walk(data: bytes) -> tuple[str, int]:
    """(problem, end): `jpeg_marker_problem` on a JPEG's first bytes, and where its header
    segments end (the start of the scan, or len(data))."""
    pos, exif_blocks = 2, 0  # after SOI
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return ("junk bytes between JPEG header segments: DALI cannot parse it; re-save the image", pos)
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x00 or 0xD0 <= marker <= 0xD8:  # no segment starts with these
            return "a broken JPEG header segment: DALI cannot parse it; re-save the image", pos
        if marker in (0xDA, 0xD9):  # start of scan / end of image: the header is sound
            return "", pos
        if marker == 0xE1 and data[pos + 4 : pos + 10] == EXIF_HEADER:
            exif_blocks += 1
            if exif_blocks == 2:
                # DALI's decoder reads every EXIF block (a process crash on some, rotations
                # mixed from both on others); PIL reads the first. Measured on DALI 2.4.
                return (
                    "two EXIF blocks (APP1): DALI's decoder crashes on such files and PIL "
                    "reads only the first; re-save the image with one",
                    pos,
                )
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return "", len(data)


def jpeg_exif_orientation(header: bytes) -> int | None:
    """The EXIF orientation (1-8) in a JPEG's header segments, 1 when there is no EXIF, None
    when an EXIF block is there but cannot be read (the caller then asks PIL)."""
    tiff = jpeg_exif_block(header)
    if tiff is None:
        return 1
    order = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return None
    try:
        (ifd,) = struct.unpack(order + "I", tiff[4:8])
        (count,) = struct.unpack(order + "H", tiff[ifd : ifd + 2])
        for i in range(count):
            tag, kind, _, value = struct.unpack(order + "HHI4s", tiff[ifd + 2 + 12 * i : ifd + 14 + 12 * i])
            if tag == 0x0112:  # Orientation, a SHORT held in the entry itself
                return struct.unpack(order + "H", value[:2])[0] if kind == 3 else None
    except struct.error:
        return None  # a truncated or broken block
    return 1


def jpeg_exif_block(header: bytes) -> bytes | None:
    """The first EXIF block of a JPEG's header segments (the TIFF data after "Exif\\0\\0"),
    from APP1 segments only, as PIL and DALI read it: "Exif" in a comment is not one."""
    pos = 2  # after SOI
    while pos + 4 <= len(header) and header[pos] == 0xFF:
        marker = header[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xDA, 0xD9):  # the scan: no more header segments
            break
        end = pos + 2 + int.from_bytes(header[pos + 2 : pos + 4], "big")
        if marker == 0xE1 and header[pos + 4 : pos + 10] == EXIF_HEADER:
            return header[pos + 10 : end]
        pos = end
    return None


def jpeg2000_truncated(path: str, data: bytes | None = None) -> bool:
    """Whether a JPEG 2000 codestream (raw, or a JP2 file's jp2c box) lacks its end marker.
    `data`: the file's bytes, already read."""
    data = read_bytes(path) if data is None else data
    pos = 0
    if data[4:8] == b"jP  ":  # a JP2 file: boxes of (size, type); the codestream is in jp2c
        while pos + 8 <= len(data):
            size, kind = struct.unpack(">I4s", data[pos : pos + 8])
            head = 8
            if size == 1 and pos + 16 <= len(data):  # a 64-bit size follows
                size, head = struct.unpack(">Q", data[pos + 8 : pos + 16])[0], 16
            end = len(data) if size == 0 else pos + size
            if kind == b"jp2c":
                return not data[pos + head : end].endswith(b"\xff\xd9")
            if size < head:
                return True  # a broken box: no codestream can be found
            pos = end
        return True
    return not data.endswith(b"\xff\xd9")


def webp_is_lossless(path: str, data: bytes | None = None) -> bool:
    """Whether the first image chunk of a RIFF/WebP file is VP8L (lossless): a header walk.
    `data`: the file's bytes, already read."""
    with io.BytesIO(read_bytes(path, 1 << 16) if data is None else data[: 1 << 16]) as f:
        f.seek(12)  # "RIFF", size, "WEBP"
        while header := f.read(8):
            if len(header) < 8:
                return False
            tag, size = header[:4], struct.unpack("<I", header[4:])[0]
            if tag in (b"VP8L", b"VP8 ", b"ANMF"):
                return tag == b"VP8L"
            f.seek(size + (size & 1), os.SEEK_CUR)  # chunks are padded to an even size
    return False
