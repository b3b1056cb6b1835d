"""An obstore store for one (scheme, bucket): each cloud configured by its standard variables.

S3: the endpoint from data.endpoint_url, AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (botocore's
variables); the region from AWS_REGION / AWS_DEFAULT_REGION or ~/.aws/config; credentials from
boto3's chain. Why boto3 stays, for credentials only (it makes no request here): its chain reads
~/.aws profiles, SSO caches, credential_process and assumed roles, which obstore's own S3
chain (environment, web identity, container and instance roles) does not. Without boto3,
obstore's chain is used. Credentials are never printed, logged or written: they live in the
store and in the provider's closure.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlsplit

import stallfree.data.storage.settings as settings
from stallfree.data.storage.errors import StoreError

# Asked again this often: boto3 refreshes an assumed role's credentials before they expire.
_REFRESH = timedelta(minutes=5)


def open_store(
    scheme: str,
    bucket: str,
    *,
    endpoint_url: str = "",
    client_options: dict[str, Any] | None = None,
    retry_config: dict[str, Any] | None = None,
) -> Any:
    """A new obstore store for `scheme://bucket` ("s3", "gs", "az"); StoreError naming the
    URL and the fix when it cannot be configured."""
    options = dict(client_options or {})
    retry = dict(retry_config or {})
    if scheme == "s3":
        return _s3(bucket, endpoint_url or settings.s3_endpoint(), options, retry)
    if scheme in ("gs", "az"):
        raise StoreError(f"{scheme}://{bucket}: {scheme}:// stores are not yet supported in this build")
    raise StoreError(f"{scheme}://{bucket}: not a store stallfree reads (s3://, gs://, az://)")


def _checked_endpoint(endpoint: str) -> str:
    """The endpoint, refused in one line where it is not an http(s) URL (obstore would panic)."""
    if endpoint and urlsplit(endpoint).scheme not in ("http", "https"):
        raise StoreError(
            f"the endpoint {endpoint!r} (AWS_ENDPOINT_URL or data.endpoint_url) is not a URL; "
            f"write it with its scheme: http://{endpoint} or https://{endpoint}"
        )
    return endpoint


def _s3(bucket: str, endpoint: str, options: dict[str, Any], retry: dict[str, Any]) -> Any:
    from obstore.store import S3Store

    endpoint = _checked_endpoint(endpoint)
    config: dict[str, Any] = {"region": _region()}
    if endpoint:
        config["endpoint"] = endpoint
        config["virtual_hosted_style_request"] = False  # as botocore addresses a custom endpoint
        options.setdefault("allow_http", endpoint.startswith("http://"))
    provider = _boto3_credentials(f"s3://{bucket}")
    return S3Store(
        bucket,
        client_options=options or None,
        retry_config=retry or None,
        credential_provider=provider,
        **config,
    )


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
        raise StoreError(
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
