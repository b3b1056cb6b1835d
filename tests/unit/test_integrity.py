"""Defects a new-user audit found, each with the behaviour it checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import build_loader, exif_block, small_recipe
from inprocess import Cli
from PIL import Image

from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.readers.imageio import BadImageError
from stallfree.recipe import DataConfig, dump_toml

CPU = torch.device("cpu")


def _img(path: Path, value: int = 90, size: tuple[int, int] = (40, 30)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (value, 255 - value, value // 2)).save(path, quality=90)


def _root(root: Path, per_class: int = 4) -> Path:
    for split in ("train", "val"):
        for c in ("a", "b"):
            for i in range(per_class):
                _img(root / split / c / f"{i}.jpg", 40 * i + (100 if c == "b" else 0))
    return root


def test_an_empty_val_class_folder_is_warned_about(tmp_path: Path) -> None:
    root = _root(tmp_path / "data")
    for path in (root / "val" / "b").iterdir():
        path.unlink()
    with pytest.warns(UserWarning, match=r"no folder or no images for 1 training class.*b"):
        resolve_dataset(DataConfig(root=str(root)))


def test_an_unwritable_cache_costs_a_warning_not_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = _root(tmp_path / "data")
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    recipe = small_recipe(root, data={"on_error": "skip"}, train={"batch_size": 2})
    with pytest.warns(UserWarning, match="cannot write the check cache"):
        build_loader(recipe, "train", device=CPU).close()


def test_bench_checks_its_out_folder_first(tmp_path: Path, cli: Cli) -> None:
    (tmp_path / "afile").write_text("x")
    recipe = tmp_path / "r.toml"
    recipe.write_text(dump_toml(small_recipe(_root(tmp_path / "data"))))
    done = cli("bench", recipe, "--out", tmp_path / "afile", "--no-progress")
    assert done.code == 2
    assert "is a file" in done.err


def test_bench_memory_is_pss_shared_pages_split_among_processes() -> None:
    from stallfree.bench.usage import _tree_pids, _tree_pss_mb

    def rss_mb(pid: int) -> float:
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            return 0.0
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024

    rss = sum(rss_mb(pid) for pid in _tree_pids())  # this process and any it started (servers)
    pss = _tree_pss_mb()
    assert 0 < pss <= rss * 1.01  # PSS never exceeds RSS: shared pages are not counted whole


def _bitfields_bmp(path: Path) -> Path:
    """A 32-bit BMP with BI_BITFIELDS colour masks (Pillow writes none; cameras and Windows do)."""
    w, h = 8, 6
    pixels = bytes(range(256))[: w * h * 4]
    info = (40).to_bytes(4, "little") + w.to_bytes(4, "little") + h.to_bytes(4, "little")
    info += (1).to_bytes(2, "little") + (32).to_bytes(2, "little") + (3).to_bytes(4, "little")
    info += len(pixels).to_bytes(4, "little") + bytes(16)
    masks = b"".join(m.to_bytes(4, "little") for m in (0x00FF0000, 0x0000FF00, 0x000000FF))
    head = b"BM" + (66 + len(pixels)).to_bytes(4, "little") + bytes(4) + (66).to_bytes(4, "little")
    path.write_bytes(head + info + masks + pixels)
    return path


def _misplaced_bmp(path: Path) -> Path:
    """A palette BMP whose file header says the pixels start where the palette does."""
    Image.new("P", (8, 6), 3).save(path, "BMP")
    data = bytearray(path.read_bytes())
    data[10:14] = (54).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


def _turned_png(path: Path) -> Path:
    Image.new("RGB", (8, 6), (200, 30, 30)).save(path, "PNG", exif=exif_block(6))
    return path


@pytest.mark.parametrize(
    ("make", "words"),
    [(_bitfields_bmp, "bit-field"), (_misplaced_bmp, "pixel-data offset"), (_turned_png, "orientation")],
)
def test_files_the_loaders_decode_to_different_pixels_are_refused(tmp_path: Path, make, words: str) -> None:
    """Pillow's corpus found three kinds that both loaders decode, to different pixels (13-95 grey
    levels mean): BMP colour masks, a BMP pixel offset that contradicts its palette, and a PNG
    orientation tag. The header check names them; a plain BMP and PNG still pass."""
    from stallfree.data.readers.imageio import check_header

    bad = make(tmp_path / f"bad.{'png' if make is _turned_png else 'bmp'}")
    with pytest.raises(BadImageError, match=words):
        check_header(str(bad))
    for fmt in ("BMP", "PNG"):
        Image.new("P", (8, 6), 3).save(tmp_path / f"ok.{fmt.lower()}", fmt)
        check_header(str(tmp_path / f"ok.{fmt.lower()}"))
