"""Two nodes of one run (`torchrun --nnodes 2`, one rank each, each with its own cache and its
own copy of the data): they refuse to start, every rank exiting, when one node lists a file
the other does not; copies at other paths agree; and two nodes in their own network namespaces
(a rendezvous that is not loopback) train together."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import PYTHON, small_recipe
from s3_server import upload_tree
from test_nodes import _copy_root

from stallfree.recipe import dump_toml


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _node(
    node_rank: int, root: Path | str, tmp_path: Path, port: int, addr: str, entry: list[str]
) -> list[str]:
    """The command of one node's launcher (static rendezvous at rank 0's `addr`:`port`);
    `entry`: what its rank runs (`-m stallfree`, or a script and its arguments)."""
    recipe = tmp_path / f"node{node_rank}.toml"
    # 60 images, 8 a rank: 3 steps.
    recipe.write_text(dump_toml(small_recipe(root, train={"batch_size": 8, "epochs": 1})))
    return [
        PYTHON, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
        "--node_rank", str(node_rank), "--master_addr", addr, "--master_port", str(port),
        *entry, "train", str(recipe), "--out", str(tmp_path / "run"), "--no-progress",
    ]  # fmt: skip


def run_two_nodes(
    roots: list[Path] | list[str],
    tmp_path: Path,
    addr: str = "127.0.0.1",
    netns: list[str] | None = None,
    entries: list[list[str]] | None = None,
) -> list[tuple[int, str]]:
    """Both nodes' launchers at once, each with its own STALLFREE_CACHE (and, with `netns`, in
    its own namespace, gloo on its veth): each one's (exit code, output)."""
    return _wait(_start_two_nodes(roots, tmp_path, addr, netns, entries), tmp_path)


def _start_two_nodes(
    roots: list[Path] | list[str],
    tmp_path: Path,
    addr: str = "127.0.0.1",
    netns: list[str] | None = None,
    entries: list[list[str]] | None = None,
) -> list[subprocess.Popen[bytes]]:
    port, procs = _free_port(), []
    for node, root in enumerate(roots):
        env = {**os.environ, "STALLFREE_CACHE": str(tmp_path / f"cache{node}"), "OMP_NUM_THREADS": "1"}
        entry = entries[node] if entries else ["-m", "stallfree"]
        command = _node(node, root, tmp_path, port, addr, entry)
        if netns:
            command = ["ip", "netns", "exec", netns[node], *command]
            env["GLOO_SOCKET_IFNAME"] = f"{netns[node]}v"
        log = (tmp_path / f"node{node}.log").open("w")  # a file: a stuck rank holds no pipe
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait(procs: list[subprocess.Popen[bytes]], tmp_path: Path) -> list[tuple[int, str]]:
    results = []
    for node, proc in enumerate(procs):
        try:
            proc.wait(timeout=150)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail(f"node {node} hung: " + (tmp_path / f"node{node}.log").read_text()[-2000:])
        results.append((proc.returncode, (tmp_path / f"node{node}.log").read_text()))
    return results


@pytest.mark.e2e
def test_two_nodes_that_list_other_files_refuse_to_start(image_root: Path, tmp_path: Path) -> None:
    """Ten tries, five pairs at once (the load makes a rank's teardown race likelier; it ended
    2 tries in 3 with an abort before): every rank ends on its one line with exit 2, none
    aborts in gloo's teardown."""
    roots = [_copy_root(image_root, tmp_path / f"data{node}", extra=node == 1) for node in (0, 1)]
    for round in range(2):
        tries = [tmp_path / f"try{round}-{i}" for i in range(5)]
        started = [_start_two_nodes(roots, (t.mkdir(), t)[1]) for t in tries]
        for procs, path in zip(started, tries):
            results = _wait(procs, path)
            _assert_refused(results, path)
            for _, log in results:  # torchrun's table names each rank's own exit code
                assert "exitcode  : 2 " in log and "terminate called" not in log, log[-3000:]
                assert "frame #0" not in log, log[-3000:]  # no C++ stack


def _assert_refused(results: list[tuple[int, str]], tmp_path: Path) -> None:
    """Every node exited non-zero with one line naming train, 60 against 61, and the fix."""
    for code, log in results:
        said = [line for line in log.splitlines() if "stallfree" in line and "error:" in line]
        assert code != 0 and len(said) == 1, log[-3000:]
        assert "train split" in said[0] and "60" in said[0] and "61" in said[0], said[0]
        assert "data.file_list" in said[0], said[0]  # the fix
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step was taken


@pytest.mark.slow
def test_an_object_added_between_two_nodes_listings_is_refused(
    s3_server, image_root: Path, tmp_path: Path
) -> None:
    url = upload_tree(s3_server.client(), image_root, "nodes", uuid.uuid4().hex[:8])
    first = sorted((image_root / "train").glob("*/*.jpg"))[0]
    added = f"{url}/train/{first.parent.name}/added-meanwhile.jpg"
    # Node 1's rank adds the object once node 0 has listed, then lists (tests/add_then_train.py).
    late = [
        str(Path(__file__).parents[1] / "add_then_train.py"),
        str(tmp_path / "cache0"),
        added,
        str(first),
        "--",
    ]
    _assert_refused(run_two_nodes([url, url], tmp_path, entries=[["-m", "stallfree"], late]), tmp_path)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def _namespaces() -> Iterator[list[str]]:
    """Two network namespaces joined by a veth pair, 10.200.0.1 and 10.200.0.2 (the
    interface in namespace NS is NSv); removed on the way out."""
    tag = uuid.uuid4().hex[:6]
    names = [f"sf{tag}a", f"sf{tag}b"]
    made: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", f"{names[0]}v", "type", "veth", "peer", "name", f"{names[1]}v")
        for i, name in enumerate(names):
            _ip("link", "set", f"{name}v", "netns", name)
            _ip("-n", name, "addr", "add", f"10.200.0.{i + 1}/24", "dev", f"{name}v")
            _ip("-n", name, "link", "set", f"{name}v", "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield names
    finally:
        for name in made:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def _netns_reason() -> str:
    """Why namespaces cannot be made here, or "" when they can."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces (ip netns add)"
    try:
        with _namespaces():
            return ""
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        return f"ip netns is unavailable here: {str(detail).strip()}"


@pytest.mark.e2e
def test_two_nodes_in_their_own_network_namespaces_train(image_root: Path, tmp_path: Path) -> None:
    reason = _netns_reason()
    if reason:
        pytest.skip(reason)
    roots = [_copy_root(image_root, tmp_path / f"data{node}") for node in (0, 1)]
    with _namespaces() as names:
        results = run_two_nodes(roots, tmp_path, addr="10.200.0.1", netns=names)
    for code, log in results:
        assert code == 0, log[-3000:]
    assert (tmp_path / "run" / "summary.json").exists()
