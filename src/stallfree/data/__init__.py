"""Data: the shared listing, the Loader contract, and one module per backend."""

from stallfree.data.listing import DatasetError, Listing, list_split
from stallfree.data.loader import BACKENDS, Batch, DistInfo, Loader, LoaderSpec, build_loader

__all__ = ["BACKENDS", "Batch", "DatasetError", "DistInfo", "Listing", "Loader", "LoaderSpec",
           "build_loader", "list_split"]
