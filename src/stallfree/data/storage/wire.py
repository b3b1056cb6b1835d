"""The object-store requests themselves (obstore), and the one place their errors are told apart.

obstore's runtime (tokio's threads) does not survive a fork: a child of a process that has made
a request would wait forever on its first one. So a process makes requests itself only where no
process it was forked from had made one before the fork, and only (see `direct`) where it will
not fork readers of its own next. A main process lists and checks through its store helper (a
process started fresh, `helper.py`), so that the DataLoader workers it forks afterwards can read
directly; a reader thread (`enable_direct`, from inflight.ReaderPool) reads directly.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import stallfree.data.storage.clouds as clouds
import stallfree.data.storage.settings as settings

# What a failed request means, by obstore's exception type: "missing" (404), "denied" (403),
# "unauthenticated" (401), "no_answer" (connection refused or reset, a timeout, a 5xx, any
# other error the store returned), "invalid" (a request obstore refused to make); "helper"
# (the store helper process exited).
KINDS = ("missing", "denied", "unauthenticated", "no_answer", "invalid", "helper")
# Signatures and tokens a URL in the client's words may carry (an Azure SAS, a presigned S3 URL).
_SECRET_PARAMS = re.compile(r"(?i)\b(sig|x-amz-signature|x-amz-credential|x-amz-security-token)=[^&\s]+")


@dataclass
class Failure(Exception):
    """A request that failed: its kind and the client's words, whole (signatures hidden), for
    `--verbose`; a message says the kind in ours."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


def classify(exc: BaseException) -> Failure:
    """The Failure an obstore exception means, by its type alone."""
    from obstore import exceptions as ox

    line = _SECRET_PARAMS.sub(r"\1=(hidden)", f"{type(exc).__name__}: {exc}")
    if isinstance(exc, (FileNotFoundError, ox.NotFoundError)):
        return Failure("missing", line)
    if isinstance(exc, ox.PermissionDeniedError):
        return Failure("denied", line)
    if isinstance(exc, ox.UnauthenticatedError):
        return Failure("unauthenticated", line)
    if isinstance(exc, (ValueError, TypeError, ox.InvalidPathError, ox.UnknownConfigurationKeyError)):
        return Failure("invalid", line)
    return Failure("no_answer", line)


_lock = threading.Lock()
_stores: dict[tuple[str, str, str, float, str], Any] = {}
_state = {"used": False, "inherited": False, "forked": False}
_local = threading.local()


def _after_fork() -> None:
    _state["inherited"] = _state["inherited"] or _state["used"]
    _state["forked"] = True
    _stores.clear()


os.register_at_fork(after_in_child=_after_fork)


def enable_direct() -> None:
    """This thread (a loader's reader) makes its requests itself from now on, under the store
    variables of now: a run's environment does not change under its readers, and digesting
    every variable again on each request is a visible share of a GET's CPU."""
    _local.direct = True
    _local.environment = settings.store_environment()


def direct() -> bool:
    """Whether this thread may make requests itself (else its process's store helper does): not
    after a fork from a process that had made one; in a reader thread, a forked child (a
    DataLoader worker, a check's worker: they fork no readers) or the helper itself."""
    if _state["inherited"]:
        return False
    return _state["forked"] or bool(getattr(_local, "direct", False)) or os.environ.get(HELPER_ENV) == "1"


HELPER_ENV = "STALLFREE_STORE_HELPER"  # "1" in the helper process itself


def store_for(scheme: str, bucket: str, endpoint: str, timeout: float) -> Any:
    """This process's obstore store for the bucket (made once per endpoint and timeout)."""
    environment = getattr(_local, "environment", None) or settings.store_environment()
    key = (scheme, bucket, endpoint, timeout, environment)
    found = _stores.get(key)
    if found is None:
        with _lock:
            found = _stores.get(key)
            if found is None:
                found = clouds.open_store(
                    scheme,
                    bucket,
                    endpoint_url=endpoint,
                    client_options={
                        "connect_timeout": timedelta(seconds=min(5.0, timeout)),
                        "timeout": timedelta(seconds=timeout),
                    },
                    # Retries are the caller's (objects.py): counted, and bounded by the budget.
                    retry_config={"max_retries": 0, "retry_timeout": timedelta(seconds=timeout)},
                )
                _stores[key] = found
    return found


def call(op: str, where: tuple[str, str, str, float], *args: Any) -> Any:
    """Make the request in this process."""
    store = store_for(*where)
    _state["used"] = True
    try:
        return OPS[op](store, *args)
    except Failure:
        raise
    except Exception as exc:  # noqa: BLE001 - every error the client raises has a kind
        raise classify(exc) from None


def _get(store: Any, key: str, start: int, end: int) -> bytes:
    import obstore

    if end < 0:
        return bytes(obstore.get(store, key).bytes())
    return bytes(obstore.get_range(store, key, start=start, end=end)) if end > start else b""


def _head(store: Any, key: str) -> tuple[int, str]:
    import obstore

    meta = obstore.head(store, key)
    return int(meta["size"]), str(meta.get("e_tag") or "")


def _list(store: Any, prefix: str, shallow: bool) -> tuple[list[tuple[str, int, str]], list[str]]:
    """([(key, size, ETag)] under the "folder" `prefix`, [its sub-folders]) (`shallow`: right
    under it only), in the store's order, through the streaming list."""
    import obstore

    if shallow:
        found = obstore.list_with_delimiter(store, prefix or None)
        objects = [(m["path"], int(m["size"]), str(m.get("e_tag") or "")) for m in found["objects"]]
        return objects, list(found["common_prefixes"])
    out: list[tuple[str, int, str]] = []
    for chunk in obstore.list(store, prefix or None, chunk_size=10_000):
        out += [(m["path"], int(m["size"]), str(m.get("e_tag") or "")) for m in chunk]
    return out, []


def _any(store: Any, prefix: str) -> bool:
    """Whether any object is under the "folder" `prefix` (one page of one key is asked for)."""
    import obstore

    for chunk in obstore.list(store, prefix or None, chunk_size=1):
        return bool(chunk)
    return False


OPS: dict[str, Callable[..., Any]] = {"get": _get, "head": _head, "list": _list, "any": _any}
