"""model.pretrained, hf-hub: names and model.kwargs, through timm's API.

timm itself does not install beside this CPU torch (it pulls torchvision), so a stand-in
`timm` module with timm's `create_model` signature records what stallfree passes and loads
the local weights file named by `pretrained_cfg_overlay=dict(file=...)`, as timm does.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stallfree.models import ModelError, build_model
from stallfree.models.small import SmallCNN
from stallfree.recipe import ModelConfig


@pytest.fixture
def fake_timm(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """A `timm` whose create_model records its arguments; the list of calls."""
    calls: list[dict[str, Any]] = []

    def create_model(
        model_name: str,
        pretrained: bool = False,
        pretrained_cfg_overlay: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> nn.Module:
        calls.append(
            {"name": model_name, "pretrained": pretrained, "overlay": pretrained_cfg_overlay, **kwargs}
        )
        model = SmallCNN(num_classes=kwargs.get("num_classes", 1000))
        if pretrained:
            file = (pretrained_cfg_overlay or {}).get("file")
            if not file:  # what the Hub client raises when it cannot connect
                raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {model_name}")
            model.load_state_dict(torch.load(file, weights_only=True))
        return model

    monkeypatch.setitem(sys.modules, "timm", types.SimpleNamespace(create_model=create_model))
    return calls


def test_timm_pretrained_from_a_local_file_with_kwargs(
    fake_timm: list[dict[str, Any]], tmp_path: Path
) -> None:
    """pretrained = true reaches create_model with the file, the class count and the kwargs."""
    weights = SmallCNN(num_classes=3).state_dict()
    torch.save(weights, tmp_path / "w.pt")
    config = ModelConfig(
        name="timm:hf-hub:someone/tiny",
        pretrained=True,
        pretrained_file=str(tmp_path / "w.pt"),
        kwargs={"drop_path_rate": 0.1},
    )
    model = build_model(config, 3)
    call = fake_timm[-1]
    assert call["name"] == "hf-hub:someone/tiny" and call["pretrained"] is True
    assert call["overlay"] == {"file": str(tmp_path / "w.pt")}
    assert (call["num_classes"], call["drop_path_rate"]) == (3, 0.1)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_offline_pretrained_is_one_line_naming_the_fix(fake_timm: list[dict[str, Any]]) -> None:
    """No network and no cache: one line naming the weights and how to pre-fetch them."""
    with pytest.raises(ModelError) as caught:
        build_model(ModelConfig(name="timm:resnet50.a1_in1k", pretrained=True), 10)
    text = str(caught.value)
    assert "\n" not in text and "timm:resnet50.a1_in1k" in text
    assert "huggingface-cli download timm/resnet50.a1_in1k" in text and "HF_HOME" in text
    assert "model.pretrained_file" in text


def test_checkpoint_loaders_do_not_fetch_pretrained_weights(fake_timm: list[dict[str, Any]]) -> None:
    """export/predict/eval/resume load a checkpoint's weights: nothing to fetch (offline-safe)."""
    build_model(ModelConfig(name="timm:tiny", pretrained=True), 3, load_pretrained=False)
    assert fake_timm[-1]["pretrained"] is False


def test_pretrained_is_refused_for_models_without_weights() -> None:
    with pytest.raises(ModelError, match="model.pretrained.*timm.*model.init_from"):
        build_model(ModelConfig(name="small_cnn", pretrained=True), 3)


def test_kwargs_reach_in_house_and_plugin_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """model.kwargs go to an in-house factory and a module:function; an unknown one is named."""
    model = build_model(ModelConfig(name="resnet18", kwargs={"zero_init_residual": False}), 4)
    assert any(m.weight.abs().sum() > 0 for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    assert build_model(ModelConfig(name="small_cnn", kwargs={"width": 3}), 4).head[3].in_features == 12
    with pytest.raises(ModelError, match="model.kwargs.*depth"):
        build_model(ModelConfig(name="small_cnn", kwargs={"depth": 3}), 4)
    (tmp_path / "my_models.py").write_text(
        "from torch import nn\ndef make(num_classes, hidden=1):\n    return nn.Linear(hidden, num_classes)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin = build_model(ModelConfig(name="my_models:make", kwargs={"hidden": 7}), 4)
    assert plugin.weight.shape == (4, 7)


def test_init_from_applies_after_pretrained(
    fake_timm: list[dict[str, Any]], image_root: Path, tmp_path: Path
) -> None:
    """pretrained weights first, then model.init_from's over them (fine-tuning a fine-tune)."""
    from helpers import small_recipe

    from stallfree.train.assemble import build_trainer
    from stallfree.train.prepare import prepare

    first, second = SmallCNN(num_classes=10).state_dict(), SmallCNN(num_classes=10).state_dict()
    torch.save(first, tmp_path / "a.pt")
    torch.save(second, tmp_path / "b.pt")
    model = {"name": "timm:tiny", "pretrained": True, "pretrained_file": str(tmp_path / "a.pt")}
    recipe = small_recipe(image_root, model={**model, "init_from": str(tmp_path / "b.pt")})
    trainer = build_trainer(prepare(recipe), train_batches=1, progress=False)
    assert fake_timm[-1]["pretrained"] is True
    got = trainer.model.state_dict()
    assert all(torch.equal(second[k], got[k]) for k in second)
