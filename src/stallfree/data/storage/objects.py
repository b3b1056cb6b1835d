"""Objects in a store (s3://, gs://, az://): retries, the outage budget and one-line errors over
wire.py's requests. A request that fails for want of an answer is tried again (attempts with
backoff and full jitter, each counted), then, for a read, waited for up to the outage budget
before StoreUnavailableError; any other failure is final at once, named by its kind.
"""

from __future__ import annotations

import random
import time
from typing import Any

import stallfree.data.storage.clouds as clouds
import stallfree.data.storage.dispatch as dispatch
import stallfree.data.storage.settings as settings
import stallfree.data.storage.stalls as stalls
import stallfree.data.storage.wire as wire
from stallfree.data.storage.failures import (
    NoSuchObjectError,
    ObjectGoneError,
    StoreError,
    StoreUnavailableError,
)
from stallfree.data.storage.locations import BUCKET_WORD, split_url
from stallfree.log import LOGGER

_said = [0.0]  # when this process last said that the store is not answering


def _where(url: str) -> tuple[tuple[str, str, str, float], str]:
    scheme, bucket, key = split_url(url)
    endpoint = settings.s3_endpoint() if scheme == "s3" else ""
    return (scheme, bucket, endpoint, settings.attempt_timeout()), key


def _reason(url: str, failure: wire.Failure) -> str:
    """What `failure` means, in our words; the client's own are the error's `detail`."""
    if failure.kind == "no_answer":
        return f"the store did not answer at {clouds.endpoint_said(split_url(url)[0])}"
    return {
        "missing": "no such object",
        "denied": "access denied (wrong credentials, or no read permission)",
        "unauthenticated": "the store refused the credentials (wrong or expired ones)",
        "helper": "the store helper process exited (its error is above)",
    }.get(failure.kind, "obstore refused to make the request (`stallfree --verbose` shows why)")


def _detailed(error: StoreError, failure: wire.Failure) -> StoreError:
    error.detail = failure.detail
    return error


def _error(url: str, op: str, failure: wire.Failure) -> StoreError:
    if failure.kind == "missing":
        gone = (ObjectGoneError if op == "get" else NoSuchObjectError)(f"{url}: no such object")
        return _detailed(gone, failure)
    return _detailed(StoreError(f"{url}: {_reason(url, failure)}"), failure)


def _probe(where: tuple[str, str, str, float], key: str) -> wire.Failure | None:
    """A HEAD of `key`: None where the store answers it (found or not), so that a failure that
    looked like no answer (a 416, a listing of a missing bucket) was the store's final word;
    else the HEAD's own failure (no answer, or refused credentials)."""
    try:
        dispatch.run("head", where, key or "_")
    except wire.Failure as probe:
        return None if probe.kind == "missing" else probe
    return None


def request(url: str, op: str, *args: Any, patient: bool = True) -> Any:
    """Request `op` of the object or prefix at `url`; a StoreError naming `url` if it fails.
    `patient`: wait out an outage (reads during a run), else fail after the attempts (checks).
    A patient GET is not probed: a store whose HEADs answer while its GETs fail (a restarting
    SeaweedFS's volumes) is in trouble, not refusing, and is waited for."""
    where, key = _where(url)
    started, attempts = time.monotonic(), settings.max_attempts()
    deadline = started + settings.outage_budget()
    for attempt in range(1, attempts + 1):
        try:
            with stalls.watched(url):
                return dispatch.run(op, where, key, *args)
        except wire.Failure as failure:
            last = failure
            if failure.kind != "no_answer":
                raise _error(url, op, failure) from None
            if (attempt == attempts or not patient) and not (patient and op == "get"):
                probe = _probe(where, key)
                if probe is None or probe.kind != "no_answer":
                    raise _refused(url, op, failure, probe) from None
            pause = random.random() * min(20.0, 2.0 ** (attempt - 1))
            if attempt == attempts or (patient and time.monotonic() + pause >= deadline):
                break  # no retry that would end past the budget
            settings.count_retry()
            time.sleep(pause)
    if not patient:
        raise _error(url, op, last) from None
    return _wait_out(url, op, where, key, args, started, last)


def _refused(url: str, op: str, failure: wire.Failure, probe: wire.Failure | None) -> StoreError:
    if probe is not None:  # the credentials, refused
        return _error(url, op, probe)
    scheme, bucket, _ = split_url(url)
    if op in ("list", "any"):  # an existing bucket lists any prefix, even an empty one
        missing = f"no such {BUCKET_WORD[scheme]} {bucket!r} (or no permission to list it)"
        return _detailed(StoreError(f"{url}: {missing}"), failure)
    return _detailed(StoreError(f"{url}: the store refused the {op.upper()} request"), failure)


def _wait_out(
    url: str,
    op: str,
    where: tuple[str, str, str, float],
    key: str,
    args: tuple[Any, ...],
    started: float,
    last: wire.Failure,
) -> Any:
    """Ask again, with jittered pauses, until the store answers or the budget (counted from
    `started`) is spent: then StoreUnavailableError."""
    budget = settings.outage_budget()
    deadline = started + budget
    _say_waiting(url, last, budget)
    while (remaining := deadline - time.monotonic()) > 0:
        time.sleep(min(remaining, random.uniform(0.5, 2.0)))  # jitter: workers come back apart
        if time.monotonic() >= deadline:
            break
        settings.count_retry()
        try:
            with stalls.watched(url):
                return dispatch.run(op, where, key, *args)
        except wire.Failure as failure:
            if failure.kind != "no_answer":
                raise _error(url, op, failure) from None
            last = failure
    unavailable = StoreUnavailableError(f"{url}: {_reason(url, last)} (still after {budget:.0f} s)")
    raise _detailed(unavailable, last) from None


def _say_waiting(url: str, failure: wire.Failure, budget: float) -> None:
    """One line when a read starts waiting on a store that does not answer (at most one every
    30 s a process): a stalled run says why before its budget runs out, not only after."""
    now = time.monotonic()
    if now - _said[0] >= 30:
        _said[0] = now
        LOGGER.warning(
            f"{url}: {_reason(url, failure)}; the store is not answering: waiting up to {budget:.0f} s "
            f"for it ({settings.OUTAGE_ENV})"
        )


def read(url: str, limit: int | None = None) -> bytes:
    """The object's bytes (at most `limit`)."""
    return bytes(request(url, "get", 0, limit if limit else -1))


def read_range(url: str, start: int, length: int) -> bytes:
    """`length` bytes of the object from byte `start` (one ranged GET)."""
    return bytes(request(url, "get", start, start + length)) if length > 0 else b""


def size(url: str) -> int:
    """The object's size in bytes (a HEAD request)."""
    return int(request(url, "head")[0])


def exists(url: str) -> bool:
    """Whether an object is at `url` (other errors, such as wrong credentials, raise)."""
    try:
        size(url)
    except NoSuchObjectError:
        # A 404 is also what a missing bucket answers: that is an error, not "no such object".
        where, _ = _where(url)
        if where not in _buckets_seen:
            request(url, "any", patient=False)  # in a missing bucket, it fails naming the bucket
            _buckets_seen.add(where)
        return False
    return True


_buckets_seen: set[tuple[str, str, str, float]] = set()


def list_objects(url: str, shallow: bool = False) -> dict[str, tuple[int, str]]:
    """{name relative to the "folder" `url`: (size, ETag)} of every object under it, in the
    store's (lexicographic) order (`shallow`: right under it only)."""
    objects, _ = request(url.rstrip("/"), "list", shallow)
    cut = len(split_url(url.rstrip("/") + "/")[2])
    return {key[cut:]: (size, etag) for key, size, etag in objects}


def list_dirs(url: str) -> list[str]:
    """The names of the "folders" (common prefixes) right under `url`, sorted."""
    _, prefixes = request(url.rstrip("/"), "list", True)
    cut = len(split_url(url.rstrip("/") + "/")[2])
    return sorted(p[cut:].rstrip("/") for p in prefixes)


def check_readable(url: str) -> None:
    """At start: the bucket exists, the credentials work and something is under `url`; else a
    StoreError naming the URL and the reason, before anything is written."""
    if not request(url.rstrip("/"), "any", patient=False):
        raise StoreError(f"{url}: no objects under this prefix (a wrong path?)")
