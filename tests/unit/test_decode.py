"""Which files are images and how they decode: the rules both backends share (data.imageio).

DALI's CPU decoder is the reference for pixels: the parity tests compare the torch path with
a small DALI pipeline on files of each awkward kind, all written into tmp_path.
"""

from __future__ import annotations

import io
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps, features

from stallfree.data.readers.imageio import (
    ACCEPTED_FORMATS,
    DEFAULT_MAX_PIXELS,
    IMAGE_EXTENSIONS,
    BadImageError,
    check_header,
    open_rgb,
)
from stallfree.data.transforms.augment import train_transform, val_transform
from stallfree.recipe import AugmentConfig

SIDE = 48  # the crop side the transforms are given
AUG = AugmentConfig(image_size=SIDE, resize_size=56)
_Y, _X = np.mgrid[0:64, 0:256]


def _dali(paths: list[Path], aug: AugmentConfig | None = None) -> list[np.ndarray]:
    """DALI CPU decode (then, with `aug`, the val resize and center crop) of `paths`: uint8 HWC."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=len(paths), num_threads=1, device_id=None)
    def pipe():  # a DALI graph
        data, _ = fn.readers.file(files=[str(p) for p in paths])
        images = fn.decoders.image(data, device="cpu", output_type=types.RGB)
        if aug is not None:
            images = fn.resize(
                images, resize_shorter=aug.resize_size, interp_type=types.INTERP_LINEAR, antialias=True
            )
            images = fn.crop(images, crop=(aug.image_size, aug.image_size), crop_pos_x=0.5, crop_pos_y=0.5)
        return images

    p = pipe()
    p.build()
    (out,) = p.run()
    return [np.array(out.at(i)) for i in range(len(paths))]


def _png(path: Path, pixels: np.ndarray, bits: int, color_type: int, trns: bytes | None = None) -> Path:
    """A PNG written byte by byte (PIL cannot write 16-bit RGB or every tRNS form)."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    h, w = pixels.shape[:2]
    dtype = ">u2" if bits == 16 else np.uint8
    rows = b"".join(b"\x00" + row.astype(dtype).tobytes() for row in pixels.reshape(h, -1))
    body = chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, bits, color_type, 0, 0, 0))
    body += chunk(b"tRNS", trns) if trns is not None else b""
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + body + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return path


def _gradient16() -> np.ndarray:
    """A 16-bit grey ramp over the whole range: mean about 32768 (128 in 8 bits)."""
    return (_X * 65535 // 255).astype(np.uint16)


def _rgb8() -> np.ndarray:
    return np.stack([_X, _Y * 4, 255 - _X], axis=-1).astype(np.uint8)


def _write_kind(tmp_path: Path, kind: str) -> Path:
    """One file of an awkward pixel kind; black where transparent, so compositing would show."""
    rgb, grey = _rgb8(), _X.astype(np.uint8)
    if kind == "gray16_png":
        return _png(tmp_path / "g16.png", _gradient16(), 16, 0)
    if kind == "rgb16_png":
        g = _gradient16()
        return _png(tmp_path / "rgb16.png", np.stack([g, g[:, ::-1], g], -1), 16, 2)
    if kind == "gray16_tiff":
        Image.fromarray(_gradient16()).save(tmp_path / "g16.tif")
        return tmp_path / "g16.tif"
    if kind == "gray_trns_png":  # value 0 (black) marked transparent
        return _png(tmp_path / "g_trns.png", grey, 8, 0, trns=struct.pack(">H", 0))
    if kind == "rgb_trns_png":
        return _png(tmp_path / "rgb_trns.png", rgb, 8, 2, trns=struct.pack(">HHH", 0, 0, 255))
    path = tmp_path / f"{kind}.png"
    if kind == "palette_trns_png":
        pal = Image.fromarray(rgb).convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
        pal.save(path, transparency=bytes([0] + [128] * 30 + [255]))
    elif kind == "la_png":
        Image.fromarray(np.dstack([grey, np.zeros_like(grey)]), "LA").save(path)
    elif kind == "rgba_png":  # fully transparent: only the stored colours remain
        Image.fromarray(np.dstack([rgb, np.zeros_like(grey)]), "RGBA").save(path)
    elif kind == "one_bit_png":
        Image.fromarray(grey).convert("1").save(path)
    else:
        raise ValueError(kind)
    return path


PIXEL_KINDS = [
    "gray16_png",
    "rgb16_png",
    "gray16_tiff",
    "gray_trns_png",
    "rgb_trns_png",
    "palette_trns_png",
    "la_png",
    "rgba_png",
    "one_bit_png",
]


@pytest.mark.dali
@pytest.mark.parametrize("kind", PIXEL_KINDS)
def test_torch_val_pixels_match_dali(tmp_path: Path, kind: str) -> None:
    path = _write_kind(tmp_path, kind)
    torch_val = val_transform(str(path), AUG, SIDE).astype(float)
    (dali_val,) = _dali([path], AUG)
    assert torch_val.shape == dali_val.shape == (48, 48, 3)
    diff = np.abs(torch_val - dali_val).mean()
    assert abs(torch_val.mean() - dali_val.mean()) < 2 and diff < 2, (
        f"{kind}: torch mean {torch_val.mean():.1f}, DALI mean {dali_val.mean():.1f}, "
        f"mean abs difference {diff:.2f}"
    )


@pytest.mark.dali
@pytest.mark.parametrize("kind", PIXEL_KINDS)
def test_decoded_pixels_match_dali_to_one_level(tmp_path: Path, kind: str) -> None:
    # Before resizing: 16-bit grey is exact (round(v / 257), as DALI); PIL's own 16-bit RGB
    # reduction truncates, so that one may be a level off.
    path = _write_kind(tmp_path, kind)
    torch_rgb = np.asarray(open_rgb(str(path))).astype(int)
    (dali_rgb,) = _dali([path])
    assert np.abs(torch_rgb - dali_rgb).max() <= (1 if kind == "rgb16_png" else 0)


def test_16_bit_grey_is_scaled_not_clipped(tmp_path: Path) -> None:
    # PIL's convert("RGB") clips 16-bit values at 255: a mid-grey ramp came out all white.
    path = _write_kind(tmp_path, "gray16_png")
    pixels = val_transform(str(path), AUG, SIDE)
    assert pixels.dtype == np.uint8 and pixels.shape == (48, 48, 3)
    assert 100 < pixels.mean() < 156, pixels.mean()
    row = np.asarray(open_rgb(str(path)))[0, :, 0].astype(int)
    assert row[0] == 0 and row[-1] == 255 and np.all(np.diff(row) >= 0)


@pytest.mark.parametrize("kind", ["gray_trns_png", "rgb_trns_png", "palette_trns_png", "la_png", "rgba_png"])
def test_transparency_keeps_the_stored_colours(tmp_path: Path, kind: str) -> None:
    # DALI ignores alpha and tRNS; a background composite (grey, white or black) would differ.
    path = _write_kind(tmp_path, kind)
    stored = Image.open(path)
    if stored.mode == "P":
        stored = stored.convert("RGBA")
    expected = np.asarray(stored.convert("RGB"))
    assert np.array_equal(np.asarray(open_rgb(str(path))), expected)


# --- which files are accepted ------------------------------------------------------------------


def _write_format(tmp_path: Path, fmt: str) -> Path:
    img = Image.fromarray(_rgb8())
    suffix = {"JPEG2000": "jp2", "MPO": "mpo", "PPM": "ppm", "TIFF": "tif"}.get(fmt, fmt.lower())
    path = tmp_path / f"image.{suffix}"
    extra = {"save_all": True, "append_images": [img]} if fmt == "MPO" else {}
    img.save(path, format=fmt, **extra)
    return path


WRITABLE = ["JPEG", "MPO", "PNG", "BMP", "TIFF", "WEBP", "PPM", "JPEG2000", "GIF", "ICO", "TGA", "PCX"]


def _can_write(fmt: str) -> bool:
    return {"JPEG2000": features.check("jpg_2000"), "WEBP": features.check("webp")}.get(fmt, True)


@pytest.mark.parametrize("fmt", WRITABLE)
def test_check_header_accepts_exactly_the_accepted_formats(tmp_path: Path, fmt: str) -> None:
    if not _can_write(fmt):
        pytest.skip(f"this PIL cannot write {fmt}")
    path = _write_format(tmp_path, fmt)
    if fmt in ACCEPTED_FORMATS:
        assert check_header(str(path)) == (256, 64)
    else:
        with pytest.raises(BadImageError, match=f"{fmt} images are not accepted.*accepted: BMP"):
            check_header(str(path))


@pytest.mark.dali
@pytest.mark.parametrize("fmt", WRITABLE)
def test_accepted_formats_are_the_ones_dali_decodes(tmp_path: Path, fmt: str) -> None:
    if not _can_write(fmt):
        pytest.skip(f"this PIL cannot write {fmt}")
    path = _write_format(tmp_path, fmt)
    try:
        (pixels,) = _dali([path])
    except RuntimeError:
        pixels = None
    assert (pixels is not None) == (fmt in ACCEPTED_FORMATS), fmt
    if pixels is not None:
        assert np.abs(pixels.astype(int) - np.asarray(open_rgb(str(path)))).mean() < 1


def test_image_extensions_name_accepted_formats() -> None:
    known = Image.registered_extensions()
    assert {known[ext] for ext in IMAGE_EXTENSIONS} == ACCEPTED_FORMATS
    assert all(ext == ext.lower() and ext.startswith(".") for ext in IMAGE_EXTENSIONS)


def _write_refused(tmp_path: Path, kind: str) -> Path:
    """Files of accepted formats whose pixels DALI cannot decode, or decodes differently."""
    grey = _X.astype(np.uint8)
    suffix = {
        "webp_lossless_exif": "webp",
        "webp_exif_rotated": "webp",
        "pgm_maxval_100": "pgm",
        "apng": "png",
        "jpeg_junk_between_segments": "jpg",
    }.get(kind, "tif")
    path = tmp_path / f"{kind}.{suffix}"
    if kind == "tiff_float":  # DALI scales 0..1 floats to 0..255; PIL clips 0..255
        Image.fromarray(_X.astype(np.float32) / 255).save(path)
    elif kind == "tiff_int32":  # DALI cannot decode 32-bit integer samples
        Image.fromarray(_X.astype(np.int32) * 1000).save(path)
    elif kind == "tiff_grey_alpha":  # DALI returns (L, A, L) instead of (L, L, L)
        Image.fromarray(np.dstack([grey, np.full_like(grey, 128)]), "LA").save(path)
    elif kind == "tiff_1bit_raw":  # PIL omits BitsPerSample; DALI's TIFF parser requires it
        Image.fromarray(grey).convert("1").save(path)
    elif kind == "pgm_maxval_100":  # PIL scales by maxval, DALI ignores it
        scaled = (grey.astype(int) * 100 // 255).astype(np.uint8)
        path.write_bytes(b"P5 256 64 100\n" + scaled.tobytes())
    elif kind == "webp_lossless_exif":  # nvImageCodec cannot parse VP8X + VP8L + EXIF
        exif = Image.Exif()
        exif[0x010F] = "camera"
        Image.fromarray(_rgb8()).save(path, lossless=True, exif=exif.tobytes())
    elif kind == "webp_exif_rotated":  # PIL applies the rotation, DALI does not (lossy WebP)
        exif = Image.Exif()
        exif[0x0112] = 6
        Image.fromarray(_rgb8()).save(path, quality=90, exif=exif.tobytes())
    elif kind == "jpeg_junk_between_segments":  # PIL skips the junk, DALI's parser stops
        buffer = io.BytesIO()
        Image.fromarray(_rgb8()).save(buffer, "JPEG", quality=90)
        data = buffer.getvalue()
        app0_end = 4 + int.from_bytes(data[4:6], "big")
        path.write_bytes(data[:app0_end] + b"junk" + data[app0_end:])
    elif kind == "apng":  # broken animation chunks fail in DALI: every APNG is refused
        frames = [Image.fromarray(_rgb8()), Image.fromarray(255 - _rgb8())]
        frames[0].save(path, save_all=True, append_images=frames[1:])
    elif kind == "tiff_multipage":  # DALI fails on some page chains (loops): all refused
        Image.fromarray(grey).save(path, save_all=True, append_images=[Image.fromarray(grey)])
    return path


REFUSED = {
    "tiff_float": "pixel mode F",
    "tiff_int32": "pixel mode I",
    "tiff_grey_alpha": "grey+alpha",
    "tiff_1bit_raw": "BitsPerSample",
    "pgm_maxval_100": "maxval 100",
    "webp_lossless_exif": "lossless WebP with EXIF",
    "webp_exif_rotated": "WebP with an EXIF rotation",
    "apng": "animated PNG",
    "jpeg_junk_between_segments": "junk bytes between JPEG header segments",
    "tiff_multipage": "multi-page TIFF",
}
# Refused as a precaution: DALI decodes well-formed ones, but not every malformed one.
_PRECAUTION = {"apng", "tiff_multipage", "webp_exif_rotated"}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_pixel_kinds_that_the_backends_do_not_share_are_refused(tmp_path: Path, kind: str) -> None:
    path = _write_refused(tmp_path, kind)
    with pytest.raises(BadImageError, match=re.escape(REFUSED[kind])):
        check_header(str(path))
    with pytest.raises(BadImageError, match=re.escape(REFUSED[kind])):
        val_transform(str(path), AUG, SIDE)


@pytest.mark.dali
@pytest.mark.parametrize("kind", sorted(set(REFUSED) - _PRECAUTION))
def test_refused_kinds_really_fail_or_differ_in_dali(tmp_path: Path, kind: str) -> None:
    # If a DALI upgrade makes one of these decode like PIL, its refusal can be lifted.
    path = _write_refused(tmp_path, kind)
    try:
        (pixels,) = _dali([path])
    except RuntimeError:
        return
    with Image.open(path) as img:
        reference = np.asarray(ImageOps.exif_transpose(img).convert("RGB")).astype(int)
    assert np.abs(pixels.astype(int) - reference).mean() > 5


# --- bad files: named, one line, before any decoding ---------------------------------------------


def _jpeg_claiming(tmp_path: Path, width: int, height: int) -> Path:
    """A ~1 KB JPEG whose SOF0 header claims width x height: a decompression bomb's header."""
    buf = io.BytesIO()
    Image.fromarray(_rgb8()[:16, :16]).save(buf, "JPEG", quality=90)
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")  # marker, length (2), precision (1), height (2), width (2)
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    path = tmp_path / "bomb.jpg"
    path.write_bytes(bytes(data))
    return path


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jpg"
    path.write_bytes(b"")
    with pytest.raises(BadImageError) as info:
        check_header(str(path))
    assert str(info.value) == f"{path}: empty file (0 bytes)"
    assert info.value.path == str(path) and info.value.reason == "empty file (0 bytes)"


def test_text_named_jpg(tmp_path: Path) -> None:
    path = tmp_path / "notes.jpg"
    path.write_text("these are not pixels\n" * 20)
    with pytest.raises(BadImageError, match="not an image PIL can identify"):
        check_header(str(path))
    with pytest.raises(BadImageError, match="not an image PIL can identify"):
        train_transform(str(path), AUG, SIDE, seed=0)


def test_gif_is_refused_by_name(tmp_path: Path) -> None:
    path = _write_format(tmp_path, "GIF")
    with pytest.raises(BadImageError) as info:
        check_header(str(path))
    assert "GIF" in info.value.reason and "JPEG" in info.value.reason
    assert "\n" not in str(info.value)


def test_decompression_bomb_header_is_refused_before_decoding(tmp_path: Path) -> None:
    path = _jpeg_claiming(tmp_path, 30000, 30000)
    assert path.stat().st_size < 2048
    expected = (
        f"{path}: 30000x30000 = 900000000 pixels is over data.max_pixels "
        f"({DEFAULT_MAX_PIXELS}): a decompression bomb or an oversized image"
    )
    with pytest.raises(BadImageError) as info:
        check_header(str(path))
    assert str(info.value) == expected
    peak_before = _peak_rss_mib()
    for transform in (val_transform, train_transform):
        with pytest.raises(BadImageError) as info:
            transform(str(path), AUG, SIDE, 0)
        assert str(info.value) == expected
    # A decode would have allocated 30000 x 30000 x 3 bytes (2.5 GiB) before failing.
    assert _peak_rss_mib() - peak_before < 256
    assert Image.MAX_IMAGE_PIXELS == DEFAULT_MAX_PIXELS  # PIL's own limit is left as it was


def test_max_pixels_override(tmp_path: Path) -> None:
    bomb = _jpeg_claiming(tmp_path, 30000, 30000)
    assert check_header(str(bomb), max_pixels=30000 * 30000) == (30000, 30000)
    small = _write_format(tmp_path, "PNG")  # 256 x 64 = 16384 pixels
    over = r"256x64 = 16384 pixels is over data.max_pixels \(16000\)"
    with pytest.raises(BadImageError, match=over):
        val_transform(str(small), AUG, SIDE, max_pixels=16_000)
    assert val_transform(str(small), AUG, SIDE, max_pixels=16_384).shape == (48, 48, 3)


def test_a_raised_max_pixels_is_not_refused_again_by_pil(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # PIL alone would refuse 16384 pixels
    small = _write_format(tmp_path, "TIFF")
    assert np.asarray(open_rgb(str(small), max_pixels=20_000)).shape == (64, 256, 3)
    with pytest.raises(BadImageError, match="over data.max_pixels"):
        check_header(str(small), max_pixels=10_000)
    assert Image.MAX_IMAGE_PIXELS == 1000  # restored


def test_truncated_jpeg_passes_the_header_check_but_not_the_decode(tmp_path: Path) -> None:
    buf = io.BytesIO()
    Image.fromarray(_rgb8()).save(buf, "JPEG", quality=90)
    path = tmp_path / "truncated.jpg"
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    assert check_header(str(path)) == (256, 64)
    for decode in (
        lambda: open_rgb(str(path)),
        lambda: val_transform(str(path), AUG, SIDE),
        lambda: train_transform(str(path), AUG, SIDE, 0),
    ):
        with pytest.raises(BadImageError) as info:
            decode()
        message = str(info.value)
        assert message.startswith(f"{path}: cannot decode: OSError: ") and "truncated" in message
        assert "\n" not in message


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(BadImageError, match="cannot read"):
        check_header(str(tmp_path / "gone.jpg"))


def test_bad_image_error_survives_pickling_and_a_one_argument_rebuild() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(BadImageError("/data/a.jpg", "empty file (0 bytes)")))
    assert (err.path, err.reason, str(err)) == (
        "/data/a.jpg",
        "empty file (0 bytes)",
        "/data/a.jpg: empty file (0 bytes)",
    )
    assert isinstance(err, ValueError)
    # torch's DataLoader re-raises a worker's exception as type(exc)(message)
    assert (
        str(BadImageError("Caught BadImageError in DataLoader worker"))
        == "Caught BadImageError in DataLoader worker"
    )


def _peak_rss_mib() -> float:
    resource = pytest.importorskip("resource")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def test_check_header_is_safe_from_many_threads(tmp_path: Path) -> None:
    # The DALI backend checks a dataset's headers from a thread pool; PIL's own limit, lifted
    # while any check runs, must come back afterwards.
    from concurrent.futures import ThreadPoolExecutor

    good = _write_format(tmp_path, "PNG")
    bomb = _jpeg_claiming(tmp_path, 30000, 30000)
    before = Image.MAX_IMAGE_PIXELS

    def check(path: Path) -> str:
        try:
            return str(check_header(str(path)))
        except BadImageError as exc:
            return exc.reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(check, [good, bomb] * 200))
    assert results[0] == "(256, 64)" and "30000x30000" in results[1]
    assert len(set(results)) == 2
    assert Image.MAX_IMAGE_PIXELS == before
