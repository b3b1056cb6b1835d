"""`Resolved`: what a run decided for itself, kept beside the recipe as the user gave it.

The recipe is never changed after its flags and --set overrides. What each "auto" became (the
device, the precision, the loader backend, its worker or thread count, the micro-batch) and the
values a run fills in (reads in flight, the S3 endpoint, a plug-in's defaults) are this record:
RUN/resolved.toml, and "resolved" in every checkpoint. A resume decides each one again on its
machine, except a measured worker/thread count, which it takes from its checkpoint's record.
Torch-free: the CLI and the checkpoint format read it without the training stack.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from stallfree.tables import at_least, table_from_dict
from stallfree.tomlwrite import dumps_toml

RESOLVED = "resolved.toml"  # in the run directory, beside recipe.toml


@dataclass(kw_only=True, slots=True)
class Resolved:
    """One run's decided values, each under the name of the recipe key it decides."""

    device: Literal["cpu", "cuda"] = "cpu"  # train.device: the kind each rank trains on
    precision: Literal["bf16", "fp16", "fp32"] = "fp32"  # train.precision
    backend: str = ""  # loader.backend: the one that ran
    wraps: str = ""  # loader.synthetic_decode: what the synthetic-decode backend wraps, else ""
    dali_decode: Literal["auto", "cpu"] = "auto"  # loader.dali.decode ("cpu": nvJPEG failed)
    io_depth: int = field(default=0, metadata=at_least(0))  # loader.io_depth (0: no data read)
    # loader.torch.workers / loader.dali.threads = "auto": the count measured (0: not asked)
    workers: int = field(default=0, metadata=at_least(0))
    threads: int = field(default=0, metadata=at_least(0))
    # train.micro_batch: the size every rank of a DDP run can take; "auto" on one process,
    # where the chunks shrink on an out-of-memory as it happens (train/microbatch.py).
    micro_batch: int | Literal["auto"] = field(default=0, metadata=at_least(0))
    endpoint_url: str = ""  # data.endpoint_url: the S3 endpoint read (no credential), else ""
    plugin: dict[str, Any] = field(default_factory=dict)  # loader.plugin, defaults filled in

    def to_dict(self) -> dict[str, Any]:
        """Plain dict: the form in checkpoints and resolved.toml."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str) -> Resolved:
        """The record from its dict form (`source` names where it came from in an error)."""
        return cast(Resolved, table_from_dict(cls, raw, "resolved", source))

    def to_toml(self) -> str:
        """resolved.toml's text."""
        return dumps_toml(self.to_dict())

    def described(self) -> str:
        """The decided loader, in the run's start line: backend, wrapped backend, counts."""
        counts = ", ".join(
            f"{n} {key}" for key, n in (("workers", self.workers), ("threads", self.threads)) if n
        )
        return (
            f"{self.backend} loader"
            + (f" wrapping {self.wraps}" if self.wraps else "")
            + (f" ({counts} chosen by auto)" if counts else "")
        )


def resolved_of_old_recipe(recipe: dict[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
    """The record of a checkpoint written before it existed (format 5 and older): `recipe`
    held the decided values, with `chosen` (recipe.lift_requested's) the ones "auto" chose."""
    train, loader, data = (recipe.get(key, {}) for key in ("train", "loader", "data"))

    def value(dotted: str, default: Any) -> Any:
        table, key = (train if dotted.startswith("train.") else loader), dotted.rsplit(".", 1)[-1]
        return chosen.get(dotted, table.get(key, default))

    backend = value("loader.backend", "")
    record: dict[str, Any] = {
        "device": value("train.device", "cpu"),
        "precision": value("train.precision", "fp32"),
        "backend": "" if backend == "auto" else backend,
        "wraps": loader.get("synthetic_decode", "") if backend == "synthetic-decode" else "",
        "dali_decode": loader.get("dali", {}).get("decode", "auto"),
        "io_depth": value("loader.io_depth", 0),
        "workers": chosen.get("loader.torch.workers", 0),
        "threads": chosen.get("loader.dali.threads", 0),
        "micro_batch": value("train.micro_batch", 0),
        "endpoint_url": data.get("endpoint_url", ""),
        "plugin": loader.get("plugin", {}),
    }
    # A value older files hold undecided (an "auto" they left) keeps the record's default.
    defaults = Resolved().to_dict()
    wanted = {"device": ("cpu", "cuda"), "precision": ("bf16", "fp16", "fp32"), "wraps": ("torch", "dali")}
    for key, allowed in wanted.items():
        if record[key] not in allowed:
            record[key] = defaults[key]
    for key in ("io_depth", "workers", "threads"):
        if not isinstance(record[key], int) or isinstance(record[key], bool):
            record[key] = 0
    return record
