"""Stop signals across `stallfree train`'s start-up, its run, and after it (train/signals.py)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from stallfree.cli import main


def test_a_sigusr1_after_one_run_is_not_honoured_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that calls main() twice (a notebook, a sweep): Slurm's SIGUSR1 after the first
    run finished is only remembered for that run; the second starts with no stop requested."""
    import stallfree.train.run as run_module
    from stallfree.train.signals import StopSignal

    seen: list[str | None] = []

    def fake_train(recipe: Any, out: Any, **kwargs: Any) -> dict[str, Any]:
        with StopSignal() as stop:  # the training loop's own handler, as train() holds it
            seen.append(stop.requested)
        return {}

    monkeypatch.setattr(run_module, "train", fake_train)
    recipe = tmp_path / "r.toml"
    recipe.write_text('[loader]\nbackend = "synthetic"\n[train]\ndevice = "cpu"\nepochs = 1\n')
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        assert main(["train", str(recipe), "--out", str(tmp_path / "a"), "--no-progress"]) == 0
        signal.raise_signal(signal.SIGUSR1)  # the job's "time is nearly up", once the run is done
        assert main(["train", str(recipe), "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert seen == [None, None]
