"""Datasets (bundled `photos`, CIFAR, ImageFolder) and the non-IID client partition."""

from eftguard.data.base import Dataset, ImageSet, DataError
from eftguard.data.registry import load_dataset, DATASET_HELP
from eftguard.data.partition import dirichlet_partition, seeded

__all__ = ["Dataset", "ImageSet", "DataError", "load_dataset", "DATASET_HELP", "dirichlet_partition", "seeded"]
