"""Which files are images, and how they open: the one rule for the torch and dali backends.

Both backends must accept the same files and produce the same pixels. NVIDIA DALI's CPU decoder
(nvImageCodec) is the reference: only the formats and pixel modes that decode to the same RGB in
DALI and in PIL are accepted (tests/unit/test_decode.py; rule by rule: `readers/compat.py`). Anything
else is refused from the header alone with a `BadImageError` naming the file and the reason,
rather than crashing a DALI pipeline mid-epoch or training on wrong pixels.
"""

from __future__ import annotations

import io
import itertools
import os
import threading
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from stallfree.data import storage
from stallfree.data.readers import fast_headers
from stallfree.data.readers.compat import ORIENTATION_TAG, SIXTEEN_BIT, unshared_mode
from stallfree.data.readers.headers import read_bytes
from stallfree.errors import StallfreeError
from stallfree.recipe import DEFAULT_MAX_PIXELS  # data.max_pixels' default: one definition
from stallfree.version import __version__

# PIL warns about some malformed files ("Corrupt EXIF data") without naming them; our checks
# name them. Filtered once, here: `warnings.catch_warnings()` in the header-check threads
# would race on the process-wide filter list and could leave every warning switched off.
warnings.filterwarnings("ignore", module=r"PIL(\.|$)")


# PIL format names that DALI's CPU decoder also decodes. Measured: GIF, ICO, TGA, PCX, QOI, DDS,
# SGI, IM and AVIF fail in DALI. "PPM" covers PBM/PGM/PPM; "MPO" is a multi-picture JPEG
# (many camera photos) of which both backends decode the first picture.
ACCEPTED_FORMATS: frozenset[str] = frozenset({"JPEG", "MPO", "PNG", "BMP", "TIFF", "WEBP", "PPM", "JPEG2000"})

# File name endings of ACCEPTED_FORMATS, which the dataset listing picks up.
IMAGE_EXTENSIONS: tuple[str, ...] = (
    ".jpg",
    ".jpeg",
    ".png",
    ".bmp",
    ".webp",
    ".tif",
    ".tiff",
    ".ppm",
    ".pgm",
    ".pbm",
    ".pnm",
    ".jp2",
    ".j2k",
    ".mpo",
)

_EXIF_FORMATS = frozenset({"JPEG", "TIFF", "PNG", "WEBP", "MPO"})
# What PIL raises on broken data: OSError, bad headers (SyntaxError, ValueError), short reads
# (EOFError, struct.error), out-of-range tables (IndexError) and, on fuzzed files, TypeError,
# KeyError, ZeroDivisionError, MemoryError... Any exception while parsing an untrusted file
# means a bad file, never a crash of the run: Exception it is (not KeyboardInterrupt).
_DECODE_ERRORS = (Exception,)


class BadImageError(StallfreeError, ValueError):
    """A file that is not an image both backends decode alike; one line: "path: reason"."""

    hint = "replace or remove the file, or leave it out with a data.file_list"

    def __init__(self, path: str, reason: str = "") -> None:
        # `reason` has a default so that `BadImageError(message)` works too: torch's DataLoader
        # re-raises a worker's exception as `type(exc)(message)`, and would otherwise lose the type.
        super().__init__(path, reason)
        self.path = str(path)
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.reason else self.path


# The header check's rules, numbered: bump it whenever the check refuses something it used to
# pass (two EXIF blocks, a TIFF without RowsPerStrip...). A start-up cache or a `data check`
# list written under older rules then vouches for nothing, even within one release.
HEADER_RULES = 3


def rules_id() -> str:
    """Which release and header rules checked a dataset: the stamp caches and lists carry."""
    return f"{__version__}+rules{HEADER_RULES}"


def _source(path: str, data: bytes | None = None) -> str | io.BytesIO:
    """What PIL opens: the bytes already read, the path itself, or a tar member's bytes (never
    extracted to disk)."""
    if data is not None:
        return io.BytesIO(data)
    return storage.file_path(path) or io.BytesIO(read_bytes(path))


def _size(path: str, data: bytes | None = None) -> int:
    if data is not None:
        return len(data)
    ref = storage.MemberRef.parse(path)
    if ref is not None:  # a member of a shard, local or in a store: its size is in the reference
        return ref.size
    return storage.size(path)


def check_header(
    path: str, max_pixels: int = DEFAULT_MAX_PIXELS, *, data: bytes | None = None
) -> tuple[int, int]:
    """Validate a file from its header alone (no pixel decode) and return (width, height).

    Raises BadImageError for an empty file, a file PIL cannot identify, a format or pixel mode
    that the two backends do not decode alike, or more than `max_pixels` pixels. `data`: the
    file's bytes, already read (a reader thread's), which every rule then reads instead of `path`.
    """
    img = _open_checked(path, max_pixels, data)
    size = img.size
    img.close()
    return size


def displayed_size(
    path: str, max_pixels: int = DEFAULT_MAX_PIXELS, *, data: bytes | None = None
) -> tuple[int, int]:
    """`check_header`'s check, and (width, height) as the image is displayed: after its EXIF
    rotation, the size both loaders crop from."""
    img, orientation = open_lazy(path, max_pixels, data=data)
    width, height = img.size
    img.close()
    return (height, width) if orientation in (5, 6, 7, 8) else (width, height)


def bad_headers(
    paths: Iterable[str], max_pixels: int = DEFAULT_MAX_PIXELS, threads: int = 0
) -> list[BadImageError]:
    """`check_header` on every file, in this process: the errors, in file order.

    `paths` is consumed in chunks, so a lazy sequence of millions of paths never exists as one
    list. `threads`: reads in flight (0: 1 for local files, 32 for an object store).
    """
    found: list[BadImageError] = []
    paths = iter(paths)
    while chunk := list(itertools.islice(paths, 16_384)):
        reasons = header_problems(chunk, max_pixels, threads)
        found += [BadImageError(path, r) for path, r in zip(chunk, reasons) if r is not None]
    return found


def fast_path_on() -> bool:
    """Whether `fast_headers` was written for these rules (a new rule turns it off)."""
    return HEADER_RULES == fast_headers.RULES


def header_problems(paths: list[str], max_pixels: int, threads: int = 0) -> list[str | None]:
    """Why `check_header` refuses each path, or None (`fast_headers.problems`)."""
    return fast_headers.problems(paths, max_pixels, threads, fast=fast_path_on())


def header_problem(path: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> str | None:
    """Why `check_header` refuses `path`, or None: the fast walk first, PIL when it asks."""
    return header_problems([path], max_pixels)[0]


def rgb_problem(path: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> str | None:
    """Why `open_rgb` (the full decode) fails on `path`, or None."""
    try:
        open_rgb(path, max_pixels).close()
    except BadImageError as exc:
        return exc.reason
    return None


def open_lazy(
    path: str, max_pixels: int = DEFAULT_MAX_PIXELS, *, data: bytes | None = None
) -> tuple[Image.Image, int]:
    """Open a checked image header (pixels not decoded yet) and read its EXIF orientation.

    The caller may `draft()` the image before `decode_rgb`, which decodes it. `data`: as in
    `check_header`.
    """
    img = _open_checked(path, max_pixels, data)
    try:
        exif = img.getexif() if img.format in _EXIF_FORMATS else {}
        orientation = int(exif.get(ORIENTATION_TAG, 1) or 1)
    except _DECODE_ERRORS as exc:
        img.close()  # reading EXIF can be the first read past the header: truncated or corrupt
        raise BadImageError(path, f"cannot read: {_one_line(exc)}") from exc
    return img, orientation


def decode_rgb(img: Image.Image, orientation: int, path: str) -> Image.Image:
    """Decode an `open_lazy` image to 8-bit RGB with DALI's rules, which the PIL path reproduces:
    16-bit samples become 8-bit as round(v / 257) (exact for 16-bit grey; PIL's own 16-bit RGB
    reduction truncates instead, at most 1 grey level off); alpha and tRNS transparency are
    ignored (the stored colours, no compositing onto a background); EXIF orientation is applied.

    Any decode failure (truncated or corrupt data) is raised as BadImageError naming `path`.
    """
    try:
        with _pil_limit_lifted():
            rgb = ImageOps.exif_transpose(img) if orientation != 1 else img
            rgb = _to_rgb(rgb)
            rgb.load()  # decode here, inside the error mapping, even when no conversion was needed
    except _DECODE_ERRORS as exc:
        img.close()
        raise BadImageError(path, f"cannot decode: {_one_line(exc)}") from exc
    if rgb is not img:
        img.close()  # release the file now, not at garbage collection
    return rgb


def open_rgb(path: str, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """Check, open and decode an image as 8-bit RGB, whatever its mode or file name."""
    img, orientation = open_lazy(path, max_pixels)
    return decode_rgb(img, orientation, path)


def _to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB of the stored colours: alpha and tRNS are dropped, as DALI does."""
    if img.mode in SIXTEEN_BIT:
        # PIL's convert("L"/"RGB") clips 16-bit values at 255 (a white image); DALI rounds v/257
        # (measured exact over all 65536 values), which (2v + 257) // 514 is in integers.
        wide = np.clip(np.asarray(img).astype(np.int64), 0, 65535)
        return Image.fromarray(((wide * 2 + 257) // 514).astype(np.uint8)).convert("RGB")
    if img.mode == "P" and "transparency" in img.info:
        # Going through RGBA keeps the palette colours and avoids PIL's warning on P -> RGB.
        img = img.convert("RGBA")
    return img if img.mode == "RGB" else img.convert("RGB")


def _open_checked(path: str, max_pixels: int, data: bytes | None = None) -> ImageFile.ImageFile:
    """Lazily open `path` and refuse, from the header, what the backends cannot share."""
    try:
        # PIL's own bomb check is lifted so that ours runs, with the size and the setting named.
        with _pil_limit_lifted():
            img = Image.open(_source(path, data))
    except UnidentifiedImageError as exc:
        # Only on this (rare) path is the size looked at: no extra stat() for every good file.
        empty = _size(path, data) == 0
        reason = "empty file (0 bytes)" if empty else "not an image PIL can identify"
        raise BadImageError(path, reason) from exc
    except OSError as exc:
        if exc.errno is None:  # PIL's own "truncated header" and the like
            raise BadImageError(path, f"unreadable header: {_one_line(exc)}") from exc
        raise BadImageError(path, f"cannot read: {exc.strerror or exc}") from exc
    except _DECODE_ERRORS as exc:
        raise BadImageError(path, f"unreadable header: {_one_line(exc)}") from exc
    try:
        _check_opened(img, path, max_pixels, data)
    except BadImageError:
        img.close()
        raise
    except _DECODE_ERRORS as exc:  # the checks read further into a header that can be broken
        img.close()
        raise BadImageError(path, f"unreadable header: {_one_line(exc)}") from exc
    return img


def _check_opened(img: ImageFile.ImageFile, path: str, max_pixels: int, data: bytes | None = None) -> None:
    """Raise BadImageError if the opened header is not something both backends decode alike."""
    if img.format not in ACCEPTED_FORMATS:
        raise BadImageError(
            path,
            f"{img.format} images are not accepted (DALI cannot decode "
            f"them); accepted: {', '.join(sorted(ACCEPTED_FORMATS))}",
        )
    width, height = img.size
    if width * height > max_pixels:
        raise BadImageError(
            path,
            f"{width}x{height} = {width * height} pixels is over "
            f"data.max_pixels ({max_pixels}): a decompression bomb or "
            "an oversized image",
        )
    reason = unshared_mode(img, path, data)
    if reason:
        raise BadImageError(path, reason)


_lift_lock = threading.Lock()
_lift_depth = 0
_saved_limit: int | None = None


@contextmanager
def _pil_limit_lifted() -> Iterator[None]:
    """Turn PIL's decompression-bomb check off while any thread is inside.

    Ours (max_pixels, from the header) runs instead: it names the size and the setting, and a
    raised data.max_pixels must not be refused again by PIL's fixed limit. Counted, because
    threads overlap: the first one in saves PIL's limit, the last one out restores it.
    """
    global _lift_depth, _saved_limit
    with _lift_lock:
        if _lift_depth == 0:
            _saved_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        _lift_depth += 1
    try:
        yield
    finally:
        with _lift_lock:
            _lift_depth -= 1
            if _lift_depth == 0:
                Image.MAX_IMAGE_PIXELS = _saved_limit


def register_plugins() -> None:
    """Import every PIL plugin now, in the order `Image.open` would (its common five first).

    Called before reader threads start: a thread importing a plugin lazily holds that module's
    import lock, and a DataLoader worker forked meanwhile would wait on it forever.
    """
    Image.preinit()
    Image.init()


def _reset_after_fork() -> None:
    """A forked child (a DataLoader worker) has none of the parent's threads: if one was inside
    `_pil_limit_lifted` at the fork, restore PIL's limit and start with a fresh, unheld lock."""
    global _lift_lock, _lift_depth
    if _lift_depth:
        Image.MAX_IMAGE_PIXELS = _saved_limit
    _lift_lock, _lift_depth = threading.Lock(), 0


if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(after_in_child=_reset_after_fork)


def _one_line(exc: BaseException) -> str:
    """`Type: message` on one line, for a reason that ends up in a log line."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
