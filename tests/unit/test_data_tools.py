"""`stallfree data demo` and `data pack` agree on what they write into: a new or empty folder
(or, for demo, its own complete demo), readable by others as the umask allows."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from inprocess import Cli, Result


@pytest.fixture
def umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _demo(cli: Cli, out: Path, *extra: str) -> Result:
    return cli("data", "demo", out, "--train-per-class", "1", "--val-per-class", "1", "--no-progress", *extra)


def test_demo_refuses_a_folder_that_is_not_its_own_demo(tmp_path: Path, cli: Cli) -> None:
    """A dataset already there is never merged into: the error names the folder and the fix."""
    other = tmp_path / "mine"
    (other / "train" / "cat").mkdir(parents=True)
    (other / "train" / "cat" / "a.jpg").write_bytes(b"x")
    done = _demo(cli, other)
    assert done.code == 2
    err = done.err
    assert str(other) in err and "not empty" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in (other / "train").iterdir()) == ["cat"]  # untouched


def test_demo_twice_is_a_no_op_and_other_settings_are_refused(tmp_path: Path, cli: Cli) -> None:
    out = tmp_path / "demo"
    assert _demo(cli, out).code == 0
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    assert _demo(cli, out).code == 0  # `make demo` again, or the README's command twice
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == files
    done = _demo(cli, out, "--seed", "3")
    assert done.code == 2  # another demo over it would mix two
    err = done.err
    assert str(out) in err and "seed=0" in err


def test_an_interrupted_demo_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Cli
) -> None:
    """Written beside the folder, then renamed: a rerun (`make demo`) is never refused for a
    half-written demo of its own."""
    import stallfree.data.tools.demo as demo

    calls = 0
    real = demo.draw_image

    def interrupted(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(demo, "draw_image", interrupted)
    out = tmp_path / "demo"
    with pytest.raises(KeyboardInterrupt):
        _demo(cli, out)
    assert not out.exists() and os.listdir(tmp_path) == []
    monkeypatch.setattr(demo, "draw_image", real)
    assert _demo(cli, out).code == 0 and (out / ".complete").is_file()


def _modes(root: Path) -> set[str]:
    return {
        f"{'d' if p.is_dir() else 'f'} {stat.S_IMODE(p.stat().st_mode):o}" for p in [root, *root.rglob("*")]
    }


def test_pack_and_demo_output_follow_the_umask(
    image_root: Path, tmp_path: Path, umask_022: None, cli: Cli
) -> None:
    """Under umask 022 every folder is 755 and every file 644: others on a shared filesystem
    can read the shards."""
    packed = tmp_path / "packed"
    assert cli("data", "pack", image_root, packed, "--no-progress").code == 0
    assert _modes(packed) == {"d 755", "f 644"}
    demo = tmp_path / "demo"
    assert _demo(cli, demo).code == 0
    assert _modes(demo) == {"d 755", "f 644"}
