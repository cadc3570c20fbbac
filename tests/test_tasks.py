"""The task seam: the classification task against hand-computed figures, tallies that fold exactly however the
evaluation is split (batches, worker processes, Flower replies), and a task that is not classification running
end to end (in-process, on Flower simulation, in a sweep and its report) under its own metric."""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from toy import toy_federation
from toy_pixels import NAME, PIXELS, pixel_federation, registered
from typer.testing import CliRunner

from feddg.cli import app
from feddg.config import ConfigError, build_config
from feddg.engines.flower.records import get_message, message_records
from feddg.engines.inprocess import run_inprocess
from feddg.engines.workers import compute_threads, use_one_thread
from feddg.evaluation.tally import domain_metrics, tally_by_domain
from feddg.experiment import run_experiment
from feddg.federation.server import Server
from feddg.reports.run import report
from feddg.sweep import run_sweep
from feddg.tasks import TaskInfo, info_for_dataset, make_task
from feddg.tasks.classification import Classification


@pytest.fixture(autouse=True, scope="module")
def pixel_task():
    with registered():
        yield



def test_further_metrics_are_reported_for_the_domains_with_samples_only():
    """slice_dice of two domains, the second without slices: its score would be 0/0; the mean is the first's."""
    from feddg.tasks.segmentation import Segmentation

    task = Segmentation(2).with_metrics(["slice_dice"])
    tally = task.tally_zeros(2)
    tally[0, 0], tally[0, -1] = 4.0, 3.0  # 4 slices, their per-slice Dice summing to 3
    assert task.extra_figures(tally, ["a", "b"], "ood") == {"ood_slice_dice/a": 75.0, "ood_slice_dice": 75.0}


def test_classification_loss_tally_score_and_chance_by_hand():
    task = Classification(4)
    out = torch.tensor([[2.0, 1, 0, 0], [0, 3, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0]])
    y = torch.tensor([0, 1, 2, 3])
    assert task.loss(out, y) == F.cross_entropy(out, y)
    tally = task.tally(out, y, np.array([0, 0, 1, 1]), 3)
    np.testing.assert_array_equal(tally[:, :2], [[2, 2], [0, 2], [0, 0]])  # a: both right; b: both wrong; c: none
    # per class: correct, samples, predictions (a: classes 0, 1 right; b: 2 taken for 3, 3 for 0)
    np.testing.assert_array_equal(tally[0, 2:], [1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(tally[1, 2:], [0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1])
    assert domain_metrics(task, tally, ["a", "b", "c"], "ood") == {"ood_acc/a": 100.0, "ood_acc/b": 0.0,
                                                                   "ood_acc": 50.0}
    assert [task.count(row) for row in tally] == [2, 2, 0]
    assert task.chance() == 25.0 and task.info()["bounds"] == [0.0, 100.0]


def test_a_task_refuses_an_unknown_input_kind_and_lists_a_metric_once():
    with pytest.raises(ValueError, match="unknown input kind 'audio'"):
        Classification(4, "audio")
    assert make_task("classification", 4, metrics=["macro_f1", "macro_f1"]).info()["extra_metrics"] == ["macro_f1"]


def test_the_task_of_a_run_without_results_comes_from_the_registry_and_reads_its_keys():
    """digits-dg's 10 classes give chance 10 %; tiny-imagenet's are found in its folders: no chance line. A block
    without a unit (an older run's) labels its axis with the bare name; a key of no role is no figure of it."""
    digits, tiny = info_for_dataset("digits-dg"), info_for_dataset("tiny-imagenet")
    assert digits is not None and digits.chance == 10.0 and digits.axis_label == "accuracy (%)"
    assert tiny is not None and tiny.chance is None
    assert info_for_dataset("no-such-set") is None
    older = TaskInfo.of({"name": "toy", "metric": "err", "label": "error", "bounds": [0, 1], "higher_is_better": False})
    assert older.axis_label == "error" and older.unit == ""
    assert older.parse("ood_err/a") == ("ood", "a") and older.parse("_err") is None


_FED = toy_federation()


def _half_tally(indices: np.ndarray) -> np.ndarray:
    return tally_by_domain(_FED.model, _FED.dataset, indices, _FED.task, batch_size=7)


def test_tallies_of_a_split_evaluation_sum_to_the_single_pass_figure_exactly():
    """Two worker processes each tally half of the index set; their tallies, also sent as Flower records (the
    message contract a reply travels in), sum to the single process's tally, and give the same figures."""
    fed = _FED
    idx = np.concatenate([fed.split.test_idx, *(c.holdout_idx for c in fed.clients)])
    with compute_threads(1):  # as each worker computes
        whole = tally_by_domain(fed.model, fed.dataset, idx, fed.task, batch_size=64)
    halves = np.array_split(np.random.default_rng(0).permutation(idx), 2)
    # an executor, not multiprocessing.Pool: Pool's exit SIGTERMs its workers; a worker forked from this process
    # (which holds Ray's Python SIGTERM handler once a Flower simulation ran) took the signal on an OpenBLAS thread
    # while its main thread waited on the queue's lock, so the handler never ran and the join hung; the executor
    # ends its workers with a sentinel, and fails (not hangs) if one dies
    with ProcessPoolExecutor(2, mp_context=mp.get_context("fork"), initializer=use_one_thread) as pool:
        parts = list(pool.map(_half_tally, halves))
    assert not np.array_equal(parts[0], whole)  # each worker saw only part of it
    np.testing.assert_array_equal(parts[0] + parts[1], whole)
    replies = [get_message(message_records({"tally": p, "num_examples": 1})) for p in parts]
    folded = replies[0]["tally"] + replies[1]["tally"]
    assert folded.dtype == whole.dtype and np.array_equal(folded, whole)
    assert domain_metrics(fed.task, folded, fed.dataset.domains, "id") == domain_metrics(
        fed.task, whole, fed.dataset.domains, "id")


def test_one_pass_over_many_domains_gives_each_domain_pass_tally():
    """Evaluation over every domain is one pass over the evaluation indices: its per-domain rows equal the
    tallies of one pass per domain, exactly (at one thread, as a worker or the default server computes)."""
    fed = _FED
    idx = np.concatenate([fed.split.test_idx, *(c.holdout_idx for c in fed.clients)])
    with compute_threads(1):
        whole = tally_by_domain(fed.model, fed.dataset, idx, fed.task, batch_size=64)
        assert len(np.unique(fed.dataset.domain_ids[idx])) > 1
        for d in range(len(fed.dataset.domains)):
            own = idx[fed.dataset.domain_ids[idx] == d]
            per = tally_by_domain(fed.model, fed.dataset, own, fed.task, batch_size=64)
            np.testing.assert_array_equal(whole[d], per[d])
            assert not per[np.arange(len(per)) != d].any()


def test_a_pixel_task_runs_fedavg_in_process_under_its_own_metric(tmp_path, monkeypatch):
    res = run_experiment(build_config(PIXELS), tmp_path / "run", progress=False)
    assert res["task"]["name"] == "pixel-agreement" and res["task"]["metric"] == "pagree"
    assert res["task"]["chance"] == 50.0 and res["task"]["bounds"] == [0.0, 100.0]
    assert set(res["final"]) == {"id_pagree", "id_pagree/a", "id_pagree/b", "ood_pagree", "ood_pagree/c"}
    assert res["counts"]["ood_pagree/c"] == 40 and res["counts"]["id_pagree"] == sum(
        len(c.holdout_idx) for c in pixel_federation(build_config(PIXELS)).clients)
    assert res["final"]["ood_pagree"] > 60.0  # it learns the pixel rule (chance: 50)
    page = report(tmp_path / "run")[0].read_text()
    assert "pixel agreement" in page and "chance (%)" in page and "accuracy" not in page.lower()


def test_a_pixel_task_gives_the_same_run_in_process_and_on_flower_simulation(tmp_path):
    from feddg.engines.flower.simulation import run_flower

    cfg = build_config(PIXELS, ["federation.rounds=2", "flower.ray_num_cpus=2"])
    ref = Server(pixel_federation(cfg), tmp_path / "ref")
    run_inprocess(ref)
    flower = Server(pixel_federation(cfg), tmp_path / "flower")
    run_flower(flower, factory=pixel_federation)
    assert [m["round"] for m in flower.metrics] == [1, 2]
    for key in ("ood_pagree", "id_pagree"):
        assert flower.metrics[-1][key] == pytest.approx(ref.metrics[-1][key], abs=1e-6)


def test_a_pixel_task_sweep_table_and_report_show_its_metric(tmp_path):
    sweep = {**PIXELS, "sweep": {"targets": ["c", "a"], "seeds": [0], "baseline": "FedAvg",
                                 "variants": {"FedAvg": {}, "FedProx": {"method.name": "fedprox"}}}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    res = run_sweep(tmp_path / "sweep.yaml", out_dir=tmp_path / "out", progress=False)
    table = (tmp_path / "out" / "table.md").read_text()
    assert "### ood_pagree" in table and "### id_pagree" in table and "acc" not in table
    page = report(tmp_path / "out")[0].read_text()
    assert "ood_pagree (%)" in page and "chance (%)" in page and "accuracy" not in page.lower()
    assert all("ood_pagree" in r for r in res["rows"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.dataset=" + NAME, "model.name=pixelnet", "method.name=pardon"],
     "method pardon needs class_labels: the pixel-agreement task of toy-pixels provides dense_masks, images"),
    (["model.name=lenet", "method.name=fedbn"], "method fedbn needs batchnorm"),
    (["data.dataset=" + NAME, "model.name=pixelnet", "optim.augment=[{name: mixstyle}]"],
     "optim.augment mixstyle needs conv_stages"),
    (["data.dataset=toy-tokens", "model.name=tiny-roberta", "optim.augment=[{name: mixstyle}]"],
     "optim.augment mixstyle needs conv_stages, images: the classification task of toy-tokens provides class_labels, "
     "tokens, model tiny-roberta tokens"),
    (["method.name=fedsr", "optim.augment=[{name: mixup}]"], "fedsr's loss uses hard labels"),
])
def test_a_method_the_task_or_model_cannot_serve_is_refused_in_one_line(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=message) as err:
        build_config({}, overrides)
    assert "\n" not in str(err.value)
    (tmp_path / "c.yaml").write_text("{}")
    res = CliRunner().invoke(app, ["run", str(tmp_path / "c.yaml"), *(a for o in overrides for a in ("-o", o))],
                             terminal_width=400)
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "error: " in res.output
