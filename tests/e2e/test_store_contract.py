"""The Store contract, one test over every store: a local folder and the same files in S3
(SeaweedFS), GCS (fake-gcs-server) and Azure (Azurite) answer every Location question alike,
so that a reader written against a Location reads each the same way."""

from __future__ import annotations

from pathlib import Path

import pytest

from stallfree.data import storage
from stallfree.errors import StallfreeError

SERVERS = {"s3": "s3_server", "gs": "gcs_server", "az": "azure_server"}
BLOB = bytes(range(256)) * 5  # 1,280 bytes: ranges and blocks that end short of it
TREE = {
    "train/a/x.bin": BLOB,
    "train/a/sub/y.bin": b"y" * 3,
    "train/b/z.bin": b"",
    "val/a/w.bin": b"w" * 10,
}


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("contract") / "root"
    for name, data in TREE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@pytest.fixture(scope="module", params=["local", *SERVERS])
def root(request: pytest.FixtureRequest, tree: Path) -> storage.Location:
    """The tree at a local path, or uploaded to one store's bucket."""
    if request.param == "local":
        return storage.locate(str(tree))
    server = request.getfixturevalue(SERVERS[request.param])
    return storage.locate(server.upload_tree(tree, "contract", "root") + "/")


def test_a_location_names_itself_and_its_parts(root: storage.Location) -> None:
    text = str(root)
    assert not text.endswith("/") and storage.locate(text) == root
    assert str(root.join("train", "a/")) == f"{text}/train/a" and root.join("val").name == "val"
    assert root.resolved().resolved() == root.resolved()
    assert storage.locate(f"{text}/").identity() == root.identity() != root.join("train").identity()


def test_listings_hold_the_same_names_and_sizes(root: storage.Location) -> None:
    listed = root.list_objects()
    assert list(listed) == sorted(TREE) and {n: s for n, (s, _) in listed.items()} == {
        n: len(d) for n, d in TREE.items()
    }
    assert list(root.join("train", "a").list_objects(shallow=True)) == ["x.bin"]
    assert root.list_dirs() == ["train", "val"] and root.join("train").list_dirs() == ["a", "b"]
    before = storage.digest_of_listing(root, listed)
    assert before == storage.digest_of_listing(root, root.list_objects())
    assert before != storage.digest_of_listing(root.join("train"), listed)
    [(names, digest)] = storage.list_many([root.join("train", "a")])
    assert names == [("sub/y.bin", 3), ("x.bin", len(BLOB))] and digest


def test_reads_sizes_and_files_agree(root: storage.Location) -> None:
    blob = root.join("train/a/x.bin")
    assert blob.read() == BLOB and blob.read(5) == BLOB[:5] and blob.size() == len(BLOB)
    assert blob.read_range(300, 10) == BLOB[300:310] and blob.read_range(1270, 100) == BLOB[1270:]
    assert blob.exists() and not root.join("train/a/nothing.bin").exists()
    assert root.join("train/b/z.bin").read() == b"" and root.join("train/b/z.bin").size() == 0
    with blob.open() as f:
        assert f.pread(7, 1000) == BLOB[1000:1007] and f.read(4) == BLOB[:4]
        f.seek(1279)
        assert f.read() == BLOB[1279:]
    assert b"".join(blob.blocks(size=500)) == BLOB
    assert storage.read_sample(str(blob)) == BLOB
    assert storage.read_sample(storage.member_path(str(blob), "m.jpg", 512, 20)) == BLOB[512:532]


def test_the_root_check_passes_a_folder_root_and_names_a_missing_split(root: storage.Location) -> None:
    root.check_root("folder")
    root.check_root("tar")
    with pytest.raises(StallfreeError) as missing:
        root.join("train").check_root("folder")  # train/ has no train/ below it
    assert f"{root}/train" in str(missing.value) and "\n" not in str(missing.value)
    with pytest.raises(StallfreeError) as nothing:
        root.join("nothing").check_root("tar")
    assert f"{root}/nothing" in str(nothing.value)


def test_only_a_local_location_is_a_folder(root: storage.Location) -> None:
    if root.store.scheme:
        with pytest.raises(storage.NotAFolderError, match=rf"^{root}: pack writes a local folder") as err:
            root.folder("pack writes a local folder")
        assert not err.value.hint  # the fix is in the message, not the store's credentials
        assert root.path is None and storage.file_path(str(root.join("train/a/x.bin"))) is None
    else:
        assert root.folder("pack writes a local folder") == Path(str(root)) == root.path
        assert storage.file_path(str(root.join("train/a/x.bin"))) == str(root.join("train/a/x.bin"))
