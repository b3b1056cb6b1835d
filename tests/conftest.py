"""Shared fixtures: tiny datasets written into tmp dirs, the CUDA marker, per-worker settings."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zygote
from inprocess import Cli
from pillow_corpus import pillow_images  # noqa: F401 - Pillow's test images, for two modules

from stallfree.data.tools.demo import write_demo

HAS_DALI = importlib.util.find_spec("nvidia.dali") is not None
# Start-up check results, packed peer shards and the like go to a cache of the test session
# (inherited by every subprocess), not into the user's ~/.cache.
# Under pytest-xdist (`make test`) each worker has its own, so that no test sees another's entries.
_CACHE = tempfile.TemporaryDirectory(prefix="stallfree-test-cache-")
if os.environ.get("STALLFREE_CACHE") in (None, os.environ.get("_STALLFREE_TEST_CACHE")):
    os.environ["STALLFREE_CACHE"] = os.environ["_STALLFREE_TEST_CACHE"] = _CACHE.name
# Workers share the cores: torch's intra-op threads would otherwise oversubscribe them
# (each worker would use every core for its matmuls and convolutions).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))
    # The same count for the runs tests start as subprocesses: a run compared bitwise with one
    # made in this process must sum its convolutions over the same number of threads.
    os.environ["OMP_NUM_THREADS"] = str(torch.get_num_threads())
# matplotlib's font cache goes to a folder of the session's (its workers inherit it): no test
# depends on what this machine has cached.
_BUILT = os.environ.get("_STALLFREE_TEST_MPL")
if _BUILT is None or _BUILT != os.environ.get("MPLCONFIGDIR"):
    _MPL = tempfile.TemporaryDirectory(prefix="stallfree-test-mpl-")
    os.environ["MPLCONFIGDIR"] = os.environ["_STALLFREE_TEST_MPL"] = _MPL.name

# The folder says what a test is: one under tests/e2e is end to end (it starts a process, trains a
# run or uses a server) and carries the `e2e` marker, so `-m "not e2e"` is tests/unit. A test under
# tests/unit that uses a server fixture (`*_server`) or is marked `slow` or `e2e` is refused here.
_E2E = Path(__file__).parent / "e2e"


def _misplaced(item: pytest.Item) -> bool:
    """A test outside tests/e2e that is end to end by its marks or fixtures."""
    if _E2E in item.path.parents:
        return False
    marked = item.get_closest_marker("slow") or item.get_closest_marker("e2e")
    return marked is not None or any(name.endswith("_server") for name in getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_dali = pytest.mark.skip(reason="needs nvidia-dali (pip install -e '.[dali]')")
    misplaced = [item.nodeid for item in items if _misplaced(item)]
    if misplaced:
        names = ", ".join(misplaced)
        raise pytest.UsageError(f"{names} uses a server or is marked slow or e2e: move it to tests/e2e")
    for item in items:
        if _E2E in item.path.parents:
            item.add_marker(pytest.mark.e2e)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "dali" in item.keywords and not HAS_DALI:
            item.add_marker(skip_dali)
    # The long tests first (a stable sort): under pytest-xdist they then run beside the short
    # ones instead of starting last and holding the whole run up at its end.
    items.sort(key=lambda item: not ("slow" in item.keywords or "slurm" in item.keywords))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's worker loop, which ends the hook
def pytest_runtestloop(session: pytest.Session) -> None:
    """Where this process will run end-to-end tests, start the fork server that their Python
    processes come from (zygote.py): each then starts in a fraction of a second, not ~5 s."""
    if session.config.option.collectonly or zygote.ZYGOTE_ENV in os.environ:
        return
    if any(item.get_closest_marker("e2e") for item in session.items):
        _ZYGOTE.append(zygote.start(Path(_CACHE.name)))


def pytest_sessionfinish(session: pytest.Session) -> None:
    for server in _ZYGOTE:
        zygote.stop(server)


_ZYGOTE: list[Any] = []
# fastpython's interpreter where no fork server answers (a unit run, another network namespace).
os.environ.setdefault("STALLFREE_TEST_PYTHON", sys.executable)


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Iterator[Cli]:
    """`cli("train", recipe, ...)`: `stallfree ARGS` in this process, its Result(code, out, err);
    what the command changed in the process is put back at the test's end (inprocess.py)."""
    runner = Cli(capsys, monkeypatch)
    yield runner
    runner.restore()


@pytest.fixture(scope="session")
def image_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 10-class demo ImageFolder: 6 train and 3 val images per class (photo-like sizes)."""
    return write_demo(
        tmp_path_factory.mktemp("demo"),
        train_per_class=6,
        val_per_class=3,
        seed=1,
        gray_every=4,
        progress=False,
    )


def _serving(server: Any) -> Iterator[Any]:
    """A session's store server, started, with its standard variables set in this process and
    its children until the session ends (then restored), and killed at the end."""
    from emulators import environment

    server.start()
    try:
        with environment(server.env()):
            yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A SeaweedFS S3 server on loopback for the session; the standard AWS_* variables point
    this process and its children at it (restored at the end)."""
    from s3_server import Server, need_weed

    yield from _serving(Server(need_weed(), tmp_path_factory.mktemp("seaweed")))


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory: pytest.TempPathFactory):
    """fake-gcs-server on loopback for the session; STORAGE_EMULATOR_HOST points this process
    and its children at it (restored at the end)."""
    from gcs_server import Server, need_binary

    yield from _serving(Server(need_binary(), tmp_path_factory.mktemp("fake-gcs")))


@pytest.fixture(scope="session")
def azure_server(tmp_path_factory: pytest.TempPathFactory):
    """Azurite on loopback for the session; AZURE_STORAGE_CONNECTION_STRING (its development
    account) points this process and its children at it (restored at the end)."""
    from azure_server import Server, need_binary

    yield from _serving(Server(need_binary(), tmp_path_factory.mktemp("azurite")))
