"""Object GETs at a tenth of botocore's CPU: obstore (Rust's `object_store`, Apache Arrow's).

Why: one botocore `get_object` costs ~3 ms of Python CPU (event hooks, endpoint rules,
signing, parsing), as much as decoding a small JPEG, and all of it under the GIL, so on a few
cores the store, not its latency, bounds a loader (benchmarks/RESULTS.md, "Object store
latency"). obstore signs and sends the same request in Rust, outside the GIL: 0.25-0.38 ms of
CPU a 20 kB GET against botocore's 3.0-3.4 here (AMD EPYC, SeaweedFS on loopback,
200 serial GETs in one process). It is a well-kept client (the `object_store` crate is
Arrow's and DataFusion's), not home-made signing.

Only a loader's reads go this way (see `enable`), and only the plain case: botocore keeps
listing, HEADs, the start-up checks, and every error. obstore retries nothing here; any error
(a missing key, a refusal, a store that does not answer) returns None and the caller makes the
botocore call, whose retries, outage wait, retry counts and one-line errors then apply.
Credentials, region and endpoint come from the store's boto3 client (the standard chain,
refreshed through botocore); none is printed or kept. Off with STALLFREE_S3_FAST_GET=0,
without obstore installed, and where an HTTP(S) proxy is set (botocore honours it; this path
would not).
"""

from __future__ import annotations

import os
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

ENV = "STALLFREE_S3_FAST_GET"
_PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")
_lock = threading.Lock()
# [the boto3 client the stores were made for, {bucket: obstore store} or False (off)]: a
# client is made again after a fork (store.client), and the stores with it.
_pools: list[Any] = [None, False]
# obstore's runtime (tokio's threads) does not survive a fork: a child of a process that has
# made a GET this way would wait forever on its first one. Such a child (a DataLoader worker
# forked after the main process read from the store) reads through botocore; a child forked
# before any use (the usual case: workers read, the main process does not) starts its own.
_used = [False]
_inherited = [False]
# Only a loader's reader threads take this path (`enable`, from inflight.ReaderPool): a main
# process that reads headers or listings at start-up, then forks its DataLoader workers, has
# not started obstore's runtime, so the workers can.
_enabled = [False]


def enable() -> None:
    """GETs of this process go through obstore from now on (where it is installed)."""
    _enabled[0] = True


def _after_fork() -> None:
    _inherited[0] = _used[0]
    _enabled[0] = False
    _pools[:] = [None, False]


os.register_at_fork(after_in_child=_after_fork)


def _credentials(client: Any) -> Any:
    """obstore's credential callback over the client's botocore credentials (refreshed by them)."""
    source = client._get_credentials()  # noqa: SLF001 - the client's own resolved chain

    def provide() -> dict[str, Any]:
        frozen = source.get_frozen_credentials()
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            # Asked again every 5 minutes: botocore refreshes a role's credentials before expiry.
            "expires_at": datetime.now(timezone.utc) + timedelta(minutes=5),
        }

    return provide


def _made(client: Any) -> Any:
    if _pools[0] is client:
        return _pools[1]
    with _lock:
        if _pools[0] is not client:
            _pools[:] = [client, _make(client)]
        return _pools[1]


def _make(client: Any) -> Any:
    if _inherited[0] or os.environ.get(ENV, "1") == "0" or any(os.environ.get(n) for n in _PROXIES):
        return False
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    if client._get_credentials() is None:  # noqa: SLF001 - botocore's call names the reason
        return False
    return {}


def _store(client: Any, stores: dict[str, Any], bucket: str, timeout: float) -> Any:
    found = stores.get(bucket)
    if found is None:
        from obstore.store import S3Store

        endpoint = client.meta.endpoint_url
        found = S3Store(
            bucket,
            endpoint=endpoint,
            region=client.meta.region_name or "us-east-1",
            virtual_hosted_style_request=False,  # as botocore addresses a custom endpoint
            credential_provider=_credentials(client),
            retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=30)},
            client_options={
                "allow_http": endpoint.startswith("http://"),
                "connect_timeout": timedelta(seconds=min(5.0, timeout)),
                "timeout": timedelta(seconds=timeout),  # the store's attempt_timeout()
            },
        )
        stores[bucket] = found
    return found


def get(
    client: Any, bucket: str, key: str, byte_range: tuple[int, int] | None = None, timeout: float = 30.0
) -> bytes | None:
    """The object's bytes (`byte_range`: (start, end) exclusive), or None: make the botocore
    call on `client` (the store's, whose endpoint and credentials these requests share).
    `timeout`: seconds to wait for an answer (fixed when the bucket's store is first made)."""
    stores = _made(client) if _enabled[0] else False
    if not isinstance(stores, dict):
        return None
    import obstore

    try:
        store = _store(client, stores, bucket, timeout)
        _used[0] = True
        if byte_range is None:
            return bytes(obstore.get(store, key).bytes())
        start, end = byte_range
        return bytes(obstore.get_range(store, key, start=start, end=end))
    except Exception:  # noqa: BLE001 - botocore's call then retries it and names the reason
        return None
