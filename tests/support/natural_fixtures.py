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


# (split, location_remapped, y) of the IWildCam fixture: 4 training locations of 4 images, the ood val split
# (2 locations) and test split (1 location), and id_val / id_test rows of training locations (left out).
IWILDCAM_ROWS = [*(("train", loc, y) for loc in (7, 3, 12, 20) for y in (0, 5, 0, 181)),
                 ("val", 30, 5), ("val", 31, 0), ("val", 30, 181), ("test", 40, 0), ("test", 40, 5),
                 ("id_val", 3, 5), ("id_test", 7, 0)]
IWILDCAM_COLOURS = {0: (200, 0, 0), 5: (0, 200, 0), 181: (0, 0, 200)}  # each class's constant colour


def iwildcam_tree(root, rows=IWILDCAM_ROWS):
    """``root/iwildcam_v2.0/metadata.csv`` in WILDS' column order and a 24 × 16 JPEG per row under ``train/``."""
    folder = root / "iwildcam_v2.0"
    lines = ["split,location_remapped,location,sequence_remapped,y,filename,datetime"]
    for i, (split, loc, y) in enumerate(rows):
        name = f"{i:04d}.jpg"
        (folder / "train").mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((16, 24, 3), IWILDCAM_COLOURS.get(y, (90, 90, 90)), dtype=np.uint8)).save(
            folder / "train" / name, quality=100)
        lines.append(f"{split},{loc},{loc + 100},{i},{y},{name},2013-06-0{1 + i % 9} 08:00:00")
    (folder / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root
