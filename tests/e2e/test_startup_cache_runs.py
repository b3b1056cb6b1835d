"""The start-up header check and its cache: what may vouch for a root's
files, and what both loaders do with a file the cache could not know about."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
from helpers import build_loader, small_recipe
from test_startup_cache import BACKENDS, CPU, _bomb, _build, _in_place, _root

from stallfree.cli import main
from stallfree.data.readers.imageio import BadImageError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.e2e  # starts worker or store-helper processes
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_clean_list_vouches_only_for_the_root_it_was_written_for(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Item 5: a `data check` list of X used with data.root = Y (a copy with a bomb in place of
    one file) does not turn off Y's start-up check; the list still selects Y's files."""
    x = _root(tmp_path / "X")
    clean = tmp_path / "clean.txt"
    monkeypatch.chdir(tmp_path)
    assert main(["data", "check", "X", "--workers", "1", "--no-progress", "--write-list", str(clean)]) == 0
    shutil.copytree(x, tmp_path / "Y")
    _in_place(tmp_path / "Y" / "train" / "a" / "1.jpg", _bomb())
    with pytest.raises(BadImageError, match="data.max_pixels"):
        _build(tmp_path / "Y", backend, file_list=str(clean))
    # For its own root, given relative or absolute, the list still vouches: no check at
    # start, so a bomb put in place after the check is only met at its batch.
    _in_place(x / "train" / "b" / "2.jpg", _bomb())
    _build("X", backend, file_list=str(clean))
    _build(x, backend, file_list=str(clean))


@pytest.mark.e2e  # starts worker or store-helper processes
@pytest.mark.parametrize("backend", BACKENDS)
def test_skip_drops_a_file_replaced_after_the_cache_on_both_loaders(
    tmp_path: Path, cache: Path, backend: str
) -> None:
    """Item 6: data.on_error = "skip", a file replaced in place by a bomb after the start-up
    check was cached (a miss the cache documents): both loaders drop that sample from its
    batch with a warning naming it, count it, and train on the rest."""
    root = _root(tmp_path / "data", per_class=4)
    recipe = small_recipe(
        root, loader={"backend": backend}, train={"batch_size": 4}, data={"on_error": "skip"}
    )
    build_loader(recipe, "train", device=CPU).close()  # checked, cached
    victim = root / "train" / "b" / "2.jpg"
    _in_place(victim, _bomb())
    loader = build_loader(recipe, "train", device=CPU)  # the cache cannot know
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = list(loader)
    finally:
        loader.close()
    skipped = [str(w.message) for w in caught if str(w.message).startswith("skipped ")]
    assert len(skipped) == 1 and str(victim) in skipped[0] and "max_pixels" in skipped[0]
    assert loader.skipped_samples == 1
    # 8 files, batch 4: two batches in the epoch's order, the bad one leaving a hole.
    assert sorted(b.labels.numel() for b in batches) == [3, 4]


@pytest.mark.e2e  # starts worker or store-helper processes
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_batch_of_only_replaced_files_is_empty_or_named(
    tmp_path: Path, cache: Path, backend: str, on_error: str
) -> None:
    """Item 6: batch 1, one file replaced in place after the cache: under skip its batch is
    empty (the step count stays in step), under raise its name stops the run; both loaders."""
    root = _root(tmp_path / "data", per_class=3)
    recipe = small_recipe(
        root, loader={"backend": backend}, train={"batch_size": 1}, data={"on_error": on_error}
    )
    build_loader(recipe, "val", device=CPU).close()  # checked, cached
    victim = root / "val" / "a" / "1.jpg"
    _in_place(victim, _bomb())
    loader = build_loader(recipe, "val", device=CPU)
    try:
        if on_error == "raise":
            with pytest.raises(BadImageError, match="data.max_pixels") as info:
                list(loader)
            assert info.value.path == str(victim)
            return
        with pytest.warns(UserWarning, match=r"skipped .*1\.jpg"):
            sizes = [b.labels.numel() for b in loader]
        assert sizes == [1, 0, 1, 1, 1, 1] and loader.skipped_samples == 1
        with pytest.warns(UserWarning, match=r"skipped .*1\.jpg"):
            assert [b.labels.numel() for b in loader] == sizes  # the next pass alike
    finally:
        loader.close()


@pytest.mark.e2e  # starts worker or store-helper processes
@pytest.mark.parametrize("backend", ["torch"])
def test_a_cache_or_list_from_older_header_rules_does_not_vouch(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """A new rule (here: refuse this one file) must be applied to a dataset whose start-up
    cache and `data check` list were written under the previous rules of the same release:
    the cache key and the list's header carry the rules' number, not only the version."""
    import stallfree.data.readers.imageio as imageio

    root = _root(tmp_path / "data")
    clean = tmp_path / "clean.txt"
    assert (
        main(["data", "check", str(root), "--workers", "1", "--no-progress", "--write-list", str(clean)]) == 0
    )
    _build(root, backend)  # the old rules' start-up check, cached
    victim = root / "train" / "a" / "2.jpg"
    old_open = imageio._open_checked  # noqa: SLF001 (the rule set itself is what changes)

    def stricter(path: str, max_pixels: int, *args: object, **kwargs: object) -> object:
        if Path(path).resolve() == victim.resolve():
            raise BadImageError(path, "refused by a newer rule")
        return old_open(path, max_pixels, *args, **kwargs)

    monkeypatch.setattr(imageio, "_open_checked", stricter)
    monkeypatch.setattr(imageio, "HEADER_RULES", imageio.HEADER_RULES + 1)
    with pytest.raises(BadImageError, match="newer rule"):
        _build(root, backend)
    with pytest.raises(BadImageError, match="newer rule"):
        _build(root, backend, file_list=str(clean))
