"""2.5-D slices of 3-D volumes from several sites (prostate MRI), for the segmentation task.

Every volume goes through :func:`slices_from_volumes`, the reference loaders' preprocessing (SAML, HarmoFL,
FedFA), whether it was read from NIfTI files (:mod:`feddg.data.prostate`) or drawn
(:mod:`feddg.data.synthetic_mri`): labels above 1 become 1; intensities are clipped at the volume's 99th
percentile and scaled to uint8 over ``[min, p99]``; slice ``i`` becomes a 3-channel image of slices ``i−1, i,
i+1``, for the slices that have both (the loaders' ``range(1, depth − 1)``); slices without foreground are dropped
(``drop_empty``); each slice is resized to the training resolution. A :class:`SliceDataset` holds the result as
uint8 arrays and slices batches from them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from feddg.data.base import DomainDataset
from feddg.data.cache import Arrays

#: a label at or above it is foreground (every structure of a multi-label mask is the one organ; a resampled mask's
#: 0.9999 and 1e-4 are 1 and 0); :func:`feddg.data.prostate.read_case` judges emptiness by the same rule
FOREGROUND = 0.5

CLASSES = ["background", "prostate"]
KEYS = ("images", "masks", "domain_ids", "cases", "mean", "std")
Volume = tuple[np.ndarray, np.ndarray]  # intensities and labels, [depth, H, W] each


def scale_intensities(volume: np.ndarray) -> np.ndarray:
    """uint8 ``volume`` clipped at its 99th percentile, ``[min, p99]`` mapped to ``0..255``."""
    v = np.asarray(volume, dtype=np.float32)
    lo, hi = float(v.min()), float(np.percentile(v, 99))
    if hi <= lo:
        return np.zeros(v.shape, dtype=np.uint8)
    return np.rint((np.clip(v, lo, hi) - lo) * (255.0 / (hi - lo))).astype(np.uint8)


def _resize(slices: np.ndarray, size: int, mode: str) -> np.ndarray:
    """uint8 ``[n, H, W]`` resized to ``[n, size, size]`` (``bilinear``, antialiased, or ``nearest-exact``)."""
    if slices.shape[1:] == (size, size):
        return slices
    x = torch.from_numpy(slices).float().unsqueeze(1)
    if mode == "bilinear":
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    else:
        x = F.interpolate(x, size=(size, size), mode=mode)
    return x.squeeze(1).round_().clamp_(0, 255).to(torch.uint8).numpy()


def slices_from_volumes(
    volumes: Mapping[str, Iterable[Volume]], image_size: int, drop_empty: bool
) -> Arrays:
    """The 2.5-D slices of every site's volumes, sites in the mapping's order, cases numbered globally in that order.

    Args:
        volumes: per site, ``(intensities, labels)`` volumes ``[depth, H, W]`` (slice axis first); any iterable,
            so a loader can read one case at a time.
        image_size: side of the square slices.
        drop_empty: keep only the slices whose labels have foreground (as the reference loaders do).

    Returns:
        ``images`` uint8 ``[N, 3, S, S]``, ``masks`` uint8 ``[N, S, S]``, int64 ``domain_ids`` and ``cases``, and the
        normalisation ``mean`` and ``std`` of the ``[0, 1]`` images, 0.5 per channel (:data:`KEYS`).
    """
    images, masks, domain_ids, cases = [], [], [], []
    case = 0
    for d, site_volumes in enumerate(volumes.values()):
        for volume, labels in site_volumes:
            if volume.ndim != 3 or volume.shape != labels.shape:
                raise ValueError(f"case {case}: volume {volume.shape} and labels {labels.shape} must be equal 3-D shapes")
            mask = (labels >= FOREGROUND).astype(np.uint8)
            inner = np.arange(1, len(mask) - 1)  # the first and last slices lack a neighbour: not samples
            keep = inner[mask[inner].any(axis=(1, 2))] if drop_empty else inner
            scaled = _resize(scale_intensities(volume), image_size, "bilinear")
            neighbours = np.stack([keep - 1, keep, keep + 1], axis=1)
            images.append(scaled[neighbours])
            masks.append(_resize(mask[keep], image_size, "nearest-exact"))
            domain_ids.append(np.full(len(keep), d, dtype=np.int64))
            cases.append(np.full(len(keep), case, dtype=np.int64))
            case += 1
    if not sum(len(c) for c in cases):
        raise ValueError("no slices: every volume was empty" + (" of foreground" if drop_empty else ""))
    out = {"images": np.concatenate(images), "masks": np.concatenate(masks),
           "domain_ids": np.concatenate(domain_ids), "cases": np.concatenate(cases)}
    # fixed, not measured: statistics over every site would carry the held-out site's into training (each volume is
    # already scaled to 0..255 by its own 99th percentile)
    out["mean"], out["std"] = np.full(3, 0.5), np.full(3, 0.5)
    return out


class SliceDataset(DomainDataset):
    """uint8 2.5-D slices ``[N, 3, S, S]`` with uint8 masks ``[N, S, S]`` (0 background, 1 prostate) of several sites.

    Attributes beyond :class:`DomainDataset`'s:
        images, masks: the uint8 arrays (possibly memory-mapped).
        cases: int64 ``[N]``, a global case id per slice: splits must keep a case's slices together (its neighbouring
            slices are in each other's channels).

    ``labels`` is 1 where a slice's mask has foreground, else 0. Training batches are augmented, image and mask
    together, from the batch's generator: by :attr:`augment` (``data.transforms``), ``hflip`` (left-right flips,
    p 1/2; the default) or ``rot90_flip`` (:func:`rot90_flip`, the papers' code's).
    """

    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: str = "hflip"

    task = "segmentation"
    inputs = "images"
    seeded_batches = True
    cases: np.ndarray  # always set: never None here

    def __init__(
        self,
        name: str,
        images: np.ndarray,
        masks: np.ndarray,
        domain_ids: np.ndarray,
        cases: np.ndarray,
        domains: list[str],
        mean: Sequence[float],
        std: Sequence[float],
    ) -> None:
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1] != 3 or images.shape[2] != images.shape[3]:
            raise ValueError(f"images must be uint8 [N, 3, S, S], got {images.dtype} {images.shape}")
        if masks.dtype != np.uint8 or masks.shape != (len(images), *images.shape[2:]):
            raise ValueError(f"masks must be uint8 {(len(images), *images.shape[2:])}, got {masks.dtype} {masks.shape}")
        if not len(images) == len(domain_ids) == len(cases):
            raise ValueError(f"{len(images)} slices but {len(domain_ids)} domain ids and {len(cases)} case ids")
        if len(mean) != 3 or len(std) != 3:
            raise ValueError(f"mean/std need 3 values, got {len(mean)} and {len(std)}")
        self.name = name
        self.images = images
        self.masks = masks
        self.domain_ids = np.asarray(domain_ids, dtype=np.int64)
        self.cases = np.asarray(cases, dtype=np.int64)
        self.labels = np.asarray(masks.any(axis=(1, 2)), dtype=np.int64)
        self.domains = list(domains)
        self.classes = list(CLASSES)
        self.image_shape = (3, int(images.shape[2]), int(images.shape[3]))
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        std_t = torch.tensor(self.std, dtype=torch.float32).view(1, -1, 1, 1)
        self._scale = 1.0 / std_t
        self._shift = torch.tensor(self.mean, dtype=torch.float32).view(1, -1, 1, 1) / std_t

    def subset(self, indices: np.ndarray, domains: list[str]) -> SliceDataset:
        """The slices at ``indices`` (in that order), which come from ``domains`` (a subset of :attr:`domains`)."""
        remap = np.full(len(self.domains), -1, dtype=np.int64)
        remap[[self.domains.index(d) for d in domains]] = np.arange(len(domains))
        domain_ids = remap[self.domain_ids[indices]]
        if (domain_ids < 0).any():
            raise ValueError(f"indices reach domains beyond {domains}")
        return SliceDataset(self.name, self.images[indices], self.masks[indices], domain_ids, self.cases[indices],
                            domains, self.mean, self.std).with_augment(self.augment)

    def with_augment(self, augment: str) -> SliceDataset:
        """This dataset (its arrays shared) with training augmentation ``augment`` (a key of :data:`AUGMENTS`)."""
        if augment not in AUGMENTS:
            raise ValueError(f"unknown slice augmentation {augment!r}; expected one of {', '.join(AUGMENTS)}")
        out = copy.copy(self)
        out.augment = augment
        return out

    @classmethod
    def from_arrays(cls, name: str, arrays: Arrays, domains: list[str]) -> SliceDataset:
        """The dataset of :func:`slices_from_volumes`' arrays (or their cache)."""
        return cls(name, arrays["images"], arrays["masks"], arrays["domain_ids"], arrays["cases"], domains,
                   arrays["mean"].tolist(), arrays["std"].tolist())

    def get_batch(
        self, indices: np.ndarray, train: bool, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor]:
        """Normalised float images ``[B, 3, S, S]`` and int64 masks ``[B, S, S]``."""
        idx = np.asarray(indices, dtype=np.int64)
        x = torch.from_numpy(np.ascontiguousarray(self.images[idx])).float().div_(255.0)
        y = torch.from_numpy(np.asarray(self.masks[idx], dtype=np.int64))
        if train:
            x, y = AUGMENTS[self.augment](x, y, generator)
        return x.mul_(self._scale).sub_(self._shift), y


def hflip(x: Tensor, y: Tensor, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Each slice ``x [B, C, S, S]`` and its mask ``y [B, S, S]`` flipped left-right with probability 1/2."""
    flip = torch.rand(len(y), generator=generator) < 0.5
    x[flip] = x[flip].flip(-1)
    y[flip] = y[flip].flip(-1)
    return x, y


def rot90_flip(x: Tensor, y: Tensor, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """HarmoFL's and FedFA's prostate training augmentation (HarmoFL ``utils/dataset.py``: ``RandomRotate90`` then
    ``RandomFlip(0.75)``), per slice: a rotation by ``k``·90° with ``k`` uniform over Python's inclusive
    ``randint(0, 4)`` (0 and 4 are both the identity: 2/5 of the slices stay upright), then with probability 0.75
    a flip of the rows, the columns or both, uniformly (``cv2.flip`` codes 0, 1, −1)."""
    n = len(y)
    k = torch.randint(0, 5, (n,), generator=generator)
    flip = torch.rand(n, generator=generator) < 0.75
    how = torch.randint(0, 3, (n,), generator=generator)
    return rotate_and_flip(x, y, k, torch.where(flip, how, -1))


def rotate_and_flip(x: Tensor, y: Tensor, k: Tensor, flip: Tensor) -> tuple[Tensor, Tensor]:
    """Slice ``i`` rotated by ``k[i]``·90° in the image plane (``np.rot90``'s direction), then flipped: its rows for
    ``flip[i] == 0``, its columns for 1, both for 2, not at all for −1; the mask moves with it."""
    for turns in (1, 2, 3):
        sel = k == turns
        x[sel] = torch.rot90(x[sel], turns, (-2, -1))
        y[sel] = torch.rot90(y[sel], turns, (-2, -1))
    for code, dims in ((0, (-2,)), (1, (-1,)), (2, (-2, -1))):
        sel = flip == code
        x[sel] = x[sel].flip(dims)
        y[sel] = y[sel].flip(dims)
    return x, y


#: ``data.transforms`` of the slice datasets -> the training augmentation of a batch
AUGMENTS = {"hflip": hflip, "rot90_flip": rot90_flip}
