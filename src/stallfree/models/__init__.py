"""Model registry: in-house ResNets and a small CNN, `timm:NAME` / `torchvision:NAME`, and any
`module:function` that returns an `nn.Module` (given `num_classes` when it takes it)."""

from __future__ import annotations

import importlib
import inspect
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
    return factory(
        num_classes=num_classes, zero_init_residual=config.zero_init_residual, drop_rate=config.drop_rate
    )


def _external(prefix: str, name: str, num_classes: int, drop_rate: float) -> nn.Module:
    if prefix not in _EXTERNAL:
        return _plugin(prefix, name, num_classes, drop_rate)
    try:
        module = importlib.import_module(prefix)
    except ImportError as exc:
        raise ModelError(
            f"model {prefix}:{name} needs {prefix}; install it with `{_EXTERNAL[prefix]}`"
        ) from exc
    if prefix == "timm":
        return module.create_model(name, pretrained=False, num_classes=num_classes, drop_rate=drop_rate)
    if drop_rate:
        raise ModelError(f"model.drop_rate is not passed to torchvision:{name}; set it to 0")
    return module.models.get_model(name, weights=None, num_classes=num_classes)


def _plugin(module_name: str, attr: str, num_classes: int, drop_rate: float) -> nn.Module:
    """`module:function` (a class too): called with num_classes (and drop_rate) when its
    signature takes them, else with nothing; it must return an nn.Module."""
    where = f"model.name = {module_name}:{attr}"
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as exc:
        raise ModelError(
            f"{where}: module {module_name!r} does not import ({exc}); "
            "check the name and that it is installed"
        ) from exc
    except AttributeError as exc:
        raise ModelError(f"{where}: {module_name} has no {attr!r}") from exc
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {
        k: v for k, v in (("num_classes", num_classes), ("drop_rate", drop_rate)) if k in params or takes_any
    }
    if drop_rate and "drop_rate" not in kwargs:
        raise ModelError(f"{where} takes no drop_rate; set model.drop_rate = 0")
    model = factory(**kwargs)
    if not isinstance(model, nn.Module):
        raise ModelError(f"{where} returned {type(model).__name__}, not a torch.nn.Module")
    return model
