"""Each cloud is reached by its standard variables alone: Google Cloud Storage (fake-gcs-server)
and Azure Blob Storage (Azurite) list, read and read ranges through `clouds.open_store`; a
missing bucket, missing credentials and a dead endpoint are errors, never an empty listing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stallfree.data.storage import clouds
from stallfree.data.storage.clouds import open_store

obstore = pytest.importorskip("obstore")


OBJECTS = {"d/a/1.bin": bytes(range(200)), "d/a/2.bin": b"two", "d/b/3.bin": b"three", "d/top.txt": b"top"}


@pytest.fixture(scope="module", params=["gs", "az"])
def cloud(request: pytest.FixtureRequest) -> tuple[str, Any]:
    """(scheme, server) with OBJECTS in its bucket `unit`."""
    server = request.getfixturevalue({"gs": "gcs_server", "az": "azure_server"}[request.param])
    (server.create_bucket if request.param == "gs" else server.create_container)("unit")
    for key, data in OBJECTS.items():
        server.put("unit", key, data)
    return request.param, server


@pytest.mark.e2e
def test_lists_reads_and_reads_ranges(cloud: tuple[str, Any]) -> None:
    scheme, _ = cloud
    store = open_store(scheme, "unit")
    listed = {o["path"]: o["size"] for o in obstore.list(store, "d/").collect()}
    assert listed == {key: len(data) for key, data in OBJECTS.items()}
    level = obstore.list_with_delimiter(store, "d/")
    assert sorted(level["common_prefixes"]) == ["d/a", "d/b"]
    assert [o["path"] for o in level["objects"]] == ["d/top.txt"]
    assert bytes(obstore.get(store, "d/a/1.bin").bytes()) == OBJECTS["d/a/1.bin"]
    assert bytes(obstore.get_range(store, "d/a/1.bin", start=7, end=130)) == OBJECTS["d/a/1.bin"][7:130]
    assert obstore.head(store, "d/b/3.bin")["size"] == 5


@pytest.mark.e2e
def test_a_missing_bucket_is_an_error_not_an_empty_listing(cloud: tuple[str, Any]) -> None:
    store = open_store(cloud[0], "no-such-bucket", retry_config={"max_retries": 0})
    with pytest.raises(obstore.exceptions.BaseError):
        obstore.list(store, "d/").collect()
    with pytest.raises(FileNotFoundError):
        obstore.head(store, "d/top.txt")


@pytest.mark.e2e
def test_a_dead_endpoint_is_an_error(cloud: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    scheme, server = cloud
    dead = "127.0.0.1:9"  # the discard port: nothing listens
    if scheme == "gs":
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", dead)  # Google's clients take host:port too
    else:
        text = server.env()["AZURE_STORAGE_CONNECTION_STRING"].replace(f"127.0.0.1:{server.port}", dead)
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", text)
    store = open_store(scheme, "unit", retry_config={"max_retries": 0})
    with pytest.raises(obstore.exceptions.BaseError, match=dead):
        obstore.list(store, "d/").collect()


@pytest.mark.e2e
def test_the_emulator_host_may_omit_the_scheme(gcs_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    gcs_server.create_bucket("hostport")
    gcs_server.put("hostport", "k", b"value")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"127.0.0.1:{gcs_server.port}")
    assert bytes(obstore.get(open_store("gs", "hostport"), "k").bytes()) == b"value"


@pytest.mark.e2e
def test_a_service_account_json_may_name_the_endpoint(
    gcs_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """obstore's own emulator route: GOOGLE_SERVICE_ACCOUNT's JSON with gcs_base_url."""
    gcs_server.create_bucket("byjson")
    gcs_server.put("byjson", "k", b"value")
    account = tmp_path / "account.json"
    fields = {
        "gcs_base_url": gcs_server.endpoint,
        "disable_oauth": True,
        "client_email": "",
        "private_key": "",
        "private_key_id": "",
    }
    account.write_text(json.dumps(fields))
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(account))
    assert bytes(obstore.get(open_store("gs", "byjson"), "k").bytes()) == b"value"


@pytest.mark.e2e
def test_an_account_name_and_key_reach_the_endpoint_url(
    azure_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    azure_server.create_container("bykey")
    azure_server.put("bykey", "k", b"value")
    monkeypatch.delenv("AZURE_STORAGE_CONNECTION_STRING")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", clouds.AZURITE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", clouds.AZURITE_KEY)
    store = open_store("az", "bykey", endpoint_url=azure_server.endpoint)
    assert bytes(obstore.get(store, "k").bytes()) == b"value"


@pytest.mark.e2e
def test_a_wrong_account_key_is_refused(azure_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    azure_server.create_container("wrongkey")
    azure_server.put("wrongkey", "k", b"value")
    wrong = azure_server.env()["AZURE_STORAGE_CONNECTION_STRING"].replace(clouds.AZURITE_KEY, "d3Jvbmc=")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong)
    store = open_store("az", "wrongkey", retry_config={"max_retries": 0})
    with pytest.raises(obstore.exceptions.PermissionDeniedError):
        obstore.get(store, "k")
