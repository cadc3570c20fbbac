"""CIFAR-10 (Krizhevsky 2009) from its Python release, ``cifar-10-batches-py/``: a label-skew benchmark.

``data_batch_1..5`` (50,000 training images) and ``test_batch`` (10,000) are pickled dicts with ``b"data"``
(uint8 ``[n, 3072]``: the red, green and blue 32×32 planes of each image) and ``b"labels"``; ``batches.meta``
names the classes (``b"label_names"``). The domains are the official split, ``test`` and ``train``: a LODO split
(``split.target: test``, the default) trains on ``train`` and reports ``ood_acc`` on the official test set.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from feddg.data.natural import Samples, Source
from feddg.data.transform_spec import TransformSpec

NAME = "cifar10"
FOLDER = "cifar-10-batches-py"
SPLITS = {"test": ["test_batch"], "train": [f"data_batch_{i}" for i in range(1, 6)]}
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
SIZE = 32
# The per-channel statistics of the training set, and the usual pad-4 crop and flip (He et al. 2016, §4.2).
TRANSFORMS = TransformSpec(flip=0.5, pad_crop=4, mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616))
LAYOUT = f"root/{FOLDER}/{{data_batch_1..5,test_batch,batches.meta}} (or those files in root itself)"


def unpickle(path: Path) -> dict[bytes, Any]:
    """One pickled batch, read as the release's Python 2 pickles must be (``encoding="bytes"``)."""
    try:
        with path.open("rb") as f:
            blob = pickle.load(f, encoding="bytes")
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, AttributeError, ImportError) as err:
        raise ValueError(f"{path}: not a CIFAR pickle ({' '.join(str(err).split()) or type(err).__name__})") from None
    if not isinstance(blob, dict):
        raise ValueError(f"{path}: not a CIFAR pickle (expected a dict, got {type(blob).__name__})")
    return blob


def read_batch(path: Path, classes: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images ``[n, 3, 32, 32]`` and int64 labels of one batch file."""
    blob = unpickle(path)
    data, labels = blob.get(b"data"), blob.get(b"labels")
    if not isinstance(data, np.ndarray) or data.ndim != 2 or data.shape[1] != 3 * SIZE * SIZE or labels is None:
        raise ValueError(f"{path}: expected b'data' uint8 [n, {3 * SIZE * SIZE}] and b'labels'")
    y = np.asarray(labels, dtype=np.int64)
    if y.shape != (len(data),) or (len(y) and not 0 <= y.min() <= y.max() < classes):
        raise ValueError(f"{path}: expected {len(data)} labels in 0..{classes - 1}")
    return data.astype(np.uint8).reshape(-1, 3, SIZE, SIZE), y


def read_cifar10(root: Path | None, seed: int, cache_dir: Path) -> Samples:
    """The official train and test batches (``seed`` and ``cache_dir`` are unused: the pickles load in seconds)."""
    assert root is not None
    folder = root / FOLDER if (root / FOLDER).is_dir() else root
    missing = [n for n in ["batches.meta", *SPLITS["test"], *SPLITS["train"]] if not (folder / n).is_file()]
    if missing:
        raise ValueError(f"{folder}: missing {', '.join(missing)}; expected {LAYOUT}")
    names = unpickle(folder / "batches.meta").get(b"label_names")
    if not isinstance(names, list) or not all(isinstance(n, bytes) for n in names):
        raise ValueError(f"{folder / 'batches.meta'}: expected b'label_names', a list of class names")
    classes = [n.decode() for n in names]
    parts = [(d, *read_batch(folder / f, len(classes))) for d, files in enumerate(SPLITS.values()) for f in files]
    images = np.concatenate([x for _, x, _ in parts])
    labels = np.concatenate([y for _, _, y in parts])
    domain_ids = np.concatenate([np.full(len(y), d, dtype=np.int64) for d, _, y in parts])
    return Samples(list(SPLITS), classes, labels, domain_ids, SIZE, 3, images=images)


SOURCE = Source(read_cifar10, list(SPLITS), CLASSES, SIZE, TRANSFORMS, layout=LAYOUT)
