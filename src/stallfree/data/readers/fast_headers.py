"""The header check's fast path: a JPEG's first 4 KiB, walked as PIL walks them (~10 us a
file, PIL ~250 us). It says "passes `imageio.check_header` for certain" or "ask PIL", never
"refused": every refusal and its reason stay PIL's and the rules' (tests/unit/test_fast_headers.py
holds it on the odd, crafted and Pillow test images). JPEG only: the check of a PNG reads its
EXIF, which PIL finds by decoding the whole image (an eXIf chunk may follow the pixels), so a
truncated PNG is refused at start, a verdict no header walk can give.
"""

from __future__ import annotations

import math
import os
import struct
import warnings
from concurrent.futures import ThreadPoolExecutor

# As in imageio (which a header worker may never import): PIL's "Corrupt EXIF data" names no
# file, and the walk's EXIF read must not print it; the check names files itself.
warnings.filterwarnings("ignore", module=r"PIL(\.|$)")

# The imageio.HEADER_RULES this walk passes files under. A new rule bumps HEADER_RULES, and
# until the walk is checked against it (and this bumped), every file goes to PIL: slower, and
# never a file passed that the new rule refuses.
RULES = 3
ASK = -1  # PIL decides
PASS = 0  # the header check passes the file
FIRST_READ = 4096  # bytes: a typical web JPEG's header segments fit; a camera's grow the read

_JPEG_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_JPEG_SKIPPED = frozenset({0xC4, 0xCC, 0xDC, 0xDD, 0xDF, 0xFE})  # PIL reads and ignores these
_EXIF = b"Exif\x00\x00"


def read_head(path: str, size: int) -> bytes:
    """The first `size` bytes of a file, an object (one ranged GET) or a tar member."""
    if ":" in path:  # maybe an object (s3://) or a tar member (SHARD::MEMBER): storage's to read
        from stallfree.data import storage  # imported here: a local check's worker starts sooner

        return storage.read_sample(path, size)
    fd = os.open(path, os.O_RDONLY)  # a local file: no file object, no storage dispatch
    try:
        return os.read(fd, size)
    finally:
        os.close(fd)


READS_IN_FLIGHT = 32  # an object store's ranged GETs at once, per process: latency, not CPU


def problems(paths: list[str], max_pixels: int, threads: int = 0, *, fast: bool = True) -> list[str | None]:
    """Why `imageio.check_header` refuses each path, or None: `passes` first (unless not
    `fast`), PIL when it asks. Local files are read one after the other (threads only add
    overhead to a GIL-bound walk); an object store's in `threads` threads (0: READS_IN_FLIGHT),
    whose GETs wait in parallel."""
    if threads == 0:
        threads = READS_IN_FLIGHT if paths and _in_a_store(paths[0]) else 1
    if threads <= 1 or len(paths) <= 1:
        return [_problem(path, max_pixels, fast) for path in paths]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda path: _problem(path, max_pixels, fast), paths))


def _in_a_store(path: str) -> bool:
    """Whether `path` names an object, asked of storage only where it might (storage's imports
    would slow a local check's worker start)."""
    if ":" not in path:
        return False
    from stallfree.data.storage.locations import is_url

    return is_url(path)


def _problem(path: str, max_pixels: int, fast: bool) -> str | None:
    if fast and passes(path, max_pixels):
        return None
    # Imported on the first file PIL is asked about: numpy and PIL are most of a worker's start.
    from stallfree.data.readers.imageio import BadImageError, check_header

    try:
        check_header(path, max_pixels)
    except BadImageError as exc:
        return exc.reason
    return None


def passes(path: str, max_pixels: int) -> bool:
    """Whether the header check passes `path` for certain, from its first bytes; False: ask PIL
    (which may pass it too)."""
    asked = FIRST_READ
    try:
        head = read_head(path, asked)
        if not head.startswith(b"\xff\xd8\xff"):
            return False
        while (verdict := jpeg_verdict(head, max_pixels)) > PASS and len(head) == asked:
            asked = max(verdict, 4 * asked)  # longer header segments (EXIF, ICC, XMP)
            head = read_head(path, asked)
    except OSError:
        return False  # PIL opens it again and names the error
    return verdict == PASS


def jpeg_verdict(head: bytes, max_pixels: int) -> int:
    """PASS, ASK, or how many bytes to read to decide, for a JPEG's first bytes.

    Mirrors JpegImagePlugin's `_open` (Pillow 13): every segment up to the scan has a length and
    a handler that cannot fail on it, one SOF of 8-bit samples in 1, 3 or 4 components, and
    the rules' walk (`headers.jpeg_header_walk`: no junk between segments, one EXIF block).
    """
    pos, size, exif, dpi = 2, len(head), b"", False
    sof: bytes | None = None
    icc: list[bytes] = []
    while True:
        if pos + 4 > size:
            return pos + 4
        if head[pos] != 0xFF:
            return ASK
        marker = head[pos + 1]
        if marker == 0xFF:  # a fill byte
            pos += 1
            continue
        start, pos = pos + 4, pos + 2 + (head[pos + 2] << 8 | head[pos + 3])
        if pos < start:
            return ASK
        if pos > size:
            return pos
        if marker in _JPEG_SKIPPED:  # the common case first: Huffman tables
            continue
        if marker == 0xDA:
            break
        body = head[start:pos]
        if 0xE0 <= marker <= 0xEF:
            if marker == 0xE1 and body.startswith(_EXIF):
                if exif:
                    return ASK  # two EXIF blocks: the rules refuse it, in PIL's words
                exif = body
            elif not _app_is_plain(marker, body):
                return ASK
            elif marker == 0xE0 and body.startswith(b"JFIF"):
                dpi = dpi or (len(body) >= 12 and body[7] in (1, 2))
            elif marker == 0xE2 and body.startswith(b"ICC_PROFILE\x00"):
                icc.append(body)
        elif marker in _JPEG_SOF:
            if sof is not None or (icc and len(min(icc)) < 14):  # a second SOF; a fragment PIL indexes past
                return ASK
            sof, icc = body, []
        elif marker != 0xDB or not _dqt_ok(body):
            return ASK  # a marker PIL reads no length for (RSTn, EOI, JPGn...), DHP, a bad DQT
    if sof is None or len(sof) < 6 or (len(sof) - 6) % 3 or sof[0] != 8 or sof[5] not in (1, 3, 4):
        return ASK  # PIL reads each 3-byte component entry whole: a partial one fails its open
    height, width = struct.unpack(">HH", sof[1:5])
    if not 0 < width * height <= max_pixels:
        return ASK
    if exif and not dpi and not _exif_dpi_reads(exif):
        return ASK
    return PASS


def _app_is_plain(marker: int, body: bytes) -> bool:
    """Whether PIL's APP handler reads this segment without an error or a format change."""
    if marker == 0xE0 and body.startswith(b"JFIF"):
        return len(body) >= 7
    if marker == 0xEE and body.startswith(b"Adobe"):
        return len(body) >= 7
    if marker == 0xE2 and body.startswith(b"MPF\x00"):
        return False  # maybe an MPO: PIL's to read
    if marker == 0xED and body.startswith(b"Photoshop 3.0\x00"):
        return _photoshop_reads(body)
    return True


def _photoshop_reads(body: bytes) -> bool:
    """Whether PIL's walk of a Photoshop block (8BIM resources) gets through it: a short read
    ends the walk quietly (struct.error), an index past the end (a name length) fails it."""
    offset = 14
    try:
        while body[offset : offset + 4] == b"8BIM":
            (code,) = struct.unpack_from(">H", body, offset + 4)
            offset += 6
            if offset >= len(body):
                return False
            offset += 1 + body[offset]
            offset += offset & 1
            (size,) = struct.unpack_from(">I", body, offset)
            offset += 4
            if code == 0x03ED and len(body[offset : offset + size]) < 14:
                return True  # PIL's resolution read stops the walk here
            offset += size + ((offset + size) & 1)
    except struct.error:
        return True
    return True


def _dqt_ok(body: bytes) -> bool:
    """PIL's DQT loop: every table whole."""
    while body:
        length = 65 if body[0] < 16 else 129
        if len(body) < length:
            return False
        body = body[length:]
    return True


def _exif_dpi_reads(exif: bytes) -> bool:
    """Whether `JpegImageFile._read_dpi_from_exif` gets through this EXIF block: PIL reads the
    resolution from it when the JFIF segment gives none, and only some errors are caught."""
    from PIL import Image

    data = Image.Exif()
    try:
        data.load(exif)
        unit, resolution = data[0x0128], data[0x011A]
        try:
            dpi = float(resolution[0]) / resolution[1]
        except TypeError:
            dpi = resolution
        if math.isnan(dpi):
            raise ValueError(dpi)
        if unit == 3:
            dpi *= 2.54
    except (struct.error, KeyError, SyntaxError, TypeError, ValueError, ZeroDivisionError):
        return True  # caught by PIL too: the default dpi
    except Exception:  # noqa: BLE001 - anything else fails PIL's open: ask PIL for its words
        return False
    return True
