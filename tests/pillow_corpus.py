"""Pillow's own test images (Tests/images of the Pillow sdist), a session fixture of the tests
that read them (tests/e2e/test_pillow_corpus.py, tests/unit/test_fast_headers.py).

The images are Pillow's, under Pillow's licence (MIT-CMU, also known as HPND:
https://github.com/python-pillow/Pillow/blob/main/LICENSE). They are not vendored: the sdist is
fetched once from the package index into data/pillow-corpus/ (ignored by git) and reused;
without network the tests using them are skipped, except under CI (env CI set), where they fail.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest

PILLOW = "13.0.0"
CACHE = Path(__file__).resolve().parents[1] / "data" / "pillow-corpus"


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the Pillow corpus is needed under CI: {reason}")
    pytest.skip(f"the Pillow corpus is not available: {reason}")


@pytest.fixture(scope="session")
def pillow_images() -> Path:
    """Pillow's Tests/images, extracted from its sdist (downloaded once into CACHE)."""
    images = CACHE / f"pillow-{PILLOW}" / "Tests" / "images"
    if (images.parent / ".extracted").is_file():
        return images
    sdist = CACHE / f"pillow-{PILLOW}.tar.gz"
    if not sdist.is_file():
        try:
            _download_sdist(sdist)
        except (OSError, ValueError) as error:
            _unavailable(f"pillow=={PILLOW} from {_index_url()}: {error}")
    # Two test modules use the images, maybe in two xdist workers at once: each extracts into a
    # folder of its own and renames it into place whole, so none reads a file being written.
    prefix = f"pillow-{PILLOW}/Tests/images/"
    staging = Path(tempfile.mkdtemp(prefix=".extracting-", dir=CACHE))
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
        tar.extractall(staging, members=members, filter="data")
    (staging / f"pillow-{PILLOW}" / "Tests" / ".extracted").touch()
    try:
        (staging / f"pillow-{PILLOW}").rename(CACHE / f"pillow-{PILLOW}")
    except OSError:
        if not (images.parent / ".extracted").is_file():  # not another worker's whole copy
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return images


def _index_url() -> str:
    """The package index pip would use (PIP_INDEX_URL or PyPI), as a PEP 503 simple index."""
    return os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")


def _download_sdist(sdist: Path) -> None:
    """Fetch the sdist's file from the index's page for pillow, checking its sha256.

    Not `pip download --no-binary`: pip prepares an sdist's metadata (a build environment,
    setuptools) before it saves the file, 52 s of the suite's time against 0.4 s for the file.
    """
    import hashlib
    import re
    import urllib.parse
    import urllib.request

    page = f"{_index_url()}/pillow/"
    with urllib.request.urlopen(page, timeout=60) as reply:
        html = reply.read().decode()
    links = [h for h in re.findall(r'href="([^"]+)"', html) if sdist.name in h]
    if not links:
        raise ValueError(f"no {sdist.name} on {page}")
    url, _, fragment = urllib.parse.urljoin(page, links[0].replace("&amp;", "&")).partition("#")
    with urllib.request.urlopen(url, timeout=300) as reply:
        data = reply.read()
    expected = fragment.removeprefix("sha256=")
    if fragment.startswith("sha256=") and hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(f"{url}: sha256 differs from the index's {expected}")
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = sdist.with_name(f"{sdist.name}.{os.getpid()}.partial")  # one a worker
    partial.write_bytes(data)
    partial.replace(sdist)  # a half-written file never passes for the sdist
