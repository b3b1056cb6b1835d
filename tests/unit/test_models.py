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


def test_a_model_by_module_function() -> None:
    identity = build_model(ModelConfig(name="torch.nn:Identity"), 10)  # takes **kwargs
    assert isinstance(identity, torch.nn.Identity)
    small = build_model(ModelConfig(name="stallfree.models.small:SmallCNN", drop_rate=0.1), 7)
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 7)  # num_classes was passed
    with pytest.raises(ModelError, match="no_such_module.*does not import"):
        build_model(ModelConfig(name="no_such_module:make"), 10)
    with pytest.raises(ModelError, match="torch.nn has no 'Nope'"):
        build_model(ModelConfig(name="torch.nn:Nope"), 10)
    with pytest.raises(ModelError, match="returned int, not a torch.nn.Module"):
        build_model(ModelConfig(name="builtins:int"), 10)


def test_init_from_fine_tunes_with_a_new_head(tmp_path) -> None:
    """Weights of a 10-class model start a 4-class one: the body is loaded, the head kept
    fresh and named; a file of another model is refused, naming what does not fit."""
    import warnings

    from stallfree.models.init import InitFromError, init_from

    source = build_model(ModelConfig(name="small_cnn"), 10)
    torch.save({"model": source.state_dict(), "epoch": 3}, tmp_path / "ckpt.pt")  # checkpoint form
    torch.save({f"module.{k}": v for k, v in source.state_dict().items()}, tmp_path / "ddp.pt")
    for name in ("ckpt.pt", "ddp.pt"):
        target = build_model(ModelConfig(name="small_cnn"), 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fresh = init_from(target, tmp_path / name)
        assert fresh == ["head.3.bias", "head.3.weight"]
        assert "fresh initialisation" in str(caught[0].message)
        body = [k for k in source.state_dict() if not k.startswith("head.3")]
        assert all(torch.equal(target.state_dict()[k], source.state_dict()[k]) for k in body)
    other = build_model(ModelConfig(name="resnet18"), 4)
    with pytest.raises(InitFromError, match="does not fit model: missing"):
        init_from(other, tmp_path / "ckpt.pt")
    with pytest.raises(InitFromError, match="no such file"):
        init_from(other, tmp_path / "absent.pt")
