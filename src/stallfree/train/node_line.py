"""An error every rank meets alike is said once a node, by its first rank: the node's other
ranks wait until it has, since torchrun stops a node's ranks as soon as one of them exits.

The event is a key in torchrun's agent store (the TCPStore its workers share), set by the
node's first rank once its line is out. Outside torchrun (srun) no launcher stops a task when
another ends, so there is nothing to wait for.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

# How long a rank waits for its node's first rank: that rank may die first, on another error.
WAIT = timedelta(seconds=60)


def _store() -> tuple[Any, str] | None:
    """The agent store and this node's key, or None outside a torchrun worker."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in env:
        return None
    from torch.distributed import TCPStore

    addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"])
    store = TCPStore(addr, port, is_master=False, timeout=WAIT)
    run = env.get("TORCHELASTIC_RUN_ID", "")
    key = f"stallfree/said/{run}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{env.get('GROUP_RANK', '0')}"
    return store, key


def said() -> None:
    """On a node's first rank, once its line is out: the node's other ranks may exit."""
    try:
        found = _store()
        if found is not None:
            found[0].set(found[1], "1")
    except Exception:  # noqa: BLE001 - the store is gone: the others' wait ends on its own
        pass


def wait_for_first_rank() -> None:
    """On a node's other ranks: return once its first rank has said the line (or WAIT)."""
    try:
        found = _store()
        if found is not None:
            found[0].wait([found[1]], WAIT)
    except Exception:  # noqa: BLE001 - no line came in time, or the store went: exit anyway
        pass
