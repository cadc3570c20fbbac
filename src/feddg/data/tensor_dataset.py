"""A :class:`DomainDataset` held in memory as one uint8 image tensor (the built-in benchmarks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from feddg.data.base import DomainDataset

BatchAugment = Callable[[Tensor, torch.Generator | None], Tensor]


class TensorDomainDataset(DomainDataset):
    """uint8 images ``[N, C, H, W]`` (any strides) with labels and domain ids; batches are sliced, not looped.

    Args:
        name: registry name.
        images: uint8 tensor ``[N, C, H, W]``.
        labels: int64 ``[N]`` indices into ``classes``.
        domain_ids: int64 ``[N]`` indices into ``domains``.
        domains: domain names.
        classes: class names.
        mean: per-channel mean of the ``[0, 1]`` images, subtracted by :meth:`get_batch`.
        std: per-channel standard deviation, divided by.
        augment: optional batched training augmentation, applied when ``train`` is true: it takes the
            uint8 batch ``[B, C, H, W]`` and returns uint8 or floats in ``[0, 1]`` (e.g.
            :class:`feddg.data.transforms.BatchRandomCrop`, :class:`feddg.data.augment.BatchAugment`).
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __init__(
        self,
        name: str,
        images: Tensor,
        labels: np.ndarray,
        domain_ids: np.ndarray,
        domains: list[str],
        classes: list[str],
        mean: Sequence[float],
        std: Sequence[float],
        augment: BatchAugment | None = None,
    ) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be a uint8 tensor [N, C, H, W], got {images.dtype} {tuple(images.shape)}")
        if not len(images) == len(labels) == len(domain_ids):
            raise ValueError(f"{len(images)} images but {len(labels)} labels and {len(domain_ids)} domain ids")
        channels = images.shape[1]
        if len(mean) != channels or len(std) != channels:
            raise ValueError(f"mean/std need {channels} values, got {len(mean)} and {len(std)}")
        self.name = name
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.domain_ids = np.asarray(domain_ids, dtype=np.int64)
        self.domains = list(domains)
        self.classes = list(classes)
        self.image_shape = (channels, int(images.shape[2]), int(images.shape[3]))
        self.augment = augment
        self.seeded_batches = augment is not None
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(v) for v in std)
        std_t = torch.tensor(self.std, dtype=torch.float32).view(1, -1, 1, 1)
        self._scale = 1.0 / std_t
        self._shift = torch.tensor(self.mean, dtype=torch.float32).view(1, -1, 1, 1) / std_t

    @classmethod
    def from_parts(
        cls,
        name: str,
        parts: Sequence[tuple[np.ndarray, np.ndarray]],
        domains: list[str],
        classes: list[str],
        mean: Sequence[float],
        std: Sequence[float],
    ) -> TensorDomainDataset:
        """Concatenate one uint8 ``(images, labels)`` pair per domain, in the order of ``domains``."""
        images = torch.from_numpy(np.concatenate([x for x, _ in parts]))
        labels = np.concatenate([y for _, y in parts])
        domain_ids = np.concatenate([np.full(len(y), d, dtype=np.int64) for d, (_, y) in enumerate(parts)])
        return cls(name, images, labels, domain_ids, domains, classes, mean, std)

    def _rows(self, idx: Tensor) -> Tensor:
        """``images[idx]``, keeping channels-last images channels-last (whole-row copies, no transpose)."""
        nhwc = self.images.permute(0, 2, 3, 1)
        if self.images.shape[1] > 1 and nhwc.is_contiguous():
            return torch.index_select(nhwc, 0, idx).permute(0, 3, 1, 2)
        return torch.index_select(self.images, 0, idx)

    def get_batch(
        self, indices: np.ndarray, train: bool, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        x = self._rows(idx)
        if train and self.augment is not None:
            x = self.augment(x, generator)
        x = x.contiguous()  # channels-last images (folder caches) are transposed while one byte a pixel
        x = x.float().div_(255.0) if x.dtype == torch.uint8 else x
        x = x.mul_(self._scale).sub_(self._shift)
        return x, torch.from_numpy(self.labels[idx.numpy()])
