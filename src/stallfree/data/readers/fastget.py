"""Opt-in (STALLFREE_S3_FAST_GET=1): object GETs as a presigned URL sent with urllib3.

Why: one botocore `get_object` costs ~3.1-3.6 ms of Python CPU (its event hooks, endpoint
rules, parsing, signing); a SigV4-presigned URL sent with urllib3 costs ~1.8-2.2 ms (measured
on 2 shared EPYC cores, 200 GETs of 20 kB from SeaweedFS). The loaders keep reads in flight, so
a store's latency is hidden; its CPU per object is not, and on small images it is as much as
the decode (benchmarks/RESULTS.md, "Object store latency"). Off by default: on the loader
benchmark the saving did not show through that machine's noise.

Only the plain case goes this way. Anything else (an answer other than 200/206, a network
error, a body cut short) returns None and the caller makes the botocore call, whose retries,
outage waits and one-line errors then apply. URLs are signed with SigV4 (botocore's default
presign is SigV2 in us-east-1, which S3 refuses for newer buckets) and verified with botocore's
CA bundle variables. An HTTP(S) proxy in the environment (which urllib3 would not use as
botocore does) turns it off; a TLS or proxy failure turns it off for the process.
"""

from __future__ import annotations

import os
import threading
from typing import Any

ENV = "STALLFREE_S3_FAST_GET"
_PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")
_lock = threading.Lock()
# [the store's client, then (presigning client, urllib3.PoolManager) or False (off)]: made anew
# with each client of the store's (one a process, and another when its endpoint is changed).
_pools: list[Any] = [None, False]


def _made(client: Any) -> Any:
    if _pools[0] is client:
        return _pools[1]
    with _lock:
        if _pools[0] is not client:
            _pools[:] = [client, _make()]
        return _pools[1]


def _make() -> Any:
    if os.environ.get(ENV, "0") != "1" or any(os.environ.get(name) for name in _PROXIES):
        return False
    import boto3
    import urllib3
    from botocore.config import Config

    # Signs only: credentials, region and endpoint from the standard chain, as the store's client.
    signer = boto3.session.Session().client("s3", config=Config(signature_version="s3v4"))
    ca = os.environ.get("AWS_CA_BUNDLE") or os.environ.get("REQUESTS_CA_BUNDLE")  # botocore's order
    # As many connections as the store's client (64); no retries here: botocore's do them.
    extra: dict[str, Any] = {"ca_certs": ca} if ca else {}
    pool = urllib3.PoolManager(
        maxsize=64, retries=False, timeout=urllib3.Timeout(connect=5, read=30), **extra
    )
    return signer, pool


def get(client: Any, bucket: str, key: str, byte_range: str | None = None) -> bytes | None:
    """The object's bytes (`byte_range`: an HTTP Range value), or None: make the botocore call
    on `client` (the store's, whose endpoint and credentials the URL's signer shares)."""
    made = _made(client)
    if made is False:
        return None
    import urllib3

    signer, pool = made
    try:
        url = signer.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=900
        )
        response = pool.request("GET", url, headers={"Range": byte_range} if byte_range else None)
    except (urllib3.exceptions.SSLError, urllib3.exceptions.ProxyError):
        _pools[1] = False  # would fail every time: botocore's settings differ
        return None
    except Exception:  # noqa: BLE001 - botocore's call then retries it and names the reason
        return None
    return response.data if response.status in (200, 206) else None
