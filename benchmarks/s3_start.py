"""First and second start from an s3:// ImageFolder of N small JPEGs: listing, every header
checked by ranged GETs (worker interpreters, reads in flight), the first batch.

Starts a SeaweedFS server (`weed`, the test extra) without identities in --work, PUTs N JPEGs
(64x48, 300 distinct bodies, as benchmarks/scale.py links them) under
s3://listing/imagenet/train/cNNNNN/ (and one a class under val/), then runs scale.py's
measurement (a fresh process: list, check, the torch loader's first batch with 2 workers) from
the store: a first start (empty cache) and a second (cached check). Objects are kept in --work.

    python benchmarks/s3_start.py --n 100000 --work /tmp/s3start
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]  # scale, s3_listing; the server helpers


def put_jpegs(port: int, keys: list[str], bodies: list[bytes], threads: int, bucket: str) -> None:
    """Each key's JPEG (bodies in turn), each thread PUTting its share on one connection."""

    def share(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for k in range(i, len(keys), threads):
            conn.request("PUT", f"/{bucket}/{keys[k]}", body=bodies[k % len(bodies)])
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                raise SystemExit(f"PUT {keys[k]}: HTTP {response.status}")
        conn.close()

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(share, range(threads)))


def _bodies(count: int) -> list[bytes]:
    import io

    import numpy as np
    from PIL import Image

    rng, out = np.random.default_rng(0), []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=85)
        out.append(buffer.getvalue())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="training objects")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=16, help="parallel PUT connections")
    parser.add_argument("--work", type=Path, default=None, help="server data (a temp folder if unset)")
    parser.add_argument("--smoke", action="store_true", help="200 objects in a temp folder: seconds")
    args = parser.parse_args()
    if args.smoke:
        args.n, args.classes, args.work = 200, 10, None
    import scale
    from s3_listing import BUCKET, PREFIX, start_in

    proc, _, port, _, work = start_in(args.work, "s3start-")
    try:
        per_class = args.n // args.classes
        keys = [f"{PREFIX}/train/c{c:05d}/{i:08d}.jpg" for c in range(args.classes) for i in range(per_class)]
        keys += [f"{PREFIX}/val/c{c:05d}/0.jpg" for c in range(args.classes)]
        done, made = work / f".complete-{args.n}", 0.0
        if not done.exists():
            t = time.perf_counter()
            put_jpegs(port, keys, _bodies(scale.SOURCES), args.threads, BUCKET)
            done.touch()
            made = time.perf_counter() - t
            print(f"PUT {len(keys):,} JPEGs in {made:.0f} s", flush=True)
        os.environ.update(
            {
                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                "AWS_ACCESS_KEY_ID": "bench",  # any: the server has no identities
                "AWS_SECRET_ACCESS_KEY": "bench",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
            }
        )
        cache = work / f"cache-{time.time_ns()}"
        root = f"s3://{BUCKET}/{PREFIX}"
        first = scale.measure(root, cache=cache)  # type: ignore[arg-type]
        second = scale.measure(root, cache=cache)  # type: ignore[arg-type]
        load = os.getloadavg()[0]
        print(json.dumps({"n": first["n"], "put_s": made, "first": first, "second": second, "load": load}))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
