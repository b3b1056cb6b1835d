"""Reads in flight: files are read off the training thread, several at a
time, on both loaders, and the batches stay the same samples in the same order."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import build_loader, exif_block, jpeg_with_segments, small_recipe
from PIL import Image

from stallfree.data.readers import headers
from stallfree.data.readers.imageio import BadImageError, check_header
from stallfree.parallel import DistInfo

CPU = torch.device("cpu")
DALI = pytest.param("dali", marks=pytest.mark.dali)
RAW_PIXELS = {"mean": [0.0, 0.0, 0.0], "std": [1 / 255] * 3}


class SlowReads:
    """`read_bytes` with a delay, recording which thread read which file and the most reads
    in flight at once; patched into every stallfree module that imported it."""

    def __init__(self, delay: float) -> None:
        self.delay, self.lock = delay, threading.Lock()
        self.threads: list[int] = []
        self.names: list[str] = []  # each read's thread name: a loader's readers are "stallfree-read"
        self.paths: list[str] = []
        self.in_flight = self.most_in_flight = 0
        self.original = headers.read_bytes

    def __call__(self, path: str, limit: int | None = None) -> bytes:
        with self.lock:
            self.threads.append(threading.get_ident())
            self.names.append(threading.current_thread().name)
            self.paths.append(path)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            time.sleep(self.delay)
            return self.original(path, limit)
        finally:
            with self.lock:
                self.in_flight -= 1

    def install(self, monkeypatch: pytest.MonkeyPatch) -> SlowReads:
        for name, module in list(sys.modules.items()):
            if name.startswith("stallfree") and getattr(module, "read_bytes", None) is self.original:
                monkeypatch.setattr(module, "read_bytes", self)
        return self


def _batches(recipe: Any, backend: str, epochs: tuple[int, ...] = (0, 1)) -> list[Any]:
    recipe.loader.backend = backend
    loader = build_loader(recipe, "train", device=CPU, dist=DistInfo())
    out = []
    try:
        for epoch in epochs:
            loader.set_epoch(epoch)
            out += [(b.images.clone(), b.labels.clone()) for b in loader]
    finally:
        loader.close()
    return out


def _odd_files(root: Path) -> list[Path]:
    """Files each header rule reads past what PIL parses: good, and refused by that rule."""
    root.mkdir()
    rgb = Image.new("RGB", (40, 30), (200, 30, 90))
    rgb.save(root / "good.jpg")
    rgb.save(root / "good.png")
    rgb.save(root / "lossless.webp", lossless=True, exif=Image.Exif().tobytes())
    rgb.save(root / "good.jp2")
    (root / "truncated.jp2").write_bytes((root / "good.jp2").read_bytes()[:-2])
    rgb.save(root / "animated.png", save_all=True, append_images=[Image.new("RGB", (40, 30))])
    good = (root / "good.jpg").read_bytes()
    app0_end = 4 + int.from_bytes(good[4:6], "big")  # junk after the first segment
    (root / "junk.jpg").write_bytes(good[:app0_end] + b"junk" + good[app0_end:])
    jpeg_with_segments(root / "two_exif.jpg", [(0xE1, exif_block(1)), (0xE1, exif_block(6))])
    return sorted(root.iterdir())


def _verdict(path: Path, **kwargs: Any) -> str:
    try:
        return str(check_header(str(path), **kwargs))
    except BadImageError as exc:
        return exc.reason


def test_header_check_on_bytes_already_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the bytes, the check reads nothing again, and finds what it finds by the path."""
    files = _odd_files(tmp_path / "odd")
    by_path = [_verdict(path) for path in files]
    assert len(set(by_path)) >= 5  # the refusals differ: each rule is exercised
    data = [path.read_bytes() for path in files]
    slow = SlowReads(0.0).install(monkeypatch)
    monkeypatch.setattr(Image, "open", _only_streams(Image.open))
    assert [_verdict(path, data=raw) for path, raw in zip(files, data)] == by_path
    assert slow.paths == []


def _only_streams(image_open: Any) -> Any:
    def opened(fp: Any, *args: Any, **kwargs: Any) -> Any:
        assert not isinstance(fp, (str, Path)), f"PIL opened {fp} by its path"
        return image_open(fp, *args, **kwargs)

    return opened


@pytest.mark.parametrize("backend", ["torch", DALI])
def test_io_depth_does_not_change_the_batches(image_root: Path, backend: str) -> None:
    """The same samples in the same order, with the same augmentation, bit for bit."""
    loaders = {"torch": {"workers": 0}, "dali": {"threads": 1}}
    runs = [
        _batches(
            small_recipe(
                image_root, augment=RAW_PIXELS, loader={"io_depth": depth, backend: loaders[backend]}
            ),
            backend,
        )
        for depth in (1, 8)
    ]
    assert len(runs[0]) == len(runs[1]) > 0
    for (images_a, labels_a), (images_b, labels_b) in zip(*runs):
        assert torch.equal(labels_a, labels_b)
        assert torch.equal(images_a, images_b)


@pytest.mark.dali
def test_dali_source_reads_off_the_training_thread(image_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DALI's source is called on the training thread: the files must be read (once each) on
    the reader pool, so that its time there per batch is far below batch x latency."""
    batch, delay = 8, 0.02
    loader_keys = {"backend": "dali", "io_depth": 16, "dali": {"threads": 1}}
    recipe = small_recipe(image_root, train={"batch_size": batch}, loader=loader_keys)
    # Installed first: the loader starts its first batches' reads while it is built, and a
    # build that outran them once left two files uncounted (a flaky "read twice").
    slow = SlowReads(delay).install(monkeypatch)
    loader = build_loader(recipe, "train", device=CPU, dist=DistInfo())
    built = len(slow.paths)  # the start-up header check's reads, on this thread or its pool
    try:
        batches = list(loader)
    finally:
        loader.close()
    assert batches
    training_thread = threading.get_ident()
    assert slow.paths[built:] and training_thread not in slow.threads[built:]
    # Each of the epoch's files once on the loader's readers (the header check re-reads none),
    # and at most the next epoch's first batches, read ahead as this one ends.
    reads = [path for path, name in zip(slow.paths, slow.names) if name.startswith("stallfree-read")]
    ahead = (recipe.loader.prefetch + 1) * batch
    assert len(batches) * batch <= len(reads) <= len(batches) * batch + ahead, "a file was read twice"
    per_batch = loader.source_s / loader.source_batches
    assert per_batch < batch * delay / 4, f"{per_batch * 1000:.1f} ms a batch in the source"


def test_torch_worker_keeps_reads_in_flight(image_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch's files are fetched concurrently, once each (then decoded from the bytes)."""
    slow = SlowReads(0.02).install(monkeypatch)
    recipe = small_recipe(image_root, loader={"io_depth": 8})
    recipe.loader.backend = "torch"
    loader = build_loader(recipe, "train", device=CPU, dist=DistInfo())
    slow.paths.clear()  # the start-up header check's reads are not the decode's
    slow.most_in_flight = 0
    try:
        assert list(loader)
    finally:
        loader.close()
    assert slow.most_in_flight > 1
    assert len(slow.paths) == len(set(slow.paths)), "a file was read twice"


@pytest.mark.dali
def test_loader_bench_reports_the_time_in_dalis_source(image_root: Path) -> None:
    """`stallfree bench --mode loader` records the training thread's time in DALI's source."""
    from stallfree.bench.runner import measure_loader

    dali = measure_loader(small_recipe(image_root, loader={"backend": "dali"}), warmup=1, batches=3)
    assert 0 < dali["dali_source_ms_per_batch"] < 1000 * dali["wall_s"] / 3
    torch_run = measure_loader(small_recipe(image_root), warmup=1, batches=3)
    assert "dali_source_ms_per_batch" not in torch_run  # no source on the training thread there


def test_io_depth_auto_keeps_more_reads_in_flight_from_a_store(image_root: Path) -> None:
    """`loader.io_depth = "auto"` (the default): 16 reads a worker from a path (a local disk or
    a network filesystem, ~2 ms a read), 64 from an object store, whose ~50 ms a request 16
    cannot hide (benchmarks/RESULTS.md); a number is kept as it is, on both loaders."""
    from stallfree.data.readers.inflight import reads_in_flight
    from stallfree.recipe import LoaderConfig

    assert LoaderConfig().io_depth == "auto"
    assert reads_in_flight("auto", str(image_root)) == 16
    assert reads_in_flight("auto", "s3://bucket/imagenet/train/") == 64
    assert reads_in_flight(8, "s3://bucket/imagenet/train/") == 8
    assert reads_in_flight(32, str(image_root)) == 32
    recipe = small_recipe(image_root, loader={"torch": {"workers": 0}})
    loader = build_loader(recipe, "train", device=CPU, dist=DistInfo())
    try:
        assert loader.dataloader.dataset.readers.threads == 16  # type: ignore[attr-defined]
    finally:
        loader.close()
