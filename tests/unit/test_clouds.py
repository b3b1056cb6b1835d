"""Each cloud is reached by its standard variables alone: Google Cloud Storage (fake-gcs-server)
and Azure Blob Storage (Azurite) list, read and read ranges through `clouds.open_store`; a
missing bucket, missing credentials and a dead endpoint are errors, never an empty listing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import CLIENT_WORDS

from stallfree.data.storage import clouds
from stallfree.data.storage.clouds import CloudConfigError, azure_config, open_store

AZURITE_STRING = (
    "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
    f"AccountKey={clouds.AZURITE_KEY};BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;"
)
# Every variable a cloud's credentials or endpoint could come from: cleared for the unit tests.
_CLOUD_VARS = (
    "STORAGE_EMULATOR_HOST",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "GOOGLE_BEARER_TOKEN",
    "GCE_METADATA_HOST",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
)


@pytest.fixture
def bare(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No cloud variable, no gcloud login, not on a Google Cloud machine."""
    for name in _CLOUD_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setattr(clouds, "_FIRMWARE_PRODUCT", tmp_path / "product_name")
    monkeypatch.setattr(clouds, "_FIRMWARE_ASSET_TAG", tmp_path / "chassis_asset_tag")
    return monkeypatch


def test_azurites_connection_string_names_account_key_and_endpoint() -> None:
    config = azure_config({"AZURE_STORAGE_CONNECTION_STRING": AZURITE_STRING})
    assert config == {
        "account_name": "devstoreaccount1",
        "account_key": clouds.AZURITE_KEY,
        "endpoint": "http://127.0.0.1:10000/devstoreaccount1",
    }
    assert azure_config({"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"}) == config


def test_a_sovereign_clouds_connection_string_makes_its_endpoint() -> None:
    text = (
        "DefaultEndpointsProtocol=https;AccountName=acct;SharedAccessSignature=sv=1&sig=x;"
        "EndpointSuffix=core.chinacloudapi.cn"
    )
    config = azure_config({"AZURE_STORAGE_CONNECTION_STRING": text})
    assert config == {
        "account_name": "acct",
        "sas_key": "sv=1&sig=x",
        "endpoint": "https://acct.blob.core.chinacloudapi.cn",
    }


@pytest.mark.parametrize("text", ["AccountKey=hush-hush-key", "AccountName=acct;hush-hush-key"])
def test_a_bad_connection_string_is_refused_without_its_value(text: str) -> None:
    with pytest.raises(CloudConfigError) as err:
        azure_config({"AZURE_STORAGE_CONNECTION_STRING": text})
    assert "AZURE_STORAGE_CONNECTION_STRING" in str(err.value) and "hush" not in str(err.value)


@pytest.mark.parametrize(
    ("scheme", "hint"),
    [("ftp", "known: s3, gs, az"), ("gcs", "write gs://bucket"), ("abfs", "write az://container")],
)
def test_an_unknown_scheme_names_the_known_ones(scheme: str, hint: str) -> None:
    with pytest.raises(CloudConfigError, match=rf"^{scheme}://bkt: unknown object store scheme") as err:
        open_store(scheme, "bkt")
    assert hint in str(err.value)


@pytest.mark.parametrize(
    ("scheme", "variables"),
    [
        ("gs", "GOOGLE_APPLICATION_CREDENTIALS to a service-account JSON"),
        ("gs", "STORAGE_EMULATOR_HOST"),
        ("az", "AZURE_STORAGE_CONNECTION_STRING"),
        ("az", "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY"),
    ],
)
def test_missing_credentials_are_one_line_naming_the_url_and_variables(
    bare: pytest.MonkeyPatch, scheme: str, variables: str
) -> None:
    with pytest.raises(
        CloudConfigError, match=rf"^{scheme}://bkt: no (Google credentials|Azure storage account)"
    ) as err:
        open_store(scheme, "bkt")
    assert variables in str(err.value) and "\n" not in str(err.value)


def test_a_gcloud_login_counts_as_google_credentials(bare: pytest.MonkeyPatch, tmp_path: Path) -> None:
    login = tmp_path / "gcloud" / "application_default_credentials.json"
    login.parent.mkdir()
    login.write_text(
        json.dumps({"type": "authorized_user", "client_id": "c", "client_secret": "s", "refresh_token": "r"})
    )
    assert open_store("gs", "bkt") is not None


# -- against the emulators ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "text"),
    [
        ("AZURE_STORAGE_CONNECTION_STRING", "AccountName=acct;AccountKey=not base64 hush!!"),
        ("AZURE_STORAGE_ACCOUNT_KEY", "not base64 hush!!"),
    ],
)
def test_an_account_key_that_is_not_base64_is_named_without_its_value(
    bare: pytest.MonkeyPatch, variable: str, text: str
) -> None:
    bare.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
    bare.setenv(variable, text)
    with pytest.raises(CloudConfigError, match=rf"^az://bkt: {variable}.*key is not base64") as err:
        open_store("az", "bkt")
    assert "hush" not in str(err.value) and "\n" not in str(err.value)
    assert not CLIENT_WORDS.search(str(err.value)), err.value


def test_a_setting_obstore_refuses_is_our_line_and_its_words_go_to_verbose(bare: pytest.MonkeyPatch) -> None:
    bare.setenv("GOOGLE_SERVICE_ACCOUNT_KEY", "{not json")
    with pytest.raises(CloudConfigError) as err:
        open_store("gs", "bkt")
    message = str(err.value)
    assert message.startswith("gs://bkt: ") and "GOOGLE_" in message and "--verbose" in message
    assert not CLIENT_WORDS.search(message) and "\n" not in message, message
    assert "Generic " in err.value.detail  # the client's words, whole, for --verbose


_PEM = "-----BEGIN PRIVATE KEY-----\n{}\n-----END PRIVATE KEY-----\n"
_ACCOUNT = {"type": "service_account", "client_email": "a@p.iam.gserviceaccount.com", "private_key_id": "1"}


@pytest.mark.parametrize(
    ("variable", "content", "said"),
    [
        ("GOOGLE_APPLICATION_CREDENTIALS", {**_ACCOUNT, "private_key": _PEM.format("notakey")}, "private"),
        ("GOOGLE_SERVICE_ACCOUNT", {**_ACCOUNT, "private_key": _PEM.format("bm90YWtleQ==")}, "private_key"),
        ("GOOGLE_APPLICATION_CREDENTIALS", {**_ACCOUNT}, "private_key"),
        ("GOOGLE_APPLICATION_CREDENTIALS", "{not json", "not JSON"),
    ],
)
def test_a_service_account_file_that_cannot_sign_names_the_file_and_the_field(
    bare: pytest.MonkeyPatch, tmp_path: Path, variable: str, content: Any, said: str
) -> None:
    path = tmp_path / "account.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    bare.setenv(variable, str(path))
    with pytest.raises(CloudConfigError, match=r"^gs://bkt: ") as err:
        open_store("gs", "bkt")
    message = str(err.value)
    assert f"{variable} ({path})" in message and said in message, message
    assert not CLIENT_WORDS.search(message) and "\n" not in message, message


def test_a_connection_string_without_a_key_is_missing_credentials(bare: pytest.MonkeyPatch) -> None:
    """Without AccountKey or a SAS, obstore asks the Azure instance metadata service for a
    token: off Azure that fails as a store that does not answer would. Said at open instead."""
    bare.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountName=acct;BlobEndpoint=http://127.0.0.1:9/acct")
    with pytest.raises(CloudConfigError, match=r"^az://bkt: no Azure credentials") as err:
        open_store("az", "bkt")
    assert "AccountKey" in str(err.value) and "SharedAccessSignature" in str(err.value)
    assert not CLIENT_WORDS.search(str(err.value)), err.value


def test_on_an_azure_machine_a_managed_identity_may_sign(bare: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bare.setenv("AZURE_STORAGE_CONNECTION_STRING", "AccountName=acct;BlobEndpoint=http://127.0.0.1:9/acct")
    (tmp_path / "chassis_asset_tag").write_text(clouds.AZURE_ASSET_TAG + "\n")  # as `bare` points it
    assert open_store("az", "bkt") is not None


def test_the_environment_holds_what_open_store_reads(bare: pytest.MonkeyPatch) -> None:
    """A store helper started with other values must be told apart (it compares these)."""
    before = clouds.environment()
    bare.setenv("AZURE_STORAGE_CONNECTION_STRING", AZURITE_STRING)
    bare.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9")
    bare.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    after = clouds.environment()
    assert {k for k in after if after[k] != before.get(k)} == {
        "AZURE_STORAGE_CONNECTION_STRING",
        "STORAGE_EMULATOR_HOST",
        "AWS_ENDPOINT_URL",
    }
    assert "PATH" not in after


@pytest.mark.parametrize(("scheme", "word"), [("s3", "bucket"), ("gs", "bucket"), ("az", "container")])
def test_a_url_without_its_bucket_says_each_stores_word(scheme: str, word: str) -> None:
    from stallfree.data.storage import StoreError, split_url

    with pytest.raises(
        StoreError, match=rf"^{scheme}://: no {word} name; expected {scheme}://{word.upper()}/"
    ):
        split_url(f"{scheme}://")
    with pytest.raises(CloudConfigError, match=rf"^{scheme}://: no {word} in the URL"):
        open_store(scheme, "")
