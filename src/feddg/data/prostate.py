"""Multi-site prostate MRI in the SAML release layout (reused by HarmoFL and FedFA), read with nibabel.

``<root>/<SITE>/CaseNN.nii.gz`` with its labels in ``CaseNN_segmentation.nii.gz`` (ISBI_1.5 spells it
``CaseNN_Segmentation.nii.gz``; either spelling is accepted everywhere), for the sites :data:`SITES`. NIfTI arrays
are ``[H, W, depth]``; volumes are handed on slice axis first.

The volumes are decoded once, through :func:`feddg.data.slices.slices_from_volumes`, into
``<cache>/folders/prostate-<fg|all>-v1_<root>_<size>px_<files>_<stamps>.npy`` (uint8 ``[N, 4, S, S]``: the three
image channels, then the mask; memory-mapped back) and a ``.npz`` beside it with the domain and case ids and the
statistics. As for image folders (:mod:`feddg.data.image_cache`), ``files`` hashes the cases' paths and ``stamps``
their sizes and modification times, so a touched, added or removed file selects another cache, and the stale one of
the same selection is deleted once the new one is written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from feddg.data.base import first_problem
from feddg.data.cache import Arrays, load_arrays, replaced_atomically, resolve_cache_dir, save_arrays
from feddg.data.image_cache import cache_path
from feddg.data.slices import FOREGROUND, KEYS, SliceDataset, Volume, slices_from_volumes

NAME = "prostate"
SITES = ["BIDMC", "HK", "I2CVB", "ISBI", "ISBI_1.5", "UCL"]
MASK_SUFFIX = {site: "_Segmentation" if site == "ISBI_1.5" else "_segmentation" for site in SITES}
DEFAULT_IMAGE_SIZE = 384
LAYOUT = "root/<SITE>/CaseNN.nii.gz with CaseNN_segmentation.nii.gz beside it, SITE among " + ", ".join(SITES)
VERSION = "v5"  # v2: fixed normalisation (0.5, 0.5); v3: slices [y, x] as SimpleITK reads them (were [x, y]);
# v4: a volume's first and last slices are not samples (the reference loaders' range(1, depth - 1)); v5: a label of
# exactly 0.5 is foreground in the slices as in read_case's emptiness check (np.rint made it background)
META_KEYS = tuple(k for k in KEYS if k not in ("images", "masks"))
_CASE = re.compile(r"(Case\d+)(\.nii(?:\.gz)?)")
_MASK = re.compile(r"(Case\d+)_[sS]egmentation(\.nii(?:\.gz)?)")


@dataclass(frozen=True)
class Case:
    """One case's image and mask files."""

    site: str
    image: Path
    mask: Path


def _reason(err: BaseException) -> str:
    return " ".join(f"{type(err).__name__}: {err}".split())


def select_sites(sites: Sequence[str] | None) -> list[str]:
    """``sites`` (in its order) after checking them against :data:`SITES`; all of them if ``None``."""
    if sites is None:
        return list(SITES)
    if not sites or len(set(sites)) != len(sites) or any(s not in SITES for s in sites):
        raise ValueError(f"bad sites {list(sites)}; expected distinct names among {SITES}")
    return list(sites)


def scan_cases(root: str | os.PathLike[str], sites: Sequence[str] | None = None) -> tuple[list[Case], list[str]]:
    """Every complete case of ``sites`` (by case number), and every problem of the layout, one line each naming the
    path: a missing root or site folder, a site without cases, a case without a mask, a mask without a case.
    Reads no NIfTI."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return [], [f"{root}: no such folder"]
    cases, problems = [], []
    for site in select_sites(sites):
        folder = root / site
        if not folder.is_dir():
            problems.append(f"{folder}: missing site folder")
            continue
        names = os.listdir(folder)
        images = {m[1]: m for m in map(_CASE.fullmatch, names) if m}
        masks = {m[1]: m for m in map(_MASK.fullmatch, names) if m}
        if not images:
            problems.append(f"{folder} has no cases (CaseNN.nii.gz)")
        for stem in sorted(images, key=lambda s: int(s[4:])):
            if stem in masks:
                cases.append(Case(site, folder / images[stem][0], folder / masks[stem][0]))
            else:
                problems.append(f"{folder / images[stem][0]} has no mask ({stem}{MASK_SUFFIX[site]}{images[stem][2]})")
        problems += [f"{folder / masks[s][0]} has no image ({s}{masks[s][2]})" for s in sorted(set(masks) - set(images))]
    return cases, problems


def _read_volume(path: Path) -> np.ndarray:
    """A NIfTI file's float32 array as ``[depth, H, W]``: nibabel's ``[x, y, z]`` reversed, SimpleITK's order, in
    which the reference loaders read it (a slice's rows are y, its columns x: flipping the last axis is left-right)."""
    import nibabel  # only where NIfTI files are read: a cached dataset loads without it

    data = nibabel.load(path).get_fdata(dtype=np.float32)  # type: ignore[attr-defined]
    while data.ndim > 3 and data.shape[-1] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise ValueError(f"expected a 3-D volume, got shape {data.shape}")
    return np.ascontiguousarray(np.transpose(data, (2, 1, 0)))


def _shape(volume: np.ndarray) -> str:
    """The file's shape (``x×y×z``) of a volume read by :func:`_read_volume`."""
    return "×".join(str(n) for n in reversed(volume.shape))


def read_case(case: Case) -> tuple[Volume | None, list[str]]:
    """``(volume, labels)`` of ``case``, or ``None`` and its problems: an unreadable file, image and mask shapes that
    differ, a mask without foreground."""
    arrays, problems = [], []
    for path in (case.image, case.mask):
        try:
            arrays.append(_read_volume(path))
        except Exception as err:
            problems.append(f"{path} cannot be read: {_reason(err)}")
    if problems:
        return None, problems
    volume, labels = arrays
    if volume.shape != labels.shape:
        return None, [f"{case.mask} has shape {_shape(labels)} but {case.image.name} has {_shape(volume)}"]
    if not (labels >= FOREGROUND).any():
        return None, [f"{case.mask} is empty (no foreground voxel)"]
    return (volume, labels), []


def _read_or_fail(cases: list[Case], root: str | os.PathLike[str]) -> Iterator[Volume]:
    for case in cases:
        volume, problems = read_case(case)
        if volume is None:
            raise ValueError(first_problem(problems, NAME, root))
        yield volume


def read_sites(root: str | os.PathLike[str], sites: Sequence[str] | None = None) -> dict[str, list[Volume]]:
    """Every case's ``(volume, labels)`` per site, slice axis first; a one-line ``ValueError`` on the first problem."""
    cases, problems = scan_cases(root, sites)
    if problems:
        raise ValueError(first_problem(problems, NAME, root))
    return {site: list(_read_or_fail([c for c in cases if c.site == site], root)) for site in select_sites(sites)}


def check_prostate(root: str | os.PathLike[str], sites: Sequence[str] | None = None) -> list[str]:
    """Every problem of the folder, one line each naming the file (reads every case; empty when all is well)."""
    cases, problems = scan_cases(root, sites)
    for case in cases:
        problems += read_case(case)[1]
    return problems


def _load_cache(path: Path, size: int) -> Arrays | None:
    """The cache at ``path`` (images and masks memory-mapped, copy-on-write), or ``None`` if missing or malformed."""
    meta = load_arrays(path.with_suffix(".npz"), META_KEYS)
    if meta is None:
        return None
    try:
        data = np.load(path, mmap_mode="c")
    except (OSError, ValueError):
        return None
    if data.dtype != np.uint8 or data.shape != (len(meta["cases"]), 4, size, size):
        return None
    return {**meta, "images": data[:, :3], "masks": data[:, 3]}


def _save_cache(path: Path, arrays: Arrays) -> None:
    """Write ``arrays`` to ``path`` and its ``.npz`` (each atomically), then delete the selection's stale caches."""
    meta = path.with_suffix(".npz")
    save_arrays(meta, {k: arrays[k] for k in META_KEYS})
    images = arrays["images"]
    with replaced_atomically(path) as tmp:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(len(images), 4, *images.shape[2:]))
        out[:, :3] = images
        out[:, 3] = arrays["masks"]
        out.flush()
        del out
    for stale in path.parent.glob(path.name.rsplit("_", 1)[0] + "_*.np[yz]"):
        if stale not in (path, meta):
            stale.unlink(missing_ok=True)


def load_prostate(
    root: str | os.PathLike[str],
    image_size: int = DEFAULT_IMAGE_SIZE,
    drop_empty: bool = True,
    sites: Sequence[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> SliceDataset:
    """The sites' 2.5-D slices at ``image_size`` px, decoded once into the cache (a later load reads no NIfTI).

    Fails with a one-line ``ValueError`` naming the file of the first problem (:func:`check_prostate` lists all).
    """
    chosen = select_sites(sites)
    cases, problems = scan_cases(root, chosen)
    if problems:
        raise ValueError(first_problem(problems, NAME, root))
    files = [p for c in cases for p in (c.image, c.mask)]
    tag = f"{NAME}-{'fg' if drop_empty else 'all'}-{VERSION}"
    path = cache_path(resolve_cache_dir(cache_dir), tag, Path(root).expanduser(), files, image_size)
    arrays = _load_cache(path, image_size)
    if arrays is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        volumes = {site: _read_or_fail([c for c in cases if c.site == site], root) for site in chosen}
        _save_cache(path, slices_from_volumes(volumes, image_size, drop_empty))
        arrays = _load_cache(path, image_size)
        if arrays is None:
            raise OSError(f"prostate cache {path} could not be read back after writing it")
    return SliceDataset.from_arrays(NAME, arrays, chosen)
