"""Datasets in their published formats: FEMNIST (LEAF json, metadata.csv), CIFAR-10 pickles, Tiny-ImageNet, and the
built-in ``writers``; each fixture is written here in the exact on-disk format."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.natural_fixtures import cifar_batches, iwildcam_tree, leaf_blob, tiny_imagenet_tree, write_json

from feddg.config import build_config
from feddg.data import load_dataset
from feddg.data.inspect import check_dataset
from feddg.data.writers import build_writers, draw, writer_styles
from feddg.federation.setup import make_clients, make_split


def test_leaf_all_data_makes_each_writer_a_domain_and_a_group(tmp_path):
    write_json(tmp_path / "all_data_0.json", leaf_blob({"f0001": ([0.0, 1.0], [3, 10]), "empty": ([], [])}))
    write_json(tmp_path / "all_data_1.json", leaf_blob({"f0000": ([0.5], [36])}))
    ds = load_dataset("femnist", root=str(tmp_path), cache_dir=tmp_path / "cache")
    assert ds.domains == ds.group_names == ["f0000", "f0001"]  # the empty user is skipped
    np.testing.assert_array_equal(ds.labels, [3, 10, 36])
    np.testing.assert_array_equal(ds.groups, [1, 1, 0])
    np.testing.assert_array_equal(ds.domain_ids, ds.groups)
    assert [ds.classes[k] for k in ds.labels] == ["3", "A", "a"] and len(ds.classes) == 62
    assert ds.image_shape == (1, 28, 28)
    x, _ = ds.get_batch(np.arange(3), train=False)  # pixels 0, 255, round(127.5) = 128, normalised by 0.5
    np.testing.assert_allclose(x[:, 0, 0, 0].numpy(), [-1.0, 1.0, 128 / 255 * 2 - 1], atol=1e-6)


def test_leaf_all_data_folder_is_read_as_well(tmp_path):
    write_json(tmp_path / "all_data" / "part_0.json", leaf_blob({"f2": ([0.5], [7]), "f1": ([0.5], [8])}))
    ds = load_dataset("femnist", root=str(tmp_path), cache_dir=tmp_path / "cache")
    assert ds.domains == ds.group_names == ["f1", "f2"]
    np.testing.assert_array_equal(ds.labels, [7, 8])
    np.testing.assert_array_equal(ds.domain_ids, [1, 0])


def test_leaf_train_and_test_files_are_the_domains_with_writers_shared_across_them(tmp_path):
    write_json(tmp_path / "train" / "a.json", leaf_blob({"u1": ([0.1, 0.2], [0, 61]), "u2": ([0.3], [5])}))
    write_json(tmp_path / "test" / "a.json", leaf_blob({"u2": ([0.4], [7]), "u1": ([0.5], [1])}))
    ds = load_dataset("femnist", root=str(tmp_path), cache_dir=tmp_path / "cache")
    assert ds.domains == ["test", "train"] and ds.group_names == ["u1", "u2"]
    np.testing.assert_array_equal(ds.domain_ids, [0, 0, 1, 1, 1])
    np.testing.assert_array_equal(ds.labels, [7, 1, 0, 61, 5])
    np.testing.assert_array_equal(ds.groups, [1, 0, 0, 0, 1])
    assert ds.classes[61] == "z"


def _png(path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((28, 28), value, dtype=np.uint8)).save(path)


def test_metadata_csv_splits_are_the_domains_and_its_domain_column_the_writers(tmp_path):
    for name, value in [("a.png", 0), ("b.png", 51), ("c.png", 255)]:
        _png(tmp_path / "img" / name, value)
    (tmp_path / "metadata.csv").write_text("path,y,split,domain\nimg/a.png,4,train,w9\nimg/b.png,35,test,w1\n"
                                           "img/c.png,12,val,w9\n")
    ds = load_dataset("femnist", root=str(tmp_path), cache_dir=tmp_path / "cache")
    assert ds.domains == ["test", "train", "val"] and ds.group_names == ["w1", "w9"]
    np.testing.assert_array_equal(ds.domain_ids, [1, 0, 2])
    np.testing.assert_array_equal(ds.groups, [1, 0, 1])
    assert [ds.classes[k] for k in ds.labels] == ["4", "Z", "C"] and ds.image_shape == (1, 28, 28)
    x, _ = ds.get_batch(np.arange(3), train=False)
    np.testing.assert_allclose(x[:, 0, 5, 5].numpy(), [-1.0, 51 / 255 * 2 - 1, 1.0], atol=1e-6)


def _wilds_femnist(root, rows):
    """FedDG_Benchmark's ``root/femnist_v1.0/metadata.csv`` (pandas' unnamed index first) and its images."""
    folder = root / "femnist_v1.0"
    lines = [",path,y,split,domain_remapped"]
    for i, (path, split, writer) in enumerate(rows):
        _png(folder / path, 20 * i)
        lines.append(f"{i},{path},{i},{split},{writer}")
    (folder / "metadata.csv").write_text("\n".join(lines) + "\n")
    return folder


def test_the_wilds_femnist_release_loads_from_its_parent_with_the_id_splits_left_out(tmp_path):
    rows = [("data/0.png", "train", 3), ("data/1.png", "id_val", 3), ("data/2.png", "val", 7), ("data/3.png", "2", 5),
            ("data/4.png", "id_test", 5), ("data/5.png", "0", 5)]
    folder = _wilds_femnist(tmp_path, rows)
    for root in (tmp_path, folder):
        ds = load_dataset("femnist", root=str(root), cache_dir=tmp_path / "cache")
        assert ds.domains == ["test", "train", "val"] and ds.group_names == ["3", "5", "7"]
        assert ds.ood_validation == "val"  # WILDS' ood validation split: a split that would train on it is refused
        np.testing.assert_array_equal(ds.labels, [0, 2, 3, 5])  # rows 1 and 4 (id_val, id_test) left out
        np.testing.assert_array_equal(ds.domain_ids, [1, 2, 0, 1])  # codes 2 and 0 read as test and train
        np.testing.assert_array_equal(ds.groups, [0, 2, 1, 1])
        assert ds.files[1] == folder / "data" / "2.png"


def test_an_image_listed_on_two_lines_of_metadata_csv_is_one_line_naming_both(tmp_path):
    folder = _wilds_femnist(tmp_path, [("a.png", "train", 1), ("b.png", "train", 1), ("./a.png", "test", 2)])
    with pytest.raises(ValueError, match=r"^[^\n]*$") as err:
        load_dataset("femnist", root=str(tmp_path), cache_dir=tmp_path / "cache")
    assert f"{folder / 'metadata.csv'}: line 4: image {folder / './a.png'} (test) is already listed on line 2 " \
           "(train)" in str(err.value)
    other = _wilds_femnist(tmp_path / "up", [("a.png", "train", 1), ("d/../a.png", "test", 2)])  # one file, two names
    with pytest.raises(ValueError, match="is already listed on line 2"):
        load_dataset("femnist", root=str(other), cache_dir=tmp_path / "cache")


def test_the_writer_column_is_domain_remapped_where_a_table_has_both(tmp_path):
    # FedDG_Benchmark's table holds the raw domain beside domain_remapped: the remapped ids are the writers
    _png(tmp_path / "a.png", 0)
    _png(tmp_path / "b.png", 0)
    (tmp_path / "metadata.csv").write_text("path,y,split,domain,domain_remapped\na.png,1,train,x,w2\n"
                                           "b.png,2,train,x,w1\n")
    ds = load_dataset("femnist", root=str(tmp_path), cache_dir=tmp_path / "cache")
    assert ds.group_names == ["w1", "w2"]
    np.testing.assert_array_equal(ds.groups, [1, 0])


def test_leaf_files_that_repeat_a_user_or_disagree_with_themselves_are_one_line(tmp_path):
    """A copied all_data file was read twice (every sample of its writers doubled); a user only in user_data was
    dropped; an x without y crashed naming no file."""
    write_json(tmp_path / "a" / "all_data_0.json", leaf_blob({"f1": ([0.5], [1]), "f2": ([0.5], [2])}))
    write_json(tmp_path / "a" / "all_data_0 (copy).json", leaf_blob({"f1": ([0.5], [1])}))
    cases = {"a": f"{tmp_path / 'a' / 'all_data_0.json'}: user f1 is also in {tmp_path / 'a' / 'all_data_0 (copy).json'}"}
    unlisted = leaf_blob({"f1": ([0.5], [1])})
    unlisted["user_data"]["f9"] = {"x": [], "y": []}
    write_json(tmp_path / "b" / "all_data_0.json", unlisted)
    cases["b"] = "all_data_0.json: user f9: in user_data but not listed in users"
    counted = leaf_blob({"f1": ([0.5], [1])})
    counted["num_samples"] = [5]
    write_json(tmp_path / "c" / "all_data_0.json", counted)
    cases["c"] = "all_data_0.json: user f1: num_samples says 5, user_data holds 1 samples"
    unlabelled = leaf_blob({"f1": ([0.5], [1]), "f2": ([0.5, 0.5], [])})
    unlabelled["num_samples"] = [1, 0]
    write_json(tmp_path / "d" / "all_data_0.json", unlabelled)
    cases["d"] = "all_data_0.json: user f2: x must be 0 lists of 784 numbers (one per label), got shape (2, 784)"
    for folder, expected in cases.items():
        with pytest.raises(ValueError, match=r"^[^\n]*$") as err:
            load_dataset("femnist", root=str(tmp_path / folder), cache_dir=tmp_path / "cache")
        assert expected in str(err.value), (folder, str(err.value))


def _broken_leaf(root):
    write_json(root / "all_data_0.json", leaf_blob({"u": ([0.5], [1])}))
    return []


def _broken_tiny(root):
    tiny_imagenet_tree(root)
    (root / "val" / "images" / "val_1.JPEG").write_bytes(b"not a JPEG")
    return [f"cannot read image {root / 'val' / 'images' / 'val_1.JPEG'}: "]


def _broken_iwildcam(root):
    iwildcam_tree(root)
    image = root / "iwildcam_v2.0" / "train" / "0003.jpg"
    image.write_bytes(image.read_bytes()[:200])  # truncated: the header opens, the pixels do not
    return [f"cannot read image {image}: "]


@pytest.mark.parametrize(("name", "make"), [("femnist", _broken_leaf), ("tiny-imagenet", _broken_tiny),
                                            ("iwildcam", _broken_iwildcam)])
def test_check_decodes_every_image_and_writes_no_cache(tmp_path, monkeypatch, name, make):
    monkeypatch.setenv("FEDDG_CACHE", str(tmp_path / "cache"))
    expected = make(tmp_path / "data")
    problems = check_dataset(name, root=str(tmp_path / "data"))
    assert len(problems) == len(expected) and all(p.startswith(e) for p, e in zip(problems, expected, strict=True))
    assert not (tmp_path / "cache").exists()


def test_cifar10_pickles_give_the_official_test_split_as_the_default_lodo_target(tmp_path):
    cifar_batches(tmp_path / "cifar-10-batches-py")
    ds = load_dataset("cifar10", root=str(tmp_path), cache_dir=tmp_path / "cache", transforms="none")
    assert ds.domains == ["test", "train"] and ds.classes[1] == "automobile" and ds.image_shape == (3, 32, 32)
    np.testing.assert_array_equal(ds.labels, [0, 9, 1, 8, 2, 7, 3, 6, 4, 5, 5, 4])
    np.testing.assert_array_equal(ds.domain_ids, [0, 0] + [1] * 10)
    assert ds.groups is None
    x, _ = ds.get_batch(np.array([0, 11]), train=False)  # green pixel 0 of test_batch (0) and data_batch_5 (5)
    mean, std = 0.4822, 0.2435
    np.testing.assert_allclose(x[:, 1, 0, 0].numpy(), [(0 - mean) / std, (5 / 255 - mean) / std], atol=1e-5)
    cfg = build_config({"data": {"dataset": "cifar10", "root": str(tmp_path)},
                        "partition": {"kind": "dirichlet_labels", "num_clients": 2, "params": {"alpha": 100.0}}})
    split = make_split(ds, cfg)
    np.testing.assert_array_equal(split.test_idx, [0, 1])
    np.testing.assert_array_equal(split.source_idx, np.arange(2, 12))


def test_tiny_imagenet_reads_the_release_tree_with_val_as_the_test_split(tmp_path):
    tiny_imagenet_tree(tmp_path / "tiny")
    ds = load_dataset("tiny-imagenet", root=str(tmp_path / "tiny"), cache_dir=tmp_path / "cache", transforms="none")
    assert ds.classes == ["European fire salamander", "goldfish"]  # wnids.txt order, words.txt's first name
    assert ds.domains == ["val", "train"] and ds.image_shape == (3, 64, 64)
    np.testing.assert_array_equal(ds.labels, [1, 0, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(ds.domain_ids, [0, 0, 0, 1, 1, 1, 1])
    x, y = ds.get_batch(np.arange(7), train=False)
    red = x[:, 0].mean((1, 2)) > x[:, 2].mean((1, 2))  # goldfish images are red, the salamander's blue
    np.testing.assert_array_equal(red.numpy(), (y == 1).numpy())


def _bad_leaf(root):
    blob = leaf_blob({"ok": ([0.5], [1]), "f0042": ([0.5], [2])})
    blob["user_data"]["f0042"]["x"][0] = [0.5] * 783
    write_json(root / "all_data_0.json", blob)
    return "all_data_0.json: user f0042: x must be 1 lists of 784"


def _leaf_file(users: dict, message: str) -> Callable[[Path], str]:
    """A LEAF all_data file of ``users``; the error it must give."""
    def make(root: Path) -> str:
        write_json(root / "all_data_0.json", leaf_blob(users))
        return message
    return make


def _wilds_table(rows: str, message: str) -> Callable[[Path], str]:
    """One image and a WILDS-style metadata.csv of ``rows``; the error it must give."""
    def make(root: Path) -> str:
        _png(root / "a.png", 0)
        (root / "metadata.csv").write_text("path,y,split,domain\n" + rows)
        return message
    return make


def _headers(text: str, message: str) -> Callable[[Path], str]:
    """One image and a metadata.csv of ``text`` (its header included); the error it must give."""
    def make(root: Path) -> str:
        _png(root / "a.png", 0)
        (root / "metadata.csv").write_text(text)
        return message
    return make


def _bad_cifar(root):
    cifar_batches(root / "cifar-10-batches-py")
    (root / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"\x80\x02}q\x00(")
    return "data_batch_3: not a CIFAR pickle"


def _bad_tiny(root):
    tiny_imagenet_tree(root)
    (root / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn01\t0\t0\t1\t1\nval_1.JPEG\tn99\t0\t0\t1\t1\n")
    return "val_annotations.txt: line 2: expected <file><TAB><wnid of wnids.txt>"


@pytest.mark.parametrize(("name", "make"), [
    ("femnist", _bad_leaf),
    ("femnist", _leaf_file({"ok": ([0.5], [1]), "f7": ([1.5], [2])}, "all_data_0.json: user f7: x values must lie in 0..1")),
    ("femnist", _leaf_file({"ok": ([0.5], [1]), "f8": ([0.5], [True])},
                           "all_data_0.json: user f8: label True is not an integer")),
    ("femnist", _wilds_table("a.png,1,train,w\na.png,62,train,w\n", "metadata.csv: line 3: label 62 is outside 0..61")),
    ("femnist", _wilds_table("a.png,1,train, \n", "metadata.csv: line 2: empty domain")),
    ("femnist", _wilds_table("a.png,1,test,w\n", "metadata.csv: no row of the train split")),
    ("femnist", _leaf_file({"a": ([], []), "b": ([], [])}, "the LEAF files hold no sample")),
    ("femnist", _headers("path,split,domain\na.png,train,w\n", "metadata.csv: expected a header with columns path, y")),
    ("cifar10", _bad_cifar),
    ("tiny-imagenet", _bad_tiny),
])
def test_a_malformed_file_is_one_line_naming_it(tmp_path, name, make):
    expected = make(tmp_path / "data")
    with pytest.raises(ValueError, match=r"^[^\n]*$") as err:
        load_dataset(name, root=str(tmp_path / "data"), cache_dir=tmp_path / "cache")
    assert str(tmp_path / "data") in str(err.value) and expected in str(err.value)


def test_affine_draw_shifts_by_whole_pixels_and_shears_as_x_minus_s_y():
    dot = np.zeros((1, 28, 28), dtype=np.uint8)
    dot[0, 10, 12] = 255
    moved = draw(dot, np.zeros(1), np.ones(1), np.array([[3.0, -2.0]]), np.zeros(1, dtype=np.int64))
    assert np.argwhere(moved[0, 0] == 255).tolist() == [[8, 15]]  # row 10 - 2, column 12 + 3
    line = np.zeros((1, 28, 28), dtype=np.uint8)
    line[0, 4:24, 14] = 255
    sheared = draw(line, np.array([0.5]), np.ones(1), np.zeros((1, 2)), np.zeros(1, dtype=np.int64))[0, 0]
    assert _slant(sheared[None]) == pytest.approx(-0.5, abs=0.02)  # x' - 13.5 = (x - 13.5) - 0.5 (y - 13.5)


def _slant(images: np.ndarray) -> np.ndarray:
    """Per image, the ink's second-moment slant ``cov(x, y) / var(y)`` (the deskewing slope of MNIST)."""
    w = images.reshape(len(images), 28, 28).astype(np.float64)
    ys, xs = np.mgrid[:28, :28]
    m = w.sum((1, 2))
    mx, my = (w * xs).sum((1, 2)) / m, (w * ys).sum((1, 2)) / m
    cov = (w * (xs - mx[:, None, None]) * (ys - my[:, None, None])).sum((1, 2)) / m
    var = (w * (ys - my[:, None, None]) ** 2).sum((1, 2)) / m
    return cov / var


def test_writers_are_deterministic_per_seed_with_measurably_different_hands():
    a, b, c = build_writers(0, 300), build_writers(0, 300), build_writers(1, 300)
    np.testing.assert_array_equal(a.images, b.images)
    assert not np.array_equal(a.images[:100], c.images[:100])
    assert a.domains == a.group_names and len(a.group_names) == 300 and set(a.groups.tolist()) == set(range(300))
    style = writer_styles(0, 300)
    np.testing.assert_array_equal(np.bincount(a.groups), style["digits"])
    slant = _slant(a.images[:, 0])
    per_writer = np.bincount(a.groups, slant) / np.bincount(a.groups)
    assert np.corrcoef(per_writer, style["slant"])[0, 1] < -0.9  # a writer's slant s tilts by -s
    ink = np.bincount(a.groups, a.images.reshape(len(a.images), -1).mean(1)) / np.bincount(a.groups)
    bold, thin = ink[style["stroke"] == 1].mean(), ink[style["stroke"] == -1].mean()
    assert bold > 1.5 * thin


def test_writers_natural_partition_gives_one_client_per_training_writer():
    ds = load_dataset("writers")
    assert len(ds.domains) == 3400 and ds.image_shape == (1, 28, 28)
    cfg = build_config({"data": {"dataset": "writers"}, "partition": {"kind": "natural"},
                        "split": {"target_fraction": 0.1}})
    split = make_split(ds, cfg)
    clients = make_clients(ds, split, cfg)
    assert len(split.test_domains) == 340 and len(clients) == 3060
    assert all(len(np.unique(ds.groups[np.concatenate([c.train_idx, c.holdout_idx])])) == 1 for c in clients[:100])


def test_leaf_num_samples_of_the_wrong_length_and_a_split_without_files_are_refused(tmp_path):
    blob = leaf_blob({"f1": ([0.5], [1]), "f2": ([0.5], [2])})
    blob["num_samples"] = [1]
    write_json(tmp_path / "a" / "all_data_0.json", blob)
    with pytest.raises(ValueError, match=r"all_data_0.json: num_samples must list one count per user \(2\)"):
        load_dataset("femnist", root=str(tmp_path / "a"), cache_dir=tmp_path / "cache")
    write_json(tmp_path / "b" / "train" / "a.json", leaf_blob({"u1": ([0.5], [1])}))
    (tmp_path / "b" / "test").mkdir()  # LEAF's split with its test files missing
    with pytest.raises(ValueError, match="no FEMNIST data; expected"):
        load_dataset("femnist", root=str(tmp_path / "b"), cache_dir=tmp_path / "cache")


def test_a_leaf_writer_without_samples_may_be_listed_in_two_files(tmp_path):
    """LEAF lists writers with too few samples with empty lists; having no samples, such a writer repeats nothing."""
    write_json(tmp_path / "all_data_0.json", leaf_blob({"f1": ([0.5], [1]), "gone": ([], [])}))
    write_json(tmp_path / "all_data_1.json", leaf_blob({"f2": ([0.5], [2]), "gone": ([], [])}))
    ds = load_dataset("femnist", root=str(tmp_path), cache_dir=tmp_path / "cache")
    assert ds.group_names == ["f1", "f2"]


def test_metadata_writers_are_stripped_and_femnist_v1_0_is_read_before_root(tmp_path):
    _png(tmp_path / "femnist_v1.0" / "a.png", 0)
    _png(tmp_path / "femnist_v1.0" / "b.png", 0)
    (tmp_path / "femnist_v1.0" / "metadata.csv").write_text("path,y,split,domain\na.png,1,train,w1\n"
                                                            "b.png,2,train, w1 \n")
    (tmp_path / "metadata.csv").write_text("path,y,split,domain\nelsewhere.png,3,train,w9\n")
    ds = load_dataset("femnist", root=str(tmp_path), cache_dir=tmp_path / "cache")
    assert ds.group_names == ["w1"]
    np.testing.assert_array_equal(ds.groups, [0, 0])
    np.testing.assert_array_equal(ds.labels, [1, 2])


def test_leaf_reads_only_all_data_files_beside_other_json(tmp_path):
    write_json(tmp_path / "all_data_0.json", leaf_blob({"f1": ([0.5], [1])}))
    write_json(tmp_path / "stats.json", {"writers": 1})  # not a LEAF data file
    ds = load_dataset("femnist", root=str(tmp_path), cache_dir=tmp_path / "cache")
    assert ds.group_names == ["f1"]
    np.testing.assert_array_equal(ds.labels, [1])
