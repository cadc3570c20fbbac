"""IWildCam (WILDS v2.0) from its metadata.csv and JPEGs, written here in that layout, and macro-F1 (WILDS' metric)
from the classification tally."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.natural_fixtures import IWILDCAM_ROWS, iwildcam_tree

from feddg.config import build_config
from feddg.data import iwildcam, load_dataset
from feddg.experiment import run_experiment
from feddg.federation.setup import make_clients, make_split
from feddg.sweep import _cells, load_sweep
from feddg.tasks import make_task

TRAIN_LOCATIONS = ["location_3", "location_7", "location_12", "location_20"]


def _load(root, **options):
    return load_dataset("iwildcam", root=str(root), cache_dir=root / "cache", image_size=8, transforms="none",
                        **options)


def test_training_locations_are_domains_and_the_ood_splits_two_pooled_domains(tmp_path):
    ds = _load(iwildcam_tree(tmp_path))
    assert ds.domains == ["test", "val", *TRAIN_LOCATIONS]
    assert len(ds) == len(IWILDCAM_ROWS) - 2  # id_val and id_test left out
    # rows 0-15 train at locations 7, 3, 12, 20 (4 each), then val 30, 31, 30 and test 40, 40
    np.testing.assert_array_equal(ds.domain_ids, [3] * 4 + [2] * 4 + [4] * 4 + [5] * 4 + [1] * 3 + [0] * 2)
    np.testing.assert_array_equal(ds.labels, [0, 5, 0, 181] * 4 + [5, 0, 181, 0, 5])
    assert ds.num_classes == 182 and ds.image_shape == (3, 8, 8)
    assert ds.group_names == [*TRAIN_LOCATIONS, "location_30", "location_31", "location_40"]
    np.testing.assert_array_equal(ds.groups, [1] * 4 + [0] * 4 + [2] * 4 + [3] * 4 + [4, 5, 4, 6, 6])
    x, _ = ds.get_batch(np.array([0, 1, 3]), train=False)  # the 24 × 16 JPEGs resized: constant red, green, blue
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    np.testing.assert_allclose((x[:, :, 4, 4] * std + mean).numpy() * 255, 200 * np.eye(3), atol=2.5)


@pytest.mark.parametrize("split", [{}, {"target": "test"}, {"protocol": "ltdo", "val_domain": "location_3",
                                                                "target": "test"}])
def test_a_split_that_would_train_on_wilds_ood_validation_split_is_refused(tmp_path, split):
    """WILDS' val is an ood validation split: the default LODO (test held out) made its 32 locations clients."""
    ds = _load(iwildcam_tree(tmp_path))
    assert ds.ood_validation == "val"
    with pytest.raises(ValueError, match="domain 'val' is its official ood validation split and would train"):
        make_split(ds, build_config({"data": {"dataset": "iwildcam"}, "split": split}))
    for fine in ({"target": ["test", "val"]}, {"protocol": "ltdo", "val_domain": "val", "target": "test"}):
        make_split(ds, build_config({"data": {"dataset": "iwildcam"}, "split": fine}))
    assert _load(iwildcam_tree(tmp_path / "no-val", [r for r in IWILDCAM_ROWS if r[0] != "val"])).ood_validation is None


def test_holding_out_wilds_val_alone_does_not_train_on_its_test_split(tmp_path):
    """split.target: val made WILDS' official ood test split a training domain (a client under a natural
    partition)."""
    ds = _load(iwildcam_tree(tmp_path))
    assert ds.ood_test == "test"
    with pytest.raises(ValueError, match="domain 'test' is its official ood test split and would train"):
        make_split(ds, build_config({"data": {"dataset": "iwildcam"}, "split": {"target": "val"}}))
    split = make_split(ds, build_config({"data": {"dataset": "iwildcam"}, "split": {"target": ["test", "val"]}}))
    assert {ds.domains[d] for d in split.source_domains} == set(TRAIN_LOCATIONS)


def test_metadata_rows_are_numbered_as_the_file_and_a_row_with_extra_fields_is_refused(tmp_path):
    root = iwildcam_tree(tmp_path)
    table = root / "iwildcam_v2.0" / "metadata.csv"
    lines = table.read_text().splitlines()
    table.write_text("\ufeff" + "\n".join([*lines[:3], "", "", lines[3].replace(",0,0002.jpg", ",999,0002.jpg"),
                                            *lines[4:]]) + "\n")  # a BOM, two blank lines, then a bad label
    with pytest.raises(ValueError, match=r"metadata.csv: line 6: y '999' is not an integer in 0\.\.181$"):
        _load(root)
    table.write_text("\n".join([*lines[:2], lines[2] + ",EXTRA", *lines[3:]]) + "\n")
    with pytest.raises(ValueError, match=r"metadata.csv: line 3: 1 field\(s\) more than the header's 7$"):
        _load(root)


def test_without_a_val_split_the_training_locations_follow_test_alone(tmp_path):
    ds = _load(iwildcam_tree(tmp_path, [r for r in IWILDCAM_ROWS if r[0] != "val"]))
    assert ds.domains == ["test", *TRAIN_LOCATIONS] and ds.ood_validation is None and ds.ood_test == "test"
    # rows 0-15 train at locations 7, 3, 12, 20 (domains 2, 1, 3, 4), then test (0) twice
    np.testing.assert_array_equal(ds.domain_ids, [2] * 4 + [1] * 4 + [3] * 4 + [4] * 4 + [0] * 2)


def test_chosen_domains_are_renumbered_in_the_order_given(tmp_path):
    ds = _load(iwildcam_tree(tmp_path), domains=["location_12", "test", "location_3"])
    assert ds.domains == ["location_12", "test", "location_3"]
    assert ds.ood_validation is None and ds.ood_test == "test"  # val is not among them
    # kept in file order: rows 4-7 (location 3), 8-11 (location 12), 19-20 (test)
    np.testing.assert_array_equal(ds.domain_ids, [2] * 4 + [0] * 4 + [1] * 2)
    np.testing.assert_array_equal(ds.labels, [0, 5, 0, 181] * 2 + [0, 5])


def test_metadata_csv_may_lie_in_root_itself(tmp_path):
    ds = _load(iwildcam_tree(tmp_path) / "iwildcam_v2.0")
    assert ds.domains == ["test", "val", *TRAIN_LOCATIONS] and len(ds) == len(IWILDCAM_ROWS) - 2


def test_split_codes_read_as_names(tmp_path):
    coded = [({"train": "0", "val": "1", "test": "2", "id_val": "3"}[s], loc, y) for s, loc, y in IWILDCAM_ROWS[:-1]]
    ds = _load(iwildcam_tree(tmp_path, coded))
    assert ds.domains == ["test", "val", *TRAIN_LOCATIONS] and len(ds) == len(IWILDCAM_ROWS) - 2


def test_lambda_zero_gives_each_client_one_location_and_val_test_are_held_out(tmp_path):
    ds = _load(iwildcam_tree(tmp_path))
    cfg = build_config({"data": {"dataset": "iwildcam"}, "split": {"protocol": "ltdo", "val_domain": "val",
                                                                    "target": "test"},
                        "partition": {"kind": "lambda", "num_clients": 4, "params": {"lam": 0.0}, "holdout": 0.25}})
    split = make_split(ds, cfg)
    np.testing.assert_array_equal(split.val_idx, [16, 17, 18])
    np.testing.assert_array_equal(split.test_idx, [19, 20])
    clients = make_clients(ds, split, cfg)
    assert sorted(c.domains for c in clients) == [(2,), (3,), (4,), (5,)]
    for c in clients:  # 3 training images and 1 held out, all of the client's own location
        assert len(c.train_idx) == 3 and len(c.holdout_idx) == 1
        assert set(ds.domain_ids[np.concatenate([c.train_idx, c.holdout_idx])]) == set(c.domains)
    natural = build_config({"data": {"dataset": "iwildcam"}, "split": cfg.split.model_dump(),
                            "partition": {"kind": "natural"}})
    assert [c.domains for c in make_clients(ds, split, natural)] == [(2,), (3,), (4,), (5,)]  # a client a location


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.replace("location_remapped,", "place,"), "metadata.csv: no column location_remapped"),
    (lambda t: t.replace("\nval,30,", "\nood,30,"), "metadata.csv: line 18: unknown split 'ood'"),
    (lambda t: t.replace("\nval,30,", "\n7,30,"), "metadata.csv: line 18: unknown split '7'"),
    (lambda t: t.replace(",0000.jpg", ",gone.jpg"), "metadata.csv: line 2: no image "),
    (lambda t: t.replace("\nval,30,", "\nval,x30,"), "metadata.csv: line 18: location_remapped 'x30' is not an integer >= 0"),
    (lambda t: t.replace("\nval,30,", "\nval,3\u00b2,"), "metadata.csv: line 18: location_remapped '3\u00b2' is not an integer"),
    (lambda t: t.replace("\ntest,40,140,19,0,", "\ntest,40,140,19,182,"), "line 21: y '182' is not an integer in 0..181"),
    (lambda t: t.split("\n")[0] + "\n", "metadata.csv: no rows"),
])
def test_a_malformed_metadata_file_is_one_line_naming_it(tmp_path, edit, message):
    table = iwildcam_tree(tmp_path) / "iwildcam_v2.0" / "metadata.csv"
    table.write_text(edit(table.read_text()))
    with pytest.raises(ValueError, match=message) as err:
        _load(tmp_path)
    assert "\n" not in str(err.value) and str(table) in str(err.value)


def test_an_image_in_two_splits_is_one_line_naming_both_rows(tmp_path):
    table = iwildcam_tree(tmp_path) / "iwildcam_v2.0" / "metadata.csv"
    table.write_text(table.read_text() + "test,40,140,99,0,0001.jpg,2013-06-01 08:00:00\n")  # line 2's image again
    with pytest.raises(ValueError) as err:
        _load(tmp_path)
    image = tmp_path / "iwildcam_v2.0" / "train" / "0001.jpg"
    assert str(err.value) == f"{table}: line 25: image {image} (test) is already listed on line 3 (train); list each " \
                             "image once"


def _hand_tally(task, domains):
    """y = [0, 0, 1 | 1, 2, 2], predictions [0, 1, 1 | 1, 0, 3] (4 classes; class 3 predicted, never true)."""
    y, pred = torch.tensor([0, 0, 1, 1, 2, 2]), torch.tensor([0, 1, 1, 1, 0, 3])
    return task.tally(torch.nn.functional.one_hot(pred, 4).float(), y, np.asarray(domains), 2)


def test_macro_f1_by_hand_over_the_classes_present():
    task = make_task("classification", 4, metrics=["macro_f1"])
    pooled = _hand_tally(task, [0] * 6).sum(0)
    # F1 = 2 TP / (T + P): class 0 2·1/(2+2), class 1 2·2/(2+3), class 2 0/(2+0); class 3 (no sample) left out
    assert task.extra_score("macro_f1", pooled) == pytest.approx(100 * (0.5 + 0.8 + 0.0) / 3)
    assert task.score(pooled) == pytest.approx(50.0)
    # per domain: a (y 0 0 1, pred 0 1 1): 2/3, 2/3; b (y 1 2 2, pred 1 0 3): 1, 0 (class 0 predicted, not present)
    figures = task.extra_figures(_hand_tally(task, [0, 0, 0, 1, 1, 1]), ["a", "b"], "ood")
    assert figures == pytest.approx({"ood_macro_f1/a": 200 / 3, "ood_macro_f1/b": 50.0,
                                     "ood_macro_f1": (200 / 3 + 50) / 2})
    assert make_task("classification", 4).extra_figures(pooled[None], ["a"], "ood") == {}  # the default: none


def test_a_metric_the_task_does_not_offer_is_one_line():
    with pytest.raises(ValueError, match="the segmentation task reports no metric 'macro_f1' beside dice"):
        make_task("segmentation", 2, metrics=["macro_f1"])
    with pytest.raises(ValueError, match="eval.metrics: the classification task of digits-dg reports no 'auc'"):
        build_config({"eval": {"metrics": ["auc"]}})


def test_val_and_test_are_two_targets_with_accuracy_and_macro_f1_in_results(tmp_path):
    root = iwildcam_tree(tmp_path / "data")
    cfg = build_config({
        "data": {"dataset": "iwildcam", "root": str(root), "cache_dir": str(tmp_path / "cache"), "image_size": 8,
                 "transforms": "none"},
        "split": {"protocol": "ltdo", "val_domain": "val", "target": "test"},
        "partition": {"kind": "lambda", "num_clients": 4, "params": {"lam": 0.1}, "holdout": 0.25},
        "model": {"name": "cnn"}, "federation": {"rounds": 1, "batch_size": 4}, "eval": {"metrics": ["macro_f1"]},
        "device": "cpu"})
    results = run_experiment(cfg, tmp_path / "run", progress=False)
    counts, final = results["counts"], results["final"]
    assert {k: counts[k] for k in ("val_acc", "val_macro_f1", "ood_acc", "ood_macro_f1", "id_acc")} == {
        "val_acc": 3, "val_macro_f1": 3, "ood_acc": 2, "ood_macro_f1": 2, "id_acc": 4}
    assert final["val_acc"] == final["val_acc/val"] and final["ood_macro_f1"] == final["ood_macro_f1/test"]
    assert results["task"]["extra_metrics"] == ["macro_f1"]
    # ood macro-F1 again from the per-class view: test holds classes 0 and 5, one image each
    view, n = results["per_class"]["ood"], 2
    f1 = [2 * (view["recall"][k] / 100) / (1 + view["predicted"][k] / 100 * n) for k in (0, 5)]
    assert final["ood_macro_f1"] == pytest.approx(100 * np.mean(f1))


def test_the_paper_config_sweeps_its_one_val_test_pair_without_listing_the_locations():
    spec, raw = load_sweep(Path(__file__).parent.parent / "configs" / "pardon" / "paper-table3.yaml")
    assert _cells(spec, build_config(raw)) == [("val→test", ['split.val_domain="val"', 'split.target="test"'])]
    assert len(spec.variants) == 18 and {v["partition.params"]["lam"] for v in spec.variants.values()} == {1, 0.1, 0}


def test_wilds_resolution_and_training_transform_are_the_source_defaults():
    """WILDS resizes IWildCam to 448 × 448 and trains with a horizontal flip (p 1/2) and ImageNet statistics."""
    assert iwildcam.SOURCE.image_size == 448
    spec = iwildcam.SOURCE.transforms
    assert spec.flip == 0.5 and spec.mean == (0.485, 0.456, 0.406) and spec.std == (0.229, 0.224, 0.225)


def test_a_filename_padded_with_spaces_names_the_image(tmp_path):
    table = iwildcam_tree(tmp_path) / "iwildcam_v2.0" / "metadata.csv"
    table.write_text(table.read_text().replace(",0000.jpg,", ", 0000.jpg ,"))
    ds = _load(tmp_path)
    assert ds.files[0] == tmp_path / "iwildcam_v2.0" / "train" / "0000.jpg"


def test_without_a_test_split_there_is_no_ood_test_domain(tmp_path):
    ds = _load(iwildcam_tree(tmp_path, [r for r in IWILDCAM_ROWS if r[0] != "test"]))
    assert ds.domains == ["val", *TRAIN_LOCATIONS] and ds.ood_validation == "val" and ds.ood_test is None


def test_a_root_without_metadata_csv_is_one_line_naming_the_layout(tmp_path):
    (tmp_path / "iwildcam_v2.0" / "train").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"no iwildcam_v2.0/metadata.csv; expected root/iwildcam_v2.0/metadata.csv"):
        _load(tmp_path)
