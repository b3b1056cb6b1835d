"""Shards in an object store (a real S3-compatible server on loopback): other people's WebDataset
shards train as from a local copy, bitwise; `data check` and `data pack` take an s3:// root."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest
import torch
from helpers import final_weights, small_recipe
from s3_server import upload_tree

from stallfree.cli import main
from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.readers.tarshards import ShardError
from stallfree.data.tools.check import check_dataset
from stallfree.data.tools.pack import PackError, pack_dataset
from stallfree.recipe import DataConfig
from stallfree.train.run import train

BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]
BUCKET = "shards3"


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _foreign_shards(image_root: Path, out: Path) -> Path:
    """Shards as another tool writes them: ROOT/{train,val}/*.tar, KEY.jpg + KEY.cls, keys with
    a folder part, members in no particular order of classes."""
    classes = sorted(p.name for p in (image_root / "train").iterdir())
    for split in ("train", "val"):
        (out / split).mkdir(parents=True)
        files = sorted((image_root / split).glob("*/*.jpg"))
        for part in range(2):
            with tarfile.open(out / split / f"shard-{part}.tar", "w") as tar:
                for i, path in enumerate(files[part::2]):
                    key = f"{path.parent.name}/s{part}_{i:05d}"
                    _add(tar, f"{key}.jpg", path.read_bytes())
                    _add(tar, f"{key}.cls", str(classes.index(path.parent.name)).encode())
    return out


@pytest.fixture(scope="module")
def foreign(image_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _foreign_shards(image_root, tmp_path_factory.mktemp("foreign"))


@pytest.fixture(scope="module")
def remote(s3_server, image_root: Path, foreign: Path) -> dict[str, str]:
    client = s3_server.client()
    return {
        "foreign": upload_tree(client, foreign, BUCKET, "foreign"),
        "folder": upload_tree(client, image_root, BUCKET, "folder"),
    }


def _recipe(root: str | Path, backend: str):
    return small_recipe(
        root,
        data={"format": "tar"},
        loader={"backend": backend, "torch": {"workers": 1}},
        train={"epochs": 1, "batch_size": 12},
        optim={"name": "sgd", "lr": 0.05},
    )


def test_foreign_shards_from_the_store_list_as_the_local_copy(remote: dict[str, str], foreign: Path) -> None:
    mine = resolve_dataset(DataConfig(root=str(foreign), format="tar"))
    theirs = resolve_dataset(DataConfig(root=remote["foreign"], format="tar"))
    assert theirs.classes == mine.classes
    for split in ("train", "val"):
        local, store = mine.splits[split], theirs.splits[split]
        assert [p.removeprefix(f"{foreign}/") for p in local.files] == [
            p.removeprefix(f"{remote['foreign']}/") for p in store.files
        ]
        assert local.labels.tolist() == store.labels.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_on_foreign_shards_from_the_store_is_the_local_run(
    remote: dict[str, str], foreign: Path, tmp_path: Path, backend: str
) -> None:
    train(_recipe(foreign, backend), tmp_path / "local", progress=False)
    train(_recipe(remote["foreign"], backend), tmp_path / "s3", progress=False)
    mine, theirs = final_weights(tmp_path / "local"), final_weights(tmp_path / "s3")
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name


def _broken(foreign: Path, how: str) -> bytes:
    data = (foreign / "train" / "shard-1.tar").read_bytes()
    if how == "truncated":
        return data[: len(data) // 2]
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        first_cls = next(m for m in tar if m.name.endswith(".cls"))
    start = first_cls.offset_data
    return data[:start] + b"x" + data[start + 1 :]  # the label is no number now


@pytest.mark.parametrize(
    ("how", "needle"),
    [("truncated", r"shard-1\.tar::.*truncated"), ("bad-cls", r"shard-1\.tar::.*\.cls member holds")],
)
def test_a_broken_shard_in_the_store_is_one_line_naming_it(
    s3_server, remote: dict[str, str], foreign: Path, how: str, needle: str
) -> None:
    client = s3_server.client()
    prefix = f"broken-{how}"
    url = upload_tree(client, foreign, BUCKET, prefix)
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/train/shard-1.tar", Body=_broken(foreign, how))
    with pytest.raises(ShardError, match=needle) as caught:
        resolve_dataset(DataConfig(root=url, format="tar"))
    assert str(caught.value).startswith(f"{url}/train/shard-1.tar::") and "\n" not in str(caught.value)


def test_data_check_names_a_corrupt_image_in_the_store(
    s3_server, remote: dict[str, str], image_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = s3_server.client()
    url = upload_tree(client, image_root, BUCKET, "corrupt")
    victim = sorted((image_root / "val").glob("*/*.jpg"))[0].relative_to(image_root).as_posix()
    client.put_object(Bucket=BUCKET, Key=f"corrupt/{victim}", Body=victim.encode() * 8)
    client.put_object(Bucket=BUCKET, Key="corrupt/train/c0/notes.txt", Body=b"hello")
    assert main(["data", "check", url, "--workers", "1", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert f"BAD {url}/{victim}: " in out and f"BAD {url}/train/c0/notes.txt: not an image file type" in out
    local = check_dataset(image_root, workers=1, progress=False)
    assert f"{len(local.good) - 1} good, 2 bad files in {url}" in out


def test_data_check_on_shards_in_the_store(remote: dict[str, str], foreign: Path) -> None:
    report = check_dataset(remote["foreign"], workers=1, progress=False)
    local = check_dataset(foreign, workers=1, progress=False)
    assert not report.bad and len(report.good) == len(local.good) > 0
    assert all(str(p).startswith(f"{remote['foreign']}/") for p in report.good)


@pytest.fixture(scope="module")
def packed(image_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "shards"
    pack_dataset(image_root, out, shard_bytes=200_000, progress=False)
    return out


def test_pack_from_the_store_writes_the_shards_of_the_local_copy(
    remote: dict[str, str], packed: Path, tmp_path: Path
) -> None:
    args = ["data", "pack", remote["folder"], str(tmp_path / "s3"), "--shard-size", "200KB", "--no-progress"]
    assert main(args) == 0
    local = sorted(p.name for p in packed.iterdir())
    assert local == sorted(p.name for p in (tmp_path / "s3").iterdir()) and len(local) > 3
    for name in local:
        assert (packed / name).read_bytes() == (tmp_path / "s3" / name).read_bytes(), name
    with pytest.raises(PackError, match=r"s3://shards3/out: data pack writes a local folder"):
        pack_dataset(remote["folder"], "s3://shards3/out", shard_bytes=200_000, progress=False)


def test_data_check_names_a_changed_shard_in_the_store(s3_server, packed: Path) -> None:
    url = upload_tree(s3_server.client(), packed, BUCKET, "changed")
    shard = sorted(packed.glob("val-*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[-tarfile.RECORDSIZE - 1] ^= 0xFF  # in the zero padding: the same size, another SHA-256
    s3_server.client().put_object(Bucket=BUCKET, Key=f"changed/{shard.name}", Body=bytes(data))
    report = check_dataset(url, workers=1, progress=False)
    assert [str(p) for p, _ in report.bad_shards] == [f"{url}/{shard.name}"] and not report.bad
    assert "SHA-256 differs" in report.bad_shards[0][1] and len(report.good) == 90


@pytest.mark.parametrize("kind", ["packed", "foreign"])
def test_a_shard_replaced_in_the_store_is_checked_again_at_start(
    s3_server, packed: Path, foreign: Path, kind: str
) -> None:
    """The start-up header check is cached per dataset state: in a store, an object's ETag is
    that state (a shard replaced by one of the same size, names and offsets is a new one)."""
    from stallfree.data.readers.startup_check import bad_headers_at_start
    from stallfree.parallel import DistInfo

    local = packed if kind == "packed" else foreign
    url = upload_tree(s3_server.client(), local, BUCKET, f"replaced-{kind}")

    def bad_at_start() -> list[str]:
        dataset = resolve_dataset(DataConfig(root=url, format="tar"))
        found = bad_headers_at_start(
            dataset.splits["val"], sources=dataset.sources, checked_by=None, max_pixels=10**8,
            dist=DistInfo(),
        )  # fmt: skip
        return [e.path for e in found]

    assert bad_at_start() == []
    shard = sorted(local.glob("val-*.tar") if kind == "packed" else (local / "val").glob("*.tar"))[0]
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tar:
        image = next(m for m in tar if not m.name.endswith(".cls"))
    data[image.offset_data : image.offset_data + image.size] = bytes(image.size)  # no image now
    key = shard.relative_to(local).as_posix()
    s3_server.client().put_object(Bucket=BUCKET, Key=f"replaced-{kind}/{key}", Body=bytes(data))
    assert [p.rpartition("::")[2].rsplit(":", 2)[0] for p in bad_at_start()] == [image.name]


@pytest.mark.parametrize("kind", ["packed", "foreign"])
def test_data_check_reads_the_shards_of_the_store_as_the_local_copys(
    s3_server, packed: Path, foreign: Path, kind: str
) -> None:
    """The same shards in a store and on disk give `data check` the same shards in order,
    sample tails, labels and classes: the readers ask the root's store, not "local or not"."""
    from stallfree.data import storage
    from stallfree.data.readers import tarshards, webdataset

    reader = tarshards if kind == "packed" else webdataset
    local = packed if kind == "packed" else foreign
    url = upload_tree(s3_server.client(), local, BUCKET, f"same-{kind}")
    (mine, on_disk), (theirs, in_store) = (reader.samples_by_shard(storage.locate(r)) for r in (local, url))

    def seen(shards: list[tarshards.ShardSamples], root: str | Path) -> list[tuple[object, ...]]:
        return [(s.split, str(s.shard).removeprefix(f"{root}/"), s.tails, s.labels, s.error) for s in shards]

    assert theirs == mine and len(on_disk) > 2 and all(s.tails and not s.error for s in on_disk)
    assert seen(in_store, url) == seen(on_disk, local)
