"""Datasets read from the formats they are published in, with natural client groups or an official test split.

A reader returns :class:`Samples` (labels, domains, natural groups, and either the pixels or the image files); the
registry (``data/registry.py``) picks domains and ``max_per_domain`` on it, and :func:`to_dataset` decodes what is
kept. **Domains** are the data's official split where it has one (``test`` first, so that a LODO split's default
target holds it out), else each writer is a domain (so ``split.target_fraction`` holds out unseen writers).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from feddg.data import image_cache
from feddg.data.augment import BatchAugment
from feddg.data.base import DomainDataset, surplus_fields
from feddg.data.digits import resize_uint8
from feddg.data.folders import FolderDomainDataset
from feddg.data.tensor_dataset import TensorDomainDataset
from feddg.data.transform_spec import TransformSpec, check_channels


@dataclass(frozen=True, eq=False)
class Samples:
    """What a reader found.

    Attributes:
        domains, classes: names; ``domain_ids`` and ``labels`` (int64 ``[N]``) index into them.
        groups: int64 ``[N]`` natural group (writer) of each sample into ``group_names``, or ``None``.
        images: uint8 ``[N, C, S, S]`` pixels at ``size`` px, or ``None`` when ``files`` holds the image files.
        root: the folder ``files`` lie under (the image cache's key is relative to it).
        channels: channels of the dataset's images (files decode as RGB; grayscale data keeps the first).
        ood_validation: the domain that is the data's official ood validation split (WILDS' ``val``): never trained.
        ood_test: the domain that is its official ood test split (WILDS' ``test``): never trained either.
    """

    domains: list[str]
    classes: list[str]
    labels: np.ndarray
    domain_ids: np.ndarray
    size: int
    channels: int
    groups: np.ndarray | None = None
    group_names: list[str] | None = None
    images: np.ndarray | None = None
    files: list[Path] | None = None
    root: Path | None = None
    ood_validation: str | None = None
    ood_test: str | None = None

    def take(self, rows: np.ndarray) -> Samples:
        """The samples at ``rows`` (domains and groups keep their names and ids)."""
        return replace(self, labels=self.labels[rows], domain_ids=self.domain_ids[rows],
                       groups=None if self.groups is None else self.groups[rows],
                       images=None if self.images is None else self.images[rows],
                       files=None if self.files is None else [self.files[i] for i in rows])

    def restrict(self, chosen: list[str]) -> Samples:
        """The samples of domains ``chosen`` (names among ``domains``), renumbered in that order."""
        ids = [self.domains.index(d) for d in chosen]
        rows = np.flatnonzero(np.isin(self.domain_ids, ids))
        remap = np.zeros(len(self.domains), dtype=np.int64)
        remap[ids] = np.arange(len(ids))
        kept = self.take(rows)
        return replace(kept, domains=list(chosen), domain_ids=remap[kept.domain_ids],
                       ood_validation=self.ood_validation if self.ood_validation in chosen else None,
                       ood_test=self.ood_test if self.ood_test in chosen else None)


@dataclass(frozen=True)
class Source:
    """A dataset format: ``read(root, seed, cache_dir)`` and what configs are checked against before it loads."""

    read: Callable[[Path | None, int, Path], Samples]
    domains: list[str]
    classes: list[str]
    image_size: int
    transforms: TransformSpec
    needs_root: bool = True
    layout: str = ""


def check_root(name: str, source: Source, root: str | None) -> Path | None:
    """``root`` as a folder for a dataset that reads one; one line when it is missing or unexpected."""
    if not source.needs_root:
        if root is not None:
            raise ValueError(f"{name} is built in and takes no root (got {root!r})")
        return None
    if root is None:
        raise ValueError(f"dataset {name} needs root=<folder> laid out as {source.layout}")
    path = Path(root).expanduser()
    if not path.is_dir():
        raise ValueError(f"dataset {name}: root {path} is not a folder; expected {source.layout}")
    return path


# WILDS' split names and codes (its metadata.csv holds either); val and test are its ood splits, id_val and id_test
# hold out images of the training domains.
WILDS_SPLITS = {"train": 0, "val": 1, "test": 2, "id_val": 3, "id_test": 4}
WILDS_ID_SPLITS = ("id_val", "id_test")
_WILDS_NAMES = {str(code): name for name, code in WILDS_SPLITS.items()}  # a code as the name it stands for
Row = Mapping[str, str]  # a csv.DictReader row
Lines = list[tuple[int, dict[str, str]]]  # each row with the file line it ends on
T = TypeVar("T")


def read_csv(table: Path) -> tuple[Lines, list[str]]:
    """The rows (each with its line in the file) and header of a metadata table (a leading byte-order mark
    dropped); one line naming it when it cannot be read as CSV or a row has more fields than the header."""
    rows: Lines = []
    try:
        with table.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            for row in reader:
                if why := surplus_fields(row, reader.fieldnames):
                    raise ValueError(f"{table}: line {reader.line_num}: {why}")
                rows.append((reader.line_num, row))
            return rows, list(reader.fieldnames or [])
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise ValueError(f"{table}: not a readable CSV ({' '.join(str(err).split())})") from None


def wilds_split(value: str) -> str:
    """WILDS' split of a row, given by name (``val``) or code (``1``), as its name; ``ValueError`` for another value."""
    value = value.strip()
    if value in WILDS_SPLITS or value in _WILDS_NAMES:
        return _WILDS_NAMES.get(value, value)
    choices = ", ".join(f"{n} ({c})" for n, c in WILDS_SPLITS.items())
    raise ValueError(f"unknown split {value!r}; expected one of {choices}")


def wilds_rows(table: Path, rows: Iterable[tuple[int, Row]],
               parse: Callable[[Row], tuple[str, Path, T]]) -> list[tuple[str, Path, T]]:
    """The rows of a WILDS ``metadata.csv`` outside the id splits, each ``parse``d to ``(split, image file, the
    rest)``; one line naming the table and line for a malformed row, for an image listed twice (in two splits it
    leaks between training and test) and for a table without a train row."""
    kept: list[tuple[str, Path, T]] = []
    seen: dict[str, tuple[int, str]] = {}
    for line, row in rows:
        try:
            split, file, rest = parse(row)
            first, where = seen.setdefault(os.path.normpath(file), (line, split))
            if first != line:
                raise ValueError(f"image {file} ({split}) is already listed on line {first} ({where}); list each "
                                 "image once")
        except ValueError as err:
            raise ValueError(f"{table}: line {line}: {err}") from None
        if split not in WILDS_ID_SPLITS:
            kept.append((split, file, rest))
    if not any(split == "train" for split, _, _ in kept):
        raise ValueError(f"{table}: no row of the train split")
    return kept


def split_order(names: set[str]) -> list[str]:
    """Split names with ``test`` first (a LODO split's default target), the others sorted."""
    return sorted(names, key=lambda s: (s != "test", s))


def to_dataset(name: str, samples: Samples, spec: TransformSpec, cache_dir: Path, size: int) -> DomainDataset:
    """The dataset of ``samples`` at ``size`` px: files are decoded once into the image cache and memory-mapped."""
    ds: TensorDomainDataset
    if samples.files is not None:
        assert samples.root is not None
        images, _ = image_cache.cached_images(cache_dir, name, samples.root, samples.files, size)
        ds = FolderDomainDataset(name, samples.files, images[..., :samples.channels], samples.labels,
                                 samples.domain_ids, samples.domains, samples.classes, spec)
    else:
        assert samples.images is not None
        x = samples.images if size == samples.size else resize_uint8(samples.images, size)
        mean, std = check_channels(spec, x.shape[1], name)
        ds = TensorDomainDataset(name, torch.from_numpy(np.ascontiguousarray(x)), samples.labels, samples.domain_ids,
                                 samples.domains, samples.classes, mean, std,
                                 BatchAugment(spec) if spec.augments else None)
    ds.groups, ds.group_names = samples.groups, samples.group_names
    ds.ood_validation, ds.ood_test = samples.ood_validation, samples.ood_test
    return ds
