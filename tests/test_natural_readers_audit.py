"""The CIFAR-10 and Tiny-ImageNet readers and the synthetic writers, from a mutation audit: each malformed part of a
release is refused in one line naming it, what the release documents (channel planes, pickles beside the root, class
names from words.txt, the val annotations table) is read as documented, and the writers' hands span the documented
ranges."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.natural_fixtures import cifar_batches, tiny_imagenet_tree

from feddg.data import cifar, tinyimagenet, writers
from feddg.data.cifar import read_batch, read_cifar10
from feddg.data.tinyimagenet import class_names, read_tinyimagenet, read_val
from feddg.data.writers import writer_styles


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


def test_writers_styles_span_the_documented_ranges() -> None:
    style = writer_styles(0)  # 3,400 writers: every documented bound is reached or nearly
    assert style["digits"].min() == 5 and style["digits"].max() == 15  # "5 to 15 digits each", inclusive
    assert set(style["stroke"].tolist()) == {-1, 0, 1}
    assert 2.4 < np.abs(style["offset"]).max() <= 2.5 and 0.45 < np.abs(style["slant"]).max() <= 0.5
    assert 0.8 <= style["scale"].min() < 0.81 and 1.14 < style["scale"].max() <= 1.15


def test_writers_jitter_each_digit_about_its_writers_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, np.ndarray] = {}

    def record(digits: np.ndarray, slant: np.ndarray, scale: np.ndarray, offset: np.ndarray,
               stroke: np.ndarray) -> np.ndarray:
        seen.update(slant=slant, offset=offset)
        return np.zeros((len(digits), 1, 28, 28), np.uint8)

    monkeypatch.setattr(writers, "draw", record)
    samples = writers.build_writers(0, 400)
    style = writer_styles(0, 400)
    who = samples.domain_ids
    # per-digit jitter: shear σ 0.05, offset σ 0.5 px (module docstring); ~4,000 digits give σ within 10 %
    assert np.std(seen["slant"] - style["slant"][who]) == pytest.approx(0.05, rel=0.1)
    assert np.std(seen["offset"] - style["offset"][who]) == pytest.approx(0.5, rel=0.1)
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        writers.build_writers(0, 0)


def test_writers_strokes_dilate_keep_or_blend_the_erosion_half_way() -> None:
    ink = torch.zeros(3, 1, 5, 5)
    ink[:, :, 1:4, 1:4] = 1.0  # a 3×3 block of ink
    bold, same, thin = writers._stroke(ink, torch.tensor([1, 0, -1]))
    assert torch.equal(bold[0], torch.ones(5, 5)) and torch.equal(same, ink[1])
    expected = 0.5 * ink[2, 0]  # (x + erosion) / 2: the erosion keeps only the centre
    expected[2, 2] = 1.0
    assert torch.equal(thin[0], expected)


def test_writers_identity_draw_returns_the_digit_exactly() -> None:
    digit = np.random.default_rng(0).integers(0, 256, (2, 28, 28), dtype=np.uint8)
    out = writers.draw(digit, np.zeros(2), np.ones(2), np.zeros((2, 2)), np.zeros(2, np.int64))
    assert np.array_equal(out[:, 0], digit)  # rounded, not truncated, back to uint8
