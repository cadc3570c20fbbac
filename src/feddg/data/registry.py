"""Datasets by name: the built-in benchmarks (no root needed) and the folder presets."""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from feddg.data import (
    cifar,
    digits,
    femnist,
    image_cache,
    iwildcam,
    mnist_variants,
    natural,
    prostate,
    synthetic_mri,
    synthetic_text,
    text_formats,
    text_sets,
    tinyimagenet,
    writers,
)
from feddg.data.augment import BatchAugment
from feddg.data.base import DomainDataset
from feddg.data.cache import resolve_cache_dir
from feddg.data.digits import Builder, cached_domain
from feddg.data.folders import (
    CARD,
    DEFAULT_IMAGE_SIZE,
    LAYOUT,
    PRESETS,
    FolderDomainDataset,
    FolderScan,
    check_root,
    discover_classes,
    discover_domains,
    read_card,
    scan_tree,
)
from feddg.data.slices import CLASSES as SLICE_CLASSES
from feddg.data.slices import SliceDataset
from feddg.data.tensor_dataset import TensorDomainDataset
from feddg.data.text import DEFAULT_MAX_LENGTH, DEFAULT_VOCAB_SIZE, BowDataset, TokenDataset
from feddg.data.transform_spec import PRESETS as TRANSFORM_PRESETS
from feddg.data.transform_spec import TransformSpec, check_channels, parse_slice_augment, parse_transforms

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Plugin:
    """A dataset registered from outside feddg (``PLUGINS[name] = Plugin(...)``): ``load(**options)`` takes
    :func:`load_dataset`'s keyword options and returns the dataset; the rest is what configs are checked against
    before it loads."""

    load: Callable[..., DomainDataset]
    domains: list[str]
    classes: list[str]
    task: str = "classification"
    inputs: str = "images"
    needs_root: bool = False
    image_size: int | None = None
    channels: int | None = None  # None: only the data tells


PLUGINS: dict[str, Plugin] = {}


Trimmable = TypeVar("Trimmable", SliceDataset, TokenDataset, BowDataset)


def _trimmed(ds: Trimmable, domains: list[str] | None, max_per_domain: int | None, seed: int) -> Trimmable:
    """``ds`` restricted to ``domains`` (in that order) and to ``max_per_domain`` samples each."""
    chosen = _select(ds.name, ds.domains, domains)
    ids = [ds.domains.index(d) for d in chosen]
    keep = np.concatenate([np.flatnonzero(ds.domain_ids == i) for i in ids])
    remap = np.zeros(len(ds.domains), dtype=np.int64)
    remap[ids] = np.arange(len(ids))
    keep = keep[subsample(chosen, remap[ds.domain_ids[keep]], ds.labels[keep], max_per_domain, seed)]
    return ds if chosen == ds.domains and len(keep) == len(ds) else ds.subset(keep, chosen)


def _load_prostate(*, root: str | None, cache_dir: str | os.PathLike[str] | None, image_size: int | None, seed: int,
                   domains: list[str] | None, max_per_domain: int | None, transforms: object) -> SliceDataset:
    augment = parse_slice_augment(transforms, prostate.NAME)
    if root is None:
        raise ValueError(f"dataset prostate needs root=<folder> laid out as {prostate.LAYOUT}")
    sites = _select(prostate.NAME, prostate.SITES, domains)
    ds = prostate.load_prostate(root, image_size or prostate.DEFAULT_IMAGE_SIZE, sites=sites, cache_dir=cache_dir)
    return _trimmed(ds, None, max_per_domain, seed).with_augment(augment)


def _load_synthetic_mri(*, root: str | None, cache_dir: str | os.PathLike[str] | None, image_size: int | None,
                        seed: int, domains: list[str] | None, max_per_domain: int | None,
                        transforms: object) -> SliceDataset:
    augment = parse_slice_augment(transforms, synthetic_mri.NAME)
    if root is not None:
        raise ValueError(f"{synthetic_mri.NAME} is built in and takes no root (got {root!r}); "
                         f"`feddg export {synthetic_mri.NAME} DIR` writes it as NIfTI for dataset prostate")
    size = image_size or synthetic_mri.DEFAULT_IMAGE_SIZE
    ds = synthetic_mri.load_synthetic_mri(seed, size, cache_dir=cache_dir)
    return _trimmed(ds, domains, max_per_domain, seed).with_augment(augment)


# Multi-site volumes read as 2.5-D slices (feddg.data.slices) for the segmentation task.
VOLUMES: dict[str, Plugin] = {
    synthetic_mri.NAME: Plugin(_load_synthetic_mri, list(synthetic_mri.SITES), list(SLICE_CLASSES), "segmentation",
                               image_size=synthetic_mri.DEFAULT_IMAGE_SIZE),
    prostate.NAME: Plugin(_load_prostate, list(prostate.SITES), list(SLICE_CLASSES), "segmentation",
                          needs_root=True, image_size=prostate.DEFAULT_IMAGE_SIZE),
}


# Natural clients and official test splits (feddg.data.natural): datasets in the formats they are published in.
def _natural_loader(name: str, source: natural.Source) -> Callable[..., DomainDataset]:
    def load(*, root: str | None, cache_dir: str | os.PathLike[str] | None, image_size: int | None, seed: int,
             domains: list[str] | None, max_per_domain: int | None, transforms: object) -> DomainDataset:
        spec = parse_transforms(transforms, source.transforms, where="transforms")
        folder = resolve_cache_dir(cache_dir)
        found = source.read(natural.check_root(name, source, root), seed, folder)
        if domains is not None:
            found = found.restrict(_select(name, found.domains, domains))
        if max_per_domain is not None:
            found = found.take(subsample(found.domains, found.domain_ids, found.labels, max_per_domain, seed))
        return natural.to_dataset(name, found, spec, folder, image_size or source.image_size)
    return load


NATURAL_SOURCES = {femnist.NAME: femnist.SOURCE, cifar.NAME: cifar.SOURCE, tinyimagenet.NAME: tinyimagenet.SOURCE,
                   writers.NAME: writers.SOURCE, iwildcam.NAME: iwildcam.SOURCE}
# a source's default normalisation has one value per channel of every image it reads (check_channels)
PLUGINS.update({name: Plugin(_natural_loader(name, s), s.domains, s.classes, needs_root=s.needs_root,
                             image_size=s.image_size, channels=None if s.transforms.mean is None else len(s.transforms.mean))
                for name, s in NATURAL_SOURCES.items()})


def _load_writers(*, writer_count: int | None = None, **options: Any) -> DomainDataset:
    """The built-in ``writers`` with ``writer_count`` writers (default :data:`writers.WRITERS`)."""
    count = writers.WRITERS if writer_count is None else writer_count
    source = replace(writers.SOURCE, read=lambda root, seed, cache_dir: writers.build_writers(seed, count))
    return _natural_loader(writers.NAME, source)(**options)


PLUGINS[writers.NAME] = replace(PLUGINS[writers.NAME], load=_load_writers)


# Text classification (feddg.data.text_sets): token ids for transformers; amazon-bow: bag-of-words vectors.
TextLoader = Callable[..., TokenDataset]
TEXT_LOADERS: dict[str, TextLoader] = {synthetic_text.NAME: text_sets.load_synthetic_sentiment,
                                       text_sets.AMAZON: text_sets.load_amazon_reviews,
                                       text_sets.TABLE: text_sets.load_text_table}


def _text_loader(name: str) -> Callable[..., DomainDataset]:
    def load(*, root: str | None, cache_dir: str | os.PathLike[str] | None, image_size: int | None, seed: int,
             domains: list[str] | None, max_per_domain: int | None, transforms: object, tokenizer: str | None = None,
             max_length: int | None = None, vocab_size: int | None = None) -> DomainDataset:
        if image_size is not None or transforms is not None:
            raise ValueError(f"{name} is a text dataset: it takes no image_size or transforms")
        if name == text_sets.AMAZON_BOW:
            if (tokenizer, max_length, vocab_size) != (None, None, None):
                raise ValueError(f"{name} is bag-of-words vectors: it takes no tokenizer, max_length or vocab_size")
            return _trimmed(text_sets.load_amazon_bow(root=root), domains, max_per_domain, seed)
        full = TEXT_LOADERS[name](root=root, cache_dir=cache_dir, seed=seed, tokenizer=tokenizer,
                                  max_length=max_length or DEFAULT_MAX_LENGTH, vocab_size=vocab_size or DEFAULT_VOCAB_SIZE)
        return _trimmed(full, domains, max_per_domain, seed)
    return load


_SENTIMENT, _AMAZON = list(text_formats.SENTIMENT), list(text_formats.AMAZON_DOMAINS)
TEXTS: dict[str, Plugin] = {  # text-table's domains and classes come from its rows
    synthetic_text.NAME: Plugin(_text_loader(synthetic_text.NAME), list(synthetic_text.DOMAINS), _SENTIMENT,
                                inputs="tokens"),
    text_sets.AMAZON: Plugin(_text_loader(text_sets.AMAZON), _AMAZON, _SENTIMENT, inputs="tokens", needs_root=True),
    text_sets.TABLE: Plugin(_text_loader(text_sets.TABLE), [], [], inputs="tokens", needs_root=True),
    text_sets.AMAZON_BOW: Plugin(_text_loader(text_sets.AMAZON_BOW), _AMAZON, _SENTIMENT, inputs="features",
                                 needs_root=True),
}
PLUGINS.update(TEXTS)


def _text_options(name: str, tokenizer: str | None, max_length: int | None, vocab_size: int | None) -> dict[str, Any]:
    """The text options for dataset ``name``'s loader; refused in one line for a dataset that is not text."""
    options = {"tokenizer": tokenizer, "max_length": max_length, "vocab_size": vocab_size}
    if name in TEXTS:
        return options
    given = [k for k, v in options.items() if v is not None]
    if given:
        raise ValueError(f"{name} is not a text dataset: it takes no {', '.join(given)}")
    return {}


def list_datasets() -> list[str]:
    """Names accepted by :func:`load_dataset`: built-in benchmarks first, then volume sets, folder presets and
    plug-ins."""
    return [*BUILTINS, *VOLUMES, *PRESETS, *PLUGINS]


def check_name(name: str) -> None:
    """``ValueError`` naming the datasets there are, for an unknown ``name``."""
    if name not in BUILTINS and name not in VOLUMES and name not in PRESETS and name not in PLUGINS:
        raise ValueError(f"unknown dataset {name!r}; expected one of {', '.join(list_datasets())}")


def dataset_info(name: str) -> dict[str, Any]:
    """``domains``, ``classes`` (empty where discovered from the folders), ``num_classes`` (``None``
    if unknown), ``needs_root``, the default ``image_size`` and the image ``channels`` (``None`` where only the data
    tells: plug-ins and volumes) of dataset ``name``."""
    check_name(name)
    task, inputs = "classification", "images"
    num_classes: int | None
    channels: int | None = None
    if name in PLUGINS or name in VOLUMES:
        plugin = PLUGINS.get(name) or VOLUMES[name]
        domains, classes, num_classes = list(plugin.domains), list(plugin.classes), len(plugin.classes) or None
        needs_root, image_size, task, inputs = plugin.needs_root, plugin.image_size, plugin.task, plugin.inputs
        channels = plugin.channels
    elif name in BUILTINS:
        b = BUILTINS[name]
        domains, classes, num_classes = list(b.builders), list(b.classes), len(b.classes)
        needs_root, image_size, channels = False, digits.NATIVE_SIZE, len(b.mean)
    else:
        p = PRESETS[name]
        domains, classes = list(p.domains), list(p.classes)
        num_classes = p.num_classes or (len(classes) or None)
        needs_root, image_size, channels = True, DEFAULT_IMAGE_SIZE, 3  # folders are read as RGB (image_cache.rgb8)
    return {"name": name, "domains": domains, "classes": classes, "num_classes": num_classes,
            "needs_root": needs_root, "image_size": image_size, "channels": channels, "task": task, "inputs": inputs}


def evaluation_mismatch(extra: str, data: str, tokenizer: str | None = None) -> str | None:
    """Why dataset ``extra`` cannot evaluate a model trained on ``data`` (another task, other inputs, other known
    image channels or classes, token ids or features of another vocabulary), from the registry alone; ``None`` when it
    can as far as the registry knows (a folder's classes are read when it loads). ``tokenizer``: the training data's fixed
    tokenizer (``data.tokenizer`` or ``model.path``), if any."""
    a, b = dataset_info(extra), dataset_info(data)
    if (a["task"], a["inputs"]) != (b["task"], b["inputs"]):
        return (f"{extra} is a {a['task']} dataset of {a['inputs']}, the training data {data} a {b['task']} dataset of "
                f"{b['inputs']}: an extra target needs the same task and inputs")
    if b["inputs"] == "tokens" and tokenizer is None:
        return (f"without data.tokenizer (or model.path) {data}'s token ids come from a BPE trained on its own corpus, "
                f"which {extra}'s would not share: an extra text target needs a fixed tokenizer")
    if b["inputs"] == "features":
        return (f"{data}'s features index its own corpus's vocabulary, which {extra}'s would not share: a bag-of-words "
                "dataset takes no extra target")
    if a["channels"] and b["channels"] and a["channels"] != b["channels"]:
        return (f"{extra} has {a['channels']}-channel images, the training data {data} {b['channels']}-channel ones: "
                "an extra target needs images of the same channels")
    if a["classes"] and b["classes"] and a["classes"] != b["classes"]:
        return (f"{extra} has classes {a['classes']}, the training data {b['classes']}; an extra target needs the "
                "same classes in the same order")
    return None


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


def default_transforms(name: str, root: str | Path | None = None) -> TransformSpec:
    """Dataset ``name``'s own transforms: none for the built-ins (their statistics), DomainBed's for
    the folder presets, overridden by ``root/feddg.json``'s ``transforms``."""
    check_name(name)
    if name in BUILTINS:
        return TransformSpec(mean=BUILTINS[name].mean, std=BUILTINS[name].std)
    spec = TRANSFORM_PRESETS["domainbed"]
    if root is not None:
        path = check_root(root)
        spec = parse_transforms(read_card(path).get("transforms"), spec, where=f"{path / CARD}: transforms")
    return spec


def _load_builtin(
    name: str,
    cache_dir: str | os.PathLike[str] | None,
    image_size: int | None,
    seed: int,
    domains: list[str],
    max_per_domain: int | None,
    spec: TransformSpec,
) -> TensorDomainDataset:
    b = BUILTINS[name]
    size = digits.NATIVE_SIZE if image_size is None else image_size
    parts = [
        cached_domain(name, d, b.builders[d], image_size=size, seed=seed, cache_dir=cache_dir, version=b.version)
        for d in domains
    ]
    full = TensorDomainDataset.from_parts(name, parts, domains, b.classes, b.mean, b.std)
    keep = subsample(domains, full.domain_ids, full.labels, max_per_domain, seed)
    mean, std = check_channels(spec, full.image_shape[0], name)
    augment = BatchAugment(spec) if spec.augments else None
    return TensorDomainDataset(name, full.images[keep] if max_per_domain else full.images, full.labels[keep],
                               full.domain_ids[keep], domains, b.classes, mean, std, augment)


def scan_folder(name: str, root: str, domains: list[str] | None) -> tuple[Path, list[str], list[str], FolderScan]:
    """The root, chosen domains, classes and :class:`FolderScan` of folder dataset ``name`` (decodes nothing)."""
    preset = PRESETS[name]
    path = check_root(root)
    available = list(preset.domains) or discover_domains(path)
    chosen = _select(name, available, domains)
    classes = list(preset.classes) or discover_classes(path, available)
    return path, chosen, classes, scan_tree(path, chosen, classes, fixed=bool(preset.classes))


def folder_image_size(root: Path, image_size: int | None) -> int:
    """``image_size`` if given, else the folder's ``feddg.json`` one, else 224."""
    return image_size or read_card(root).get("image_size") or DEFAULT_IMAGE_SIZE


def _load_folder(
    name: str,
    root: str,
    cache_dir: str | os.PathLike[str] | None,
    image_size: int | None,
    seed: int,
    domains: list[str] | None,
    max_per_domain: int | None,
    spec: TransformSpec,
) -> FolderDomainDataset:
    path, chosen, classes, scan = scan_folder(name, root, domains)
    if scan.problems:
        raise ValueError(scan.error(name, path))
    if scan.absent:
        log.warning(scan.absent_line(name, path))
    labels, domain_ids = np.array(scan.labels, dtype=np.int64), np.array(scan.domain_ids, dtype=np.int64)
    keep = subsample(chosen, domain_ids, labels, max_per_domain, seed)
    files = [scan.files[i] for i in keep]
    size = folder_image_size(path, image_size)
    try:
        images, _ = image_cache.cached_images(resolve_cache_dir(cache_dir), name, path, files, size)
    except image_cache.UnreadableImages as err:
        more = f" `feddg datasets {name} --root {path} --check` lists every unreadable file"
        raise ValueError(f"{err}; {LAYOUT};{more}") from None
    return FolderDomainDataset(name, files, images, labels[keep], domain_ids[keep], chosen, classes, spec)


def load_dataset(
    name: str,
    *,
    root: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    image_size: int | None = None,
    seed: int = 0,
    domains: list[str] | None = None,
    max_per_domain: int | None = None,
    transforms: str | dict[str, Any] | None = None,
    loader_workers: int = 0,
    tokenizer: str | None = None,
    max_length: int | None = None,
    vocab_size: int | None = None,
    writer_count: int | None = None,
) -> DomainDataset:
    """Dataset ``name``, restricted to ``domains`` (in that order) and to ``max_per_domain`` samples each.

    Built-in benchmarks are built on first use (deterministically from ``seed``) and cached under
    ``cache_dir`` / ``$FEDDG_CACHE`` / ``~/.cache/feddg``; folder datasets are read from ``root``,
    checked (layout, class names, empty classes) and decoded once into an image cache there.
    ``transforms`` overrides the dataset's default augmentation and statistics (a preset name or a
    mapping, see :mod:`feddg.data.transform_spec`); ``loader_workers`` > 0 builds training batches
    in that many DataLoader processes. Text datasets take ``tokenizer`` (a local tokenizer directory; default: a
    byte-level BPE of ``vocab_size`` trained on the corpus) and ``max_length`` (tokens per text), others refuse them.
    ``writer_count`` sets how many writers the built-in ``writers`` dataset has (others refuse it).
    """
    check_name(name)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if max_per_domain is not None and max_per_domain < 1:
        raise ValueError(f"max_per_domain must be >= 1, got {max_per_domain}")
    if image_size is not None and image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    if loader_workers < 0:
        raise ValueError(f"loader_workers must be >= 0, got {loader_workers}")
    options = _text_options(name, tokenizer, max_length, vocab_size)
    if writer_count is not None:
        if name != writers.NAME:
            raise ValueError(f"{name} takes no writer count (data.writers is the built-in writers dataset's)")
        options["writer_count"] = writer_count
    dataset: DomainDataset
    if name in PLUGINS or name in VOLUMES:
        plugin = PLUGINS.get(name) or VOLUMES[name]
        dataset = plugin.load(root=root, cache_dir=cache_dir, image_size=image_size, seed=seed, domains=domains,
                              max_per_domain=max_per_domain, transforms=transforms, **options)
    elif name in BUILTINS:
        if root is not None:
            raise ValueError(f"{name} is built in and takes no root (got {root!r})")
        chosen = _select(name, list(BUILTINS[name].builders), domains)
        spec = parse_transforms(transforms, default_transforms(name), where="transforms")
        dataset = _load_builtin(name, cache_dir, image_size, seed, chosen, max_per_domain, spec)
    else:
        if root is None:
            raise ValueError(f"dataset {name} needs root=<folder> laid out as root/<domain>/<class>/<image>")
        spec = parse_transforms(transforms, default_transforms(name, root), where="transforms")
        dataset = _load_folder(name, root, cache_dir, image_size, seed, domains, max_per_domain, spec)
    dataset.loader_workers = loader_workers
    return dataset
