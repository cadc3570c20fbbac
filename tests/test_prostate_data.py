"""Tests of the prostate MRI data: 2.5-D slices, the SAML-layout NIfTI loader and its cache, the synthetic sites."""

from __future__ import annotations

import os
from pathlib import Path

import nibabel
import numpy as np
import pytest
import torch

from feddg.data import prostate
from feddg.data.prostate import check_prostate, load_prostate, read_sites
from feddg.data.slices import AUGMENTS, SliceDataset, rot90_flip, rotate_and_flip, scale_intensities, slices_from_volumes
from feddg.data.synthetic_mri import export_nifti, load_synthetic_mri, synthetic_volumes
from feddg.data.transform_spec import SLICE_AUGMENTS

SITES = ["BIDMC", "ISBI_1.5"]
DEPTH, SIZE = 5, 16
FOREGROUND = {0: [1, 2, 3], 1: [0, 1], 2: [4]}  # case -> slices with foreground (the ends included)
INNER = {c: [z for z in zs if 0 < z < DEPTH - 1] for c, zs in FOREGROUND.items()}  # the samples: not the ends


def _volume(site: int, case: int) -> tuple[np.ndarray, np.ndarray]:
    """Intensities and labels ``[depth, H, W]``; labels 1 and 2 (the second must read as 1)."""
    rng = np.random.default_rng([site, case])
    volume = rng.uniform(0.0, 1000.0, (DEPTH, SIZE, SIZE)).astype(np.float32)
    labels = np.zeros((DEPTH, SIZE, SIZE), dtype=np.uint8)
    for z in FOREGROUND[case]:
        labels[z, 4:10, 5:12] = 1
        labels[z, 6:8, 6:9] = 2
    return volume, labels


def _save(path: Path, array: np.ndarray) -> None:
    """Write a ``[depth, H, W]`` array as NIfTI (``[W, H, depth]``: x, y, z)."""
    nibabel.save(nibabel.Nifti1Image(np.transpose(array, (2, 1, 0)), np.eye(4)), path)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Two sites of 3 cases, 5 slices of 16×16; ISBI_1.5 with the ``_Segmentation`` spelling."""
    for s, site in enumerate(SITES):
        folder = tmp_path / "data" / site
        folder.mkdir(parents=True)
        for case in FOREGROUND:
            volume, labels = _volume(s, case)
            _save(folder / f"Case{case:02d}.nii.gz", volume)
            _save(folder / f"Case{case:02d}{prostate.MASK_SUFFIX[site]}.nii.gz", labels)
    return tmp_path / "data"


def _load(root: Path, drop_empty: bool = True) -> SliceDataset:
    return load_prostate(root, image_size=SIZE, drop_empty=drop_empty, sites=SITES, cache_dir=root.parent / "cache")


def test_two_sites_load_with_shapes_ids_and_labels(root: Path) -> None:
    ds = _load(root)
    per_case = [len(INNER[c]) for c in INNER]
    n = 2 * sum(per_case)
    assert ds.domains == SITES and ds.classes == ["background", "prostate"] and ds.task == "segmentation"
    assert ds.image_shape == (3, SIZE, SIZE)
    assert ds.images.shape == (n, 3, SIZE, SIZE) and ds.images.dtype == np.uint8
    assert ds.masks.shape == (n, SIZE, SIZE) and ds.masks.dtype == np.uint8
    assert ds.domain_ids.tolist() == [0] * (n // 2) + [1] * (n // 2)
    assert ds.cases.tolist() == [c for c, k in enumerate(per_case * 2) for _ in range(k)]
    assert ds.labels.tolist() == [1] * n
    assert set(np.unique(ds.masks).tolist()) == {0, 1}  # labels 2 read as 1
    volume, labels = _volume(1, 1)
    assert np.array_equal(ds.masks[ds.cases == 4], (labels[[1]] > 0).astype(np.uint8))
    small = load_prostate(root, image_size=8, sites=SITES, cache_dir=root.parent / "cache")
    assert small.images.shape == (n, 3, 8, 8) and small.masks.shape == (n, 8, 8)


def test_a_slice_stacks_its_neighbours_and_a_volumes_ends_are_not_samples(root: Path) -> None:
    """The reference loaders' ``range(1, depth − 1)``: the first and last slices only lend their pixels."""
    ds = _load(root, drop_empty=False)
    scaled = scale_intensities(_volume(0, 0)[0])
    rows = np.flatnonzero(ds.cases == 0)
    assert len(rows) == DEPTH - 2
    for z, row in enumerate(rows, start=1):
        assert np.array_equal(ds.images[row], scaled[[z - 1, z, z + 1]])


def test_drop_empty_drops_exactly_the_slices_without_foreground(root: Path) -> None:
    full, kept = _load(root, drop_empty=False), _load(root)
    assert len(full) == 2 * len(FOREGROUND) * (DEPTH - 2)
    has_foreground = full.masks.any(axis=(1, 2))
    assert full.labels.tolist() == has_foreground.astype(int).tolist()
    assert np.array_equal(kept.images, full.images[has_foreground])
    assert np.array_equal(kept.masks, full.masks[has_foreground])
    assert np.array_equal(kept.cases, full.cases[has_foreground])


def test_intensities_are_clipped_at_the_99th_percentile() -> None:
    volume = np.random.default_rng(0).uniform(5.0, 10.0, (10, 10, 10)).astype(np.float32)
    volume[0, 0, 0] = 1e6
    scaled = scale_intensities(volume)
    lo, hi = volume.min(), np.percentile(volume, 99)
    assert scaled.dtype == np.uint8 and scaled.min() == 0 and scaled[0, 0, 0] == 255
    assert 10 <= (scaled == 255).sum() <= 12  # the outlier and the top 1 % land on p99
    assert np.array_equal(scaled, np.rint((np.clip(volume, lo, hi) - lo) / (hi - lo) * 255).astype(np.uint8))


def test_batches_normalise_and_flip_image_and_mask_together(root: Path) -> None:
    ds = _load(root, drop_empty=False)
    idx = np.arange(len(ds))
    x, y = ds.get_batch(idx, train=False)
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and tuple(y.shape) == (len(ds), SIZE, SIZE)
    mean, std = torch.tensor(ds.mean).view(1, 3, 1, 1), torch.tensor(ds.std).view(1, 3, 1, 1)
    assert torch.allclose((x * std + mean) * 255, torch.from_numpy(ds.images).float(), atol=1e-3)
    assert ds.mean == ds.std == (0.5, 0.5, 0.5)  # fixed: no site's statistics (the held-out one's) in training
    xt, yt = ds.get_batch(idx, train=True, generator=torch.Generator().manual_seed(3))
    again = ds.get_batch(idx, train=True, generator=torch.Generator().manual_seed(3))
    assert torch.equal(xt, again[0]) and torch.equal(yt, again[1])
    flipped = (xt != x).flatten(1).any(1)
    assert 0 < int(flipped.sum()) < len(ds)
    assert torch.equal(xt[flipped], x[flipped].flip(-1)) and torch.equal(yt[flipped], y[flipped].flip(-1))
    assert torch.equal(yt[~flipped], y[~flipped])


def _reference(image_hwc: np.ndarray, mask: np.ndarray, k: int, code: int) -> tuple[np.ndarray, np.ndarray]:
    """HarmoFL's ``RandomRotate90`` / ``RandomFlip`` on one ``[H, W, C]`` slice in numpy: ``np.rot90`` over the first
    two axes, then ``cv2.flip``'s code 0 (rows), 1 (columns), −1 (both) as ``np.flip`` (−2 here: no flip)."""
    image_hwc, mask = np.rot90(image_hwc, k), np.rot90(mask, k)
    axes = {0: (0,), 1: (1,), -1: (0, 1), -2: ()}[code]
    return np.flip(image_hwc, axes) if axes else image_hwc, np.flip(mask, axes) if axes else mask


def test_rotate_and_flip_is_the_papers_numpy_and_cv2_per_slice() -> None:
    g = np.random.default_rng(0)
    x = torch.from_numpy(g.random((20, 3, 5, 5), dtype=np.float32))
    y = torch.from_numpy(g.integers(0, 2, (20, 5, 5)))
    k = torch.tensor([i % 5 for i in range(20)])
    flip = torch.tensor([i % 4 - 1 for i in range(20)])  # -1 none, 0 rows, 1 columns, 2 both
    xt, yt = rotate_and_flip(x.clone(), y.clone(), k, flip)
    for i in range(20):
        code = {-1: -2, 0: 0, 1: 1, 2: -1}[int(flip[i])]
        want_x, want_y = _reference(x[i].permute(1, 2, 0).numpy(), y[i].numpy(), int(k[i]), code)
        assert np.array_equal(xt[i].permute(1, 2, 0).numpy(), want_x) and np.array_equal(yt[i].numpy(), want_y)


def test_rot90_flip_draws_each_symmetry_as_often_as_the_papers_code() -> None:
    """Rotations k ∈ {0, ..., 4} (Python's inclusive randint) then, with p 0.75, one of three flips: the 8
    symmetries of a square are drawn with the probabilities that composition gives (0 and 4 both the identity)."""
    square = np.arange(4, dtype=np.float32).reshape(2, 2)
    exact: dict[bytes, float] = {}
    for k in range(5):
        for code, p in ((-2, 0.25), (0, 0.25), (1, 0.25), (-1, 0.25)):
            out = _reference(square[:, :, None], square, k, code)[1].tobytes()
            exact[out] = exact.get(out, 0.0) + p / 5
    n = 40_000
    x = torch.from_numpy(np.broadcast_to(square, (n, 3, 2, 2)).copy())
    _, y = rot90_flip(x, torch.from_numpy(np.broadcast_to(square, (n, 2, 2)).copy()), torch.Generator().manual_seed(0))
    seen: dict[bytes, int] = {}
    for row in y.numpy():
        seen[row.tobytes()] = seen.get(row.tobytes(), 0) + 1
    assert set(seen) == set(exact) and len(exact) == 8
    for key, p in exact.items():  # within 5 standard deviations of a binomial count
        assert abs(seen[key] - n * p) < 5 * np.sqrt(n * p * (1 - p)), (seen[key], n * p)
    assert set(AUGMENTS) == set(SLICE_AUGMENTS)  # the config's names are the loader's


def test_a_slice_is_read_as_simpleitk_reads_it_and_the_flip_is_left_right(tmp_path: Path) -> None:
    # NIfTI voxels [x, y, z] (nibabel's order): the bright half at x < 8, the prostate at x 1..4, y 5..9; the
    # reference loaders read SimpleITK's [z, y, x], so a slice's columns are x and flipping them mirrors left-right
    volume = np.where(np.arange(SIZE)[:, None, None] < 8, 1000.0, 0.0) * np.ones((SIZE, SIZE, DEPTH))
    mask = np.zeros((SIZE, SIZE, DEPTH), dtype=np.uint8)
    mask[1:5, 5:10, :] = 1
    folder = tmp_path / "data" / "BIDMC"
    folder.mkdir(parents=True)
    nibabel.save(nibabel.Nifti1Image(volume.astype(np.float32), np.eye(4)), folder / "Case00.nii.gz")
    nibabel.save(nibabel.Nifti1Image(mask, np.eye(4)), folder / "Case00_segmentation.nii.gz")
    ds = load_prostate(tmp_path / "data", image_size=SIZE, sites=["BIDMC"], cache_dir=tmp_path / "cache")
    image, truth = ds.images[0, 1], ds.masks[0]  # the middle channel: the slice itself
    assert (image[:, :8] > image[:, 8:].max()).all()  # bright columns: x < 8
    assert np.array_equal(np.argwhere(truth.any(0)).ravel(), [1, 2, 3, 4])  # columns: x
    assert np.array_equal(np.argwhere(truth.any(1)).ravel(), [5, 6, 7, 8, 9])  # rows: y
    masks = ds.get_batch(np.zeros(16, dtype=np.int64), train=True, generator=torch.Generator().manual_seed(0))[1]
    kept, mirrored = torch.from_numpy(truth).long(), torch.from_numpy(truth[:, ::-1].copy()).long()
    assert all(torch.equal(m, kept) or torch.equal(m, mirrored) for m in masks)
    assert any(torch.equal(m, mirrored) for m in masks)  # x mirrored: the prostate at columns 11..14


def test_problems_fail_in_one_line_and_are_all_listed(root: Path) -> None:
    (root / "BIDMC" / "Case01_segmentation.nii.gz").unlink()
    with pytest.raises(ValueError) as err:
        _load(root)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{root / 'BIDMC' / 'Case01.nii.gz'} has no mask (Case01_segmentation.nii.gz)")
    _save(root / "ISBI_1.5" / "Case00_Segmentation.nii.gz", np.zeros((DEPTH, SIZE, SIZE - 1), dtype=np.uint8))
    _save(root / "ISBI_1.5" / "Case01_Segmentation.nii.gz", np.zeros((DEPTH, SIZE, SIZE), dtype=np.uint8))
    (root / "ISBI_1.5" / "Case02.nii.gz").write_bytes(b"not a nifti")
    problems = check_prostate(root)
    isbi = root / "ISBI_1.5"
    assert problems[0] == message
    assert problems[1:5] == [f"{root / s}: missing site folder" for s in ("HK", "I2CVB", "ISBI", "UCL")]
    assert problems[5] == f"{isbi / 'Case00_Segmentation.nii.gz'} has shape 15×16×5 but Case00.nii.gz has 16×16×5"
    assert problems[6] == f"{isbi / 'Case01_Segmentation.nii.gz'} is empty (no foreground voxel)"
    assert problems[7].startswith(f"{isbi / 'Case02.nii.gz'} cannot be read: ")
    assert len(problems) == 8
    with pytest.raises(ValueError, match=r"Case01.nii.gz has no mask .* \(and 4 more: `feddg datasets prostate --root "
                                         rf"{root} --check` lists them\)$"):
        read_sites(root)


def test_cache_reads_no_nifti_and_a_touched_file_rebuilds(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _load(root)
    reads = []

    def refuse(path: object, *args: object, **kwargs: object) -> object:
        reads.append(path)
        raise AssertionError("a cached load read a NIfTI file")

    with monkeypatch.context() as m:
        m.setattr(nibabel, "load", refuse)
        second = _load(root)
    assert not reads
    assert np.array_equal(first.images, second.images) and np.array_equal(first.masks, second.masks)
    assert np.array_equal(first.cases, second.cases) and first.mean == second.mean
    assert isinstance(second.images, np.memmap)  # the cache is memory-mapped
    cache = root.parent / "cache" / "folders"
    before = sorted(p.name for p in cache.iterdir())
    image = root / "BIDMC" / "Case00.nii.gz"
    stat = image.stat()
    os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    counting = nibabel.load
    monkeypatch.setattr(nibabel, "load", lambda path, *a, **k: reads.append(path) or counting(path, *a, **k))
    third = _load(root)
    assert len(reads) == 2 * len(FOREGROUND) * len(SITES)
    assert np.array_equal(first.images, third.images)
    after = sorted(p.name for p in cache.iterdir())
    assert len(before) == len(after) == 2 and not set(before) & set(after)  # the stale .npy/.npz went


@pytest.fixture(scope="module")
def volumes() -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    return synthetic_volumes(seed=0)


def test_synthetic_exported_as_nifti_reads_back_as_the_same_slices(
    tmp_path: Path, volumes: dict[str, list[tuple[np.ndarray, np.ndarray]]]
) -> None:
    out = export_nifti(tmp_path / "synthetic", seed=0)
    assert (out / "ISBI_1.5" / "Case07_Segmentation.nii.gz").is_file()
    assert (out / "UCL" / "Case07_segmentation.nii.gz").is_file()
    assert check_prostate(out) == []
    real = load_prostate(out, image_size=64, cache_dir=tmp_path / "cache")
    built = load_synthetic_mri(seed=0, image_size=64, cache_dir=tmp_path / "cache")
    assert real.domains == built.domains == prostate.SITES
    for key in ("images", "masks", "domain_ids", "cases"):
        assert np.array_equal(getattr(real, key), getattr(built, key)), key
    assert real.mean == built.mean and real.std == built.std
    assert np.array_equal(built.images, slices_from_volumes(volumes, 64, True)["images"])


def test_synthetic_volumes_are_deterministic_and_differ_between_sites(
    volumes: dict[str, list[tuple[np.ndarray, np.ndarray]]]
) -> None:
    small = synthetic_volumes(seed=0, cases=2, depth=8, size=32)
    again = synthetic_volumes(seed=0, cases=2, depth=8, size=32)
    other = synthetic_volumes(seed=1, cases=2, depth=8, size=32)
    for site in prostate.SITES:
        for (v, m), (v2, m2), (v3, _) in zip(small[site], again[site], other[site], strict=True):
            assert v.dtype == np.float32 and m.dtype == np.uint8 and v.shape == m.shape == (8, 32, 32)
            assert np.array_equal(v, v2) and np.array_equal(m, m2) and not np.array_equal(v, v3)
    assert list(volumes) == prostate.SITES and all(len(cases) == 8 for cases in volumes.values())
    stats = {}
    for site, cases in volumes.items():
        scaled = np.stack([scale_intensities(v) for v, _ in cases]).astype(np.float64)
        noise = np.median(np.abs(np.diff(scaled, axis=-1)))  # pixel-to-pixel jumps: noise and resolution
        stats[site] = np.array([scaled.mean(), noise])
        masks = np.stack([m for _, m in cases])
        assert masks.any(axis=(2, 3)).all(axis=0).sum() < masks.shape[1]  # some slices without gland
        assert 0.005 < masks.mean() < 0.1
    for a in prostate.SITES:
        for b in prostate.SITES:
            if a < b:
                assert np.abs(stats[a] - stats[b]).max() > 2.0, (a, b, stats[a], stats[b])


def test_default_size_and_site_selection_follow_the_reference_loaders() -> None:
    """Input 3 × 384 × 384 (SAML/HarmoFL/FedFA); sites kept in the caller's order, duplicates and unknowns refused."""
    assert prostate.DEFAULT_IMAGE_SIZE == 384
    assert prostate.select_sites(["UCL", "BIDMC"]) == ["UCL", "BIDMC"]
    for bad in (["HK", "HK"], [], ["RUNMC"]):
        with pytest.raises(ValueError, match="bad sites"):
            prostate.select_sites(bad)


def test_cases_are_numbered_by_case_number_and_plain_nii_is_read(tmp_path: Path) -> None:
    """Case9 before Case10 (not text order); uncompressed ``.nii`` files are cases too, read as ``[depth, y, x]``."""
    folder = tmp_path / "data" / "HK"
    folder.mkdir(parents=True)
    for case, suffix in ((10, ".nii.gz"), (9, ".nii")):
        volume, labels = _volume(0, 0)
        _save(folder / f"Case{case}{suffix}", volume + case)
        _save(folder / f"Case{case}_segmentation{suffix}", labels)
    cases, problems = prostate.scan_cases(tmp_path / "data", ["HK"])
    assert problems == []
    assert [c.image.name for c in cases] == ["Case9.nii", "Case10.nii.gz"]
    assert [c.mask.name for c in cases] == ["Case9_segmentation.nii", "Case10_segmentation.nii.gz"]
    volumes = read_sites(tmp_path / "data", ["HK"])["HK"]
    assert np.array_equal(volumes[0][0], _volume(0, 0)[0] + 9) and np.array_equal(volumes[1][0], _volume(0, 0)[0] + 10)


def test_a_site_without_cases_and_a_mask_without_image_are_problems(root: Path) -> None:
    for file in (root / "BIDMC").iterdir():
        file.unlink()
    (root / "ISBI_1.5" / "Case02.nii.gz").unlink()
    assert check_prostate(root, SITES) == [
        f"{root / 'BIDMC'} has no cases (CaseNN.nii.gz)",
        f"{root / 'ISBI_1.5' / 'Case02_Segmentation.nii.gz'} has no image (Case02.nii.gz)",
    ]


def test_a_volume_with_a_trailing_unit_axis_reads_as_3d(tmp_path: Path) -> None:
    """NIfTI ``[x, y, z, 1]`` (a one-frame 4-D file) is the 3-D volume ``[z, y, x]``."""
    volume = np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2)  # x, y, z
    nibabel.save(nibabel.Nifti1Image(volume[..., None], np.eye(4)), tmp_path / "Case00.nii.gz")
    assert np.array_equal(prostate._read_volume(tmp_path / "Case00.nii.gz"), np.transpose(volume, (2, 1, 0)))


def test_read_sites_keeps_the_callers_site_order(root: Path) -> None:
    volumes = read_sites(root, ["ISBI_1.5", "BIDMC"])
    assert list(volumes) == ["ISBI_1.5", "BIDMC"]
    assert np.array_equal(volumes["ISBI_1.5"][0][0], _volume(1, 0)[0])  # ISBI_1.5 is the fixture's site 1


def test_a_cache_of_the_wrong_shape_is_rebuilt_and_a_loaded_cache_is_copy_on_write(root: Path) -> None:
    first = _load(root)
    images, masks = np.array(first.images), np.array(first.masks)
    (npy,) = (root.parent / "cache" / "folders").glob("*.npy")
    npy.unlink()  # a new file: the first load's memory map keeps the old one
    np.save(npy, np.zeros((len(images), 4, SIZE, SIZE - 1), dtype=np.uint8))  # same name, wrong shape
    again = _load(root)
    assert again.images.shape == images.shape == (len(images), 3, SIZE, SIZE)
    assert np.array_equal(again.images, images) and np.array_equal(again.masks, masks)
    value = int(again.images[0, 0, 0, 0])
    again.images[0, 0, 0, 0] = value ^ 1  # writable in memory ...
    assert int(_load(root).images[0, 0, 0, 0]) == value  # ... without touching the file


def test_a_missing_root_is_one_problem(tmp_path: Path) -> None:
    assert prostate.scan_cases(tmp_path / "nowhere") == ([], [f"{tmp_path / 'nowhere'}: no such folder"])
