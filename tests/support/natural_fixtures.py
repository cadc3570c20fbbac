"""Fixtures in the published on-disk formats of the natural-client datasets (LEAF json, CIFAR-10's python pickles,
the Tiny-ImageNet release tree), written by the tests that read them."""

from __future__ import annotations

import json
import pickle

import numpy as np
from PIL import Image


def leaf_blob(users: dict[str, tuple[list[float], list[int]]]) -> dict:
    """A LEAF json blob; each user's images are constant ``value`` images."""
    return {"users": list(users), "num_samples": [len(y) for _, y in users.values()],
            "user_data": {u: {"x": [[v] * 784 for v in xs], "y": ys} for u, (xs, ys) in users.items()}}


def write_json(path, blob):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(blob))


def cifar_batches(folder, per_batch=2):
    folder.mkdir(parents=True)
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    with (folder / "batches.meta").open("wb") as f:
        pickle.dump({b"label_names": names, b"num_vis": 3072}, f)
    for k, file in enumerate(["test_batch", *(f"data_batch_{i}" for i in range(1, 6))]):
        data = np.zeros((per_batch, 3072), dtype=np.uint8)
        data[:, 1024] = k  # the green plane's first pixel
        with (folder / file).open("wb") as f:
            pickle.dump({b"data": data, b"labels": [k, 9 - k][:per_batch], b"filenames": []}, f)


def jpeg(path, rgb):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((64, 64, 3), rgb, dtype=np.uint8)).save(path, quality=100)


def tiny_imagenet_tree(root):
    (root / "wnids.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "wnids.txt").write_text("n02\nn01\n")
    (root / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn02\tEuropean fire salamander\n")
    for wnid, rgb in [("n01", (200, 0, 0)), ("n02", (0, 0, 200))]:
        for i in range(2):
            jpeg(root / "train" / wnid / "images" / f"{wnid}_{i}.JPEG", rgb)
    for i, wnid in enumerate(["n01", "n02", "n01"]):
        jpeg(root / "val" / "images" / f"val_{i}.JPEG", (200, 0, 0) if wnid == "n01" else (0, 0, 200))
    (root / "val" / "val_annotations.txt").write_text(
        "".join(f"val_{i}.JPEG\t{w}\t0\t0\t63\t63\n" for i, w in enumerate(["n01", "n02", "n01"])))
