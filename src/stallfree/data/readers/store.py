"""Object-store reads: `s3://bucket/key` URLs (AWS S3 or any S3-compatible store).

Why boto3/botocore: it is the reference client, everywhere already (AWS images, the NVIDIA
container's pip), it takes credentials from the standard chain (environment, ~/.aws, SSO,
instance and pod roles) and the endpoint from the standard `AWS_ENDPOINT_URL` /
`AWS_ENDPOINT_URL_S3` (botocore >= 1.31), signs requests itself, does byte-range GETs, and its
"standard" retry mode retries what is transient (timeouts, connection resets, 5xx, throttling)
with exponential backoff and full jitter. fsspec+s3fs adds an async layer over the same
botocore; obstore is faster per request but young. A GET's latency, not the client's CPU, is
what a loader waits on, and the loaders keep several in flight (see data/backends).

One client per process, made on first use: a client must not cross a fork (its connection
pool's sockets would be shared by the DataLoader workers), so the pid is part of its key.
Credentials are never read here: botocore finds them, and nothing here prints, logs or writes
them. Errors name the URL and the reason in one line.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

from stallfree.data.readers import fastget
from stallfree.errors import PREEMPTED_EXIT_CODE, StallfreeError
from stallfree.log import LOGGER

SCHEME = "s3://"
# The endpoint of a data.endpoint_url key travels to every process (DataLoader workers, DALI's,
# spawned or forked) through botocore's own service-specific variable.
ENDPOINT_ENV = "AWS_ENDPOINT_URL_S3"
# Attempts per request (the first one included), botocore's standard mode: waits random in
# [0, 2^n) s with n the attempt, so a wrong endpoint is named at start within seconds.
ATTEMPTS_ENV = "STALLFREE_S3_MAX_ATTEMPTS"
DEFAULT_ATTEMPTS = 5
# A store that does not answer at all (down, restarting, a partition) is waited for this long
# by a read, with jittered pauses, before the read fails: botocore's attempts (and its
# per-client retry quota, which an outage drains) are for blips, this budget for outages.
OUTAGE_ENV = "STALLFREE_S3_OUTAGE_S"
DEFAULT_OUTAGE_S = 120.0

_lock = threading.Lock()
_clients: dict[int, Any] = {}
# Requests retried by this process and the ones it forks (DataLoader workers): a counter in
# shared memory, made at import, before any worker forks, so a worker's retries land in the
# count the training process reads, at no cost per batch (a retry is rare; its lock is cheap).
# A worker started by spawn or forkserver imports its own and counts apart (not our default).
_retries = multiprocessing.Value("q", 0)


class StoreError(StallfreeError):
    """An object-store URL that cannot be read; the message names the URL and the reason."""

    hint = (
        "check the URL, the endpoint (AWS_ENDPOINT_URL or data.endpoint_url) and the "
        "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, or a role)"
    )

    def __init__(self, message: str = "") -> None:
        # torch's DataLoader re-raises a worker's error as this type, built from "Caught
        # StoreError in DataLoader worker ... Original Traceback ...": keep the worker's line.
        if message.startswith(f"Caught {type(self).__name__}"):
            last = message.rstrip().splitlines()[-1]
            message = last.partition(f"{type(self).__name__}: ")[2] or last
        super().__init__(message)


class ObjectGoneError(StoreError):
    """A GET of an object that is not there: one that was listed (a loader reads only what
    its listing holds; a resume keeps the run's listing) has been deleted since."""

    hint = (
        "it was listed when this run started and is gone from the store now: put it back and "
        "--resume auto, or start a new --out to list the store as it is"
    )


class StoreUnavailableError(StoreError):
    """The store did not answer for the whole outage budget (STALLFREE_S3_OUTAGE_S): a
    training run stops as a preempted one does, to resume once the store is back."""

    exit_code = PREEMPTED_EXIT_CODE  # try again later, as a preempted run
    hint = f"{OUTAGE_ENV} sets how long to wait for it"


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is an object-store URL rather than a local path."""
    return isinstance(path, str) and path.startswith(SCHEME)


def split_url(url: str) -> tuple[str, str]:
    """(bucket, key) of `s3://bucket/key`."""
    bucket, _, key = url[len(SCHEME) :].partition("/")
    if not bucket:
        raise StoreError(f"{url}: no bucket name; expected s3://BUCKET/PREFIX")
    return bucket, key


def join(base: str, *parts: str) -> str:
    """`base/part/...` for a URL or a local path, without doubled slashes."""
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def configure(endpoint_url: str = "") -> None:
    """Use `endpoint_url` (data.endpoint_url) in this process and the ones it starts."""
    if endpoint_url:
        os.environ[ENDPOINT_ENV] = endpoint_url
        _clients.clear()


def client() -> Any:
    """This process's S3 client (made on first use, and again after a fork)."""
    pid = os.getpid()
    found = _clients.get(pid)
    if found is not None:
        return found
    with _lock:
        if pid not in _clients:
            _clients.clear()  # a parent's client, inherited through fork: never used here
            _clients[pid] = _make_client()
        return _clients[pid]


def _make_client() -> Any:
    try:
        import boto3
        import botocore.session
        from botocore.config import Config
    except ImportError as exc:
        raise StoreError(
            "s3:// roots need boto3: pip install 'stallfree[s3]' (or pip install boto3)"
        ) from exc
    wait = attempt_timeout()
    config = Config(
        retries={"mode": "standard", "max_attempts": max_attempts()},
        connect_timeout=min(5.0, wait),
        read_timeout=wait,
        max_pool_connections=64,  # the loaders keep many reads in flight per process
    )
    # A session of its own: boto3's default one is not safe to share across threads.
    core = botocore.session.Session()
    core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=_timestamp)
    try:
        return boto3.session.Session(botocore_session=core).client("s3", config=config)
    except ValueError:  # botocore's "Invalid endpoint: 127.0.0.1:8333": no scheme
        endpoint = os.environ.get(ENDPOINT_ENV) or os.environ.get("AWS_ENDPOINT_URL", "")
        raise StoreError(
            f"the endpoint {endpoint!r} (AWS_ENDPOINT_URL or data.endpoint_url) is not a URL; "
            f"write it with its scheme: http://{endpoint} or https://{endpoint}"
        ) from None


def outage_budget() -> float:
    """Seconds a read waits for a store that does not answer (STALLFREE_S3_OUTAGE_S)."""
    return float(os.environ.get(OUTAGE_ENV) or DEFAULT_OUTAGE_S)


def max_attempts() -> int:
    """botocore's attempts a request (STALLFREE_S3_MAX_ATTEMPTS)."""
    return int(os.environ.get(ATTEMPTS_ENV) or DEFAULT_ATTEMPTS)


def attempt_timeout() -> float:
    """Seconds one request waits for an answer: 30, or less, so that botocore's attempts fit in
    the outage budget. A store that hangs (connections accepted, never answered) otherwise held
    a read for 30 s in obstore and 5 x 30 s in botocore, twice, whatever the budget said."""
    return max(1.0, min(30.0, outage_budget() / max_attempts()))


def _timestamp(text: str) -> Any:
    """botocore's timestamp parse, fast for S3's ISO 8601: a listing has one a key, and
    dateutil's parse of it cost 4x the rest of a 1,000-key page (measured, 677 vs 150 ms a
    page on a loaded 2-core EPYC). Python < 3.11 (no "Z") and other forms take botocore's."""
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        from botocore.utils import parse_timestamp

        return parse_timestamp(text)


def retries() -> int:
    """Requests retried so far by this process and its forked DataLoader workers (transient
    errors, and pauses of an outage); DALI's reader threads count in their process's."""
    return int(_retries.value)


def _count(response: dict[str, Any]) -> dict[str, Any]:
    attempts = response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
    if attempts:
        with _retries.get_lock():
            _retries.value += attempts
    return response


def _reason(exc: BaseException) -> str:
    """The store's reason in a few words (never the request's headers or credentials)."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        code = error.get("Code") or exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        words = {
            "NoSuchBucket": "no such bucket",
            "NoSuchKey": "no such object",
            "404": "no such object or bucket",
            "403": "access denied (wrong credentials, or no read permission)",
            "AccessDenied": "access denied (no read permission)",
            "InvalidAccessKeyId": "the access key is not known to the store (wrong credentials)",
            "SignatureDoesNotMatch": "the secret key does not match (wrong credentials)",
        }
        return words.get(str(code), f"{code}: {error.get('Message', '')}".strip(": "))
    if isinstance(exc, NoCredentialsError):
        return "no credentials found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, or a role)"
    if isinstance(exc, BotoCoreError):
        return str(exc).splitlines()[0]
    return f"{type(exc).__name__}: {exc}"


def _transient(exc: BaseException) -> bool:
    """An error that says the store is not answering (rather than answering no)."""
    from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

    if isinstance(exc, ClientError):
        return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0) >= 500
    return isinstance(exc, (ConnectionError, HTTPClientError))


def _call(
    url: str, fn: str, *, patient: bool = True, since: float | None = None, **kwargs: Any
) -> dict[str, Any]:
    """One client call; a failure left after botocore's retries (and, when `patient`, after
    the outage budget, counted from `since` when the read began earlier) becomes a StoreError."""
    from botocore.exceptions import BotoCoreError, ClientError

    deadline = None
    while True:
        try:
            return _count(getattr(client(), fn)(**kwargs))
        except (BotoCoreError, ClientError) as exc:
            if patient and _transient(exc):
                budget = outage_budget()
                if deadline is None:
                    deadline = (since or time.monotonic()) + budget
                    _say_waiting(url, exc, budget)
                if time.monotonic() < deadline:
                    _count({"ResponseMetadata": {"RetryAttempts": 1}})
                    time.sleep(random.uniform(0.5, 2.0))  # jitter: workers do not come back in step
                    continue
                raise StoreUnavailableError(f"{url}: {_reason(exc)} (still after {budget:.0f} s)") from None
            if fn == "get_object" and _reason(exc) == "no such object":
                raise ObjectGoneError(f"{url}: {_reason(exc)}") from None
            raise StoreError(f"{url}: {_reason(exc)}") from None  # no chained request details


_said = [0.0]  # when this process last said that the store is not answering


def _say_waiting(url: str, exc: BaseException, budget: float) -> None:
    """One line when a read starts waiting on a store that does not answer (at most one every
    30 s a process): a stalled run says why before its budget runs out, not only after."""
    now = time.monotonic()
    if now - _said[0] >= 30:
        _said[0] = now
        LOGGER.warning(
            f"{url}: {_reason(exc)}; the store is not answering: waiting up to {budget:.0f} s "
            f"for it ({OUTAGE_ENV})"
        )


def _body(url: str, response: dict[str, Any]) -> bytes:
    from botocore.exceptions import BotoCoreError

    try:
        return response["Body"].read()
    except (BotoCoreError, OSError) as exc:
        raise StoreError(f"{url}: the read broke off ({_reason(exc)})") from None


def read(url: str, limit: int | None = None) -> bytes:
    """The object's bytes (at most `limit`)."""
    return _get(url, (0, limit) if limit else None)


def read_range(url: str, start: int, length: int) -> bytes:
    """`length` bytes of the object from byte `start` (one ranged GET)."""
    return _get(url, (start, start + length)) if length > 0 else b""


def _get(url: str, span: tuple[int, int] | None) -> bytes:
    """One GET of the object (`span`: bytes [start, end)): through obstore where a loader's
    readers enabled it (a tenth of the CPU), else, and on anything unusual, through botocore."""
    bucket, key = split_url(url)
    started = time.monotonic()  # the outage budget counts the fast path's wait too
    fast = fastget.get(client(), bucket, key, span, attempt_timeout())
    if fast is not None:
        return fast
    extra: dict[str, Any] = {"Range": f"bytes={span[0]}-{span[1] - 1}"} if span else {}
    for attempt in range(3):  # a body cut off mid-read is fetched again, as a GET error would be
        # A failed GET is final here: _call has already spent botocore's retries and the outage
        # budget (retrying it again would triple the wait before a run that cannot go on stops).
        response = _call(url, "get_object", since=started, Bucket=bucket, Key=key, **extra)
        try:
            return _body(url, response)
        except StoreError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def size(url: str) -> int:
    """The object's size in bytes (a HEAD request)."""
    bucket, key = split_url(url)
    return int(_call(url, "head_object", Bucket=bucket, Key=key)["ContentLength"])


def exists(url: str) -> bool:
    """Whether an object is at `url` (other errors, such as wrong credentials, raise)."""
    try:
        size(url)
    except StoreError as exc:
        if "no such" in str(exc):
            return False
        raise
    return True


def _pages(url: str, **kwargs: Any) -> Iterable[dict[str, Any]]:
    """list_objects_v2 pages under `url` (a prefix), following continuation tokens."""
    bucket, key = split_url(url)
    token: dict[str, Any] = {}
    while True:
        page = _call(url, "list_objects_v2", Bucket=bucket, Prefix=key, **kwargs, **token)
        yield page
        if not page.get("IsTruncated"):
            return
        token = {"ContinuationToken": page["NextContinuationToken"]}


def list_dirs(url: str) -> list[str]:
    """The names of the "folders" (common prefixes) right under `url`, sorted."""
    base = url.rstrip("/") + "/"
    cut = len(split_url(base)[1])
    pages = _pages(base, Delimiter="/")
    return sorted(p["Prefix"][cut:].rstrip("/") for page in pages for p in page.get("CommonPrefixes", ()))


def list_objects(url: str, shallow: bool = False) -> dict[str, tuple[int, str]]:
    """{name relative to the "folder" `url`: (size, ETag)} of every object under it (`shallow`:
    right under it only): what tells one object's state from another's (an object replaced
    under its name gets a new ETag)."""
    base = url.rstrip("/") + "/"
    cut = len(split_url(base)[1])
    return {
        obj["Key"][cut:]: (int(obj["Size"]), str(obj.get("ETag", "")))
        for page in _pages(base, **({"Delimiter": "/"} if shallow else {}))
        for obj in page.get("Contents", ())
    }


def list_prefix(url: str) -> tuple[list[tuple[str, int]], str]:
    """Every object under the "folder" `url`: ([(name relative to it, size)], digest of the
    keys, sizes and ETags: what changes when an object is added, replaced or removed)."""
    objects = list_objects(url)
    prefix = split_url(url.rstrip("/") + "/")[1]
    digest = hashlib.sha256()
    for name, (size, etag) in objects.items():  # listing order: a dict keeps it
        digest.update(f"{prefix}{name}\0{size}\0{etag}\n".encode())
    return [(name, size) for name, (size, _) in objects.items()], digest.hexdigest()


def list_many(urls: list[str], threads: int = 16) -> list[tuple[list[tuple[str, int]], str]]:
    """`list_prefix` of each URL (class prefixes, say), `threads` listings in flight."""
    if len(urls) <= 1:
        return [list_prefix(u) for u in urls]
    with ThreadPoolExecutor(min(threads, len(urls))) as pool:
        return list(pool.map(list_prefix, urls))


def check_readable(url: str) -> None:
    """At start: the bucket exists, the credentials work and something is under `url`; else a
    StoreError naming the URL and the reason, before anything is written."""
    bucket, key = split_url(url)
    try:
        _call(url, "head_bucket", patient=False, Bucket=bucket)
    except StoreError as exc:
        if "no such" in str(exc):  # HEAD has no body: a 404 on a bucket is the bucket
            raise StoreError(f"{url}: no such bucket {bucket!r}") from None
        raise
    prefix = key.rstrip("/") + "/" if key else ""
    page = _call(url, "list_objects_v2", patient=False, Bucket=bucket, Prefix=prefix, MaxKeys=1)
    if not page.get("KeyCount"):
        raise StoreError(f"{url}: no objects under this prefix (a wrong path?)")


def digest_of(parts: list[str]) -> str:
    """One digest of several listing digests (the class prefixes of a split)."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def check_store_root(root: str, fmt: str, endpoint_url: str = "") -> None:
    """`check_readable` on what a recipe's s3:// root must hold: train/ and val/ for folders."""
    configure(endpoint_url)
    for split in ("train", "val") if fmt == "folder" else ("",):
        check_readable(join(root, split) if split else root)
