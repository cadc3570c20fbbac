"""Batched training augmentation on tensors: one call transforms a whole ``[B, C, H, W]`` batch.

Every random number is drawn from the given ``torch.Generator`` in a fixed order and count per
batch, so a batch is a pure function of (images, generator state). Geometry runs on the uint8
images: the random-resized crop keeps torchvision's sampling (ten tries, then a central crop) and
resamples each crop bilinearly (crops only enlarge, so no antialiasing is needed). Colour jitter
and grayscale are linear in the pixels, so each image's whole sequence of them (brightness,
contrast and saturation in a random order, then grayscale) is composed into one map
``a·x + b·luma(x) + c`` applied in a single pass and clamped to ``[0, 1]`` once (torchvision clamps
after each factor; the two differ for an image in which some pixel is pushed past 0 or 1 midway, then in all of
its pixels through the contrast mean: common with natural photos, docs/data.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from feddg.data.transform_spec import TransformSpec
from feddg.data.transforms import BatchRandomCrop
from feddg.numerics import sqrt

_LUMA = (0.299, 0.587, 0.114)
_TRIES = 10


def batch_grey(x: Tensor) -> Tensor:
    """Luma ``[B, 1, H, W]`` of an RGB batch (a copy of the batch if it has one channel)."""
    if x.shape[1] == 1:
        return x.clone()
    r, g, b = x.unbind(1)
    return (r * _LUMA[0]).add_(g, alpha=_LUMA[1]).add_(b, alpha=_LUMA[2]).unsqueeze(1)


def _uniform(lo: float, hi: float, shape: tuple[int, ...], generator: torch.Generator | None) -> Tensor:
    return lo + (hi - lo) * torch.rand(shape, generator=generator, dtype=torch.float64)


def crop_boxes(
    b: int, height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float],
    generator: torch.Generator | None,
) -> Tensor:
    """``[B, 4]`` int64 ``(top, left, h, w)`` boxes, sampled as :class:`feddg.data.transforms.RandomResizedCrop`."""
    area = height * width
    target = area * _uniform(*scale, (b, _TRIES), generator)
    aspect = torch.exp(_uniform(math.log(ratio[0]), math.log(ratio[1]), (b, _TRIES), generator))
    w = torch.round(sqrt(target * aspect)).long()
    h = torch.round(sqrt(target / aspect)).long()
    ok = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = ok.long().argmax(1, keepdim=True)
    w, h = w.gather(1, first).squeeze(1), h.gather(1, first).squeeze(1)
    lo, hi = ratio
    if width / height < lo:
        fw, fh = width, round(width / lo)
    elif width / height > hi:
        fw, fh = round(height * hi), height
    else:
        fw, fh = width, height
    found = ok.any(1)
    w, h = torch.where(found, w, fw), torch.where(found, h, fh)
    u = torch.rand((2, b), generator=generator, dtype=torch.float64)
    top = torch.where(found, (u[0] * (height - h + 1)).long(), (height - h) // 2)
    left = torch.where(found, (u[1] * (width - w + 1)).long(), (width - w) // 2)
    return torch.stack([top, left, h, w], dim=1)


def resized_crops(x: Tensor, boxes: Tensor, size: tuple[int, int], flip: Tensor | None = None) -> Tensor:
    """Each image's box ``(top, left, h, w)`` resized bilinearly to ``size``, mirrored where ``flip`` (bool
    ``[B]``) is set; same dtype, contiguous. Channels-last uint8 input is torch's fastest resize (3×)."""
    out = x.new_empty((x.shape[0], x.shape[1], *size))
    for i, (top, left, h, w) in enumerate(boxes.tolist()):
        crop = x[i : i + 1, :, top : top + h, left : left + w]
        img = crop if (h, w) == size else F.interpolate(crop, size=size, mode="bilinear", align_corners=False)
        out[i] = img[0].flip(-1) if flip is not None and flip[i] else img[0]
    return out


def colour_maps(
    b: int, jitter: tuple[float, float, float], grayscale: float, generator: torch.Generator | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-image ``(a, l, m)`` ``[B]`` of the map ``x -> a·x + l·luma(x) + m·mean(luma(x))`` composing the
    jitter factors (in a random order per image) and grayscale; luma of a grey image is itself."""
    a, lum, mean = torch.ones(b), torch.zeros(b), torch.zeros(b)
    if any(jitter):
        u = torch.rand((b, 3), generator=generator)
        order = torch.rand((b, 3), generator=generator).argsort(dim=1)
        for step in range(3):
            for kind, strength in enumerate(jitter):
                lo = max(0.0, 1.0 - strength)
                f = torch.where(order[:, step] == kind, lo + (1.0 + strength - lo) * u[:, kind], torch.ones(b))
                if kind == 0:  # brightness: f·x'
                    a, lum, mean = f * a, f * lum, f * mean
                elif kind == 1:  # contrast: f·x' + (1 - f)·mean(luma(x')), mean(luma(x')) = (a + l + m)·mean
                    a, lum, mean = f * a, f * lum, mean + (1 - f) * (a + lum)
                else:  # saturation: f·x' + (1 - f)·luma(x'), luma(x') = (a + l)·luma + m·mean
                    a, lum = f * a, f * lum + (1 - f) * (a + lum)
    if grayscale:
        grey = torch.rand(b, generator=generator) < grayscale
        a, lum = torch.where(grey, 0.0, a), torch.where(grey, a + lum, lum)
    return a, lum, mean


class BatchAugment:
    """The augmentation of a :class:`TransformSpec` for batches ``[B, C, H, W]`` of uint8 (or floats in
    ``[0, 1]``); colour transforms return floats in ``[0, 1]``, geometric ones keep the dtype.

    Order as DomainBed: random-resized crop (to the batch's own size) with horizontal flip, pad-crop,
    colour jitter, grayscale.
    """

    def __init__(self, spec: TransformSpec) -> None:
        self.spec = spec
        self._pad_crop = BatchRandomCrop(spec.pad_crop) if spec.pad_crop else None

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        s = self.spec
        b, _, height, width = x.shape
        boxes = crop_boxes(b, height, width, s.crop_scale, s.crop_ratio, generator) if s.crop_scale else None
        flip = torch.rand(b, generator=generator) < s.flip if s.flip else None
        if boxes is not None:
            x = resized_crops(x, boxes, (height, width), flip)
        elif flip is not None:
            x = torch.where(flip.view(-1, 1, 1, 1).to(x.device), x.flip(-1), x)
        if self._pad_crop is not None:
            x = self._pad_crop(x, generator)
        if not any(s.jitter) and not s.grayscale:
            return x  # uint8 stays uint8: the dataset scales it exactly as an evaluation batch
        scale = 1 / 255 if x.dtype == torch.uint8 else 1.0
        x = x.contiguous().float() if x.dtype == torch.uint8 else x.contiguous().clone()  # never the caller's
        a, lum, mean = (t.to(x.device).view(-1, 1, 1, 1) for t in colour_maps(b, s.jitter, s.grayscale, generator))
        luma = batch_grey(x)
        level = luma.mean((1, 2, 3), keepdim=True)
        shift = luma.mul_(lum * scale).add_(level * mean * scale)
        return x.mul_(a * scale).add_(shift).clamp_(0.0, 1.0)  # in place: 4× faster than a broadcast addcmul
