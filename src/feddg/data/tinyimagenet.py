"""Tiny-ImageNet (CS231n, 200 ImageNet classes at 64×64) from its release layout: a label-skew benchmark.

``wnids.txt`` lists the classes' WordNet ids; ``words.txt`` (optional) names them (``wnid<TAB>name, name``: the
first name is the class's); ``train/<wnid>/images/*.JPEG`` are 500 training images a class, ``val/images/*.JPEG``
the 10,000 validation images labelled by ``val/val_annotations.txt`` (``file<TAB>wnid<TAB>box``). The release's
test labels are withheld, so its validation set is the test set: the domains are ``val`` and ``train``, and a
LODO split (``split.target: val``, the default) trains on ``train`` and reports ``ood_acc`` on ``val``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from feddg.data.natural import Samples, Source
from feddg.data.transform_spec import TransformSpec
from feddg.data.transforms import IMAGENET_MEAN, IMAGENET_STD

NAME = "tiny-imagenet"
DOMAINS = ["val", "train"]
SIZE = 64
TRANSFORMS = TransformSpec(flip=0.5, pad_crop=4, mean=IMAGENET_MEAN, std=IMAGENET_STD)
LAYOUT = "root/wnids.txt, root/train/<wnid>/images/*.JPEG, root/val/val_annotations.txt, root/val/images/*.JPEG"


def _lines(path: Path) -> list[str]:
    try:
        return [line.rstrip("\r\n") for line in path.read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not readable ({' '.join(str(err).split())}); expected {LAYOUT}") from None


def class_names(root: Path, wnids: list[str]) -> list[str]:
    """Each wnid's first name in ``words.txt``, or the wnid itself."""
    words = root / "words.txt"
    if not words.is_file():
        return list(wnids)
    names = dict(line.split("\t", 1) for line in _lines(words) if "\t" in line)
    return [names.get(w, w).split(",")[0].strip() or w for w in wnids]


def read_val(root: Path, index: dict[str, int]) -> tuple[list[Path], list[int]]:
    """The validation images and their labels from ``val/val_annotations.txt``."""
    table = root / "val" / "val_annotations.txt"
    files, labels = [], []
    for n, line in enumerate(_lines(table), start=1):
        if not line.strip():
            continue
        cells = line.split("\t")
        file = root / "val" / "images" / cells[0]
        if len(cells) < 2 or cells[1] not in index:
            raise ValueError(f"{table}: line {n}: expected <file><TAB><wnid of wnids.txt>, got {line!r}")
        if not file.is_file():
            raise ValueError(f"{table}: line {n}: no image {file}")
        files.append(file)
        labels.append(index[cells[1]])
    return files, labels


def read_tinyimagenet(root: Path | None, seed: int, cache_dir: Path) -> Samples:
    """The release's training and validation images (``seed`` is unused; they are decoded into the image cache)."""
    assert root is not None
    wnids = [w.strip() for w in _lines(root / "wnids.txt") if w.strip()]
    if not wnids or len(set(wnids)) != len(wnids):
        raise ValueError(f"{root / 'wnids.txt'}: expected distinct WordNet ids, one a line")
    index = {w: k for k, w in enumerate(wnids)}
    files, labels = read_val(root, index)
    domain_ids = [0] * len(files)
    for k, w in enumerate(wnids):
        images = sorted((root / "train" / w / "images").glob("*.JPEG"))
        if not images:
            raise ValueError(f"{root / 'train' / w / 'images'}: no .JPEG image of class {w}; expected {LAYOUT}")
        files += images
        labels += [k] * len(images)
        domain_ids += [1] * len(images)
    return Samples(list(DOMAINS), class_names(root, wnids), np.array(labels, dtype=np.int64),
                   np.array(domain_ids, dtype=np.int64), SIZE, 3, files=files, root=root)


SOURCE = Source(read_tinyimagenet, list(DOMAINS), [], SIZE, TRANSFORMS, layout=LAYOUT)
