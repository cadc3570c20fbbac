"""Multi-domain datasets: the built-in benchmarks, folder datasets, and the batch interface."""

from feddg.data.base import DomainDataset, iterate_batches
from feddg.data.registry import dataset_info, list_datasets, load_dataset

__all__ = ["DomainDataset", "dataset_info", "iterate_batches", "list_datasets", "load_dataset"]
