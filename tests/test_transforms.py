"""Tests of the torch-only image transforms (feddg.data.transforms)."""

from __future__ import annotations

import pytest
import torch

from feddg.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BatchRandomCrop,
    ColorJitter,
    Normalize,
    RandomGrayscale,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    eval_transform,
    resize,
    train_transform,
)


def _img(seed: int = 0, c: int = 3, h: int = 20, w: int = 30) -> torch.Tensor:
    return torch.rand(c, h, w, generator=torch.Generator().manual_seed(seed))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_resize_shapes_and_constant_image() -> None:
    assert resize(_img(), 8).shape == (3, 8, 8)
    assert resize(_img(), (10, 12)).shape == (3, 10, 12)
    batch = torch.full((2, 3, 9, 9), 200, dtype=torch.uint8)
    out = resize(batch, 16)
    assert out.shape == (2, 3, 16, 16) and out.dtype == torch.float32
    assert torch.allclose(out, torch.full_like(out, 200.0))
    assert Resize(5)(_img()).shape == (3, 5, 5)


def test_random_resized_crop_box_respects_scale_and_ratio() -> None:
    crop = RandomResizedCrop(16, scale=(0.7, 1.0))
    g = _gen(0)
    for _ in range(200):
        top, left, h, w = crop.box(100, 120, g)
        assert 0 <= top and top + h <= 100 and 0 <= left and left + w <= 120
        assert 0.6 <= h * w / (100 * 120) <= 1.0
        assert 3 / 4 - 0.05 <= w / h <= 4 / 3 + 0.05
    assert crop(_img(), _gen(1)).shape == (3, 16, 16)


def test_random_resized_crop_falls_back_to_centre() -> None:
    crop = RandomResizedCrop(4, scale=(0.99, 1.0), ratio=(1.0, 1.0))
    assert crop.box(10, 40, _gen(0)) == (0, 15, 10, 10)


def test_random_resized_crop_is_seeded() -> None:
    crop = RandomResizedCrop(12, scale=(0.3, 1.0))
    img = _img()
    assert torch.equal(crop(img, _gen(5)), crop(img, _gen(5)))
    assert not torch.equal(crop(img, _gen(5)), crop(img, _gen(6)))


def test_flip() -> None:
    img = _img()
    assert torch.equal(RandomHorizontalFlip(1.0)(img, _gen(0)), img.flip(-1))
    assert torch.equal(RandomHorizontalFlip(0.0)(img, _gen(0)), img)
    flips = sum(not torch.equal(RandomHorizontalFlip()(img, g), img) for g in [_gen(0)] for _ in range(200))
    assert 60 < flips < 140


def test_color_jitter() -> None:
    img = _img()
    assert torch.equal(ColorJitter()(img, _gen(0)), img)
    out = ColorJitter(0.3, 0.3, 0.3)(img, _gen(0))
    assert out.shape == img.shape and out.min() >= 0 and out.max() <= 1
    assert not torch.allclose(out, img)
    grey = _img(c=1).expand(3, -1, -1).clone()
    assert torch.allclose(ColorJitter(saturation=0.9)(grey, _gen(3)), grey, atol=1e-6)
    bright = ColorJitter(brightness=0.5)
    ratios = [(bright(img * 0.5, _gen(s)) / (img * 0.5)).median().item() for s in range(20)]
    assert all(0.5 - 1e-4 <= r <= 1.5 + 1e-4 for r in ratios) and max(ratios) - min(ratios) > 0.2


def test_random_grayscale() -> None:
    img = _img()
    out = RandomGrayscale(1.0)(img, _gen(0))
    assert torch.equal(out[0], out[1]) and torch.equal(out[1], out[2])
    assert torch.equal(RandomGrayscale(0.0)(img, _gen(0)), img)


def test_normalize() -> None:
    img = torch.full((3, 2, 2), 0.5)
    out = Normalize(IMAGENET_MEAN, IMAGENET_STD)(img)
    expected = torch.tensor([(0.5 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD, strict=True)])
    assert torch.allclose(out[:, 0, 0], expected)


def test_presets() -> None:
    img = _img(h=40, w=50)
    train = train_transform(24)
    a, b = train(img, _gen(0)), train(img, _gen(0))
    assert a.shape == (3, 24, 24) and torch.equal(a, b)
    assert not torch.equal(a, train(img, _gen(1)))
    ev = eval_transform(24)(img, _gen(0))
    manual = (resize(img, 24) - torch.tensor(IMAGENET_MEAN).view(3, 1, 1)) / torch.tensor(IMAGENET_STD).view(3, 1, 1)
    assert torch.allclose(ev, manual)
    assert torch.equal(ev, eval_transform(24)(img, _gen(9))), "eval is deterministic"


@pytest.mark.parametrize("padding", [1, 3])
def test_batch_random_crop_is_a_shifted_window(padding: int) -> None:
    batch = torch.rand(16, 3, 10, 10, generator=_gen(0)) + 0.1
    out = BatchRandomCrop(padding)(batch, _gen(1))
    assert out.shape == batch.shape
    padded = torch.nn.functional.pad(batch, (padding,) * 4)
    offsets = set()
    for i in range(len(batch)):
        found = [(dy, dx) for dy in range(2 * padding + 1) for dx in range(2 * padding + 1)
                 if torch.equal(out[i], padded[i, :, dy : dy + 10, dx : dx + 10])]
        assert found, f"image {i} is not a crop of its padded input"
        offsets.add(found[0])
    assert len(offsets) > 1
    assert torch.equal(out, BatchRandomCrop(padding)(batch, _gen(1)))
