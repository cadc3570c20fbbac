"""The one interface every multi-domain dataset implements.

A :class:`DomainDataset` is a labelled image dataset in which every sample also carries a
domain id. Clients never hold a dataset object of their own: they hold index arrays into
the shared dataset and ask it for batches, so a thousand simulated clients cost index
memory, not data copies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor


class DomainDataset(ABC):
    """Labelled images from several domains.

    Attributes:
        name: registry name, e.g. ``"digits-dg"``.
        domains: domain names; ``domain_ids`` index into it.
        classes: class names; ``labels`` index into it.
        labels: int64 array ``[N]``.
        domain_ids: int64 array ``[N]``.
        image_shape: ``(C, H, W)`` of the tensors :meth:`get_batch` returns.
    """

    name: str
    domains: list[str]
    classes: list[str]
    labels: np.ndarray
    domain_ids: np.ndarray
    image_shape: tuple[int, int, int]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def domain_index(self, domain: str) -> int:
        """Id of ``domain``; a clear error names the valid domains."""
        if domain not in self.domains:
            raise ValueError(f"unknown domain {domain!r} for {self.name}; expected one of {self.domains}")
        return self.domains.index(domain)

    @abstractmethod
    def get_batch(
        self, indices: np.ndarray, train: bool, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """Float images ``[B, C, H, W]`` (normalised) and int64 labels ``[B]``.

        ``train`` switches on the dataset's training augmentation, drawn from ``generator``
        so a client's batches are reproducible.
        """

    def counts(self) -> dict[str, dict[str, int]]:
        """Sample counts per domain and class, for ``feddg datasets``."""
        out: dict[str, dict[str, int]] = {}
        for d, dname in enumerate(self.domains):
            mask = self.domain_ids == d
            out[dname] = {c: int((self.labels[mask] == k).sum()) for k, c in enumerate(self.classes)}
        return out


def iterate_batches(
    dataset: DomainDataset,
    indices: np.ndarray,
    batch_size: int,
    *,
    shuffle: bool,
    train: bool,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield batches of ``dataset`` restricted to ``indices``.

    Shuffling and augmentation draw from ``generator`` only, so two runs with equally seeded
    generators see identical batches.
    """
    indices = np.asarray(indices, dtype=np.int64)
    if shuffle:
        order = torch.randperm(len(indices), generator=generator).numpy()
        indices = indices[order]
    stop = len(indices) - (len(indices) % batch_size if drop_last else 0)
    for start in range(0, stop, batch_size):
        chunk = indices[start : start + batch_size]
        if len(chunk) == 0:
            break
        yield dataset.get_batch(chunk, train=train, generator=generator)
