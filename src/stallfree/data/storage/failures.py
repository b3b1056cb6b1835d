"""The storage layer's errors: one line naming the URL and the reason, told apart by type."""

from __future__ import annotations

from stallfree.errors import PREEMPTED_EXIT_CODE, StallfreeError

# The variable that sets how long a read waits for a store that does not answer (seconds);
# STALLFREE_S3_OUTAGE_S, its older name, still works.
OUTAGE_ENV = "STALLFREE_STORE_OUTAGE_S"


_HINTS = {
    "s3": "check the URL, the endpoint (AWS_ENDPOINT_URL or data.endpoint_url) and the "
    "credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, or a role)",
    "gs": "check the URL and the credentials (GOOGLE_APPLICATION_CREDENTIALS, or "
    "STORAGE_EMULATOR_HOST for an emulator)",
    "az": "check the URL and the account (AZURE_STORAGE_CONNECTION_STRING, or "
    "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY)",
}


class StoreError(StallfreeError):
    """An object-store URL that cannot be read; the message names the URL and the reason."""

    hint = _HINTS["s3"]

    def __init__(self, message: str = "") -> None:
        # torch's DataLoader re-raises a worker's error as this type, built from "Caught
        # StoreError in DataLoader worker ... Original Traceback ...": keep the worker's line.
        if message.startswith(f"Caught {type(self).__name__}"):
            last = message.rstrip().splitlines()[-1]
            message = last.partition(f"{type(self).__name__}: ")[2] or last
        super().__init__(message)
        if type(self).hint == StoreError.hint:  # the settings to check are the named store's
            self.hint = next((h for s, h in _HINTS.items() if f"{s}://" in message), self.hint)


class NoSuchObjectError(StoreError):
    """A HEAD or GET of an object that is not there (the store answered 404)."""


class ObjectGoneError(NoSuchObjectError):
    """A GET of an object that is not there: one that was listed (a loader reads only what
    its listing holds; a resume keeps the run's listing) has been deleted since."""

    hint = (
        "it was listed when this run started and is gone from the store now: put it back and "
        "--resume auto, or start a new --out to list the store as it is"
    )


class StoreUnavailableError(StoreError):
    """The store did not answer for the whole outage budget (STALLFREE_STORE_OUTAGE_S): a
    training run stops as a preempted one does, to resume once the store is back."""

    exit_code = PREEMPTED_EXIT_CODE  # EX_TEMPFAIL (sysexits.h): try again later, as a preempted run's
    hint = f"{OUTAGE_ENV} (or STALLFREE_S3_OUTAGE_S) sets how long to wait for it"


class NotAFolderError(StoreError):
    """A location in an object store where a local folder is needed (data pack's output)."""

    hint = ""  # the fix is in the message: nothing about credentials


class NoDataError(StallfreeError, ValueError):
    """A data root, or a split a root must hold, that is not there: the one start-up check's."""

    same_on_every_rank = True  # a node's ranks see one filesystem: its first rank says it
