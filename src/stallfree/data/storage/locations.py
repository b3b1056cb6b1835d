"""Where data is: the one place a location's scheme is read, and the tar member reference."""

from __future__ import annotations

import os
from dataclasses import dataclass

from stallfree.data.storage.failures import StoreError

# The object stores a root may name. "azure://" is not taken: Azure's own tools write
# az:// (adlfs, obstore) or https://ACCOUNT.blob.core.windows.net, and one spelling a store
# keeps cache keys and listings from splitting in two.
SCHEMES = ("s3", "gs", "az")
# What each store calls the thing a URL's first part names.
BUCKET_WORD = {"s3": "bucket", "gs": "bucket", "az": "container"}


def scheme_of(location: str | os.PathLike[str]) -> str:
    """The object store's scheme ("s3", "gs", "az"), or "" for a local path. An unknown
    scheme (http://, azure://, s3a://) is refused: read as a local path it failed far later."""
    if not isinstance(location, str) or "://" not in location:
        return ""
    scheme = location.partition("://")[0]
    if scheme in SCHEMES:
        return scheme
    if "/" in scheme or not scheme.isidentifier():
        return ""  # a local path that holds "://" further on ("/data/s3://x")
    spelled = {"gcs": "gs", "azure": "az", "abfs": "az", "s3a": "s3"}.get(scheme)
    if spelled:
        raise StoreError(
            f"{location}: write {spelled}://BUCKET/PREFIX (stallfree's one spelling of that store)"
        )
    raise StoreError(
        f"{location}: {scheme}:// is not a store stallfree reads; use "
        + ", ".join(f"{s}://BUCKET/PREFIX" for s in SCHEMES)
        + " or a local path"
    )


def is_url(location: str | os.PathLike[str]) -> bool:
    """Whether `location` names an object store rather than a local path."""
    return bool(scheme_of(location))


def split_url(url: str) -> tuple[str, str, str]:
    """(scheme, bucket, key) of `SCHEME://bucket/key`."""
    scheme = scheme_of(url)
    bucket, _, key = url[len(scheme) + 3 :].partition("/")
    if not scheme or not bucket:
        word = BUCKET_WORD.get(scheme, "bucket")
        raise StoreError(f"{url}: no {word} name; expected {scheme or 's3'}://{word.upper()}/PREFIX")
    return scheme, bucket, key


def join(base: str, *parts: str) -> str:
    """`base/part/...` for a URL or a local path, without doubled slashes."""
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


# The separator between a shard and its member in a sample's path: "SHARD.tar::MEMBER:OFFSET:SIZE".
MEMBER_SEP = "::"


@dataclass(frozen=True, slots=True)
class MemberRef:
    """A member of a tar shard, read in place: bytes [offset, offset + size) of `shard`."""

    shard: str
    member: str
    offset: int
    size: int

    def __str__(self) -> str:
        return f"{self.shard}{MEMBER_SEP}{self.member}:{self.offset}:{self.size}"

    @staticmethod
    def parse(path: str) -> MemberRef | None:
        """The reference `path` spells, or None for a plain file or object."""
        if MEMBER_SEP not in path:
            return None
        shard, _, rest = path.rpartition(MEMBER_SEP)
        member, offset, size = rest.rsplit(":", 2)
        return MemberRef(shard, member, int(offset), int(size))


def member_path(shard: str, member: str, offset: int, size: int) -> str:
    """The path of a tar member read in place (what a listing holds)."""
    return str(MemberRef(shard, member, offset, size))


def base_name(path: str) -> str:
    """The file name a sample's path ends in: a member's own name for a member reference."""
    ref = MemberRef.parse(path)
    return ref.member if ref is not None else path
