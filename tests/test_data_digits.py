"""Tests of the built-in benchmarks: Digits-DG, Rotated MNIST, Colored MNIST, and their cache."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from feddg.data import dataset_info, digits, iterate_batches, list_datasets, load_dataset, mnist_variants
from feddg.data.cache import cache_file
from feddg.data.tensor_dataset import TensorDomainDataset
from feddg.data.transforms import BatchRandomCrop

COUNTS = {"mnist": 2500, "uci": 1797, "synth": 5000, "mnistm": 2500}


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TensorDomainDataset, float]:
    """Digits-DG built once into a fresh cache: the folder, the dataset and the build time."""
    folder = tmp_path_factory.mktemp("feddg-cache")
    start = time.perf_counter()
    ds = load_dataset("digits-dg", cache_dir=folder)
    assert isinstance(ds, TensorDomainDataset)
    return folder, ds, time.perf_counter() - start


def _domain(ds: TensorDomainDataset, name: str) -> tuple[np.ndarray, np.ndarray]:
    mask = ds.domain_ids == ds.domain_index(name)
    return ds.images.numpy()[mask], ds.labels[mask]


def test_digits_shapes_counts_and_balance(built) -> None:
    _, ds, _ = built
    assert ds.domains == ["mnist", "uci", "synth", "mnistm"]
    assert ds.classes == [str(d) for d in range(10)]
    assert ds.image_shape == (3, 28, 28)
    assert ds.images.dtype == torch.uint8 and tuple(ds.images.shape) == (len(ds), 3, 28, 28)
    assert ds.labels.dtype == np.int64 and ds.domain_ids.dtype == np.int64
    counts = ds.counts()
    assert {d: sum(c.values()) for d, c in counts.items()} == COUNTS
    assert set(counts["synth"].values()) == {500}
    for d in ("mnist", "mnistm"):
        assert set(counts[d].values()) == {250}
    assert min(counts["uci"].values()) >= 170 and max(counts["uci"].values()) <= 185


def test_mnist_and_mnistm_hold_disjoint_digits(built, monkeypatch: pytest.MonkeyPatch) -> None:
    """Holding one out must not train on its digits in the other's style (v1 blended the same 5,000 into mnistm):
    each domain's images are recovered to their MNIST 5k index through the digit's ink mask."""
    _, ds, _ = built
    digits_all, labels_all = digits.mnist5k()
    index_of = {(d > 0).tobytes(): i for i, d in enumerate(digits_all)}
    assert len(index_of) == len(digits_all), "ink masks identify the digits"
    mnist, y_mnist = _domain(ds, "mnist")
    in_mnist = [index_of[(x[0] > 0).tobytes()] for x in mnist]
    np.testing.assert_array_equal(labels_all[in_mnist], y_mnist)
    # on a black photo (every patch flat, so the texture threshold is lifted) the blend is 255 × the ink mask
    monkeypatch.setattr(digits, "_photos", lambda: [np.zeros((40, 40, 3), np.uint8)])
    monkeypatch.setattr(digits, "MNISTM_MIN_STD", 0.0)
    mnistm, y_mnistm = digits.build_mnistm(0)
    assert set(np.unique(mnistm)) == {0, 255}
    in_mnistm = [index_of[(x[0] > 0).tobytes()] for x in mnistm]
    np.testing.assert_array_equal(labels_all[in_mnistm], y_mnistm)
    assert not set(in_mnist) & set(in_mnistm), "a digit in both domains"
    assert len(set(in_mnist)) + len(set(in_mnistm)) == len(digits_all)


def test_digits_value_ranges(built) -> None:
    _, ds, _ = built
    for name in ds.domains:
        x, _ = _domain(ds, name)
        assert x.min() < 30 and x.max() > 225, name
        assert x.reshape(len(x), -1).std(axis=1).min() > 5, f"{name} has a flat image"
    for name in ("mnist", "uci"):
        x, _ = _domain(ds, name)
        assert (x[:, 0] == x[:, 1]).all() and (x[:, 1] == x[:, 2]).all(), f"{name} should be grey"


def test_get_batch_normalises_and_slices(built) -> None:
    _, ds, _ = built
    idx = np.array([0, 5001, 7000, len(ds) - 1])
    x, y = ds.get_batch(idx, train=True)
    assert x.dtype == torch.float32 and tuple(x.shape) == (4, 3, 28, 28)
    assert torch.equal(y, torch.from_numpy(ds.labels[idx]))
    assert torch.allclose(x, ds.images[torch.from_numpy(idx)].float() / 127.5 - 1.0, atol=1e-6)
    assert x.min() >= -1.0 and x.max() <= 1.0
    assert torch.equal(x, ds.get_batch(idx, train=False)[0]), "digits have no augmentation by default"


def test_synth_is_coloured_and_varied(built) -> None:
    _, ds, _ = built
    x, _ = _domain(ds, "synth")
    x = x.astype(np.float32)
    assert np.abs(x[:, 0] - x[:, 1]).mean() > 20, "synth should be in colour"
    corner_colours = x[:, :, 0, 0]
    assert corner_colours.std(axis=0).min() > 40, "background colours should vary"


def test_synth_fonts_render_every_digit() -> None:
    fonts = digits.synth_fonts()
    names = {f.name for f in fonts}
    assert len(fonts) >= 10
    assert not names & {"DejaVuSansDisplay.ttf", "DejaVuSerifDisplay.ttf"}
    for path in fonts:
        font = ImageFont.truetype(str(path), 20)
        renders = []
        for ch in "0123456789":
            canvas = Image.new("L", (32, 32))
            ImageDraw.Draw(canvas).text((16, 16), ch, font=font, fill=255, anchor="mm")
            pixels = np.asarray(canvas)
            assert pixels.sum() > 255 * 20, f"{path.name} renders {ch} empty"
            renders.append(pixels.tobytes())
        assert len(set(renders)) == 10, f"{path.name} draws identical glyphs"


def test_mnistm_is_mnist_on_photos(built) -> None:
    _, ds, _ = built
    mnist, y_mnist = _domain(ds, "mnist")
    mnistm, y_mnistm = _domain(ds, "mnistm")
    np.testing.assert_array_equal(y_mnist, y_mnistm)
    diff = np.abs(mnist.astype(np.int16) - mnistm.astype(np.int16)).mean()
    assert diff > 40
    assert np.abs(mnistm[:, 0].astype(np.int16) - mnistm[:, 2]).mean() > 10, "photo patches are coloured"
    ink = mnist[:, 0] > 0
    background = mnistm.astype(np.float32).transpose(0, 2, 3, 1)[~ink]
    assert background.std(axis=0).min() > 30, "backgrounds should be varied photo patches"


def test_builders_deterministic_per_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digits, "SYNTH_PER_CLASS", 10)
    for build in (digits.build_synth, digits.build_mnistm):
        a, ya = build(3)
        b, yb = build(3)
        c, _ = build(4)
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ya, yb)
        assert not np.array_equal(a, c), f"{build.__name__} ignores the seed"
    assert len(digits.build_synth(0)[1]) == 100


def test_cache_hit_skips_builder_and_returns_same_arrays(built, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, ds, build_time = built
    for name in ds.domains:
        path = cache_file(folder, "digits-dg", name, "28px", "seed0", digits.VERSION)
        assert path.is_file() and all(s in path.name for s in ("digits-dg", name, "28", "seed0", digits.VERSION))
    assert not list(folder.glob("*.tmp")), "temporary files left behind"

    def boom(seed: int) -> tuple[np.ndarray, np.ndarray]:
        raise AssertionError("cache miss: builder called")

    for name in ds.domains:
        monkeypatch.setitem(digits.BUILDERS, name, boom)
    start = time.perf_counter()
    again = load_dataset("digits-dg", cache_dir=folder)
    assert time.perf_counter() - start < build_time
    assert torch.equal(again.images, ds.images)
    np.testing.assert_array_equal(again.labels, ds.labels)
    np.testing.assert_array_equal(again.domain_ids, ds.domain_ids)


def test_corrupt_cache_is_rebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    build = digits.BUILDERS["mnist"]

    def counting(seed: int) -> tuple[np.ndarray, np.ndarray]:
        calls.append(seed)
        return build(seed)

    monkeypatch.setitem(digits.BUILDERS, "mnist", counting)
    first = load_dataset("digits-dg", cache_dir=tmp_path, domains=["mnist"])
    path = cache_file(tmp_path, "digits-dg", "mnist", "28px", "seed0", digits.VERSION)
    path.write_bytes(b"not a zip file")
    second = load_dataset("digits-dg", cache_dir=tmp_path, domains=["mnist"])
    third = load_dataset("digits-dg", cache_dir=tmp_path, domains=["mnist"])
    assert calls == [0, 0]
    assert torch.equal(first.images, second.images) and torch.equal(second.images, third.images)


def test_cache_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDDG_CACHE", str(tmp_path / "env-cache"))
    load_dataset("digits-dg", domains=["uci"], seed=2)
    assert (tmp_path / "env-cache").is_dir()
    assert [p.name for p in (tmp_path / "env-cache").iterdir()] == [f"digits-dg_uci_28px_seed2_{digits.VERSION}.npz"]


def test_image_size_32(built) -> None:
    folder, ds, _ = built
    big = load_dataset("digits-dg", cache_dir=folder, image_size=32, domains=["uci", "mnist"])
    assert big.image_shape == (3, 32, 32) and tuple(big.images.shape[1:]) == (3, 32, 32)
    assert big.domains == ["uci", "mnist"]
    assert big.get_batch(np.arange(3), train=False)[0].shape == (3, 3, 32, 32)
    with pytest.raises(ValueError, match="image_size"):
        load_dataset("digits-dg", cache_dir=folder, image_size=64)


def test_domains_and_max_per_domain(built) -> None:
    folder, _, _ = built
    small = load_dataset("digits-dg", cache_dir=folder, domains=["synth", "uci"], max_per_domain=50, seed=0)
    assert small.domains == ["synth", "uci"]
    assert {d: sum(c.values()) for d, c in small.counts().items()} == {"synth": 50, "uci": 50}
    assert set(small.counts()["synth"].values()) == {5}, "subsample keeps classes balanced"
    same = load_dataset("digits-dg", cache_dir=folder, domains=["synth", "uci"], max_per_domain=50, seed=0)
    assert torch.equal(small.images, same.images)
    other = load_dataset("digits-dg", cache_dir=folder, domains=["uci"], max_per_domain=50, seed=1)
    assert not torch.equal(small.images[50:], other.images), "another seed keeps other samples"


def test_registry_errors(built) -> None:
    folder, _, _ = built
    with pytest.raises(ValueError, match="unknown dataset 'nope'.*digits-dg.*office-home"):
        load_dataset("nope")
    with pytest.raises(ValueError, match="expected distinct names"):
        load_dataset("digits-dg", cache_dir=folder, domains=["svhn"])
    with pytest.raises(ValueError, match="takes no root"):
        load_dataset("digits-dg", root="/data", cache_dir=folder)
    with pytest.raises(ValueError, match="needs root"):
        load_dataset("pacs")


def test_list_and_info() -> None:
    names = list_datasets()
    assert names[:3] == ["digits-dg", "rotated-mnist", "colored-mnist"]
    assert {"pacs", "office-home", "vlcs", "terra-incognita", "domainnet", "office-caltech10", "folder"} <= set(names)
    info = dataset_info("digits-dg")
    assert info["domains"] == ["mnist", "uci", "synth", "mnistm"] and info["num_classes"] == 10
    assert not info["needs_root"]
    assert dataset_info("colored-mnist")["classes"] == ["0-4", "5-9"]


def test_iterate_batches_reproducible_with_augmentation(built) -> None:
    _, ds, _ = built
    aug = TensorDomainDataset(ds.name, ds.images, ds.labels, ds.domain_ids, ds.domains, ds.classes,
                              (0.5,) * 3, (0.5,) * 3, augment=BatchRandomCrop(2))
    idx = np.arange(0, len(ds), 50)

    def run(seed: int, train: bool) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return [x for x, _ in iterate_batches(aug, idx, 32, shuffle=True, train=train, generator=g)]

    a, b, c = run(0, True), run(0, True), run(1, True)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(a, c, strict=True))
    g = torch.Generator().manual_seed(0)
    plain = [x for x, _ in iterate_batches(ds, idx, 32, shuffle=True, train=False, generator=g)]
    assert not torch.equal(a[0], plain[0]), "train batches should be augmented"
    assert a[0].shape == plain[0].shape


def test_rotated_mnist_domains_are_rotations(tmp_path: Path) -> None:
    ds = load_dataset("rotated-mnist", cache_dir=tmp_path)
    assert ds.domains == ["0", "15", "30", "45", "60", "75"]
    assert ds.image_shape == (1, 28, 28) and len(ds) == 5000
    parts = mnist_variants.deal("rotated-mnist", 0, 6)
    assert len(np.unique(np.concatenate(parts))) == 5000, "parts must be disjoint and cover the digits"
    source, digit = digits.mnist5k()
    for k, angle in enumerate(mnist_variants.ANGLES):
        x, y = _domain(ds, str(angle))
        np.testing.assert_array_equal(y, digit[parts[k]])
        expected = mnist_variants.rotate(source[parts[k]][:, None], angle)
        np.testing.assert_array_equal(x, expected)
        if angle == 0:
            np.testing.assert_array_equal(x[:, 0], source[parts[k]])
        else:
            assert np.abs(x[:, 0].astype(np.int16) - source[parts[k]]).mean() > 10


def test_rotate_matches_exact_rotations() -> None:
    x = digits.mnist5k()[0][:20, None]
    np.testing.assert_array_equal(mnist_variants.rotate(x, 0), x)
    np.testing.assert_array_equal(mnist_variants.rotate(x, 90), np.rot90(x, 1, axes=(2, 3)))
    np.testing.assert_array_equal(mnist_variants.rotate(x, 180), np.rot90(x, 2, axes=(2, 3)))
    corners = mnist_variants.rotate(np.full((1, 1, 28, 28), 255, np.uint8), 45)[0, 0]
    assert corners[0, 0] == corners[-1, -1] == 0 and corners[14, 14] == 255  # zero fill outside the rotated square


def test_colored_mnist_correlations(tmp_path: Path) -> None:
    ds = load_dataset("colored-mnist", cache_dir=tmp_path)
    assert ds.domains == ["+90%", "+80%", "-90%"] and ds.classes == ["0-4", "5-9"]
    assert mnist_variants.COLOR_FLIP == {"+90%": 0.1, "+80%": 0.2, "-90%": 0.9}  # DomainBed's environments
    assert ds.image_shape == (3, 28, 28)
    parts = mnist_variants.deal("colored-mnist", 0, 3)
    _, digit = digits.mnist5k()
    for k, (env, e) in enumerate(mnist_variants.COLOR_FLIP.items()):
        x, y = _domain(ds, env)
        assert (x[:, 2] == 0).all(), "third channel is empty"
        red, green = x[:, 0].any(axis=(1, 2)), x[:, 1].any(axis=(1, 2))
        assert (red ^ green).all(), "each digit is in exactly one of red and green"
        colour = green.astype(np.int64)
        assert abs((colour != y).mean() - e) < 0.04, env
        assert abs((y != (digit[parts[k]] >= 5)).mean() - 0.25) < 0.04, env
