"""Tests of the torch-only image transforms (feddg.data.transforms)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feddg.config import ConfigError, build_config
from feddg.data import load_dataset
from feddg.data.augment import BatchAugment, crop_boxes, resized_crops
from feddg.data.registry import default_transforms
from feddg.data.transform_spec import PRESETS as TRANSFORM_PRESETS
from feddg.data.transform_spec import TransformSpec, parse_transforms
from feddg.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BatchRandomCrop,
    ColorJitter,
    Normalize,
    RandomGrayscale,
    RandomHorizontalFlip,
    RandomResizedCrop,
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


# --- batched augmentation and the transform spec (data.transforms) ---


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ({"flip": 2}, "transforms.flip must be a probability in [0, 1], got 2"),
        ({"flips": 0.5}, "unknown key 'flips'"),
        ("domainbedd", "unknown transforms preset 'domainbedd'"),
        ({"crop_scale": [0.9, 0.2]}, "transforms.crop_scale must be [lo, hi]"),
        ({"jitter": [0.1, 0.2]}, "transforms.jitter must be 3 numbers"),
        ({"pad_crop": 1.5}, "transforms.pad_crop must be an integer"),
        ({"std": [0.5, 0, 0.5]}, "transforms.std must be > 0"),
        ({"mean": [0.5], "std": [0.5, 0.5]}, "mean and std need as many values"),
        (3, "must be a preset name"),
    ],
)
def test_spec_errors_are_one_line_with_the_key(value: object, fragment: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_transforms(value)
    assert fragment in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_config_validates_transforms() -> None:
    with pytest.raises(ConfigError, match=r"^data: transforms\.flip must be a probability"):
        build_config({}, ["data.transforms.flip=yes"])
    cfg = build_config({}, ["data.transforms.preset=domainbed", "data.transforms.flip=0"])
    assert parse_transforms(cfg.data.transforms).flip == 0 and parse_transforms(cfg.data.transforms).crop_scale


def test_spec_presets_and_overrides() -> None:
    base = TransformSpec(mean=(0.1,), std=(0.2,))
    assert parse_transforms(None, base) == base
    none = parse_transforms("none", TRANSFORM_PRESETS["domainbed"])
    assert not none.augments and none.mean == IMAGENET_MEAN, "'none' drops augmentation, keeps the statistics"
    spec = parse_transforms({"preset": "domainbed", "flip": 0, "jitter": 0.1, "crop_scale": None}, base)
    assert spec.flip == 0 and spec.jitter == (0.1,) * 3 and spec.crop_scale is None and spec.grayscale == 0.1
    assert spec.mean == IMAGENET_MEAN


def test_digits_get_no_augmentation_by_default(cache_dir) -> None:
    assert default_transforms("digits-dg") == TransformSpec(mean=(0.5,) * 3, std=(0.5,) * 3)
    ds = load_dataset("digits-dg", cache_dir=cache_dir, max_per_domain=40)
    idx = np.arange(0, len(ds), 7)
    g = _gen(0)
    assert torch.equal(ds.get_batch(idx, train=True, generator=g)[0], ds.get_batch(idx, train=False)[0])
    flipped = load_dataset("digits-dg", cache_dir=cache_dir, max_per_domain=40, transforms={"flip": 1.0})
    assert torch.equal(flipped.get_batch(idx, train=True, generator=g)[0], ds.get_batch(idx, train=False)[0].flip(-1))
    with pytest.raises(ValueError, match="rotated-mnist: transforms mean/std need 1 values"):
        load_dataset("rotated-mnist", cache_dir=cache_dir, transforms="digits")


def test_batch_crop_boxes_and_identity_crop() -> None:
    boxes = crop_boxes(500, 40, 60, (0.3, 1.0), (3 / 4, 4 / 3), _gen(0))
    top, left, h, w = boxes.T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= 40).all() and (left + w <= 60).all()
    area = (h * w).double() / (40 * 60)
    assert area.min() >= 0.29 and area.max() <= 1.0 and area.std() > 0.1
    assert torch.equal(boxes, crop_boxes(500, 40, 60, (0.3, 1.0), (3 / 4, 4 / 3), _gen(0)))
    assert crop_boxes(3, 10, 40, (0.99, 1.0), (1.0, 1.0), _gen(0)).tolist() == [[0, 15, 10, 10]] * 3
    x = torch.rand(4, 3, 16, 16, generator=_gen(1))
    full = torch.tensor([[0, 0, 16, 16]] * 4)
    assert torch.allclose(resized_crops(x, full, (16, 16)), x, atol=1e-5)
    corner = resized_crops(x, torch.tensor([[0, 0, 8, 8]] * 4), (8, 8))
    assert torch.allclose(corner, x[..., :8, :8], atol=1e-5)


def test_batch_augment_is_seeded_and_keeps_range() -> None:
    x = torch.rand(8, 3, 24, 24, generator=_gen(0))
    aug = BatchAugment(TRANSFORM_PRESETS["domainbed"])
    a, b, c = aug(x, _gen(1)), aug(x, _gen(1)), aug(x, _gen(2))
    assert a.shape == x.shape and torch.equal(a, b) and not torch.equal(a, c)
    assert a.min() >= 0 and a.max() <= 1
    flip = BatchAugment(TransformSpec(flip=1.0))(x, _gen(0))
    assert torch.equal(flip, x.flip(-1))
    grey = BatchAugment(TransformSpec(grayscale=1.0))(x, _gen(0))
    assert torch.equal(grey[:, 0], grey[:, 1]) and torch.equal(grey[:, 1], grey[:, 2])
    bright = BatchAugment(TransformSpec(jitter=(0.5, 0.0, 0.0)))(x * 0.5, _gen(0))
    ratios = (bright / (x * 0.5)).flatten(1).median(1).values
    assert ((ratios >= 0.5 - 1e-4) & (ratios <= 1.5 + 1e-4)).all() and ratios.max() - ratios.min() > 0.2
    shifted = BatchAugment(TransformSpec(pad_crop=2))(x, _gen(0))
    assert torch.equal(shifted, BatchRandomCrop(2)(x, _gen(0)))


@pytest.mark.parametrize("grayscale", [0.0, 1.0])
def test_composed_colour_map_equals_sequential_jitter(grayscale: float) -> None:
    x = 0.35 + 0.2 * torch.rand(6, 3, 5, 7, generator=_gen(0))  # no factor sequence pushes these past 0 or 1
    before = x.clone()
    out = BatchAugment(TransformSpec(jitter=(0.2, 0.2, 0.2), grayscale=grayscale))(x, _gen(3))
    assert torch.equal(x, before), "the input batch is not modified"
    g = _gen(3)
    u, order = torch.rand((6, 3), generator=g), torch.rand((6, 3), generator=g).argsort(dim=1)
    for i in range(6):
        img = x[i]
        for kind in order[i].tolist():
            img = ColorJitter._apply(kind, img, 0.8 + 0.4 * float(u[i, kind]))
        want = RandomGrayscale(grayscale)(img, _gen(0)) if grayscale else img
        assert torch.allclose(out[i], want, atol=1e-5), i
