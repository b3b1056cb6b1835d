"""Typed tables: dataclasses filled from nested dicts (TOML, `--set`), every value checked.

Allowed values live on the fields (`Literal[...]`, `field(metadata=at_least(...))`) and are
checked when a value is set, so a TOML key, a `--set` override and a loader plug-in's declared
options all meet the same rules and the same messages.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import types
import typing
import warnings
from typing import Any, Literal

from stallfree.errors import StallfreeError


class RecipeError(StallfreeError, ValueError):
    """A recipe that cannot be used; the message names the key or path and the fix."""

    same_on_every_rank = True


def at_least(low: float) -> dict[str, float]:
    return {"min": low}


def _check_type(value: Any, annotation: Any, where: str) -> Any:
    """Return `value` coerced to `annotation` (int->float, list->list[float]) or raise."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise RecipeError(f"{where} = {value!r}; choose one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{where}: expected a list, got {value!r}")
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise RecipeError(f"{where}: expected a table, got {value!r}")
        args = typing.get_args(annotation)
        if not args or args[1] is Any:  # a free table (loader.plugin before its plug-in checks it)
            return dict(value)
        return {k: _check_type(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _check_type(value, option, where)
            except RecipeError:
                continue
        options = " or ".join(
            ", ".join(map(repr, typing.get_args(o)))
            if typing.get_origin(o) is Literal
            else getattr(o, "__name__", str(o))
            for o in typing.get_args(annotation)
        )
        raise RecipeError(f"{where} = {value!r}; expected {options}")
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (annotation is int and isinstance(value, bool)) or not isinstance(value, annotation):
        name = getattr(annotation, "__name__", str(annotation))
        raise RecipeError(f"{where}: expected {name}, got {type(value).__name__} {value!r}")
    return value


def set_field(
    table: Any, path: str, key: str, value: Any, source: str, moved: dict[str, str] | None = None
) -> None:
    """Set `table.key` (the table at dotted `path`) after checking its type and bounds;
    `moved` maps old dotted keys to their new place, for a better message than "unknown"."""
    dotted = f"{path}.{key}"
    # get_type_hints resolves the string annotations that `from __future__ import annotations` leaves.
    hints = typing.get_type_hints(type(table))
    if key not in hints:
        if moved and dotted in moved:
            raise RecipeError(
                f"{source}: '{dotted}' has moved to '{moved[dotted]}'; write it "
                f"under [{moved[dotted].rpartition('.')[0]}] instead"
            )
        close = difflib.get_close_matches(key, hints, n=1)
        guess = f"did you mean '{path}.{close[0]}'? " if close else ""
        raise RecipeError(
            f"{source}: unknown key '{dotted}'; {guess}known keys in [{path}]: {', '.join(hints)}"
        )
    annotation = hints[key]
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise RecipeError(f"{source}: [{dotted}] must be a table, got {value!r}")
        for sub_key, sub_value in value.items():
            set_field(getattr(table, key), dotted, sub_key, sub_value, source, moved)
        return
    value = _check_type(value, annotation, f"{source}: {dotted}")
    if typing.get_origin(annotation) is dict:  # a free table: `--set` adds keys to it
        value = _merged(getattr(table, key), value)
    low = next(f for f in dataclasses.fields(table) if f.name == key).metadata.get("min")
    if low is not None and isinstance(value, (int, float)) and value < low:
        raise RecipeError(f"{source}: {dotted} = {value!r} must be >= {low}")
    object.__setattr__(table, key, value)  # a plug-in's options may be a frozen dataclass


def _merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new` over `old`, sub-tables merged key by key (two `--set a.b.x=`, `a.b.y=` keep both)."""
    out = dict(old)
    for key, value in new.items():
        both = isinstance(value, dict) and isinstance(old.get(key), dict)
        out[key] = _merged(old[key], value) if both else value
    return out


def table_from_dict(cls: type[Any], raw: dict[str, Any], path: str, source: str) -> Any:
    """A dataclass table (`cls()` updated from `raw`) under the rules of a recipe's own tables:
    what checks a loader plug-in's declared options. The class itself is checked first: each
    field needs a default and a type a recipe can hold and write back."""
    _check_declared(cls, path, source)
    table = copy.deepcopy(cls())  # fresh nested tables: a frozen default may be shared
    for key, value in _texts_as_declared(cls, raw).items():
        set_field(table, path, key, value, source)
    return table


_UNSET = dataclasses.MISSING


def _holdable(annotation: Any, table_ok: bool = True) -> bool:
    """Whether a recipe can check and write this type: TOML's scalars, Literal, lists and
    str-keyed tables of those, unions of those, nested dataclass tables (not inside a list or
    a free table: those hold plain values)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in (bool, int, float, str) or origin is Literal:
        return True
    if origin is list:
        return _holdable(args[0], table_ok=False)
    if origin is dict:
        return not args or (args[0] is str and (args[1] is Any or _holdable(args[1], False)))
    if origin in (typing.Union, types.UnionType):
        return all(_holdable(a, table_ok) for a in args)
    return table_ok and dataclasses.is_dataclass(annotation)


def _check_declared(cls: type[Any], path: str, source: str) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, where = hints[f.name], f"{source}: {path}.{f.name}"
        if f.default is _UNSET and f.default_factory is _UNSET:
            raise RecipeError(
                f"{where} has no default; give every option one (a recipe may leave any key out)"
            )
        if not _holdable(hint):
            raise RecipeError(
                f"{where} is declared {hint}, which a recipe cannot hold: use bool, int, float, "
                "str, a Literal, a list or str-keyed dict of those, or a nested dataclass "
                '(TOML has no null: a str defaulting to "" rather than None)'
            )
        # dataclasses refuse both a default and a factory, so a callable factory is the default
        default = f.default_factory() if callable(f.default_factory) else f.default
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            _check_declared(hint, f"{path}.{f.name}", source)
        else:
            _check_type(default, hint, f"{where} (its default)")


def _texts_as_declared(cls: type[Any], raw: dict[str, Any]) -> dict[str, Any]:
    """A `--set` value under a free table is parsed without knowing its type, so a text option
    given 2024 or true arrives as a number or a boolean: as text, as `data.root=2024` is."""
    hints, out = typing.get_type_hints(cls), dict(raw)
    for key, value in raw.items():
        hint = hints.get(key)
        if hint is str and isinstance(value, (bool, int, float)):
            out[key] = ("true" if value else "false") if isinstance(value, bool) else str(value)
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, dict):
            out[key] = _texts_as_declared(hint, value)
    return out


def parse_text(text: str, annotation: Any) -> Any:
    """Parse an override value as a TOML/Python literal; a text field takes the text as it is
    (`data.root=2024` is a folder name), unquoted when it was quoted."""
    stripped = text.strip()
    if annotation is str:
        quoted = len(stripped) >= 2 and stripped[0] == stripped[-1] and stripped[0] in "'\""
        return stripped[1:-1] if quoted else stripped
    if stripped in ("true", "false"):
        return stripped == "true"
    try:
        with warnings.catch_warnings():  # "1a" would warn "invalid decimal literal"
            warnings.simplefilter("ignore", SyntaxWarning)
            return ast.literal_eval(stripped)
    except (ValueError, SyntaxError):
        return text


def field_annotation(root: Any, tables: list[str], key: str) -> Any:
    """The declared type of `key` in the table at `tables` below the dataclass `root` (a
    recipe), or None when the path is unknown (reported later)."""
    table: Any = root
    for name in tables:
        table = getattr(table, name, None)
        if not dataclasses.is_dataclass(table):
            return None
    return typing.get_type_hints(type(table)).get(key)
