"""The storage layer's settings (the environment's, read when used) and its retry count."""

from __future__ import annotations

import hashlib
import multiprocessing
import os

from stallfree.data.storage.failures import OUTAGE_ENV

# The endpoint of a data.endpoint_url key travels to every process (DataLoader workers, DALI's,
# spawned or forked, the store helper) through the AWS SDKs' own service-specific variable.
ENDPOINT_ENV = "AWS_ENDPOINT_URL_S3"
# Attempts per request (the first one included): waits random in [0, 2^n) s with n the attempt,
# so a wrong endpoint is named at start within seconds.
ATTEMPTS_ENV = "STALLFREE_STORE_MAX_ATTEMPTS"
OLD_ATTEMPTS_ENV = "STALLFREE_S3_MAX_ATTEMPTS"  # its older name, still read
DEFAULT_ATTEMPTS = 5
# A store that does not answer at all (down, restarting, a partition) is waited for this long
# by a read, with jittered pauses, before the read fails: attempts are for blips, this for outages.
OLD_OUTAGE_ENV = "STALLFREE_S3_OUTAGE_S"
DEFAULT_OUTAGE_S = 120.0

# Requests retried by this process and the ones it forks (DataLoader workers): a counter in
# shared memory, made at import, before any worker forks, so a worker's retries land in the
# count the training process reads, at no cost per batch (a retry is rare; its lock is cheap).
_retries = multiprocessing.Value("q", 0)


def configure(endpoint_url: str = "") -> None:
    """Use `endpoint_url` (data.endpoint_url) for s3:// in this process and the ones it starts."""
    # Written only when it differs: a recipe.toml records the endpoint a run read, and a
    # resume of it must not pin this process to it when AWS_ENDPOINT_URL says the same.
    if endpoint_url and endpoint_url != s3_endpoint():
        os.environ[ENDPOINT_ENV] = endpoint_url


def s3_endpoint() -> str:
    """The S3 endpoint in use: data.endpoint_url, else AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL;
    "" for AWS's own."""
    return os.environ.get(ENDPOINT_ENV) or os.environ.get("AWS_ENDPOINT_URL") or ""


def outage_budget() -> float:
    """Seconds a read waits for a store that does not answer (STALLFREE_STORE_OUTAGE_S)."""
    return float(os.environ.get(OUTAGE_ENV) or os.environ.get(OLD_OUTAGE_ENV) or DEFAULT_OUTAGE_S)


def max_attempts() -> int:
    """Attempts a request (STALLFREE_STORE_MAX_ATTEMPTS, or STALLFREE_S3_MAX_ATTEMPTS)."""
    return max(1, int(os.environ.get(ATTEMPTS_ENV) or os.environ.get(OLD_ATTEMPTS_ENV) or DEFAULT_ATTEMPTS))


def attempt_timeout() -> float:
    """Seconds one request waits for an answer: 30, or less, so that the attempts fit in the
    outage budget (a store that accepts connections and never answers is bounded by it)."""
    return max(1.0, min(30.0, outage_budget() / max_attempts()))


def retries() -> int:
    """Requests retried so far by this process and its forked DataLoader workers (transient
    errors, and pauses of an outage); DALI's reader threads count in their process's."""
    return int(_retries.value)


def count_retry(n: int = 1) -> None:
    """Add `n` retried requests to the count."""
    with _retries.get_lock():
        _retries.value += n


# The variables a store is configured by (endpoints, regions, credentials, emulators).
_STORE_VARS = ("AWS_", "GOOGLE_", "AZURE_", "STORAGE_EMULATOR_HOST")


def store_environment() -> str:
    """A digest of the variables stores are configured by: a store (or a helper process) made
    under others is not used again. Kept in memory only; it reveals no value."""
    items = sorted((k, v) for k, v in os.environ.items() if k.startswith(_STORE_VARS))
    return hashlib.sha256(repr(items).encode()).hexdigest()
