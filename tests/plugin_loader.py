"""A loader plug-in with keys of its own, written as a user would (tests/test_loaders.py)."""

from __future__ import annotations

from dataclasses import dataclass

from stallfree.data import synthetic
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
