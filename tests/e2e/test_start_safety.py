"""The start-up check (a full decode of every file, under data.on_error = "skip" with DALI, and
`stallfree data check`) finishes whatever the calling process's other threads are doing, and
still names every bad file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

pytestmark = pytest.mark.e2e  # each test starts interpreters

# A reader thread of the train loader caught inside an import when the val loader's check
# starts, made certain rather than left to chance: a finder holds the thread inside the import
# of PIL's JPEG plugin (its module lock held) until the check has answered. A worker forked from
# this process would wait on that lock forever; the check must not depend on such timing.
_MID_IMPORT = """
import json, sys, threading
from stallfree.data.readers.startup_check import decode_all
assert "PIL.JpegImagePlugin" not in sys.modules, "the plugin must still be unimported"
inside, release = threading.Event(), threading.Event()

class Held:
    def find_spec(self, name, path=None, target=None):
        if name == "PIL.JpegImagePlugin" and threading.current_thread().name == "reader":
            inside.set()
            release.wait()
        return None

sys.meta_path.insert(0, Held())
reader = threading.Thread(target=lambda: __import__("PIL.JpegImagePlugin"), name="reader")
reader.start()
inside.wait()
print(json.dumps(decode_all(sys.argv[1:], 10**8, 2, desc="check", progress=False)), flush=True)
release.set()
reader.join()
"""


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `args`; on a hang kill its whole session (a forked worker too) and fail."""
    pipe = subprocess.PIPE
    proc = subprocess.Popen(args, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"hung for {timeout:.0f} s: {err[-1500:]}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def test_the_check_finishes_while_another_thread_is_inside_an_import(tmp_path: Path) -> None:
    good, cut = tmp_path / "good.jpg", tmp_path / "cut.jpg"
    Image.new("RGB", (64, 48), (200, 40, 40)).save(good, quality=90)
    cut.write_bytes(good.read_bytes()[:300])
    done = _run([sys.executable, "-c", _MID_IMPORT, str(good), str(cut)], timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    reasons = json.loads(done.stdout.strip().splitlines()[-1])
    assert reasons[0] is None and reasons[1], reasons
