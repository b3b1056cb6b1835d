"""Recipe loading, overrides and validation fail early with errors that name the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.registry import check_data_root
from stallfree.data.storage import NoDataError
from stallfree.recipe import (
    DataConfig,
    Recipe,
    RecipeError,
    apply_overrides,
    dump_toml,
    load_recipe,
    recipe_from_dict,
    validate,
)

REPO = Path(__file__).resolve().parents[2]


def test_demo_recipe_loads() -> None:
    recipe = load_recipe(REPO / "pipelines" / "demo.toml")
    assert recipe.model.name == "small_cnn"
    assert recipe.augment.image_size == 48 and recipe.train.precision == "auto"


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"train": {"epoch": 3}}, "unknown key 'train.epoch'"),
        ({"trainer": {}}, "unknown table [trainer]"),
        ({"train": {"epochs": "3"}}, "train.epochs: expected int"),
        ({"train": {"channels_last": 1}}, "expected bool"),
        ({"augment": {"scale": 0.5}}, "augment.scale: expected a list"),
    ],
)
def test_bad_keys_and_types_are_named(raw: dict, needle: str) -> None:
    with pytest.raises(RecipeError, match=None) as info:
        recipe_from_dict(raw, source="x.toml")
    assert needle in str(info.value) and "x.toml" in str(info.value)


def test_int_is_accepted_for_float() -> None:
    assert recipe_from_dict({"optim": {"lr": 1}}).optim.lr == 1.0


def test_overrides_are_type_checked() -> None:
    recipe = apply_overrides(
        Recipe(),
        ["train.epochs=7", "augment.scale=[0.2, 1]", "train.precision=fp32", "train.channels_last=true"],
    )
    assert recipe.train.epochs == 7 and recipe.augment.scale == [0.2, 1.0]
    assert recipe.train.precision == "fp32" and recipe.train.channels_last is True
    with pytest.raises(RecipeError, match="train.batch_size: expected int"):
        apply_overrides(Recipe(), ["train.batch_size=big"])
    with pytest.raises(RecipeError, match="expected section.key=value"):
        apply_overrides(Recipe(), ["epochs=3"])


@pytest.mark.parametrize(
    "override, needle",
    [
        ("train.precision=fp8", "train.precision"),
        ("optim.name=lamb", "optim.name"),
        ("augment.resize_size=100", "resize_size"),
        ("augment.scale=[1.0, 0.5]", "augment.scale"),
        ("train.accum_steps=0", "train.accum_steps"),
    ],
)
def test_bad_values_fail_validation(tmp_path: Path, override: str, needle: str) -> None:
    # A key's own rule fails when it is set; a rule across keys fails in validate().
    with pytest.raises(RecipeError, match=needle.replace(".", r"\.")):
        validate(apply_overrides(Recipe(), ['data.root="x"', override]))


def test_missing_and_empty_data_roots(tmp_path: Path) -> None:
    recipe = Recipe()
    with pytest.raises(RecipeError, match="data.root, which is empty"):
        check_data_root(recipe)
    with pytest.raises(NoDataError, match="does not exist"):
        resolve_dataset(DataConfig(root=str(tmp_path / "nope")))
    with pytest.raises(NoDataError, match="no train/ folder"):
        resolve_dataset(DataConfig(root=str(tmp_path)))


def test_missing_recipe_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nepochs=1")
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(bad)


def test_dump_round_trips(tmp_path: Path) -> None:
    recipe = apply_overrides(Recipe(), ["train.epochs=5", 'data.root="a \\"b\\""'])
    path = tmp_path / "r.toml"
    path.write_text(dump_toml(recipe))
    assert load_recipe(path) == recipe


@pytest.mark.parametrize("path", sorted((REPO / "pipelines").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_recipe_loads_and_validates(path: Path) -> None:
    validate(load_recipe(path))


def test_an_older_runs_recipe_reads_as_the_one_its_user_gave() -> None:
    """Runs before the Resolved record wrote each "auto"'s result into recipe.toml with
    `<key>_requested` beside it: "auto" comes back, the decided values and the keys go."""
    written = {
        "train": {
            "precision": "bf16",
            "precision_requested": "auto",
            "device": "cpu",
            "device_requested": "",
        },
        "loader": {
            "backend": "torch",
            "backend_requested": "auto",
            "torch": {"workers": 3, "workers_requested": "auto"},
        },
    }
    recipe = recipe_from_dict(written)
    assert (recipe.train.precision, recipe.train.device) == ("auto", "cpu")
    assert (recipe.loader.backend, recipe.loader.torch.workers) == ("auto", "auto")
    assert "_requested" not in dump_toml(recipe) and written["train"]["precision"] == "bf16"


def test_python_310_parser_fallback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """On Python 3.10 recipe.py reads TOML with tomli, which has tomllib's API."""
    import importlib.util
    import sys

    tomli = pytest.importorskip("tomli")
    import stallfree.recipe as real

    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    monkeypatch.setitem(sys.modules, "tomllib", None)  # as on 3.10: no stdlib tomllib
    # A private copy of the module, so the real one (and its exception classes) stays untouched.
    spec = importlib.util.spec_from_file_location("recipe_on_310", real.__file__)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "recipe_on_310", module)  # dataclasses look it up there
    spec.loader.exec_module(module)
    assert module.tomllib is tomli
    path = tmp_path / "r.toml"
    path.write_text("[train]\nepochs = 4\n[loader.dali]\nthreads = 2\n")
    recipe = module.load_recipe(path)
    assert recipe.train.epochs == 4 and recipe.loader.dali.threads == 2


def test_nested_loader_tables_and_overrides() -> None:
    recipe = apply_overrides(
        Recipe(), ["loader.dali.threads=3", "loader.torch.workers=0", 'loader.dali.decode="cpu"']
    )
    assert recipe.loader.dali.threads == 3 and recipe.loader.torch.workers == 0
    assert recipe.loader.dali.decode == "cpu"
    with pytest.raises(RecipeError, match=r"loader\.dali\.decode = 'gpu'; choose one of auto, cpu"):
        apply_overrides(Recipe(), ['loader.dali.decode="gpu"'])
    with pytest.raises(RecipeError, match="unknown key 'loader.dali.thread'"):
        apply_overrides(Recipe(), ["loader.dali.thread=3"])


def test_micro_batch_is_a_size_or_auto() -> None:
    assert apply_overrides(Recipe(), ["train.micro_batch=auto"]).train.micro_batch == "auto"
    assert apply_overrides(Recipe(), ["train.micro_batch=32"]).train.micro_batch == 32
    with pytest.raises(RecipeError, match="train.micro_batch"):
        apply_overrides(Recipe(), ["train.micro_batch=big"])
    with pytest.raises(RecipeError, match="must be >= 0"):
        apply_overrides(Recipe(), ["train.micro_batch=-1"])


def test_an_old_recipe_names_every_moved_key_at_once(tmp_path: Path) -> None:
    path = tmp_path / "old.toml"
    path.write_text(
        '[data]\nroot = "x"\n[loader]\nbackend = "dali"\nworkers = 4\nthreads = 3\n'
        'device = "cpu"\nhw_decoder_load = 0.5\n'
    )
    with pytest.raises(RecipeError) as caught:
        load_recipe(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    for old, new in (
        ("loader.workers", "loader.torch.workers"),
        ("loader.threads", "loader.dali.threads"),
        ("loader.device", "loader.dali.device"),
        ("loader.hw_decoder_load", "loader.dali.hw_decoder_load"),
    ):
        assert f"'{old}'" in message and f"'{new}'" in message
