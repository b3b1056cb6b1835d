"""Who makes a request: this thread itself, or this process's store helper (wire.py says why)."""

from __future__ import annotations

from typing import Any

import stallfree.data.storage.helper as helper
import stallfree.data.storage.wire as wire


def run(op: str, where: tuple[str, str, str, float], *args: Any) -> Any:
    """Request `op` (see wire.OPS) of the store `where` = (scheme, bucket, endpoint, timeout),
    made here or by the helper; a failure raises wire.Failure."""
    if wire.direct():
        return wire.call(op, where, *args)
    return helper.request(op, where, *args)
