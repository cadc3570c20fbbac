"""The one interface every multi-domain dataset implements.

A :class:`DomainDataset` is a labelled image dataset in which every sample also carries a
domain id. Clients never hold a dataset object of their own: they hold index arrays into
the shared dataset and ask it for batches, so a thousand simulated clients cost index
memory, not data copies.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from feddg.devices import Inputs


def first_problem(problems: Sequence[str], name: str, root: str | os.PathLike[str]) -> str:
    """One line for a load to stop with: the first of ``problems`` and, where there are more, the command that lists
    them all."""
    more = len(problems) - 1
    return problems[0] + (f" (and {more} more: `feddg datasets {name} --root {root} --check` lists them)" if more else "")


def ascii_int(text: str) -> int | None:
    """``text`` as a whole number >= 0 when it is ASCII digits only, else ``None`` (``'²'.isdigit()`` is true and
    ``int('²')`` raises)."""
    return int(text) if text.isascii() and text.isdigit() else None


def surplus_fields(row: Mapping[str | None, object], header: Sequence[str] | None) -> str | None:
    """Why a ``csv.DictReader`` row has too many fields (the reader files those past the header's under ``None``:
    an unquoted comma shifts every later column), or ``None``."""
    extra = row.get(None)
    return None if extra is None else f"{len(cast(list, extra))} field(s) more than the header's {len(header or [])}"


class DomainDataset(ABC):
    """Samples from several domains, each with a target for the dataset's task.

    Attributes:
        name: registry name, e.g. ``"digits-dg"``.
        task: the task of its targets (``feddg.tasks``): ``classification``, ...
        inputs: what :meth:`get_batch` returns as inputs: ``images`` (a tensor), ``tokens`` (a dict of tensors) or
            ``features`` (a float tensor ``[B, V]``).
        domains: domain names; ``domain_ids`` index into it.
        classes: class names (a segmentation's per-pixel classes); ``labels`` index into it.
        labels: int64 array ``[N]``: each sample's class where the task has one per sample (partitioners and
            ``feddg datasets`` read it), else 0.
        domain_ids: int64 array ``[N]``.
        groups: int64 array ``[N]`` of natural client groups (a writer, a camera, a hospital), or ``None``;
            ``partition.kind: natural`` makes each group a client; ``group_names`` names them.
        cases: int64 array ``[N]`` of samples that stay together in every split (a volume's slices), or ``None``:
            a client's holdout is then made of whole cases.
        image_shape: ``(C, H, W)`` of the image tensors :meth:`get_batch` returns (tokens: ``(1, 1, L)``, features:
            ``(1, 1, V)``).
        mean, std: the per-channel statistics :meth:`get_batch` normalised its ``[0, 1]`` images with (``(x − mean) /
            std``), or ``None`` (not images, or not normalised so); the privacy audit scores images in ``[0, 1]`` with them.
        seeded_batches: whether training batches are random (see :func:`iterate_batches`).
        loader_workers: processes that build batches for :func:`iterate_batches` (0: the caller's).
    """

    name: str
    task: str = "classification"
    inputs: str = "images"
    domains: list[str]
    classes: list[str]
    labels: np.ndarray
    domain_ids: np.ndarray
    groups: np.ndarray | None = None
    group_names: list[str] | None = None
    cases: np.ndarray | None = None
    ood_validation: str | None = None  # the domain that is the data's official ood validation split (WILDS' val)
    ood_test: str | None = None  # the domain that is its official ood test split (WILDS' test)
    image_shape: tuple[int, int, int]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    seeded_batches: bool = False
    loader_workers: int = 0

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def model_args(self) -> dict[str, Any]:
        """What ``create_model`` needs of the data (images: ``in_channels`` and ``image_size``; text datasets
        override it)."""
        c, h, _ = self.image_shape
        return {"in_channels": c, "image_size": h}

    def domain_index(self, domain: str) -> int:
        """Id of ``domain``; a clear error names the valid domains."""
        if domain not in self.domains:
            raise ValueError(f"unknown domain {domain!r} for {self.name}; expected one of {self.domains}")
        return self.domains.index(domain)

    @abstractmethod
    def get_batch(
        self, indices: np.ndarray, train: bool, generator: torch.Generator | None = None
    ) -> tuple[Inputs, Tensor]:
        """``(inputs, target)``: float images ``[B, C, H, W]`` (normalised), or a dict of tensors, and the task's
        target (int64 labels ``[B]`` for classification).

        ``train`` switches on the dataset's training augmentation, drawn from ``generator``
        so a client's batches are reproducible.
        """

    def counts(self) -> dict[str, dict[str, int]]:
        """Sample counts per domain and class, for ``feddg datasets``."""
        return class_counts(self.domains, self.classes, self.domain_ids, self.labels)


class _Batches(torch.utils.data.Dataset):
    """Batch ``i`` of a pass, for ``DataLoader`` workers: ``chunks[i]`` with generator ``seed + i``."""

    def __init__(self, dataset: DomainDataset, chunks: list[np.ndarray], train: bool, seed: int | None) -> None:
        self.dataset, self.chunks, self.train, self.seed = dataset, chunks, train, seed

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> tuple[Inputs, Tensor]:
        generator = None if self.seed is None else torch.Generator().manual_seed(self.seed + i)
        return self.dataset.get_batch(self.chunks[i], train=self.train, generator=generator)


def iterate_batches(
    dataset: DomainDataset,
    indices: np.ndarray,
    batch_size: int,
    *,
    shuffle: bool,
    train: bool,
    generator: torch.Generator | None = None,
    drop_last: bool = False,
) -> Iterator[tuple[Inputs, Tensor]]:
    """Yield batches of ``dataset`` restricted to ``indices``.

    Shuffling and augmentation draw from ``generator`` only, so two runs with equally seeded
    generators see identical batches. For a dataset with ``seeded_batches`` (batched tensor
    augmentation), one number drawn per training pass seeds a generator per batch, so batches can
    be built in ``dataset.loader_workers`` DataLoader processes (memory pinned when CUDA is
    available) with the same result as in this process.
    """
    indices = np.asarray(indices, dtype=np.int64)
    if shuffle:
        order = torch.randperm(len(indices), generator=generator).numpy()
        indices = indices[order]
    stop = len(indices) - (len(indices) % batch_size if drop_last else 0)
    chunks = [indices[s : s + batch_size] for s in range(0, stop, batch_size)]
    chunks = [c for c in chunks if len(c)]
    seeded = train and dataset.seeded_batches
    seed = int(torch.randint(2**62, (), generator=generator)) if seeded and chunks else None
    workers = 0 if mp.current_process().daemon else min(dataset.loader_workers, len(chunks))
    if workers > 0 and (seeded or not train):
        loader = torch.utils.data.DataLoader(_Batches(dataset, chunks, train, seed), batch_size=None,
                                             num_workers=workers, pin_memory=torch.cuda.is_available())
        yield from loader
        return
    for i, chunk in enumerate(chunks):
        g = torch.Generator().manual_seed(seed + i) if seed is not None else generator
        yield dataset.get_batch(chunk, train=train, generator=g)


def class_counts(domains: list[str], classes: list[str], domain_ids: np.ndarray, labels: np.ndarray
                 ) -> dict[str, dict[str, int]]:
    """Samples per domain and class (``domain_ids`` and ``labels`` index ``domains`` and ``classes``)."""
    out: dict[str, dict[str, int]] = {}
    for d, name in enumerate(domains):
        mask = domain_ids == d
        out[name] = {c: int((labels[mask] == k).sum()) for k, c in enumerate(classes)}
    return out
