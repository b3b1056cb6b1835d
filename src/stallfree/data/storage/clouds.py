"""An obstore store for one bucket of S3, Google Cloud Storage or Azure Blob Storage, configured
by each cloud's standard variables alone (no recipe key); the one module that knows them.

Each `_open_<cloud>` says which variables it reads. One spelling a store (`s3://`, `gs://`,
`az://`): other tools' `gcs://`, `azure://` and `abfs://` are refused, so that cache keys and
listings never split in two. Credentials go to obstore and nowhere else: no error, log line or
file holds one (an error names the variable, never its value).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import stallfree.data.storage.credentials as credentials
import stallfree.data.storage.settings as settings
from stallfree.data.storage.failures import StoreError
from stallfree.data.storage.locations import BUCKET_WORD, SCHEMES

if TYPE_CHECKING:
    from typing import TypeAlias

    from obstore.store import AzureStore, GCSStore, S3Store

    CloudStore: TypeAlias = S3Store | GCSStore | AzureStore

# Other tools' spellings of them, refused with the one to write (`abfs://` also names Data Lake
# file systems by `fs@account.dfs.core.windows.net`, an account `az://` leaves to the variables).
_SPELLINGS = {"gcs": "gs://bucket/prefix", "azure": "az://container/prefix", "abfs": "az://container/prefix"}
# The variables each cloud is configured by, for an error's hint.
_VARIABLES = {"s3": "AWS_*", "gs": "GOOGLE_* and STORAGE_EMULATOR_HOST", "az": "AZURE_STORAGE_*"}
# Azurite's documented development account (public, the same on every machine).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_ENDPOINT = f"http://127.0.0.1:10000/{AZURITE_ACCOUNT}"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_GCS_CREDENTIALS = (
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_PATH",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "GOOGLE_BEARER_TOKEN",
)

# The variables open_store reads, by prefix: a process that opens stores for another (started
# with that one's environment) must be started again when they change.
_READS = ("AWS_", "GOOGLE_", "AZURE_", "STORAGE_EMULATOR_HOST", "GCE_METADATA_HOST", "CLOUDSDK_CONFIG")
# Where Linux shows the machine's product name: "Google Compute Engine" on Google Cloud.
_FIRMWARE_PRODUCT = Path("/sys/class/dmi/id/product_name")
# And its chassis asset tag: this one on every Azure machine (as cloud-init tells Azure).
_FIRMWARE_ASSET_TAG = Path("/sys/class/dmi/id/chassis_asset_tag")
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"


class CloudConfigError(StoreError, ValueError):
    """An object store URL this machine is not configured to reach (names the variables)."""

    hint = ""  # the message names the variables to set


# Asked again this often: boto3 refreshes an assumed role's credentials before they expire.
_REFRESH = timedelta(minutes=5)


def open_store(
    scheme: str,
    bucket: str,
    *,
    endpoint_url: str = "",
    client_options: dict[str, Any] | None = None,
    retry_config: dict[str, Any] | None = None,
) -> CloudStore:
    """The obstore store of `scheme://bucket` (an S3 bucket, a GCS bucket, an Azure container).
    `endpoint_url` overrides the cloud's endpoint (S3's, GCS's base URL, Azure's blob
    endpoint); `client_options` / `retry_config` are obstore's, passed on."""
    url = f"{scheme}://{bucket}"
    if scheme not in SCHEMES:
        known = ", ".join(SCHEMES)
        hint = f"; write {_SPELLINGS[scheme]}" if scheme in _SPELLINGS else ""
        raise CloudConfigError(f"{url}: unknown object store scheme (known: {known}){hint}")
    if not bucket:
        word = BUCKET_WORD[scheme]
        raise CloudConfigError(f"{url}: no {word} in the URL; write {scheme}://{word}/prefix")
    try:
        from obstore.exceptions import BaseError
    except ImportError:
        raise CloudConfigError(f"{url}: object stores need obstore: pip install 'stallfree[s3]'") from None
    try:
        return _OPENERS[scheme](url, bucket, endpoint_url, dict(client_options or {}), retry_config)
    except BaseError as exc:  # a setting obstore cannot use: named in our words, its own kept
        problem = _setting_problem(scheme) or (
            f"obstore cannot use the {_VARIABLES[scheme]} settings (`stallfree --verbose` shows what it said)"
        )
        error = CloudConfigError(f"{url}: {problem}")
        error.detail = f"{type(exc).__name__}: {exc}"
        raise error from None


def _setting_problem(scheme: str) -> str | None:
    """Which setting obstore refused, where the files and variables show it."""
    if scheme == "gs":
        return credentials.service_account_problem(os.environ)
    if scheme == "az":
        return credentials.azure_key_problem(azure_config(os.environ), os.environ)
    return None


def endpoint_said(scheme: str) -> str:
    """The endpoint a store of `scheme` is asked at, and what set it, for an error's words
    ("http://127.0.0.1:9 (STORAGE_EMULATOR_HOST)"); never a credential."""
    if scheme == "s3":
        found = settings.s3_endpoint()
        return f"{_bare(found)} (AWS_ENDPOINT_URL or data.endpoint_url)" if found else "AWS's S3 endpoint"
    if scheme == "gs":
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
        if emulator:
            return f"{_bare(emulator if '://' in emulator else f'http://{emulator}')} (STORAGE_EMULATOR_HOST)"
        base = _service_account_base_url()
        if base:
            return f"{_bare(base)} (the service-account JSON's gcs_base_url)"
        return "storage.googleapis.com"
    try:
        config = azure_config(os.environ)
    except CloudConfigError:
        config = {}
    if config.get("endpoint"):
        said = "AZURE_STORAGE_CONNECTION_STRING's BlobEndpoint or EndpointSuffix"
        return f"{_bare(config['endpoint'])} ({said})"
    account = config.get("account_name") or os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", "ACCOUNT")
    return f"{account}.blob.core.windows.net"


def _bare(url: str) -> str:
    """`url` without a user, password or query (which could hold a credential)."""
    parts = urlsplit(url)
    netloc = f"{parts.hostname or ''}:{parts.port}" if parts.port else parts.hostname or ""
    return f"{parts.scheme}://{netloc}{parts.path}".rstrip("/")


def environment() -> dict[str, str]:
    """The variables `open_store` reads, as they are now: to compare, never to print."""
    return {name: value for name, value in os.environ.items() if name.startswith(_READS)}


def _http(options: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """Plain HTTP only where the endpoint says so (an emulator on loopback)."""
    if endpoint.startswith("http://"):
        options.setdefault("allow_http", True)
    return options


def _store(
    kind: Callable[..., CloudStore],
    name: str,
    config: dict[str, Any],
    options: dict[str, Any],
    retry: dict[str, Any] | None,
    endpoint: str,
) -> CloudStore:
    """obstore's `kind` store of bucket or container `name`: its `config`, the HTTP client's
    `options` (plain HTTP where `endpoint`, the URL it is sent to, says so) and `retry`."""
    return kind(name, config=config, client_options=_http(options, endpoint), retry_config=retry)


def _open_s3(
    url: str, bucket: str, endpoint: str, options: dict[str, Any], retry: dict[str, Any] | None
) -> CloudStore:
    """`s3://bucket`: the endpoint from `endpoint_url` (data.endpoint_url), `AWS_ENDPOINT_URL_S3`
    or `AWS_ENDPOINT_URL`; credentials from boto3's chain where boto3 is installed (it makes no
    request, and reads ~/.aws profiles, SSO caches, credential_process and assumed roles, which
    obstore's own chain does not), else from obstore's own reading of the AWS_* variables."""
    from obstore.store import S3Store

    endpoint = _checked_endpoint(endpoint or settings.s3_endpoint())
    config: dict[str, Any] = {"region": _region()}
    if endpoint:
        # A custom endpoint (MinIO, SeaweedFS, R2...) is addressed path-style, as botocore does.
        config |= {"endpoint": endpoint, "virtual_hosted_style_request": False}
    return S3Store(
        bucket,
        config=config,
        client_options=_http(options, endpoint),
        retry_config=retry,
        credential_provider=_boto3_credentials(url),
    )


def _checked_endpoint(endpoint: str) -> str:
    """The endpoint, refused in one line where it is not an http(s) URL (obstore would panic)."""
    if endpoint and urlsplit(endpoint).scheme not in ("http", "https"):
        raise CloudConfigError(
            f"the endpoint {endpoint!r} (AWS_ENDPOINT_URL or data.endpoint_url) is not a URL; "
            f"write it with its scheme: http://{endpoint} or https://{endpoint}"
        )
    return endpoint


def _region() -> str:
    found = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if found:
        return found
    session = _session()
    return (session.region_name if session is not None else None) or "us-east-1"


def _session() -> Any:
    """A boto3 session (None without boto3): a new one a store, so that it reads the
    environment as it is now (a store is made once per bucket and endpoint)."""
    try:
        import boto3
    except ImportError:
        return None
    return boto3.session.Session()


def _boto3_credentials(url: str) -> Any:
    """obstore's credential callback over boto3's chain; None (obstore's chain) without boto3."""
    session = _session()
    if session is None:
        return None
    source = session.get_credentials()
    if source is None:
        raise CloudConfigError(
            f"{url}: no credentials found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, or a role)"
        )

    def provide() -> dict[str, Any]:
        frozen = source.get_frozen_credentials()
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": datetime.now(timezone.utc) + _REFRESH,
        }

    return provide


def _gcs_credentials_found() -> bool:
    """Whether obstore will find Google credentials, in the order Google's clients look:
    a variable, gcloud's application-default login, then the metadata server of a Google
    Cloud machine (told by its firmware's product name, as google-auth does)."""
    if any(os.environ.get(name) for name in (*_GCS_CREDENTIALS, "GCE_METADATA_HOST")):
        return True
    gcloud = Path(os.environ.get("CLOUDSDK_CONFIG") or Path.home() / ".config" / "gcloud")
    if (gcloud / "application_default_credentials.json").is_file():
        return True
    try:
        return "Google" in _FIRMWARE_PRODUCT.read_text()
    except OSError:
        return False


def _on_azure() -> bool:
    try:
        return _FIRMWARE_ASSET_TAG.read_text().strip() == AZURE_ASSET_TAG
    except OSError:
        return False


def _service_account_base_url() -> str:
    """The `gcs_base_url` of the service-account JSON GOOGLE_SERVICE_ACCOUNT names (obstore's
    own way to an emulator, with `disable_oauth`): plain HTTP is allowed for such a URL alone."""
    path = os.environ.get("GOOGLE_SERVICE_ACCOUNT") or os.environ.get("GOOGLE_SERVICE_ACCOUNT_PATH")
    if not path:
        return ""
    try:
        return str(json.loads(Path(path).read_text()).get("gcs_base_url", ""))
    except (OSError, ValueError, AttributeError):
        return ""  # obstore's own reading of it names the problem


def _open_gcs(
    url: str, bucket: str, endpoint: str, options: dict[str, Any], retry: dict[str, Any] | None
) -> CloudStore:
    """`gs://bucket`: `GOOGLE_APPLICATION_CREDENTIALS` or `GOOGLE_SERVICE_ACCOUNT` (a
    service-account JSON), gcloud's application-default login, or the metadata server on Google
    Cloud; `STORAGE_EMULATOR_HOST` (read as Google's own clients read it) points every request
    at an emulator, unsigned."""
    from obstore.store import GCSStore

    config: dict[str, Any] = {}
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator:
        # Google's clients take "host:port" or a URL, and send no credentials to an emulator.
        endpoint = endpoint or (emulator if "://" in emulator else f"http://{emulator}")
        config["skip_signature"] = True
    elif not _gcs_credentials_found():
        raise CloudConfigError(
            f"{url}: no Google credentials (set GOOGLE_APPLICATION_CREDENTIALS to a service-account "
            "JSON, run `gcloud auth application-default login`, or set STORAGE_EMULATOR_HOST "
            "for an emulator)"
        )
    if endpoint:
        config["base_url"] = endpoint.rstrip("/")
    return _store(GCSStore, bucket, config, options, retry, endpoint or _service_account_base_url())


def parse_connection_string(text: str) -> dict[str, str]:
    """An Azure Storage connection string's fields (`Key=Value;...`; keys as written, matched
    without case by `azure_config`). A field without `=` is refused, naming its position only."""
    fields: dict[str, str] = {}
    for i, part in enumerate(p.strip() for p in text.split(";")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise CloudConfigError(
                f"AZURE_STORAGE_CONNECTION_STRING: field {i + 1} is not Key=Value (the value is not shown)"
            )
        fields[key.strip().lower()] = value.strip()
    return fields


def azure_config(env: Mapping[str, str]) -> dict[str, Any]:
    """obstore's AzureStore settings from the standard variables of `env`: a connection string
    first (as Azure's SDKs prefer it), then obstore reads the rest (account name, key...)."""
    text = env.get("AZURE_STORAGE_CONNECTION_STRING", "")
    if not text:
        return {}
    fields = parse_connection_string(text)
    if fields.get("usedevelopmentstorage", "").lower() == "true":  # Azurite on its default port
        fields = {"accountname": AZURITE_ACCOUNT, "accountkey": AZURITE_KEY, "blobendpoint": AZURITE_ENDPOINT}
    account = fields.get("accountname", "")
    if not account:
        raise CloudConfigError("AZURE_STORAGE_CONNECTION_STRING has no AccountName (the value is not shown)")
    config: dict[str, Any] = {"account_name": account}
    if fields.get("accountkey"):
        config["account_key"] = fields["accountkey"]
    if fields.get("sharedaccesssignature"):
        config["sas_key"] = fields["sharedaccesssignature"]
    if fields.get("blobendpoint"):
        config["endpoint"] = fields["blobendpoint"].rstrip("/")
    elif account and fields.get("endpointsuffix"):  # a sovereign cloud (China, US Gov)
        protocol = fields.get("defaultendpointsprotocol", "https")
        config["endpoint"] = f"{protocol}://{account}.blob.{fields['endpointsuffix']}"
    return config


def _open_azure(
    url: str, container: str, endpoint: str, options: dict[str, Any], retry: dict[str, Any] | None
) -> CloudStore:
    """`az://container`: `AZURE_STORAGE_CONNECTION_STRING` (AccountName, AccountKey or
    SharedAccessSignature, BlobEndpoint; `UseDevelopmentStorage=true` is Azurite), or
    `AZURE_STORAGE_ACCOUNT_NAME` with `AZURE_STORAGE_ACCOUNT_KEY` (or obstore's other Azure
    credentials: a SAS token, Entra ID)."""
    from obstore.store import AzureStore

    config = azure_config(os.environ)
    if not config and not os.environ.get("AZURE_STORAGE_ACCOUNT_NAME"):
        raise CloudConfigError(
            f"{url}: no Azure storage account (set AZURE_STORAGE_CONNECTION_STRING, or "
            "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY)"
        )
    if not credentials.azure_signer_found(config, os.environ, _on_azure()):
        # obstore would ask the instance metadata service for a managed identity's token: off
        # Azure that request fails as if the store did not answer.
        given = "AZURE_STORAGE_CONNECTION_STRING" if config else "AZURE_STORAGE_ACCOUNT_NAME"
        raise CloudConfigError(
            f"{url}: no Azure credentials: {given} names an account but no AccountKey or "
            "SharedAccessSignature (add one, or set AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_KEY; "
            "a managed identity signs on an Azure machine only)"
        )
    if endpoint:
        config["endpoint"] = endpoint.rstrip("/")
    return _store(AzureStore, container, config, options, retry, config.get("endpoint", ""))


_OPENERS: dict[str, Callable[[str, str, str, dict[str, Any], dict[str, Any] | None], CloudStore]] = {
    "s3": _open_s3,
    "gs": _open_gcs,
    "az": _open_azure,
}
