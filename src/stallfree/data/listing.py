"""The shared dataset listing: one source of file order and class indices for every backend."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


class DatasetError(ValueError):
    """A dataset folder that cannot be used; the message names the path and the fix."""


@dataclass(frozen=True, slots=True)
class Listing:
    """Sorted (path, label) pairs of one split, and the class names that labels index."""

    samples: tuple[tuple[str, int], ...]
    classes: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def files(self) -> list[str]:
        return [path for path, _ in self.samples]

    @property
    def labels(self) -> list[int]:
        return [label for _, label in self.samples]


def list_split(root: str | Path, split: str, file_list: str | Path | None = None) -> Listing:
    """List `root/split/<class>/<image>`, classes sorted by name, files sorted within a class.

    With `file_list` (lines of `split/class/file` relative to root), only the listed files are
    kept, so that a data checker can exclude bad files without touching the dataset.
    """
    split_dir = Path(root) / split
    if not split_dir.is_dir():
        raise DatasetError(f"{split_dir} does not exist; expected {root}/{split}/<class>/<image>")
    classes = sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DatasetError(f"{split_dir} has no class folders; expected {split_dir}/<class>/<image>")
    allowed = _read_file_list(Path(root), file_list) if file_list else None
    samples: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        files = sorted(
            p for p in (split_dir / name).iterdir()
            if p.suffix.lower() in IMAGE_EXTENSIONS and not p.name.startswith(".")
        )
        if allowed is not None:
            files = [p for p in files if p.resolve() in allowed]
        if not files:
            raise DatasetError(
                f"class folder {split_dir / name} has no images ({', '.join(IMAGE_EXTENSIONS)}); "
                "add images or remove the folder"
            )
        samples.extend((str(p), label) for p in files)
    return Listing(samples=tuple(samples), classes=tuple(classes))


def _read_file_list(root: Path, file_list: str | Path) -> set[Path]:
    lines = Path(file_list).read_text().splitlines()
    return {(root / line.strip()).resolve() for line in lines if line.strip() and not line.startswith("#")}
