"""The storage layer against a real S3-compatible server (SeaweedFS on loopback)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallfree.data import storage
from stallfree.data.storage import dispatch, objects, settings, wire


def test_an_unknown_scheme_is_refused_by_name() -> None:
    """gs-like URLs passed the start check and failed later as a local path."""
    with pytest.raises(storage.StoreError, match=r"^http://x/y: http:// is not a store"):
        storage.locate("http://x/y")
    assert storage.locate("/data/s3://x").store == storage.LocalStore()
    assert storage.locate(Path("s3:/b")).store == storage.LocalStore()
    assert storage.locate("s3://b/p/") == storage.Location(storage.ObjectStore("s3", "b"), "p")


@pytest.mark.parametrize("read", [lambda url: storage.read(url), lambda url: storage.read_range(url, 0, 10)])
def test_a_get_that_failed_for_good_is_not_made_again(monkeypatch: pytest.MonkeyPatch, read) -> None:
    """A GET's failure comes after the attempts and the outage budget: asking again would
    multiply the wait before a run that cannot go on stops (read_range once asked 3x)."""
    calls: list[str] = []

    def down(op: str, where: object, *args: object) -> object:
        calls.append(op)
        raise wire.Failure("no_answer", "connection refused")

    monkeypatch.setattr(dispatch, "run", down)
    monkeypatch.setenv(storage.ATTEMPTS_ENV, "1")
    monkeypatch.setenv(storage.OUTAGE_ENV, "0.01")
    before = settings.retries()
    with pytest.raises(storage.StoreUnavailableError, match=r"^s3://bucket/key: the store did not answer"):
        read("s3://bucket/key")
    assert calls.count("get") == 1 and settings.retries() == before


def test_a_get_that_errs_while_its_head_answers_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted SeaweedFS answers HEADs (its filer) while its volumes still answer GETs with a
    500: a read during a run waits for the bytes, it does not call that the store's refusal."""
    failures = iter(range(3))

    def restarting(op: str, where: object, *args: object) -> object:
        if op == "head":
            return (4, "etag")
        if next(failures, None) is not None:
            raise wire.Failure("no_answer", "Server returned non-2xx status code: 500 Internal Server Error")
        return b"data"

    monkeypatch.setattr(dispatch, "run", restarting)
    monkeypatch.setattr(objects.time, "sleep", lambda seconds: None)
    monkeypatch.setenv(storage.ATTEMPTS_ENV, "2")
    monkeypatch.setenv(storage.OUTAGE_ENV, "30")
    assert storage.read("s3://bucket/key") == b"data"


def test_only_the_storage_package_reads_a_scheme() -> None:
    """Local-or-remote was decided at 29 places in 13 files, three different ways."""
    import re

    src = Path(__file__).resolve().parents[2] / "src" / "stallfree"
    pattern = re.compile(r"""["']://["']\s+(not\s+)?in\b|startswith\(\s*["'](s3|gs|az)://|is_remote\(""")
    found = [
        f"{path.relative_to(src)}:{number}"
        for path in src.rglob("*.py")
        if "storage" not in path.relative_to(src).parts
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found


def test_the_outage_budget_under_either_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(storage.OUTAGE_ENV, raising=False)
    monkeypatch.setenv("STALLFREE_S3_OUTAGE_S", "7")
    assert storage.outage_budget() == 7.0
    monkeypatch.setenv(storage.OUTAGE_ENV, "9")  # the store-neutral name wins
    assert storage.outage_budget() == 9.0


def test_a_local_listing_names_a_dangling_link_instead_of_failing(tmp_path: Path) -> None:
    """A dangling link under a shard root made the local listing raise FileNotFoundError:
    it is listed (by the link's own size), and reading it names the file."""
    (tmp_path / "a.tar").write_bytes(b"x" * 5)
    (tmp_path / "b.tar").symlink_to(tmp_path / "gone.tar")
    root = storage.locate(str(tmp_path))
    assert list(root.list_objects()) == ["a.tar", "b.tar"] and root.list_objects()["a.tar"][0] == 5
    with pytest.raises(OSError, match="b.tar"):
        root.join("b.tar").read()


def test_a_file_given_as_the_data_root_is_named_as_a_file(tmp_path: Path) -> None:
    """A plain file as data.root was said not to exist, which sent a user looking for a path
    that was there."""
    (tmp_path / "afile").write_bytes(b"x")
    with pytest.raises(storage.NoDataError, match=r"afile is a file, not a folder"):
        storage.locate(str(tmp_path / "afile")).check_root("folder")
