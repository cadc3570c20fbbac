"""Image transforms in plain torch (torchvision is not a dependency).

Each transform is a callable ``t(img, generator) -> img`` on a float ``[C, H, W]`` tensor in
``[0, 1]`` (``Normalize`` excepted, which ends a pipeline); all randomness is drawn from the
given ``torch.Generator`` so a client's augmentations are reproducible. :class:`BatchRandomCrop`
works on a whole ``[B, C, H, W]`` batch at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

Transform = Callable[[Tensor, torch.Generator | None], Tensor]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_GREY_WEIGHTS = (0.299, 0.587, 0.114)


def _uniform(low: float, high: float, generator: torch.Generator | None) -> float:
    return low + (high - low) * float(torch.rand((), generator=generator))


def _randint(high: int, generator: torch.Generator | None) -> int:
    """A uniform integer in ``[0, high)``."""
    return int(torch.randint(high, (), generator=generator))


def _size2(size: int | tuple[int, int]) -> tuple[int, int]:
    return (size, size) if isinstance(size, int) else size


def resize(img: Tensor, size: int | tuple[int, int]) -> Tensor:
    """Bilinear (antialiased) resize of ``[C, H, W]`` or ``[N, C, H, W]`` to ``size``; returns float."""
    x = img if img.dim() == 4 else img.unsqueeze(0)
    out = F.interpolate(x.float(), size=_size2(size), mode="bilinear", align_corners=False, antialias=True)
    return out if img.dim() == 4 else out.squeeze(0)


def grey(img: Tensor) -> Tensor:
    """Luma ``[1, H, W]`` of an RGB image (the image itself if it has one channel)."""
    if img.shape[0] == 1:
        return img
    w = torch.tensor(_GREY_WEIGHTS, dtype=img.dtype, device=img.device).view(3, 1, 1)
    return (img * w).sum(dim=0, keepdim=True)


class Compose:
    """Apply transforms in order, all drawing from one generator."""

    def __init__(self, *transforms: Transform) -> None:
        self.transforms = transforms

    def __call__(self, img: Tensor, generator: torch.Generator | None = None) -> Tensor:
        for t in self.transforms:
            img = t(img, generator)
        return img


class RandomResizedCrop:
    """Crop a random area fraction ``scale`` and aspect ratio ``ratio``, resize to ``size``.

    Same sampling as torchvision: ten tries, then a central crop of the nearest valid ratio.
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
    ) -> None:
        self.size = _size2(size)
        self.scale = scale
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))

    def box(self, height: int, width: int, generator: torch.Generator | None) -> tuple[int, int, int, int]:
        """``(top, left, h, w)`` of the crop."""
        area = height * width
        for _ in range(10):
            target = area * _uniform(*self.scale, generator)
            aspect = math.exp(_uniform(*self.log_ratio, generator))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                return _randint(height - h + 1, generator), _randint(width - w + 1, generator), h, w
        lo, hi = math.exp(self.log_ratio[0]), math.exp(self.log_ratio[1])
        if width / height < lo:
            w, h = width, round(width / lo)
        elif width / height > hi:
            h, w = height, round(height * hi)
        else:
            h, w = height, width
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img: Tensor, generator: torch.Generator | None = None) -> Tensor:
        top, left, h, w = self.box(img.shape[-2], img.shape[-1], generator)
        return resize(img[..., top : top + h, left : left + w], self.size)


class RandomHorizontalFlip:
    """Mirror left-right with probability ``p``."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = p

    def __call__(self, img: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return img.flip(-1) if float(torch.rand((), generator=generator)) < self.p else img


class ColorJitter:
    """Random brightness, contrast and saturation factors in ``[1 - s, 1 + s]``, applied in random order."""

    def __init__(self, brightness: float = 0.0, contrast: float = 0.0, saturation: float = 0.0) -> None:
        self.strengths = (brightness, contrast, saturation)

    @staticmethod
    def _apply(kind: int, img: Tensor, factor: float) -> Tensor:
        if kind == 0:
            other = torch.zeros_like(img)
        elif kind == 1:
            other = grey(img).mean().expand_as(img)
        else:
            other = grey(img).expand_as(img)
        return (factor * img + (1 - factor) * other).clamp(0.0, 1.0)

    def __call__(self, img: Tensor, generator: torch.Generator | None = None) -> Tensor:
        for kind in torch.randperm(3, generator=generator).tolist():
            s = self.strengths[kind]
            if s > 0:
                img = self._apply(kind, img, _uniform(max(0.0, 1 - s), 1 + s, generator))
        return img


class RandomGrayscale:
    """Replace every channel by the luma with probability ``p``."""

    def __init__(self, p: float = 0.1) -> None:
        self.p = p

    def __call__(self, img: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return grey(img).expand_as(img).clone() if float(torch.rand((), generator=generator)) < self.p else img


class Normalize:
    """``(img - mean) / std`` per channel."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, img: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return (img - self.mean) / self.std


class BatchRandomCrop:
    """Batched augmentation: zero-pad ``[B, C, H, W]`` by ``padding`` and crop each image at a random offset.

    Offsets are drawn on the CPU from ``generator``; the batch may live on any device.
    """

    def __init__(self, padding: int) -> None:
        self.padding = padding

    def __call__(self, batch: Tensor, generator: torch.Generator | None = None) -> Tensor:
        b, c, h, w = batch.shape
        p = self.padding
        padded = F.pad(batch, (p, p, p, p))
        dy, dx = torch.randint(2 * p + 1, (2, b, 1), generator=generator).to(batch.device)
        rows = (dy + torch.arange(h, device=batch.device)).view(b, 1, h, 1).expand(b, c, h, w + 2 * p)
        cols = (dx + torch.arange(w, device=batch.device)).view(b, 1, 1, w).expand(b, c, h, w)
        return padded.gather(2, rows).gather(3, cols)


def train_transform(size: int) -> Compose:
    """DomainBed's training augmentation, ImageNet-normalised (hue jitter left out)."""
    return Compose(
        RandomResizedCrop(size, scale=(0.7, 1.0)),
        RandomHorizontalFlip(),
        ColorJitter(0.3, 0.3, 0.3),
        RandomGrayscale(0.1),
        Normalize(IMAGENET_MEAN, IMAGENET_STD),
    )

