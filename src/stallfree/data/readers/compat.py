"""The DALI-compatibility rules: which image formats and pixel modes decode alike in DALI's CPU
decoder (nvImageCodec, the reference) and in PIL, measured file kind by file kind (Pillow's own
test images, tests/unit/test_decode.py). `unshared_mode` says, from an opened header, why a file
would decode differently or not at all in DALI; `imageio` refuses such a file up front.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, BinaryIO, cast

from PIL import ImageFile

from stallfree.data.readers.headers import (
    jpeg2000_truncated,
    jpeg_marker_problem,
    png_is_animated,
    read_bytes,
    tiff_ifds_loop,
    webp_is_lossless,
)

if TYPE_CHECKING:  # PIL imports its TIFF plugin when it opens one; no import here otherwise
    from PIL.TiffImagePlugin import ImageFileDirectory_v2, TiffImageFile

# PIL modes that decode alike in both backends. Absent on purpose: "F" (float: DALI scales
# 0..1 to 0..255, PIL clips 0..255), "LAB" (DALI differs by ~14 levels), "I;16S" and the
# premultiplied "RGBa"/"La" (untested, so refused rather than guessed).
_MODES = frozenset(
    {"1", "L", "P", "RGB", "RGBA", "LA", "CMYK", "YCbCr", "I;16", "I;16B", "I;16L", "I;16N", "I"}
)
SIXTEEN_BIT = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})
ORIENTATION_TAG = 0x0112
_TIFF_BITS_PER_SAMPLE = 258
_TIFF_ROWS_PER_STRIP = 278
_TIFF_TILE_WIDTH = 322


def unshared_mode(img: ImageFile.ImageFile, path: str, data: bytes | None = None) -> str:
    """Why this format/mode decodes differently (or not at all) in DALI; "" if it is fine."""
    fmt, mode = img.format, img.mode
    if mode not in _MODES or (mode == "I" and fmt not in ("PNG", "PPM")):
        # "I" is 16-bit from PNG/PGM, but 32-bit from TIFF (which DALI cannot decode).
        return f"pixel mode {mode} ({fmt}) is not decoded alike by both backends; save as 8-bit"
    if fmt == "TIFF" and mode == "LA":
        return "grey+alpha TIFF: DALI decodes it to wrong colours; save as L, RGB or PNG"
    if fmt == "TIFF" and _TIFF_BITS_PER_SAMPLE not in _tiff_tags(img):
        return "TIFF without a BitsPerSample tag: DALI cannot parse it; re-save with compression"
    if fmt == "PPM" and img.tile:
        args = img.tile[0][3]  # (rawmode, maxval) when PIL rescales; a bare rawmode otherwise
        maxval = args[-1] if isinstance(args, tuple) else 255
        if maxval not in (255, 65535):
            # PIL scales by maxval; DALI ignores it (a maxval-100 image comes out dark).
            return f"PNM with maxval {maxval}: only 255 and 65535 decode alike; re-save as 8-bit"
    if fmt == "WEBP" and "exif" in img.info:
        if webp_is_lossless(path, data):
            return "lossless WebP with EXIF: DALI cannot parse it; re-save without EXIF or lossy"
        if img.getexif().get(ORIENTATION_TAG, 1) not in (1, None):
            # DALI rotates some (PIL-written) and not others (Pillow's hopper_orientation_6.webp).
            return "WebP with an EXIF rotation: DALI does not always apply it; re-save it upright"
    if "RGBa" in str(img.tile) or "La;" in str(img.tile):
        # Premultiplied alpha (PIL reports RGBA): PIL unpremultiplies, DALI keeps the stored values.
        return "premultiplied-alpha image: the backends decode it differently; save without alpha"
    rawmode = str(
        img.tile[0][3][0]
        if img.tile and isinstance(img.tile[0][3], tuple)
        else img.tile[0][3]
        if img.tile
        else ""
    )
    if fmt == "TIFF":
        return _tiff_problem(img)
    if fmt == "BMP":
        return _bmp_problem(img, rawmode, path, data)
    if fmt == "PPM" and img.tile and img.tile[0][0] == "ppm_plain":
        return "plain-text (ASCII) PNM: DALI cannot parse every one; re-save as binary PNM or PNG"
    if fmt == "PNG" and (img.get_format_mimetype() == "image/apng" or png_is_animated(path, data)):
        return "animated PNG: DALI cannot decode every one; save its first frame as a PNG"
    if fmt == "PNG" and img.getexif().get(ORIENTATION_TAG, 1) not in (1, None):
        # An eXIf chunk, an ImageMagick EXIF text or XMP (Pillow's own test images): PIL turns
        # the image, DALI does not (13-92 grey levels mean apart on Pillow's three).
        return "PNG with an orientation tag (EXIF or XMP): PIL applies it, DALI does not; re-save it upright"
    if fmt == "JPEG2000":
        return _jpeg2000_problem(img, path, data)
    if fmt in ("JPEG", "MPO"):
        return jpeg_marker_problem(path, data)
    return ""


def _bmp_problem(img: ImageFile.ImageFile, rawmode: str, path: str, data: bytes | None) -> str:
    """BMP variants DALI decodes differently from PIL (measured on Pillow's test images); ""
    for the plain kinds both read alike."""
    compression = img.info.get("compression")
    if compression in (1, 2) or ";1" in rawmode[3:]:
        return (
            "run-length-encoded or 15/16-bit BMP: DALI cannot decode every one; re-save as 24-bit BMP or PNG"
        )
    if compression == 3:  # BI_BITFIELDS: DALI ignores the masks (rgb32h52.bmp: 40 levels off)
        return "BMP with bit-field colour masks: DALI reads its channels apart; re-save as 24-bit BMP or PNG"
    header = data[:14] if data is not None else read_bytes(path, 14)
    pixels_at = int.from_bytes(header[10:14], "little") if len(header) >= 14 else -1
    if img.tile and pixels_at != img.tile[0][2]:
        # The file header's pixel offset contradicts the palette that precedes the pixels
        # (mmap_error.bmp): PIL reads after the palette, DALI from the stated offset.
        return (
            f"BMP whose pixel-data offset ({pixels_at}) contradicts its header: the decoders read "
            "different pixels; re-save it"
        )
    return ""


def _jpeg2000_problem(img: ImageFile.ImageFile, path: str, data: bytes | None = None) -> str:
    """JPEG 2000 files that DALI cannot decode, or that crash its decoder (measured on Pillow's
    test images: a truncated codestream is a segfault); "" for the 8-bit kinds both read."""
    if img.mode not in ("L", "RGB"):
        return f"JPEG 2000 in mode {img.mode}: DALI cannot decode it; save as 8-bit"
    if img.get_format_mimetype() == "image/jpx":
        return "JPX (extended JPEG 2000): DALI cannot decode it; re-save as JP2 or PNG"
    if jpeg2000_truncated(path, data):
        return "truncated JPEG 2000 (no end-of-codestream marker): DALI's decoder crashes on it"
    return ""


def _tiff_tags(img: ImageFile.ImageFile) -> ImageFileDirectory_v2:
    """The tags of an image whose format is TIFF (PIL's TiffImageFile, which has `tag_v2`)."""
    return cast("TiffImageFile", img).tag_v2


def _tiff_problem(img: ImageFile.ImageFile) -> str:
    """TIFF variants that PIL reads and DALI's decoders (libtiff, then OpenCV) do not (measured
    on Pillow's own test images); "" for the plain 8-bit kinds both read alike."""
    tags = _tiff_tags(img)
    if _TIFF_ROWS_PER_STRIP not in tags and _TIFF_TILE_WIDTH not in tags:
        # Required in a striped TIFF; libtiff assumes one strip, DALI's fallback decoder
        # (OpenCV) returns a wrong shape and its cropping decoder stops (Pillow's crash-74d2).
        return "TIFF without a RowsPerStrip tag: DALI's decoder misreads it or stops; re-save the image"
    compression = img.info.get("compression")
    if compression in _TIFF_UNSHARED:
        return (
            f"TIFF with {compression} compression: DALI cannot decode it; "
            "re-save with LZW, Deflate or no compression"
        )
    bits = tags.get(_TIFF_BITS_PER_SAMPLE, (8,))
    bits = bits if isinstance(bits, tuple) else (bits,)
    if tags.get(339, 1) not in (1, (1,)) or not set(bits) <= {1, 8, 16}:
        return "TIFF with unusual samples (signed, or 2/4-bit): DALI cannot decode it; re-save as 8-bit"
    if 16 in bits and img.mode not in SIXTEEN_BIT:
        return "16-bit colour TIFF: DALI cannot decode it; re-save as 8-bit"
    # Opened, not loaded: `fp` is the file (PIL types it Optional for after a close).
    if getattr(img, "n_frames", 1) != 1 or tiff_ifds_loop(cast(BinaryIO, img.fp)):
        return "multi-page TIFF: DALI cannot decode every one; save the page you want alone"
    return ""


# TIFF compressions that PIL reads and DALI's decoders (libtiff, OpenCV) do not (measured:
# LZMA fails); the rest are rare codecs refused rather than guessed.
_TIFF_UNSHARED = frozenset(
    {
        "tiff_lzma",
        "lzma",
        "zstd",
        "webp",
        "jpegxl",
        "tiff_sgilog",
        "tiff_sgilog24",
        "tiff_thunderscan",
        "tiff_jpeg",
    }
)  # old-style JPEG-in-TIFF, deprecated by libtiff
