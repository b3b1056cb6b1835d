"""Model registry: in-house ResNets and a small CNN, plus `timm:NAME` / `torchvision:NAME`."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from stallfree.errors import StallfreeError
from stallfree.recipe import ModelConfig

# name -> "module:function"; imported on use.
MODELS: dict[str, str] = {
    "resnet18": "stallfree.models.resnet:resnet18",
    "resnet50": "stallfree.models.resnet:resnet50",
    "small_cnn": "stallfree.models.small:SmallCNN",
}
_EXTERNAL = {"timm": "pip install timm", "torchvision": "pip install torchvision"}


class ModelError(StallfreeError, ValueError):
    """Unknown model name or missing optional package."""


def build_model(config: ModelConfig, num_classes: int) -> nn.Module:
    """Instantiate `config.name` with `num_classes` outputs."""
    prefix, sep, name = config.name.partition(":")
    if not 0 <= config.drop_rate < 1:
        raise ModelError(f"model.drop_rate {config.drop_rate} must be in [0, 1)")
    if sep:
        return _external(prefix, name, num_classes, config.drop_rate)
    if config.name not in MODELS:
        raise ModelError(
            f"unknown model.name {config.name!r}; available: {', '.join(MODELS)}, "
            "or timm:NAME / torchvision:NAME"
        )
    module_name, _, attr = MODELS[config.name].partition(":")
    factory: Callable[..., nn.Module] = getattr(importlib.import_module(module_name), attr)
    return factory(num_classes=num_classes, zero_init_residual=config.zero_init_residual,
                   drop_rate=config.drop_rate)


def _external(prefix: str, name: str, num_classes: int, drop_rate: float) -> nn.Module:
    if prefix not in _EXTERNAL:
        raise ModelError(f"unknown model source {prefix!r}; use timm:NAME or torchvision:NAME")
    try:
        module = importlib.import_module(prefix)
    except ImportError as exc:
        raise ModelError(f"model {prefix}:{name} needs {prefix}; "
                         f"install it with `{_EXTERNAL[prefix]}`") from exc
    if prefix == "timm":
        return module.create_model(name, pretrained=False, num_classes=num_classes,
                                   drop_rate=drop_rate)
    if drop_rate:
        raise ModelError(f"model.drop_rate is not passed to torchvision:{name}; set it to 0")
    return module.models.get_model(name, weights=None, num_classes=num_classes)
