"""ImageFolder-shaped prefixes in an object store: `s3://bucket/prefix/{train,val}/CLASS/...`.

Listed here (every class prefix in full, in parallel; no object is read) and made into a Dataset
by `read_store_folders`: the one a local copy of the same objects gives, sample for sample
in the same order (`folders.class_files`), so a run from the store and one from the copy see the
same batches. The listing is cached per node (`list_root`), so that a resume counts its
positions in the listing it started with. A `data.file_list` lists nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

from stallfree.data import storage
from stallfree.data.readers.folders import add_class, built, from_file_list, warn_unmeasured
from stallfree.data.readers.listing import SPLITS, Dataset, DatasetError, Listing, ListingBuilder
from stallfree.parallel import DistInfo
from stallfree.recipe import DataConfig
from stallfree.version import __version__

# How long a node's other ranks wait for local rank 0's listing before listing themselves (a
# 14M-key listing takes minutes; a lister that died takes its launcher, and them, down first).
WAIT_S = 1800.0


def imagefolder_order(names: list[str]) -> list[str]:
    """Object names under a class prefix in the order `folders.class_files` walks a local copy:
    the class folder's own files first, then each sub-folder's by its path; hidden ones
    (a part starting with ".") and folder markers (a key ending in "/") left out."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split("/")
        if not parts[-1] or any(p.startswith(".") for p in parts):
            continue
        groups.setdefault("/".join(parts[:-1]), []).append(name)
    order = sorted(groups, key=lambda rel: (rel != "", rel))
    return [name for rel in order for name in sorted(groups[rel])]


def read_store_folders(
    root: storage.Location, data: DataConfig, seed: int = 0, reuse: bool = False
) -> Dataset:
    """An ImageFolder-shaped prefix: the same samples, in the same order, as a local copy gives;
    listed once a run (cached per node, reused by a resume: `reuse`), a file list lists nothing.
    `seed` is the folder reader's (a held-out val), which a store root does not draw."""
    if data.file_list:
        return from_file_list(root, list_classes(data.file_list), data.file_list)
    classes, names, digests, cached = list_root(root, reuse=reuse)
    splits = {}
    for split in SPLITS:  # a loop, not a comprehension: _split_of's stacklevel counts frames
        splits[split] = _split_of(root.join(split), split, classes, names[split])
    sources = tuple(f"{root.join(split)}#keys={digests[split]}" for split in SPLITS)  # no times: ETags
    warn_unmeasured(root.join("val"), classes, splits["val"])
    return Dataset(root=str(root), classes=classes, splits=splits, sources=sources, cached_listing=cached)


def _split_of(
    split_root: storage.Location, split: str, classes: tuple[str, ...], names: list[list[str]]
) -> Listing:
    """A split's listing from each class's object names (the accepted image types only)."""
    builder = ListingBuilder(f"{split_root}/", classes)
    left_out: list[str] = []
    for label, (name, files) in enumerate(zip(classes, names, strict=True)):
        empty = f"class prefix {split_root}/{name}/ has no images; add images or remove it"
        add_class(builder, label, name, files, left_out, empty if split == "train" else "")
    return built(builder, f"{split_root}/", left_out, "object(s)", stacklevel=6)


def class_prefixes(root: storage.Location) -> dict[str, list[str]]:
    """Each split's class prefixes (a delimiter listing each: requests by classes, not objects)."""
    return {
        split: [name for name in root.join(split).list_dirs() if not name.startswith(".")] for split in SPLITS
    }


def remote_classes(root: storage.Location, prefixes: dict[str, list[str]] | None = None) -> tuple[str, ...]:
    """Train's class prefixes (the label map); a val class that train lacks is an error.
    `prefixes`: each split's class prefixes, when already listed."""
    prefixes = prefixes or class_prefixes(root)
    classes = tuple(prefixes["train"])
    if not classes:
        raise DatasetError(f"{root}/train/ has no class prefixes; expected {root}/train/<class>/<image>")
    unknown = sorted(set(prefixes["val"]) - set(classes))
    if unknown:
        raise DatasetError(
            f"{root}/val/ has class prefixes that {root}/train/ lacks: {', '.join(unknown)}; "
            "labels come from train's classes, so remove them from val/ or add them to train/"
        )
    return classes


def list_classes(file_list: str) -> tuple[str, ...]:
    """The classes a `data.file_list` names under train/ (sorted, as prefixes are): with a list,
    nothing is listed. A class prefix the list names no image of is no class here (a local
    root's folder would be an error: a label never learned); () for a missing list, which the
    folder reader names."""
    found: set[str] = set()
    try:
        with open(file_list, encoding="utf-8", errors="surrogateescape") as lines:
            for line in lines:
                text = line.strip()
                if text.startswith("train/") and "/." not in text and "//" not in text:
                    parts = text.split("/", 2)
                elif text and not text.startswith("#"):
                    parts = os.path.normpath(text).split("/", 2)
                else:
                    continue
                if len(parts) == 3 and parts[0] == "train" and not parts[1].startswith("."):
                    found.add(parts[1])
    except FileNotFoundError:
        return ()
    return tuple(sorted(found))


def class_objects(split: storage.Location, classes: tuple[str, ...]) -> tuple[list[list[str]], str]:
    """Each class prefix's object names (relative to it) in ImageFolder's order, and one digest
    of every key, size and ETag under them: the start-up check cache's key, carried in the
    Dataset's `sources` (an object replaced under its own name changes its ETag)."""
    listed = storage.list_many([split.join(name) for name in classes])
    names = [imagefolder_order([key for key, _ in objects]) for objects, _ in listed]
    return names, storage.digest_of([digest for _, digest in listed])


# (train's classes, each split's object names per class, each split's digest of keys and ETags,
# and, for a cached listing, the phrase naming it: `cached_note`; "" for one made now)
Listed = tuple[tuple[str, ...], dict[str, list[list[str]]], dict[str, str], str]

# Set to 1, a resume lists the store again rather than take the node's cached listing.
RELIST_ENV = "STALLFREE_RELIST"


def cached_note(listed_at: float, path: Path) -> str:
    """The phrase a refusal names a cached listing by: its time, its file, how to list again."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(listed_at))
    return f"the cached listing made at {when} ({path}; remove it, or set {RELIST_ENV}=1, to list again)"


def list_root(root: storage.Location, *, reuse: bool, dist: DistInfo | None = None) -> Listed:
    """List the prefix's classes, object names and digests, and cache them for the node.

    A new run lists every object, so it trains on the store as it is now (an object added,
    removed or replaced under a known class prefix is seen: S3 has no cheaper way, a prefix has
    no modification time and no count). A resume (`reuse`) takes the node's cached listing while
    the class prefixes still hold: its checkpoint positions count samples of that listing, and
    another would silently give them other samples. A class prefix added or removed means the
    store moved under the run, and everything is listed; a key removed since stops the run when
    its batch comes, naming it (remove `cache_path`, or set STALLFREE_RELIST=1, to list again);
    one added waits for a new run. The resume says which listing it took (`check_same_data`).
    With several ranks a node, local rank 0 lists and writes the entry, and the others wait
    for that entry of this launch (`_launch_token`), so a node lists once; without a writable
    cache every rank lists. Nodes list apart, as they would walk local copies.
    """
    dist = dist or DistInfo.from_env()
    prefixes = class_prefixes(root)  # the cheap revalidation: a few requests, not one per 1,000 keys
    classes = remote_classes(root, prefixes)
    path = cache_path(root)
    reuse = reuse and os.environ.get(RELIST_ENV) != "1"
    if reuse and (entry := _load(path, str(root))) is not None and entry["prefixes"] == prefixes:
        return _unpack(entry, cached_note(entry.get("listed_at", 0), path))
    token = _launch_token()
    if dist.local_world_size > 1 and dist.local_rank != 0 and _writable(path.parent):
        entry = _wait(path, str(root), token)
        if entry is not None:  # rank 0's, even if the store moved since: the node's ranks agree
            return _unpack(entry)
    names, digests = {}, {}
    for split in SPLITS:
        names[split], digests[split] = class_objects(root.join(split), classes)
    entry = {"version": __version__, "root": str(root), "token": token, "host": socket.gethostname()}
    entry["listed_at"] = time.time()
    entry |= {"prefixes": prefixes, "classes": list(classes), "digests": digests}
    # One string a class ("\0" is in no key: XML cannot carry it): a fast load at 1M+ names.
    entry["names"] = {split: ["\0".join(files) for files in names[split]] for split in SPLITS}
    _save(path, entry)
    return classes, names, digests, ""


def cache_path(root: storage.Location) -> Path:
    """The node's listing of `root` at this endpoint (one bucket name, many stores); remove it
    to have a resume list everything again."""
    from stallfree.data.readers.startup_check import cache_dir

    key = hashlib.sha256(root.identity().encode()).hexdigest()[:32]
    return cache_dir() / f"listing-{key}.json.z"


def _launch_token() -> str:
    """What a node's ranks of one launch share and the next launch does not: their parent
    process (torchrun's agent, srun's step daemon) with its start time (pids are reused), and
    the agent's restart count."""
    ppid = os.getppid()
    try:  # field 22 of /proc/PID/stat, counted after the ")" that ends the command name
        started = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = ""
    return f"{ppid} {started} {os.environ.get('TORCHELASTIC_RESTART_COUNT', '')}"


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def _save(path: Path, entry: dict[str, Any]) -> None:
    """Write the entry atomically; one that cannot be written only costs the next start a listing."""
    from stallfree.data.readers.startup_check import write_cache_file

    exc = write_cache_file(path, zlib.compress(json.dumps(entry).encode(), 1))
    if exc is not None:
        warnings.warn(
            f"cannot write the listing cache {path} ({exc.strerror or exc}): a resume lists "
            "again; set STALLFREE_CACHE to a writable folder",
            stacklevel=3,
        )


def _load(path: Path, root: str) -> dict[str, Any] | None:
    """The entry, or None: absent, another version's, or not as `_save` wrote it (warned)."""
    try:
        entry = json.loads(zlib.decompress(path.read_bytes()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, zlib.error):
        entry = None
    if isinstance(entry, dict) and entry.get("version") != __version__:
        return None  # another version's: listed again, silently
    if _well_formed(entry, root):
        return entry
    warnings.warn(f"listing cache {path} is damaged: ignored, the prefix is listed again", stacklevel=3)
    return None


def _well_formed(entry: Any, root: str) -> bool:
    if not isinstance(entry, dict) or entry.get("root") != root:
        return False
    classes, names, digests = entry.get("classes"), entry.get("names"), entry.get("digests")
    return (
        isinstance(classes, list)
        and isinstance(entry.get("prefixes"), dict)
        and isinstance(names, dict)
        and isinstance(digests, dict)
        and all(
            isinstance(names.get(s), list)
            and len(names[s]) == len(classes)
            and all(isinstance(n, str) for n in names[s])
            and isinstance(digests.get(s), str)
            for s in SPLITS
        )
    )


def _unpack(entry: dict[str, Any], cached: str = "") -> Listed:
    names = {split: [text.split("\0") if text else [] for text in entry["names"][split]] for split in SPLITS}
    return tuple(entry["classes"]), names, dict(entry["digests"]), cached


def _started() -> float:
    """When this process started (wall clock, from /proc); now where that cannot be read."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = [line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")]
        return int(btime[0].split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def _elsewhere_since(entry: dict[str, Any], started: float) -> bool:
    listed_at = entry.get("listed_at")
    elsewhere = entry.get("host") != socket.gethostname()
    return elsewhere and isinstance(listed_at, (int, float)) and listed_at > started


def _wait(path: Path, root: str, token: str) -> dict[str, Any] | None:
    """Local rank 0's entry of this launch (read when the file changes), or None after WAIT_S.
    Another node's entry listed since this process started counts too: on a cache shared by
    several nodes, that node's rank 0 of the same job may have replaced this node's since."""
    deadline, seen, started = time.monotonic() + WAIT_S, None, _started()
    while time.monotonic() < deadline:
        try:
            st = path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        if stamp is not None and stamp != seen:
            seen = stamp
            entry = _load(path, root)
            if entry is not None and (entry.get("token") == token or _elsewhere_since(entry, started)):
                return entry
        time.sleep(0.2)
    warnings.warn(
        f"local rank 0 wrote no listing of {root} to {path} in {WAIT_S:.0f} s: listing it here",
        stacklevel=3,
    )
    return None
