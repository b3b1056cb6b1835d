"""Decode and resize for the torch backend: the fastest well-kept path the machine has.

Decode: libjpeg-turbo through `simplejpeg` (the `fast` extra) for plain JPEGs, which skips PIL's
per-image object; PIL for every other file, and whenever simplejpeg is missing or refuses one.
Both are libjpeg-turbo with the same IDCT and fancy upsampling, so the pixels are the same
(checked bit for bit in the tests). Resize: torch's uint8 antialiased bilinear kernel. Which
files are accepted and how they become RGB stays in `readers/imageio.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from stallfree.data.readers.headers import jpeg_exif_orientation, jpeg_header_walk, read_bytes
from stallfree.data.readers.imageio import decode_rgb, open_lazy

try:
    import simplejpeg
except ImportError:  # optional: PIL decodes the same pixels, ~15% slower
    simplejpeg = None

# Colour spaces whose JPEG data simplejpeg turns into the same RGB as PIL (CMYK and YCCK go to
# PIL, which applies Adobe's inversion).
_FAST_COLORSPACES = frozenset({"YCbCr", "Gray", "RGB"})


@dataclass(slots=True)
class Opened:
    """A checked image header: the file's pixels are not decoded yet.

    `data` holds the bytes of a plain JPEG that simplejpeg decodes (no PIL object then); `img`
    the lazily opened PIL image of everything else.
    """

    path: str
    width: int  # as displayed, i.e. after the EXIF rotation
    height: int
    img: Image.Image | None = None
    orientation: int = 1
    data: bytes | None = None

    @property
    def scalable(self) -> bool:
        """Whether a DCT-scaled decode is possible: an upright JPEG."""
        return self.data is not None or (
            self.img is not None and self.img.format == "JPEG" and self.orientation == 1
        )


def open_image(path: str, max_pixels: int, data: bytes | None = None) -> Opened:
    """Check and open `path`, or its bytes `data` when already read (raises BadImageError
    like `imageio.open_lazy`)."""
    if simplejpeg is not None:
        fast = _open_plain_jpeg(path, max_pixels, data)
        if fast is not None:
            return fast
    img, orientation = open_lazy(path, max_pixels, data=data)
    width, height = (img.height, img.width) if orientation in (5, 6, 7, 8) else img.size
    return Opened(path, width, height, img, orientation)


def _open_plain_jpeg(path: str, max_pixels: int, data: bytes | None = None) -> Opened | None:
    """A JPEG that simplejpeg decodes exactly as PIL would, from its bytes alone: upright (no
    EXIF rotation), 8-bit YCbCr/grey/RGB, a header DALI parses, within the pixel limit. None
    sends the file down PIL's path, which names whatever is wrong with it (or, for headers
    longer than 64 KiB, reads an EXIF block this walk did not reach)."""
    data = read_bytes(path) if data is None else data
    if data[:3] != b"\xff\xd8\xff":
        return None
    head = data[: 1 << 16]
    problem, header_end = jpeg_header_walk(head)
    if problem or header_end >= len(head) or jpeg_exif_orientation(data[:header_end]) != 1:
        return None  # PIL names the problem, or applies the rotation
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    if colorspace not in _FAST_COLORSPACES or width * height > max_pixels:
        return None
    return Opened(path, width, height, data=data)


def jpeg_reduction(opened: Opened, need_w: int, need_h: int) -> int:
    """The largest DCT scale-down (1, 2, 4 or 8) whose decode is still >= (need_w, need_h).

    Only an upright JPEG can be decoded scaled; pixels the resize would throw away are then
    never decoded (1/4 of the work at 2x, 1/16 at 4x).
    """
    if not opened.scalable:
        return 1
    for k in (8, 4, 2):
        if math.ceil(opened.width / k) >= need_w and math.ceil(opened.height / k) >= need_h:
            return k
    return 1


def decode_resized(
    opened: Opened,
    box: tuple[int, int, int, int],
    width: int,
    height: int,
    *,
    flip: bool = False,
    reduce: int = 1,
) -> np.ndarray:
    """Decode `opened` (DCT-scaled by `reduce`, see `jpeg_reduction`), crop `box` = (left, top,
    w, h) in full-image pixels, resize it to width x height (bilinear, antialiased) and mirror
    it if `flip`: a contiguous HWC uint8 RGB array.

    simplejpeg's pixels are resized by torch; PIL's by PIL, whose resize takes a sub-pixel box
    and whose image would cost a full-size copy to hand to torch.
    """
    if opened.data is not None:
        try:
            pixels = simplejpeg.decode_jpeg(
                opened.data,
                colorspace="RGB",
                min_width=math.ceil(opened.width / reduce),
                min_height=math.ceil(opened.height / reduce),
                min_factor=reduce,
            )
        except ValueError:
            # libjpeg-turbo's warnings are errors under strict mode (corrupt data); PIL decides
            # those files as it always did: decoded, or named in a BadImageError.
            lazy, _ = open_lazy(opened.path, opened.width * opened.height, data=opened.data)
            opened = Opened(opened.path, opened.width, opened.height, lazy)
        else:
            return _resize_array(
                pixels,
                _scaled_box(box, pixels.shape[1] / opened.width, pixels.shape[0] / opened.height),
                width,
                height,
                flip,
            )
    img = opened.img
    assert img is not None
    if reduce > 1:
        img.draft(None, (math.ceil(opened.width / reduce), math.ceil(opened.height / reduce)))
    img = decode_rgb(img, opened.orientation, opened.path)
    sx, sy = img.width / opened.width, img.height / opened.height
    left, top, w, h = box
    img = img.resize(
        (width, height), Image.Resampling.BILINEAR, box=(left * sx, top * sy, (left + w) * sx, (top + h) * sy)
    )
    return np.array(img.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else img)


def _scaled_box(box: tuple[int, int, int, int], sx: float, sy: float) -> tuple[int, int, int, int]:
    """`box` in an image scaled by (sx, sy), to the nearest pixel and at least one pixel."""
    if (sx, sy) == (1, 1):
        return box
    left, top, w, h = box
    x0, y0 = round(left * sx), round(top * sy)
    return x0, y0, max(1, round((left + w) * sx) - x0), max(1, round((top + h) * sy) - y0)


def _resize_array(
    pixels: np.ndarray, box: tuple[int, int, int, int], width: int, height: int, flip: bool
) -> np.ndarray:
    left, top, w, h = box
    view = torch.from_numpy(pixels).permute(2, 0, 1)[None, :, top : top + h, left : left + w]
    # Channels-last in: torch's vectorised uint8 kernel (Pillow-SIMD's), and HWC memory out.
    out = view.contiguous(memory_format=torch.channels_last)
    if (w, h) != (width, height):
        out = torch.nn.functional.interpolate(
            out, size=(height, width), mode="bilinear", antialias=True, align_corners=False
        )
    if flip:
        out = out.flip(3)  # torch's flip: 10x numpy's strided copy of a mirrored HWC view
    return out[0].permute(1, 2, 0).contiguous().numpy()
