"""The model registry and the in-house architectures."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from stallfree.models import MODELS, ModelError, build_model
from stallfree.recipe import ModelConfig


def test_resnet_parameter_counts_match_the_standard() -> None:
    count = lambda name: sum(p.numel() for p in build_model(ModelConfig(name=name), 1000).parameters())  # noqa: E731
    assert count("resnet50") == 25_557_032
    assert count("resnet18") == 11_689_512


@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_maps_images_to_logits(name: str) -> None:
    model = build_model(ModelConfig(name=name), 7).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 64, 64)).shape == (2, 7)


def test_unknown_model_lists_the_choices() -> None:
    with pytest.raises(ModelError, match="available: resnet18, resnet50, small_cnn"):
        build_model(ModelConfig(name="vgg"), 10)


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm is installed")
def test_missing_timm_says_how_to_install() -> None:
    with pytest.raises(ModelError, match="pip install timm"):
        build_model(ModelConfig(name="timm:resnet50"), 10)
