"""A real Azure Blob Storage emulator for the tests: Azurite (npm's `azurite`) on loopback, one
per test session, reached through its documented development account and key.

`make test` installs it into tests/.node (npm); where node or the package is missing, the tests
that need it are skipped with the install command (they fail under CI). Requests of the tests'
own (a container, uploads) are signed here with the account key (Azure's Shared Key scheme),
so that nothing else needs installing.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

from emulators import ROOT, Process, free_port, unavailable

from stallfree.data.storage.clouds import AZURITE_ACCOUNT as ACCOUNT
from stallfree.data.storage.clouds import AZURITE_KEY as KEY

VERSION = "2021-08-06"  # a REST API version Azurite serves


def binary() -> str | None:
    """`azurite-blob` from tests/.node (where `make test` installs it), or on PATH."""
    local = ROOT / "tests/.node/node_modules/.bin/azurite-blob"
    if local.is_file() and shutil.which("node"):
        return str(local)
    return shutil.which("azurite-blob")


def need_binary() -> str:
    found = binary()
    if found is None:
        unavailable("Azurite is not installed: npm install --prefix tests/.node azurite (make test does)")
    return found


class Server(Process):
    """azurite-blob on a loopback port, its blobs under `data_dir`."""

    def __init__(self, binary: str, data_dir: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}/{ACCOUNT}"
        cmd = [
            binary, "--blobHost", "127.0.0.1", "--blobPort", str(self.port),
            "--location", str(data_dir / "blobs"), "--skipApiVersionCheck", "--loose",
            "--disableTelemetry", "--silent",
        ]  # fmt: skip
        super().__init__(cmd, data_dir, self._answers)

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.endpoint}?comp=list", timeout=2).close()
        except urllib.error.HTTPError:
            return True  # refused unsigned: it is up
        except OSError:
            return False
        return True

    def _request(
        self, method: str, path: str, query: dict[str, str], body: bytes = b"", **headers: str
    ) -> None:
        """One Shared Key signed request (path: `container[/blob]`)."""
        headers = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": VERSION, **headers}
        content_type = "application/octet-stream" if body else ""
        canonical = "".join(f"{k}:{v}\n" for k, v in sorted(headers.items()))
        resource = f"/{ACCOUNT}/{ACCOUNT}/{path}" + "".join(f"\n{k}:{v}" for k, v in sorted(query.items()))
        length = str(len(body)) if body else ""
        signed = f"{method}\n\n\n{length}\n\n{content_type}\n\n\n\n\n\n\n{canonical}{resource}"
        digest = hmac.new(base64.b64decode(KEY), signed.encode(), hashlib.sha256).digest()
        headers["Authorization"] = f"SharedKey {ACCOUNT}:{base64.b64encode(digest).decode()}"
        headers["Content-Type"] = content_type
        url = f"{self.endpoint}/{path}" + (
            "?" + "&".join(f"{k}={v}" for k, v in query.items()) if query else ""
        )
        request = urllib.request.Request(url, data=body, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=30):
            pass

    def create_container(self, container: str) -> None:
        try:
            self._request("PUT", container, {"restype": "container"})
        except urllib.error.HTTPError as err:
            if err.code != 409:  # already there: a module's server, used again
                raise

    def put(self, container: str, key: str, data: bytes) -> None:
        """One block blob."""
        self._request("PUT", f"{container}/{quote(key)}", {}, data, **{"x-ms-blob-type": "BlockBlob"})

    def upload_tree(self, local: Path, container: str, prefix: str) -> str:
        """Every file under `local` at az://container/prefix/<relative path>; the URL."""
        self.create_container(container)
        for path in sorted(local.rglob("*")):
            if path.is_file():
                self.put(container, f"{prefix}/{path.relative_to(local).as_posix()}", path.read_bytes())
        return f"az://{container}/{prefix}"

    def env(self) -> dict[str, str]:
        """The standard variable Azure's SDKs (and stallfree) read: a connection string."""
        return {
            "AZURE_STORAGE_CONNECTION_STRING": (
                f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};BlobEndpoint={self.endpoint};"
            )
        }
