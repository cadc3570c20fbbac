"""Datasets by name: the built-in benchmarks (no root needed) and the folder presets."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from feddg.data import digits, mnist_variants
from feddg.data.base import DomainDataset
from feddg.data.digits import Builder, cached_domain
from feddg.data.folders import (
    DEFAULT_IMAGE_SIZE,
    PRESETS,
    FolderDomainDataset,
    check_root,
    discover_classes,
    discover_domains,
    scan_tree,
)
from feddg.data.tensor_dataset import TensorDomainDataset


@dataclass(frozen=True)
class Builtin:
    """A benchmark built from packaged data: one builder per domain, cached as uint8 arrays."""

    builders: dict[str, Builder]
    classes: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    version: str


BUILTINS: dict[str, Builtin] = {
    digits.NAME: Builtin(digits.BUILDERS, digits.CLASSES, digits.MEAN, digits.STD, digits.VERSION),
    mnist_variants.ROTATED: Builtin(
        mnist_variants.ROTATED_BUILDERS,
        mnist_variants.ROTATED_CLASSES,
        mnist_variants.MEAN_1,
        mnist_variants.STD_1,
        mnist_variants.VERSION,
    ),
    mnist_variants.COLORED: Builtin(
        mnist_variants.COLORED_BUILDERS,
        mnist_variants.COLORED_CLASSES,
        mnist_variants.MEAN_3,
        mnist_variants.STD_3,
        mnist_variants.VERSION,
    ),
}


def list_datasets() -> list[str]:
    """Names accepted by :func:`load_dataset`: built-in benchmarks first, then folder presets."""
    return [*BUILTINS, *PRESETS]


def _check_name(name: str) -> None:
    if name not in BUILTINS and name not in PRESETS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(list_datasets())}")


def dataset_info(name: str) -> dict[str, Any]:
    """``domains``, ``classes`` (empty where discovered from the folders), ``num_classes`` (``None``
    if unknown), ``needs_root`` and the default ``image_size`` of dataset ``name``."""
    _check_name(name)
    if name in BUILTINS:
        b = BUILTINS[name]
        domains, classes, num_classes = list(b.builders), list(b.classes), len(b.classes)
        needs_root, image_size = False, digits.NATIVE_SIZE
    else:
        p = PRESETS[name]
        domains, classes = list(p.domains), list(p.classes)
        num_classes = p.num_classes or (len(classes) or None)
        needs_root, image_size = True, DEFAULT_IMAGE_SIZE
    return {"name": name, "domains": domains, "classes": classes, "num_classes": num_classes,
            "needs_root": needs_root, "image_size": image_size}


def _select(name: str, available: list[str], requested: list[str] | None) -> list[str]:
    """``requested`` (in its order) after checking it against ``available``; all of them if ``None``."""
    if requested is None:
        return list(available)
    unknown = [d for d in requested if d not in available]
    if unknown or not requested or len(set(requested)) != len(requested):
        raise ValueError(f"bad domains {requested} for {name}; expected distinct names among {available}")
    return list(requested)


def subsample(
    domains: list[str], domain_ids: np.ndarray, labels: np.ndarray, max_per_domain: int | None, seed: int
) -> np.ndarray:
    """Sorted indices keeping at most ``max_per_domain`` samples of each domain.

    The kept samples are drawn at random (seeded by ``seed`` and the domain's name) round-robin
    over the classes, so every class keeps its share while it has samples left.
    """
    keep = []
    for d, name in enumerate(domains):
        idx = np.flatnonzero(domain_ids == d)
        if max_per_domain is not None and len(idx) > max_per_domain:
            idx = np.random.default_rng([seed, zlib.crc32(name.encode())]).permutation(idx)
            rank = np.empty(len(idx), dtype=np.int64)
            for k in np.unique(labels[idx]):
                members = labels[idx] == k
                rank[members] = np.arange(members.sum())
            idx = np.sort(idx[np.argsort(rank, kind="stable")[:max_per_domain]])
        keep.append(idx)
    return np.concatenate(keep)


def _load_builtin(
    name: str,
    cache_dir: str | os.PathLike[str] | None,
    image_size: int | None,
    seed: int,
    domains: list[str],
    max_per_domain: int | None,
) -> TensorDomainDataset:
    b = BUILTINS[name]
    size = digits.NATIVE_SIZE if image_size is None else image_size
    parts = [
        cached_domain(name, d, b.builders[d], image_size=size, seed=seed, cache_dir=cache_dir, version=b.version)
        for d in domains
    ]
    full = TensorDomainDataset.from_parts(name, parts, domains, b.classes, b.mean, b.std)
    if max_per_domain is None:
        return full
    keep = subsample(domains, full.domain_ids, full.labels, max_per_domain, seed)
    return TensorDomainDataset(name, full.images[keep], full.labels[keep], full.domain_ids[keep],
                               domains, b.classes, b.mean, b.std)


def _load_folder(
    name: str,
    root: str,
    image_size: int | None,
    seed: int,
    domains: list[str] | None,
    max_per_domain: int | None,
) -> FolderDomainDataset:
    preset = PRESETS[name]
    path = check_root(root)
    available = list(preset.domains) or discover_domains(path)
    chosen = _select(name, available, domains)
    classes = list(preset.classes) or discover_classes(path, available)
    files, labels, domain_ids = scan_tree(path, chosen, classes)
    keep = subsample(chosen, domain_ids, labels, max_per_domain, seed)
    size = DEFAULT_IMAGE_SIZE if image_size is None else image_size
    return FolderDomainDataset(name, [files[i] for i in keep], labels[keep], domain_ids[keep], chosen, classes, size)


def load_dataset(
    name: str,
    *,
    root: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    image_size: int | None = None,
    seed: int = 0,
    domains: list[str] | None = None,
    max_per_domain: int | None = None,
) -> DomainDataset:
    """Dataset ``name``, restricted to ``domains`` (in that order) and to ``max_per_domain`` samples each.

    Built-in benchmarks are built on first use (deterministically from ``seed``) and cached under
    ``cache_dir`` / ``$FEDDG_CACHE`` / ``~/.cache/feddg``; folder datasets are read from ``root``.
    """
    _check_name(name)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if max_per_domain is not None and max_per_domain < 1:
        raise ValueError(f"max_per_domain must be >= 1, got {max_per_domain}")
    if image_size is not None and image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    if name in BUILTINS:
        if root is not None:
            raise ValueError(f"{name} is built in and takes no root (got {root!r})")
        chosen = _select(name, list(BUILTINS[name].builders), domains)
        return _load_builtin(name, cache_dir, image_size, seed, chosen, max_per_domain)
    if root is None:
        raise ValueError(f"dataset {name} needs root=<folder> laid out as root/<domain>/<class>/<image>")
    return _load_folder(name, root, image_size, seed, domains, max_per_domain)
