"""The CIFAR-10 and Tiny-ImageNet readers' refusals and layouts, from a mutation audit: each malformed part of a
release is refused in one line naming it, and what the release documents (channel planes, pickles beside the root,
class names from words.txt, the val annotations table) is read as documented."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.natural_fixtures import cifar_batches, tiny_imagenet_tree

from feddg.data import cifar, tinyimagenet
from feddg.data.cifar import read_batch, read_cifar10
from feddg.data.tinyimagenet import class_names, read_tinyimagenet, read_val


def _pickle(path: Path, blob: Any) -> Path:
    path.write_bytes(pickle.dumps(blob))
    return path


@pytest.mark.parametrize(("blob", "message"), [
    ({b"data": np.zeros((2, 3073), np.uint8), b"labels": [0, 1]}, "expected b'data' uint8 [n, 3072] and b'labels'"),
    ({b"data": np.zeros((2, 3072), np.uint8)}, "expected b'data' uint8 [n, 3072] and b'labels'"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0]}, "expected 2 labels in 0..9"),
    ({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, "expected 2 labels in 0..9"),  # 10 classes: 0..9
    ([1, 2], "not a CIFAR pickle (expected a dict, got list)"),
])
def test_a_cifar_batch_is_refused_in_one_line(tmp_path: Path, blob: Any, message: str) -> None:
    path = _pickle(tmp_path / "data_batch_1", blob)
    with pytest.raises(ValueError, match=r"^[^\n]*$") as err:
        read_batch(path, 10)
    assert str(err.value) == f"{path}: {message}"


def test_a_cifar_row_is_its_red_green_and_blue_planes(tmp_path: Path) -> None:
    row = np.concatenate([np.full(1024, 1), np.full(1024, 2), np.full(1024, 3)]).astype(np.uint8)
    row[1024 + 32 * 5 + 7] = 9  # the green plane's pixel at row 5, column 7
    images, labels = read_batch(_pickle(tmp_path / "b", {b"data": row[None], b"labels": [9]}), 10)
    assert images.shape == (1, 3, 32, 32) and labels.tolist() == [9]
    assert [int(images[0, c, 0, 0]) for c in range(3)] == [1, 2, 3] and images[0, 1, 5, 7] == 9


def test_cifar_pickles_may_lie_in_the_root_itself_and_need_byte_class_names(tmp_path: Path) -> None:
    cifar_batches(tmp_path / "flat")  # the files, without the cifar-10-batches-py folder
    samples = read_cifar10(tmp_path / "flat", 0, tmp_path)
    assert samples.domains == ["test", "train"] and len(samples.labels) == 12
    _pickle(tmp_path / "flat" / "batches.meta", {b"label_names": ["airplane"] * 10})  # str, not the release's bytes
    with pytest.raises(ValueError, match=r"batches\.meta: expected b'label_names', a list of class names$"):
        read_cifar10(tmp_path / "flat", 0, tmp_path)


def test_cifar_trains_with_the_papers_pad_4_crop_and_flip_on_the_training_sets_statistics() -> None:
    spec = cifar.TRANSFORMS
    assert (spec.flip, spec.pad_crop) == (0.5, 4)
    assert spec.mean == (0.4914, 0.4822, 0.4465) and spec.std == (0.2470, 0.2435, 0.2616)


def test_tiny_imagenet_class_names_come_from_words_txt_or_are_the_wnids(tmp_path: Path) -> None:
    assert class_names(tmp_path, ["n02", "n01"]) == ["n02", "n01"]  # no words.txt: the wnids, in wnids.txt's order
    (tmp_path / "words.txt").write_text("n01\tgoldfish, Carassius auratus\nn03\t\nno tab here\n")
    assert class_names(tmp_path, ["n02", "n01", "n03"]) == ["n02", "goldfish", "n03"]


def test_tiny_imagenet_val_table_skips_blank_lines_and_refuses_short_or_dangling_rows(tmp_path: Path) -> None:
    tiny_imagenet_tree(tmp_path)
    table, index = tmp_path / "val" / "val_annotations.txt", {"n02": 0, "n01": 1}
    table.write_text("val_0.JPEG\tn01\t0\t0\t63\t63\n\n  \nval_1.JPEG\tn02\n")
    files, labels = read_val(tmp_path, index)
    assert [f.name for f in files] == ["val_0.JPEG", "val_1.JPEG"] and labels == [1, 0]
    table.write_text("val_0.JPEG\tn01\nval_1.JPEG\n")
    with pytest.raises(ValueError, match=r"line 2: expected <file><TAB><wnid of wnids.txt>, got 'val_1.JPEG'$"):
        read_val(tmp_path, index)
    table.write_text("val_0.JPEG\tn01\nval_9.JPEG\tn01\n")
    with pytest.raises(ValueError, match=rf"line 2: no image {tmp_path / 'val' / 'images' / 'val_9.JPEG'}$"):
        read_val(tmp_path, index)


def test_tiny_imagenet_refuses_repeated_wnids_a_class_without_images_and_an_undecodable_list(tmp_path: Path) -> None:
    tiny_imagenet_tree(tmp_path)
    (tmp_path / "wnids.txt").write_text("n01\nn02\nn01\n")
    with pytest.raises(ValueError, match=r"wnids\.txt: expected distinct WordNet ids, one a line$"):
        read_tinyimagenet(tmp_path, 0, tmp_path)
    (tmp_path / "wnids.txt").write_text("n01\nn02\nn03\n")
    (tmp_path / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn01\n")
    with pytest.raises(ValueError, match=r"train/n03/images: no \.JPEG image of class n03; expected root/wnids"):
        read_tinyimagenet(tmp_path, 0, tmp_path)
    (tmp_path / "wnids.txt").write_bytes(b"n01\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"wnids\.txt: not readable \(.*\); expected root/wnids\.txt"):
        read_tinyimagenet(tmp_path, 0, tmp_path)
    assert tinyimagenet.DOMAINS == ["val", "train"]
