"""A loader plug-in with keys of its own, written as a user would (tests/unit/test_loaders.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from stallfree.data.backends import synthetic
from stallfree.data.loader import Loader, LoaderSpec


@dataclass
class Options:
    """`[loader.plugin]` of this backend."""

    brightness: float = 1.0
    tag: str = "plain"


def build(spec: LoaderSpec) -> Loader:
    loader = synthetic.build(spec)
    loader.options_seen = spec.options  # what the test checks
    return loader


build.options = Options


def build_without_options(spec: LoaderSpec) -> Loader:
    return synthetic.build(spec)


@dataclass(frozen=True)
class Inner:
    x: int = 0
    y: int = 0


@dataclass(frozen=True)
class FrozenOptions:
    """Frozen, nested, a free table, a text option: what plug-in authors write."""

    name: str = "plain"
    inner: Inner = Inner()
    table: dict[str, int] = field(default_factory=dict)


def _builder(options: type) -> Callable[[LoaderSpec], Loader]:
    def builder(spec: LoaderSpec) -> Loader:
        return build(spec)

    builder.options = options
    return builder


build_frozen = _builder(FrozenOptions)


@dataclass
class NoneDefault:
    cache: str | None = None


@dataclass
class TupleOption:
    size: tuple[int, int] = (1, 2)


@dataclass
class NoDefault:
    needed: int


build_none_default, build_tuple, build_no_default = (
    _builder(NoneDefault),
    _builder(TupleOption),
    _builder(NoDefault),
)
