"""What ``feddg datasets NAME [--check]`` shows: counts and shapes without decoding, and a full check."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from feddg.data import image_cache
from feddg.data.folders import PRESETS, FolderScan, check_root, discover_classes, discover_domains, scan_tree
from feddg.data.registry import BUILTINS, default_transforms, folder_image_size, load_dataset, scan_folder
from feddg.data.transform_spec import TransformSpec, parse_transforms


@dataclass(frozen=True)
class Summary:
    """Domains, classes, per-domain class counts, batch image shape and transforms of a dataset."""

    name: str
    domains: list[str]
    classes: list[str]
    counts: dict[str, dict[str, int]]
    image_shape: tuple[int, int, int]
    transforms: TransformSpec

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())


def describe_dataset(
    name: str,
    *,
    root: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    image_size: int | None = None,
    transforms: str | dict[str, Any] | None = None,
) -> Summary:
    """The :class:`Summary` of dataset ``name``; a folder is scanned (and its cheap checks run), not decoded."""
    if name in BUILTINS or root is None:
        ds = load_dataset(name, root=root, cache_dir=cache_dir, image_size=image_size, transforms=transforms)
        spec = parse_transforms(transforms, default_transforms(name))
        return Summary(name, ds.domains, ds.classes, ds.counts(), ds.image_shape, spec)
    spec = parse_transforms(transforms, default_transforms(name, root))
    path, domains, classes, scan = scan_folder(name, root, None)
    if scan.problems:
        raise ValueError(scan.error(name, path))
    labels, domain_ids = np.array(scan.labels), np.array(scan.domain_ids)
    counts = {d: {c: int(((domain_ids == i) & (labels == k)).sum()) for k, c in enumerate(classes)}
              for i, d in enumerate(domains)}
    size = folder_image_size(path, image_size)
    return Summary(name, domains, classes, counts, (3, size, size), spec)


def check_dataset(name: str, *, root: str | None = None, workers: int | None = None) -> list[str]:
    """Every problem of folder dataset ``name``: the layout ones, then each image that cannot be decoded.

    Built-in datasets have nothing to check (``[]``).
    """
    if name in BUILTINS:
        return []
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
    return problems + scan.problems + [f"cannot read image {file}: {reason}" for file, reason in bad]
