"""Run under torchrun by tests/e2e/test_nodes_runs.py as the second node's rank: waits until the first
node has listed the store (its listing cache is written), adds one object, then runs
`stallfree train ARGS`; so the two nodes list the prefix before and after the object came.

Usage: add_then_train.py FIRST_NODE_CACHE S3_URL_OF_NEW_OBJECT LOCAL_FILE -- train ARGS...
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import boto3

from stallfree.cli import main

if __name__ == "__main__":
    cache, url, body = sys.argv[1:4]
    deadline = time.monotonic() + 120
    while not list(Path(cache).glob("listing-*.json.z")) and time.monotonic() < deadline:
        time.sleep(0.1)
    bucket, _, key = url.removeprefix("s3://").partition("/")
    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=Path(body).read_bytes())
    sys.exit(main(sys.argv[5:]))
