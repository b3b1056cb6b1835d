"""augment.auto_augment: RandAugment and TrivialAugmentWide alike on both loaders.

Each operation of the torch backend's suites (stallfree.data.transforms.policies) is checked against DALI's
own (nvidia.dali.auto_aug) at fixed magnitudes and signs; DALI's graph applies the operations
both loaders are handed (`draw_ops`); both loaders run them end to end.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build_loader, small_recipe
from PIL import Image

from stallfree.data.transforms.policies import FILL, MAX_TRANSLATE, SUITES, apply_op, apply_ops, draw_ops
from stallfree.recipe import RecipeError, apply_overrides, validate

CPU = torch.device("cpu")
BINS = 31


def _images(image_root: Path, count: int = 3) -> list[np.ndarray]:
    """Small non-square crops of the demo photos (non-square, so x and y cannot swap)."""
    files = sorted((image_root / "train").rglob("*.jpg"))[:count]
    return [np.array(Image.open(f).convert("RGB").resize((72, 56))) for f in files]


def _run_dali(images: list[np.ndarray], graph, runs: int = 1) -> list[list[np.ndarray]]:
    """Run `graph(node)` on `images` through one CPU DALI pipeline, `runs` times: each
    output, per image of every run."""
    from nvidia.dali import fn, pipeline_def

    @pipeline_def(enable_conditionals=True, batch_size=len(images), num_threads=1, device_id=None, seed=7)
    def pipe():
        return graph(fn.external_source(source=lambda: images, layout="HWC", batch=True))

    pipeline = pipe()
    pipeline.build()
    results = [pipeline.run() for _ in range(runs)]
    return [
        [np.asarray(outs[k][i]) for outs in results for i in range(len(images))]
        for k in range(len(results[0]))
    ]


def _dali_suite(policy: str) -> list:
    from nvidia.dali.auto_aug import rand_augment, trivial_augment

    getter = (
        rand_augment.get_rand_augment_suite
        if policy == "randaugment"
        else trivial_augment.get_trivial_augment_wide_suite
    )
    return getter(use_shape=True, max_translate_rel=MAX_TRANSLATE[policy])


@pytest.mark.dali
@pytest.mark.parametrize("policy", sorted(SUITES))
@pytest.mark.parametrize(("magnitude_bin", "negative"), [(9, False), (24, True)])
def test_each_operation_matches_dali_at_a_fixed_magnitude(
    image_root: Path, policy: str, magnitude_bin: int, negative: bool
) -> None:
    """Same suite, in the same order, with the same parameter per bin and sign; every output
    within one grey level of DALI's (the rounding of the warps' half-pixel weights and of the
    casts)."""
    from nvidia.dali import fn, types
    from nvidia.dali.auto_aug.core import signed_bin

    images = _images(image_root)
    suite = _dali_suite(policy)
    assert [op.name.removesuffix("_no_shape") for op in suite] == [op.name for op in SUITES[policy]]

    def every_op(node):
        sign = fn.random.uniform(values=[int(negative)], dtype=types.INT32)
        kwargs = {
            "magnitude_bin": signed_bin(magnitude_bin, random_sign=sign),
            "num_magnitude_bins": BINS,
            "shape": node.shape(),
            "fill_value": FILL,
        }
        return tuple(
            op(
                node,
                **{
                    k: v
                    for k, v in kwargs.items()
                    if k in ("magnitude_bin", "num_magnitude_bins") or k in op.op.__code__.co_varnames
                },
            )
            for op in suite
        )

    dali_out = _run_dali(images, every_op)
    for op, per_image in zip(SUITES[policy], dali_out, strict=True):
        value = op.value(magnitude_bin, BINS, negative)
        for image, expected in zip(images, per_image, strict=True):
            ours = apply_op(torch.from_numpy(image).permute(2, 0, 1), op.name, value)
            diff = np.abs(ours.permute(1, 2, 0).numpy().astype(int) - expected.astype(int))
            assert diff.max() <= 1 and diff.mean() < 0.5, (op.name, value, diff.max(), diff.mean())
            if op.name != "identity" and value not in (0.0, 256.0):
                assert not np.array_equal(expected, image) or op.name in ("posterize",), op.name


@pytest.mark.dali
@pytest.mark.parametrize("policy", sorted(SUITES))
def test_the_dali_graph_applies_the_drawn_operations(image_root: Path, policy: str) -> None:
    """The same image through 48 draws of each policy (`draw_ops`, what both loaders are
    handed): DALI's graph applies each sample's operations, at its bins and signs, within a
    grey level of the torch backend's, and the draws vary from sample to sample."""
    from nvidia.dali import fn, pipeline_def, types

    from stallfree.data.backends.dali_graph import _apply_ops

    image = _images(image_root, 1)[0]
    aug = small_recipe(image_root, augment={"auto_augment": policy}).augment
    rng = random.Random(3)
    draws = [
        draw_ops(policy, rng, n=aug.randaugment_n, m=aug.randaugment_m, bins=aug.magnitude_bins)
        for _ in range(48)
    ]
    assert len(set(draws)) > 30
    ops = [np.array(d, np.int32).reshape(-1, 3) for d in draws]

    @pipeline_def(enable_conditionals=True, batch_size=len(ops), num_threads=1, device_id=None)
    def pipe():
        images, drawn = fn.external_source(
            source=lambda: ([image] * len(ops), ops),
            num_outputs=2,
            batch=True,
            layout=["HWC", ""],
            dtype=[types.UINT8, types.INT32],
        )
        return _apply_ops(images, drawn, aug)

    pipeline = pipe()
    pipeline.build()
    (out,) = pipeline.run()
    for i, drawn in enumerate(draws):
        ours = apply_ops(image, policy, drawn, aug.magnitude_bins).astype(int)
        diff = np.abs(ours - np.asarray(out[i]).astype(int))
        names = [SUITES[policy][k].name for k, _, _ in drawn]
        # After a first operation's one grey level, a second may move a few pixels far (a
        # threshold's or a histogram's jump): measured mean 0.06 at worst.
        assert diff.mean() < 0.25 and (len(names) > 1 or diff.max() <= 1), (names, diff.max(), diff.mean())


def test_bad_policy_settings_are_refused(image_root: Path) -> None:
    for bad, named in (
        ('augment.auto_augment="autoaugment"', "augment.auto_augment"),
        ("augment.randaugment_m=31", "augment.randaugment_m"),
        ("augment.randaugment_n=0", "augment.randaugment_n"),
    ):
        with pytest.raises(RecipeError, match=named):
            validate(apply_overrides(small_recipe(image_root), ['augment.auto_augment="randaugment"', bad]))
    # randaugment_m is RandAugment's alone: fewer bins for TrivialAugmentWide are fine.
    validate(
        apply_overrides(
            small_recipe(image_root), ['augment.auto_augment="trivialaugment"', "augment.magnitude_bins=5"]
        )
    )


@pytest.mark.gpu
@pytest.mark.dali
@pytest.mark.parametrize("policy", sorted(SUITES))
def test_policies_run_in_the_gpu_graph(image_root: Path, policy: str) -> None:
    """With nvJPEG the policies run on the GPU (DALI's GPU operators), and the batches are
    as on the CPU: finite, on the device, and not the plain crops."""

    def first(auto_augment: str) -> torch.Tensor:
        recipe = small_recipe(
            image_root,
            augment={"auto_augment": auto_augment},
            loader={"backend": "dali"},
            train={"precision": "fp32"},
        )
        loader = build_loader(recipe, "train", device=torch.device("cuda"))
        images = next(iter(loader)).images
        loader.close()
        return images

    augmented = first(policy)
    assert augmented.is_cuda and torch.isfinite(augmented).all()
    assert not torch.equal(augmented, first("none"))


def _one_sided_wedges(images: torch.Tensor) -> tuple[int, int]:
    """Outputs whose fill (128) covers a one-sided wedge of the frame: a whole top or bottom
    row, and far more of one side column than the other (shear_y's, about the origin).
    (right, left) counts."""
    fill = ((images - 128).abs() <= 2).all(dim=1)  # N x H x W
    rows = torch.maximum(fill[:, 0].sum(1), fill[:, -1].sum(1))
    left, right = fill[:, :, 0].sum(1), fill[:, :, -1].sum(1)
    full = rows >= fill.shape[2] - 3
    return (
        int((full & (right > left + 3) & (left <= 1)).sum()),
        int((full & (left > right + 3) & (right <= 1)).sum()),
    )


@pytest.mark.dali
def test_the_flip_comes_before_the_policy_on_both_loaders(tmp_path: Path) -> None:
    """A shear about the origin uncovers a wedge on one side only; a flip after the policy
    would move it to the other. Flat grey images, every one flipped: both loaders put the
    wedges on the same side."""
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
        for k in range(128):
            Image.new("RGB", (40, 40), (230, 230, 230)).save(tmp_path / split / "a" / f"{k}.png")
    counts = {}
    for backend in ("torch", "dali"):
        recipe = small_recipe(
            tmp_path,
            loader={"backend": backend},
            train={"batch_size": 128},
            augment={
                "auto_augment": "trivialaugment",
                "image_size": 40,
                "resize_size": 40,
                "scale": [1.0, 1.0],
                "ratio": [1.0, 1.0],
                "hflip": 1.0,
                "mean": [0.0] * 3,
                "std": [1 / 255] * 3,
            },
        )
        loader = build_loader(recipe, "train", device=CPU)
        found = np.zeros(2, dtype=int)
        for epoch in range(3):
            loader.set_epoch(epoch)
            for batch in loader:
                found += _one_sided_wedges(batch.images.round())
        loader.close()
        counts[backend] = found
    for right, left in counts.values():
        # shear_y (1/14 of 384 images) puts its wedge on the right; a flip after the policy
        # would put it on the left (DALI's graph did: right 1, left 22 of 384).
        assert right >= 10 and right > 4 * left, counts
