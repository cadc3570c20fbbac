"""Tests of the 2.5-D slices (feddg.data.slices): resizing, refusals, SliceDataset's checks, subsets and flips."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feddg.data.slices import SliceDataset, hflip, scale_intensities, slices_from_volumes

DOMAINS = ["a", "b", "c"]


def _dataset(domain_ids: list[int], size: int = 2) -> SliceDataset:
    """Slice ``i`` is filled with the value ``i`` (its mask with ``i % 2``): a subset shows which slices it took."""
    n = len(domain_ids)
    images = np.broadcast_to(np.arange(n, dtype=np.uint8)[:, None, None, None], (n, 3, size, size)).copy()
    masks = np.broadcast_to((np.arange(n) % 2).astype(np.uint8)[:, None, None], (n, size, size)).copy()
    return SliceDataset("toy", images, masks, np.array(domain_ids), np.arange(n), DOMAINS, [0.5] * 3, [0.5] * 3)


def _columns(pattern: list[float], depth: int = 3) -> np.ndarray:
    """A ``[depth, 4, 4]`` volume whose every row is ``pattern``."""
    return np.broadcast_to(np.asarray(pattern, dtype=np.float32), (depth, 4, 4)).copy()


def test_downsampled_images_are_antialiased_and_masks_take_the_nearest_exact_pixel() -> None:
    # columns 255, 255, 0, 0 (scaled: p99 is the 255 level) halved: the antialiased bilinear (triangle filter of
    # width 2 per output pixel, PIL's) weighs columns (0, 1, 2) by (3, 3, 1)/7 and (1, 2, 3) by (1, 3, 3)/7, then
    # rounds (218.57 -> 219); plain bilinear would average the two nearest columns (255 and 0)
    volume = _columns([70.0, 70.0, 0.0, 0.0])
    labels = _columns([0, 1, 0, 1])  # nearest-exact takes source columns floor((i + 0.5) * 2) = 1, 3: both 1
    out = slices_from_volumes({"site": [(volume, labels)]}, image_size=2, drop_empty=True)
    want = np.rint(255.0 * np.array([6.0, 1.0]) / 7.0)
    assert out["images"].shape == (1, 3, 2, 2) and out["images"].dtype == np.uint8
    assert np.array_equal(out["images"][0], np.broadcast_to(want, (3, 2, 2)))
    assert np.array_equal(out["masks"], np.ones((1, 2, 2), np.uint8))


def test_a_constant_volume_scales_to_zeros() -> None:
    scaled = scale_intensities(np.full((3, 4, 4), 7.0))
    assert scaled.dtype == np.uint8 and not scaled.any()


@pytest.mark.parametrize("inside,outside", [(0.9999, 1e-4), (0.5, 0.4999), (2.0, -1.0)])
def test_a_label_at_or_above_one_half_is_foreground(inside: float, outside: float) -> None:
    # a resampled mask reads 0.9999 inside the gland and 1e-4 outside: 1 and 0, not truncated; 0.5 is foreground, as
    # prostate.read_case counts it (np.rint made it 0); a second structure (2) is the same organ
    labels = np.where(_columns([0, 1, 1, 0]) > 0, inside, outside)
    out = slices_from_volumes({"site": [(_columns([1.0, 2.0, 3.0, 4.0]), labels)]}, image_size=4, drop_empty=True)
    assert np.array_equal(out["masks"][0], np.broadcast_to(np.array([0, 1, 1, 0], np.uint8), (4, 4)))


@pytest.mark.parametrize(
    "volume,labels,drop_empty,match",
    [
        (np.zeros((3, 4, 4)), np.zeros((3, 4, 5)), True, r"^case 0: volume \(3, 4, 4\) and labels \(3, 4, 5\) must"),
        (np.zeros((4, 4)), np.zeros((4, 4)), False, "must be equal 3-D shapes"),
        (np.zeros((5, 4, 4)), np.zeros((5, 4, 4)), True, "^no slices: every volume was empty of foreground$"),
        (np.zeros((2, 4, 4)), np.ones((2, 4, 4)), False, "^no slices: every volume was empty$"),  # no inner slice
    ],
)
def test_slices_from_volumes_refuses(volume: np.ndarray, labels: np.ndarray, drop_empty: bool, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        slices_from_volumes({"site": [(volume, labels)]}, image_size=4, drop_empty=drop_empty)


def test_slice_dataset_refuses_arrays_of_the_wrong_kind() -> None:
    good = _dataset([0, 1])
    images, masks, ids, cases = good.images, good.masks, good.domain_ids, good.cases
    with pytest.raises(ValueError, match="images must be uint8"):
        SliceDataset("toy", images.astype(np.float32), masks, ids, cases, DOMAINS, [0.5] * 3, [0.5] * 3)
    with pytest.raises(ValueError, match="images must be uint8"):
        SliceDataset("toy", images[:, :2], masks, ids, cases, DOMAINS, [0.5] * 3, [0.5] * 3)
    with pytest.raises(ValueError, match="masks must be uint8"):
        SliceDataset("toy", images, masks.astype(np.int64), ids, cases, DOMAINS, [0.5] * 3, [0.5] * 3)
    with pytest.raises(ValueError, match="^2 slices but 1 domain ids and 2 case ids$"):
        SliceDataset("toy", images, masks, ids[:1], cases, DOMAINS, [0.5] * 3, [0.5] * 3)
    with pytest.raises(ValueError, match="^mean/std need 3 values, got 3 and 1$"):
        SliceDataset("toy", images, masks, ids, cases, DOMAINS, [0.5] * 3, [0.5])


def test_a_subset_renumbers_its_domains_in_the_order_given_and_keeps_the_augmentation() -> None:
    ds = _dataset([0, 2, 1, 2, 0]).with_augment("rot90_flip")
    sub = ds.subset(np.array([3, 0, 1]), ["c", "a"])
    assert sub.domains == ["c", "a"] and sub.domain_ids.tolist() == [0, 1, 0]  # c -> 0, a -> 1
    assert sub.images[:, 0, 0, 0].tolist() == [3, 0, 1] and sub.cases.tolist() == [3, 0, 1]
    assert sub.labels.tolist() == [1, 0, 1] and sub.augment == "rot90_flip"
    with pytest.raises(ValueError, match=r"^indices reach domains beyond \['c', 'a'\]$"):
        ds.subset(np.array([0, 2]), ["c", "a"])  # slice 2 is domain b


def test_an_unknown_augmentation_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown slice augmentation 'vflip'"):
        _dataset([0]).with_augment("vflip")


def test_hflip_flips_half_of_the_slices() -> None:
    n = 4000
    x = torch.tensor([0.0, 1.0]).expand(n, 1, 1, 2).clone()
    _, y = hflip(x.clone(), x[:, 0].clone().long(), torch.Generator().manual_seed(0))
    flipped = int((y[:, 0, 0] == 1).sum())
    assert abs(flipped - n / 2) < 5 * np.sqrt(n / 4)  # binomial(n, 1/2) within 5 standard deviations
