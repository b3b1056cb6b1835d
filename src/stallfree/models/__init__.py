"""Model registry: in-house ResNets and a small CNN, `timm:NAME` / `torchvision:NAME`, and any
`module:function` that returns an `nn.Module` (given `num_classes` when it takes it). Every
factory also gets `model.kwargs`; timm models may start from pretrained weights."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

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


def build_model(config: ModelConfig, num_classes: int, *, load_pretrained: bool = True) -> nn.Module:
    """Instantiate `config.name` with `num_classes` outputs and `config.kwargs`.

    `load_pretrained=False`: a caller that loads a checkpoint's weights next (export, predict,
    eval, a resume) skips fetching model.pretrained's, so it works offline.
    """
    prefix, sep, name = config.name.partition(":")
    if not 0 <= config.drop_rate < 1:
        raise ModelError(f"model.drop_rate {config.drop_rate} must be in [0, 1)")
    if (config.pretrained or config.pretrained_file) and prefix != "timm":
        raise ModelError(
            f"model.pretrained and model.pretrained_file are for timm:NAME models, not "
            f"{config.name}; start from saved weights with model.init_from instead"
        )
    if prefix == "timm":
        return _timm(config, name, num_classes, config.pretrained and load_pretrained)
    if sep:
        return _external(prefix, name, num_classes, config)
    if config.name not in MODELS:
        raise ModelError(
            f"unknown model.name {config.name!r}; available: {', '.join(MODELS)}, "
            "or timm:NAME / torchvision:NAME"
        )
    module_name, _, attr = MODELS[config.name].partition(":")
    factory: Callable[..., nn.Module] = getattr(importlib.import_module(module_name), attr)
    kwargs = {"zero_init_residual": config.zero_init_residual, "drop_rate": config.drop_rate}
    return _call(factory, f"model.name = {config.name}", num_classes=num_classes, **kwargs | config.kwargs)


def _call(factory: Callable[..., Any], where: str, **kwargs: Any) -> Any:
    """factory(**kwargs); a keyword it does not take is named as model.kwargs' fault."""
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise ModelError(f"{where}: model.kwargs {sorted(kwargs)} do not fit its factory: {exc}") from exc
    except ValueError:
        pass  # no signature to check (a builtin): the call itself says
    return factory(**kwargs)


def _import(prefix: str, name: str) -> Any:
    try:
        return importlib.import_module(prefix)
    except ImportError as exc:
        raise ModelError(
            f"model {prefix}:{name} needs {prefix}; install it with `{_EXTERNAL[prefix]}`"
        ) from exc


def _timm(config: ModelConfig, name: str, num_classes: int, pretrained: bool) -> nn.Module:
    """timm.create_model, with its pretrained weights when asked: from a local file
    (model.pretrained_file), else the Hub or timm's cache; failing that, one line on how to
    pre-fetch them."""
    timm = _import("timm", name)
    kwargs: dict[str, Any] = {"num_classes": num_classes, "drop_rate": config.drop_rate, **config.kwargs}
    if pretrained and config.pretrained_file:
        kwargs["pretrained_cfg_overlay"] = {"file": config.pretrained_file}
    try:
        return timm.create_model(name, pretrained=pretrained, **kwargs)
    except (OSError, RuntimeError, ValueError) as exc:
        if not pretrained:
            raise
        repo = name.removeprefix("hf-hub:") if name.startswith("hf-hub:") else f"timm/{name}"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelError(
            f"model.pretrained: the weights of timm:{name} are not available here "
            f"({type(exc).__name__}: {first[:200]}); pre-fetch them on a machine online with "
            f"`huggingface-cli download {repo}` into the same HF_HOME (offline: HF_HUB_OFFLINE=1), "
            "or set model.pretrained_file to a local weights file"
        ) from exc


def _external(prefix: str, name: str, num_classes: int, config: ModelConfig) -> nn.Module:
    if prefix not in _EXTERNAL:
        return _plugin(prefix, name, num_classes, config.drop_rate, config.kwargs)
    module = _import(prefix, name)
    if config.drop_rate:
        raise ModelError(f"model.drop_rate is not passed to torchvision:{name}; set it to 0")
    return _call(
        module.models.get_model,
        f"model.name = {config.name}",
        name=name,
        weights=None,
        num_classes=num_classes,
        **config.kwargs,
    )


def _plugin(
    module_name: str, attr: str, num_classes: int, drop_rate: float, extra: dict[str, Any]
) -> nn.Module:
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
    params: Mapping[str, inspect.Parameter]
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
    model = _call(factory, where, **(kwargs | extra))
    if not isinstance(model, nn.Module):
        raise ModelError(f"{where} returned {type(model).__name__}, not a torch.nn.Module")
    return model
