"""bench: the measurements on tiny data, the interleaved runner, and the report writer."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest
import torch
from helpers import build_loader, small_recipe
from inprocess import Cli
from PIL import Image

from stallfree.bench.report import markdown, ratios, summarise, write_report
from stallfree.bench.runner import (
    BenchConfig,
    measure_bare_loop,
    measure_loader,
    measure_train,
    stream,
)
from stallfree.data.tools.demo import write_demo

CPU = torch.device("cpu")


def _fake_result() -> dict:
    records = []
    for repeat, scale in enumerate((1.0, 1.2, 0.9)):
        for backend, ips in (
            ("torch", 300),
            ("torch-naive", 200),
            ("dali", 400),
            ("peer-pil", 250),
            ("peer-webdataset", 240),
        ):
            records.append(
                {
                    "backend": backend,
                    "mode": "loader",
                    "knob": None,
                    "repeat": repeat,
                    "images_per_s": ips * scale,
                    "cpu_cores": 1.9,
                    "peak_pss_mb": 500,
                }
            )
        for backend, ips in (("synthetic", 98), ("bare-loop", 100)):
            records.append(
                {
                    "backend": backend,
                    "mode": "train",
                    "knob": None,
                    "repeat": repeat,
                    "images_per_s": ips * scale,
                    "data_wait_frac": 0.0,
                    "step_ms": 10.0,
                }
            )
    records.append(
        {"backend": "dali", "mode": "train", "knob": None, "repeat": 0, "error": "RuntimeError: boom"}
    )
    return {
        "machine": {
            "cpu": "Test CPU",
            "cores_available": 2,
            "gpu": None,
            "torch": "x",
            "dali": None,
            "python": "3.11",
        },
        "limit": {
            "images_per_s": 500.0,
            "cores": 2,
            "single_thread": {"pil": 200.0, "fast": 250.0},
            "fastest": "fast",
            "spread": [450.0, 550.0],
            "runs": 3,
        },
        "records": records,
        "config": {
            "repeats": 3,
            "warmup": 1,
            "batches": 2,
            "batch_size": 8,
            "model": "m",
            "image_size": 32,
            "precision": "fp32",
            "data_root": "d",
            "augment": "RandomResizedCrop + flip, RandAugment n=2 m=9/31",
        },
    }


def test_summary_takes_medians_and_ratios() -> None:
    result = _fake_result()
    rows = {(r["mode"], r["backend"]): r for r in summarise(result)}
    assert rows[("loader", "torch")]["images_per_s"] == pytest.approx(300)
    assert rows[("loader", "torch")]["of_limit"] == pytest.approx(0.6)
    assert rows[("loader", "torch")]["runs"] == 3
    measured = ratios(list(rows.values()), 500.0)
    assert measured["torch loader / torch-naive loader"] == pytest.approx(1.5)
    assert measured["dali loader / limit"] == pytest.approx(0.8)
    assert measured["synthetic train / bare loop"] == pytest.approx(0.98)
    # Peers: x best peer beside x limit, and the targets' ratios named.
    assert rows[("loader", "torch")]["of_peer"] == pytest.approx(1.2)
    assert measured["torch loader / plain DataLoader + PIL (peer-pil)"] == pytest.approx(1.2)
    assert measured["dali loader / fastest peer (peer-pil)"] == pytest.approx(1.6)


def test_report_writes_json_markdown_and_chart(tmp_path: Path) -> None:
    result = _fake_result()
    written = write_report(result, tmp_path, command="stallfree bench x.toml")
    names = {p.name for p in written}
    assert {"bench.json", "bench.md"} <= names
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["machine"]["cpu"] == "Test CPU" and len(saved["summary"]) == 7
    text = (tmp_path / "bench.md").read_text()
    assert "| loader | **limit** (fast) | 2 cores | 500 (450-550) | 1.00 |" in text
    assert "| loader | torch | auto | 300 | 0.60 | 1.20 |" in text
    assert "`stallfree bench x.toml`" in text and "RuntimeError: boom" in text
    assert "32 px (RandomResizedCrop + flip, RandAugment n=2 m=9/31)" in text  # what was timed
    pytest.importorskip("matplotlib")
    assert "bench.png" in names
    assert Image.open(tmp_path / "bench.png").size[0] > 100


def test_the_report_names_the_augmentation_timed() -> None:
    from stallfree.bench.runner import augment_words
    from stallfree.recipe import AugmentConfig

    assert augment_words(AugmentConfig()) == "RandomResizedCrop + flip"
    words = augment_words(AugmentConfig(auto_augment="trivialaugment", random_erasing=0.25))
    assert words == "RandomResizedCrop + flip, TrivialAugmentWide (31 bins), random erasing p=0.25"


def test_the_report_says_whether_the_comparison_was_strict() -> None:
    result = _fake_result()  # a bench.json of before the switch: off, as it was
    assert "Strict comparison: off" in markdown(result, summarise(result))
    result["config"]["exact_decode"] = True
    assert "Strict comparison: on (`loader.torch.exact_decode`)" in markdown(result, summarise(result))


def test_markdown_without_limit_or_train() -> None:
    result = _fake_result()
    result["limit"] = None
    result["records"] = [r for r in result["records"] if r["mode"] == "loader"]
    text = markdown(result, summarise(result))
    assert "**limit**" not in text and "/ limit" not in text
    assert "| loader | torch | auto | 300 | - | 1.20 |" in text


def test_warmup_and_window_share_one_iterator(image_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loader = build_loader(small_recipe(image_root), "train", device=CPU)  # 7 batches an epoch
    iterations = []
    original = type(loader).__iter__
    monkeypatch.setattr(type(loader), "__iter__", lambda self: iterations.append(1) or original(self))
    batches = stream(loader)
    warmup = list(islice(batches, 5))
    window = list(islice(batches, 5))
    assert len(warmup) == len(window) == 5
    # One iterator per epoch: the timed window did not restart the loader after the warm-up.
    assert len(iterations) == 2
    assert (loader.epoch, loader.position) == (1, 3 * 8)


def test_measurements_on_tiny_data(image_root: Path) -> None:
    recipe = small_recipe(image_root)
    recipe.loader.backend = "stallfree.data.backends.naive:build"
    loader = measure_loader(recipe, warmup=1, batches=3)
    assert loader["images_per_s"] > 0 and loader["peak_pss_mb"] > 10
    trained = measure_train(small_recipe(image_root, loader={"backend": "synthetic"}), warmup=1, steps=3)
    assert trained["images_per_s"] > 0 and 0 <= trained["data_wait_frac"] < 1
    bare = measure_bare_loop(small_recipe(image_root), warmup=1, steps=3)
    assert bare["images_per_s"] > 0 and bare["step_ms"] > 0


@pytest.mark.parametrize("peer", ["peer-pil", "peer-webdataset"])
def test_peers_load_the_same_files_as_ours(image_root: Path, peer: str) -> None:
    from stallfree.bench.variants import PEERS

    recipe = small_recipe(image_root, loader={"backend": PEERS[peer][0], "torch": {"workers": 1}})
    loader = build_loader(recipe, "train", device=CPU)
    try:
        batches = list(loader)
        assert len(batches) == len(loader) > 0
        images, labels = batches[0]
        assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
        assert -3 < float(images.mean()) < 3 and labels.dtype == torch.int64
        assert len(list(loader)) == len(loader)  # a second epoch
    finally:
        loader.close()


def test_bench_config_rejects_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown bench backend 'ffcv'"):
        BenchConfig(backends=["ffcv"]).validate()


def test_naive_loader_matches_torch_labels_and_dtype(image_root: Path) -> None:
    recipe = small_recipe(image_root)
    tuned = build_loader(recipe, "val", device=CPU)
    recipe.loader.backend = "stallfree.data.backends.naive:build"
    naive = build_loader(recipe, "val", device=CPU)
    for a, b in zip(naive, tuned):
        assert a.images.dtype == torch.float32 and a.images.shape == b.images.shape
        assert torch.equal(a.labels, b.labels)
        assert (a.images - b.images).abs().mean() < 0.02  # same val transform, same normalisation
    naive.close()
    tuned.close()


def test_photo_like_data_is_photo_sized(tmp_path: Path) -> None:
    write_demo(tmp_path, train_per_class=1, val_per_class=0, photo_like=True, progress=False)
    files = sorted(tmp_path.glob("train/*/*.jpg"))
    assert len(files) == 10
    sizes = [Image.open(f).size for f in files]
    assert all(333 <= min(s) <= 500 for s in sizes)
    mean_kb = sum(f.stat().st_size for f in files) / len(files) / 1000
    assert 50 < mean_kb < 200, mean_kb


def test_dali_sweeps_threads_and_hardware_decoder_load() -> None:
    from stallfree.bench.runner import _variants

    config = BenchConfig(threads=[2, 4], hw_decoder_loads=[0.12, 0.65])
    variants = dict(_variants("dali-cpudecode", config))
    assert variants["2 hw0.12"] == ["loader.dali.threads=2", "loader.dali.hw_decoder_load=0.12"]
    assert len(variants) == 4 and _variants("synthetic", config) == [(None, [])]


def test_bench_names_come_from_the_registry_and_select_by_the_recipe(cli: Cli) -> None:
    """Every registered backend is a bench row under its own name, each row is the recipe
    override `train` would take, and the CLI's help lists these names."""
    from stallfree.bench.variants import BENCH_VARIANTS, PEERS
    from stallfree.data.registry import BACKENDS
    from stallfree.recipe import Recipe, apply_overrides

    assert set(BACKENDS) | set(PEERS) <= set(BENCH_VARIANTS)
    for name, sets in BENCH_VARIANTS.items():
        recipe = apply_overrides(Recipe(), list(sets))
        assert recipe.loader.backend in BACKENDS or ":" in recipe.loader.backend, name
    done = cli("bench", "--help")
    assert done.code == 0
    text = " ".join(done.out.split()).replace("- ", "-")  # argparse's wrapping
    assert all(name in text for name in BENCH_VARIANTS)


def test_the_memory_sampler_backs_off_when_a_sample_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading smaps_rollup walks every page table of a process: for a loader with workers it
    took ~11% of the one core a loader ran on (perf: smaps_account) at 10 samples a second,
    CPU taken from the loader being measured. A sample that costs time is taken less often."""
    import time

    from stallfree.bench import usage

    calls = []

    def slow_pss() -> float:
        calls.append(time.perf_counter())
        time.sleep(0.02)  # as a big process tree's smaps_rollup reads
        return 1.0

    monkeypatch.setattr(usage, "_tree_pss_mb", slow_pss)
    with usage.ResourceSampler(interval=0.01):
        time.sleep(0.6)
    # One sample at the start; then at most one a ~2 s (100x the sample's 20 ms): <= 1% busy.
    assert 1 <= len(calls) <= 2, len(calls)
