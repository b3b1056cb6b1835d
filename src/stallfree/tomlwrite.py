"""A TOML writer for recipes: tomli-w when installed, else a small writer of nested tables of
scalars and lists (what a recipe holds), so that a bare machine without tomli-w still trains."""

from __future__ import annotations

import json
from typing import Any


def dumps_toml(data: dict[str, Any]) -> str:
    """`data` (nested dicts of scalars and lists) as TOML."""
    try:
        import tomli_w
    except ImportError:
        return _toml_tables(data)
    return tomli_w.dumps(data)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        text = repr(value)
        return {"inf": "inf", "-inf": "-inf", "nan": "nan"}.get(text, text)
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are TOML basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _toml_tables(data: dict[str, Any], prefix: str = "") -> str:
    """Tables of scalars and lists, with nested tables, as a recipe's to_dict() has them."""
    scalars = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    out = (f"[{prefix}]\n" if prefix else "") + "".join(line + "\n" for line in scalars)
    for key, value in data.items():
        if isinstance(value, dict):
            out += ("\n" if out else "") + _toml_tables(value, f"{prefix}.{key}" if prefix else key)
    return out
