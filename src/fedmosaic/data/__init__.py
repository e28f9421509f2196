"""Data layer: datasets, partitioners and the FederatedData container."""

from .base import ArrayDataset
from .registry import dataset_names, get_spec, load_dataset

__all__ = ["ArrayDataset", "dataset_names", "get_spec", "load_dataset"]
