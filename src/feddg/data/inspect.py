"""What ``feddg datasets NAME [--check]`` shows: counts and shapes (a folder scanned and a natural source's files
listed, neither decoded; a built-in loaded as a run loads it, so its cache is built), and a full check."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from feddg.data import image_cache, natural, prostate, synthetic_mri
from feddg.data.base import class_counts
from feddg.data.cache import resolve_cache_dir
from feddg.data.folders import PRESETS, FolderScan, check_root, discover_classes, discover_domains, scan_tree
from feddg.data.registry import (
    BUILTINS,
    NATURAL_SOURCES,
    TEXTS,
    VOLUMES,
    check_name,
    default_transforms,
    folder_image_size,
    load_dataset,
    scan_folder,
)
from feddg.data.slices import SliceDataset
from feddg.data.text_sets import check_text
from feddg.data.transform_spec import TransformSpec, parse_transforms


@dataclass(frozen=True)
class Summary:
    """Domains, classes, per-domain counts (rows: the classes, or for volumes cases and slices), batch image shape
    and transforms (``None`` where the dataset has fixed ones) of a dataset; ``total`` samples, each a ``unit``."""

    name: str
    domains: list[str]
    classes: list[str]
    counts: dict[str, dict[str, int]]
    image_shape: tuple[int, int, int]
    transforms: TransformSpec | None
    total: int
    unit: str = "images"


def _describe_slices(ds: SliceDataset) -> Summary:
    counts = {}
    for i, d in enumerate(ds.domains):
        mask = ds.domain_ids == i
        counts[d] = {"cases": len(np.unique(ds.cases[mask])), "slices": int(mask.sum()),
                     "slices with prostate": int(ds.labels[mask].sum())}
    return Summary(ds.name, ds.domains, ds.classes, counts, ds.image_shape, None, len(ds), "slices")


def describe_dataset(
    name: str,
    *,
    root: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    image_size: int | None = None,
    transforms: str | dict[str, Any] | None = None,
) -> Summary:
    """The :class:`Summary` of dataset ``name``; a folder is scanned (and its cheap checks run), not decoded; a text
    dataset is read (and tokenised into its cache)."""
    if name in TEXTS:
        ds = load_dataset(name, root=root, cache_dir=cache_dir, image_size=image_size, transforms=transforms)
        return Summary(name, ds.domains, ds.classes, ds.counts(), ds.image_shape, None, len(ds), "texts")
    if name in VOLUMES:
        ds = load_dataset(name, root=root, cache_dir=cache_dir, image_size=image_size, transforms=transforms)
        assert isinstance(ds, SliceDataset)
        return _describe_slices(ds)
    if name in NATURAL_SOURCES:
        return _describe_natural(name, root, cache_dir, image_size, transforms)
    if name in BUILTINS or root is None:
        ds = load_dataset(name, root=root, cache_dir=cache_dir, image_size=image_size, transforms=transforms)
        spec = parse_transforms(transforms, default_transforms(name))
        return Summary(name, ds.domains, ds.classes, ds.counts(), ds.image_shape, spec, len(ds))
    spec = parse_transforms(transforms, default_transforms(name, root))
    path, domains, classes, scan = scan_folder(name, root, None)
    if scan.problems:
        raise ValueError(scan.error(name, path))
    counts = class_counts(domains, classes, np.array(scan.domain_ids), np.array(scan.labels))
    size = folder_image_size(path, image_size)
    return Summary(name, domains, classes, counts, (3, size, size), spec, len(scan.labels))


def _describe_natural(name: str, root: str | None, cache_dir: str | os.PathLike[str] | None, image_size: int | None,
                      transforms: str | dict[str, Any] | None) -> Summary:
    """A natural source's counts from what its reader lists (IWildCam's metadata.csv, FEMNIST's LEAF json): its
    images are not decoded, so no image cache is built (IWildCam's 200,000 photos take ~112 GB at 448 px)."""
    source = NATURAL_SOURCES[name]
    spec = parse_transforms(transforms, source.transforms)
    samples = source.read(natural.check_root(name, source, root), 0, resolve_cache_dir(cache_dir))
    counts = class_counts(samples.domains, samples.classes, samples.domain_ids, samples.labels)
    size = image_size or source.image_size
    return Summary(name, samples.domains, samples.classes, counts, (samples.channels, size, size), spec,
                   len(samples.labels))


def _check_natural(name: str, root: str | None, workers: int | None) -> list[str]:
    """The first malformed file of natural dataset ``name``, else every image file it lists that cannot be decoded.

    Like the folder check it writes no cache (so ``--image-size`` and ``--cache-dir`` do not matter): the images are
    only decoded, and LEAF json's parsed arrays go to a throwaway folder.
    """
    source = NATURAL_SOURCES[name]
    try:
        with tempfile.TemporaryDirectory(prefix="feddg-check-") as scratch:
            samples = source.read(natural.check_root(name, source, root), 0, Path(scratch))
    except ValueError as err:  # the readers stop at the first malformed file with one line naming it
        return [str(err)]
    bad = image_cache.unreadable(samples.files or [], workers)
    return [f"cannot read image {file}: {reason}" for file, reason in bad]


def check_dataset(name: str, *, root: str | None = None, workers: int | None = None) -> list[str]:
    """Every problem of folder dataset ``name``: the layout ones, then each image that cannot be decoded (for
    prostate: each case that cannot be read or whose mask does not match it). Nothing is cached.

    Built-in datasets have nothing to check (``[]``); text datasets list every malformed file and line; the natural
    datasets (FEMNIST, CIFAR-10, Tiny-ImageNet, IWildCam) their first malformed file, else every undecodable image.
    """
    check_name(name)  # an unknown name says so, before any --root advice
    if name in TEXTS:
        return check_text(name, root)
    if name in BUILTINS or name == synthetic_mri.NAME:
        return []
    if name in NATURAL_SOURCES:
        return _check_natural(name, root, workers)
    if name == prostate.NAME:
        if root is None:
            raise ValueError(f"dataset prostate needs --root <folder> laid out as {prostate.LAYOUT}")
        return prostate.check_prostate(root)
    if root is None:
        raise ValueError(f"dataset {name} needs --root <folder> laid out as root/<domain>/<class>/<image>")
    path = check_root(root)
    preset = PRESETS[name]
    available = list(preset.domains) or discover_domains(path)
    present = [d for d in available if (path / d).is_dir()]
    problems = [f"domain folder {path / d} is missing" for d in available if d not in present]
    classes = list(preset.classes) or discover_classes(path, available)
    scan = scan_tree(path, present, classes, fixed=bool(preset.classes)) if present else FolderScan()
    bad = image_cache.unreadable(scan.files, workers)
    absent = [scan.absent_line(name, path)] if scan.absent else []
    return problems + scan.problems + absent + [f"cannot read image {file}: {reason}" for file, reason in bad]
