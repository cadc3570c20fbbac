"""Mutation audit of the task seam (tasks/), DP-FedAvg's server state and the small numerics: figures against hand
computations and scikit-learn, refusals the docstrings promise, and results.json blocks field by field."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from sklearn.metrics import f1_score

from feddg.aggregation.mean import WeightedSum
from feddg.algorithms.base import Accumulator
from feddg.config import WeightDPConfig
from feddg.data.slices import SliceDataset
from feddg.federation.weight_privacy import NOISE_STREAM, WeightPrivacy
from feddg.numerics import adam, sqrt
from feddg.seeds import derived_seed
from feddg.tasks import TaskInfo, make_task
from feddg.tasks.classification import Classification
from feddg.tasks.segmentation import Segmentation, example_slices


def _onehot_logits(pred: list[int], classes: int) -> torch.Tensor:
    """Outputs ``[B, classes]`` whose argmax is ``pred``."""
    return torch.nn.functional.one_hot(torch.tensor(pred), classes).float()


def test_class_view_gives_each_class_recall_and_its_share_of_all_predictions() -> None:
    """y = 0 0 1 1, predicted 0 2 1 1: recall 1/2, 2/2 and none for class 2 (no samples); the 4 predictions are
    1, 2, 1 of classes 0, 1, 2 (shares of the samples, not of the correct ones)."""
    task = Classification(3)
    row = task.tally(_onehot_logits([0, 2, 1, 1], 3), torch.tensor([0, 0, 1, 1]), np.zeros(4, dtype=np.int64), 1)[0]
    assert task.class_view(row) == {"recall": [50.0, 100.0, None], "predicted": [25.0, 50.0, 25.0]}


def test_macro_f1_equals_scikit_learns_over_the_classes_present() -> None:
    """Random labels of 5 classes, class 4 never true but predicted: sklearn's macro F1 over unique(y_true)."""
    g = np.random.default_rng(3)
    y = g.integers(0, 4, 200)
    pred = np.where(g.random(200) < 0.6, y, g.integers(0, 5, 200))
    task = make_task("classification", 5, metrics=["macro_f1"])
    row = task.tally(_onehot_logits(pred.tolist(), 5), torch.from_numpy(y), np.zeros(200, dtype=np.int64), 1)[0]
    want = 100 * f1_score(y, pred, average="macro", labels=np.unique(y))
    assert task.extra_score("macro_f1", row) == pytest.approx(want, rel=1e-9)


def test_a_metric_a_task_does_not_offer_is_refused_when_scored() -> None:
    """extra_score of a name outside ``offers`` raises (base.py) instead of scoring it as the offered metric."""
    cls = Classification(2)
    with pytest.raises(ValueError, match="the classification task reports no metric 'slice_dice'"):
        cls.extra_score("slice_dice", cls.tally_zeros(1)[0])
    seg = Segmentation(2)
    with pytest.raises(ValueError, match="the segmentation task reports no metric 'macro_f1'"):
        seg.extra_score("macro_f1", seg.tally_zeros(1)[0])


def test_further_metrics_average_over_domains_by_their_mean() -> None:
    """macro-F1 per domain: a perfect (100); b y = 0 1, pred 0 0 (F1 2/3 and 0: 100/3); c y = 0 0, pred 1 1 (only
    class 0 present: 0). The overall figure is the mean 400/9, not the median 100/3."""
    task = Classification(2).with_metrics(["macro_f1"])
    pred, y = [0, 1, 0, 0, 1, 1], torch.tensor([0, 1, 0, 1, 0, 0])
    tally = task.tally(_onehot_logits(pred, 2), y, np.array([0, 0, 1, 1, 2, 2]), 3)
    figures = task.extra_figures(tally, ["a", "b", "c"], "ood")
    assert figures == pytest.approx({"ood_macro_f1/a": 100.0, "ood_macro_f1/b": 100 / 3, "ood_macro_f1/c": 0.0,
                                     "ood_macro_f1": 400 / 9}, rel=1e-12)


@pytest.mark.parametrize("inputs", ["images", "tokens", "features"])
def test_every_input_kind_is_accepted_and_make_task_passes_it_on(inputs: str) -> None:
    """IMAGES, TOKENS and FEATURES are the input kinds (base.py); make_task hands its ``inputs`` to the task."""
    assert make_task("classification", 3, inputs).inputs == inputs
    assert make_task("classification", 3, inputs).info()["inputs"] == inputs


def test_an_unknown_task_is_refused_with_the_available_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'regression'; available: \['classification', 'segmentation'\]"):
        make_task("regression", 2)


def test_the_task_block_by_hand_and_its_direction_from_the_class() -> None:
    """results.json's ``task`` block: every field, ``extra_metrics`` only when some are reported; a task whose lower
    figures are better says so."""

    class Error(Classification):
        higher_is_better = False

    assert Classification(4).info() == {"name": "classification", "metric": "acc", "label": "accuracy", "unit": "%",
                                        "bounds": [0.0, 100.0], "higher_is_better": True, "chance": 25.0,
                                        "num_classes": 4, "inputs": "images"}
    assert Error(4).info()["higher_is_better"] is False
    assert Segmentation(2).info()["chance"] is None  # Dice has no uninformed level to draw
    assert Segmentation(3).model_head() == {"num_classes": 3}  # outputs [B, num_classes, H, W], background included


def test_further_metrics_of_a_tally_without_samples_are_none_rather_than_nan() -> None:
    """extra_figures reports the domains with samples only, and no mean over none of them."""
    task = Classification(2).with_metrics(["macro_f1"])
    assert task.extra_figures(task.tally_zeros(2), ["a", "b"], "ood") == {}


def test_a_task_that_offers_no_further_metric_says_so_when_asked_for_one() -> None:
    class Plain(Classification):
        offers = ()

    with pytest.raises(ValueError, match="the classification task reports no metric 'macro_f1' beside acc; it offers "
                                         "none"):
        Plain(2).with_metrics(["macro_f1"])


def test_task_info_reads_bounds_direction_and_bounds_only_its_own_keys() -> None:
    info = TaskInfo.of({"name": "toy", "metric": "err", "label": "error", "bounds": [0, 1], "higher_is_better": False})
    assert info.bounds == (0.0, 1.0) and info.higher_is_better is False
    assert info.bounds_of("ood_err/a") == (0.0, 1.0)
    assert info.bounds_of("time_total_s") is None  # unbounded: not this metric's figure


def test_a_key_with_the_metric_inside_its_name_but_not_at_its_end_is_not_the_metrics() -> None:
    info = TaskInfo.of(Classification(3).info())
    assert info.parse("ood_acc_top5/a") is None and info.parse("ood_acc/a") == ("ood", "a")


def test_a_reported_extra_metric_of_an_unregistered_task_is_another_metrics_key() -> None:
    """``others`` holds the block's ``extra_metrics`` too, not only a registered task's offers."""
    info = TaskInfo.of({"name": "toy", "metric": "dice", "label": "Dice", "bounds": [0, 100], "higher_is_better": True,
                        "extra_metrics": ["slice_dice"]})
    assert info.parse("ood_slice_dice/a") is None and info.parse("ood_dice/a") == ("ood", "a")


def _slices(n: int) -> SliceDataset:
    """``n`` 8×8 slices of one site, each with a 2×2 foreground square."""
    images = np.random.default_rng(0).integers(0, 256, size=(n, 3, 8, 8), dtype=np.uint8)
    masks = np.zeros((n, 8, 8), dtype=np.uint8)
    masks[:, 2:4, 2:4] = 1
    return SliceDataset("hand", images, masks, np.zeros(n, dtype=np.int64), np.arange(n), ["a", "b"],
                        (0.5,) * 3, (0.5,) * 3)


def test_examples_draw_four_slices_per_site_by_default_and_skip_a_site_without_any() -> None:
    """docs/architecture.md: 4 slices per site, evenly spaced (of 10: 0, 3, 6, 9), the prediction panel filled with
    the prediction (not the ground truth); a site with no evaluation slices gets no figure."""
    ds, seen = _slices(10), []
    pred = np.zeros((8, 8), dtype=bool)
    pred[5:7, 4:7] = True  # 6 pixels, apart from the true square

    def predict(indices: np.ndarray) -> torch.Tensor:
        seen.append(indices.tolist())
        return torch.stack([torch.from_numpy(~pred), torch.from_numpy(pred)]).float().expand(len(indices), 2, 8, 8)

    figs = Segmentation(2).examples(ds, {"a": np.arange(10), "b": np.array([], dtype=np.int64)}, predict)
    assert list(figs) == ["a"] and seen == [[0, 3, 6, 9]]
    axes = np.array(figs["a"].axes).reshape(4, 3)
    for fig in figs.values():
        plt.close(fig)
    for ax in axes[:, 2]:  # the grey image, then the prediction's fill
        np.testing.assert_array_equal(~np.ma.getmaskarray(ax.images[1].get_array()), pred)


def test_example_slices_read_the_masks_in_batches_of_any_size() -> None:
    """Foreground on slices 2, 5 and 9 of 10 only, read 3 at a time: the 2 evenly spaced ones are 2 and 9."""
    ds = _slices(10)
    ds.masks[[0, 1, 3, 4, 6, 7, 8]] = 0
    assert example_slices(ds, np.arange(10)[::-1], 2, batch_size=3).tolist() == [2, 9]


def test_adam_is_not_fused_when_a_parameter_is_not_floating_point() -> None:
    """numerics.adam: the fused step only for float parameters (docstring)."""
    weights, counter = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.int64),
                                                                              requires_grad=False)
    assert adam([weights, counter], lr=0.1).param_groups[0]["fused"] is None


def test_adaptive_clipping_without_count_std_noises_the_count_at_m_over_20_of_the_sampled_clients() -> None:
    """K = 20, fraction 0.5: m = 10, σ_b = 10/20 = 0.5, so z_Δ = (0.5⁻² − (2·0.5)⁻²)^(−1/2) = 1/√3 (Andrew et al.
    Thm. 1); the record says the clip is adaptive."""
    cfg = WeightDPConfig(noise_multiplier=0.5, clip=1.0, adaptive={})
    record = WeightPrivacy(cfg, num_clients=20, fraction=0.5, seed=0).record(0)
    assert record["sampled"] == 10 and record["adaptive"] is True
    assert record["noise_multiplier_weights"] == pytest.approx(3 ** -0.5, rel=1e-12)
    assert record["noise_multiplier"] == 0.5  # the configured z, which the accountant reads (as z / 2)
    assert (record["neighboring"], record["unit"]) == ("replace-one", "client")


def test_the_record_names_the_configured_accountant() -> None:
    cfg = WeightDPConfig(noise_multiplier=0.0, clip=1.0, accountant="pld")
    assert WeightPrivacy(cfg, num_clients=2, fraction=1.0, seed=0).record(1)["accountant"] == "pld"


def test_a_small_positive_noise_std_still_noises_the_weights() -> None:
    """z = 1e-6, C = 1, one client: std 1e-6, drawn from the round's noise stream into the mean."""
    priv = WeightPrivacy(WeightDPConfig(noise_multiplier=1e-6, clip=1.0), num_clients=1, fraction=1.0, seed=4)
    acc = Accumulator(WeightedSum("w/", 3))
    acc.weights.add({"w/x": np.zeros(5, np.float64)}, 3)
    assert priv.add_noise(acc, 2, [3], 1)["dp_weights/noise_std"] == 1e-6
    want = np.random.default_rng(derived_seed(4, 2, NOISE_STREAM)).normal(0.0, 1e-6, 5)
    np.testing.assert_allclose(acc.weights.mean()["w/x"], want, rtol=1e-7)


def test_sqrt_of_an_integer_tensor_is_a_float32_root_as_torchs() -> None:
    """An integer or bool tensor's root is float32, as ``torch.sqrt`` gives it (it was cast back: √2 gave 1); a
    bfloat16 one stays bfloat16."""
    for x in (torch.tensor([2, 9]), torch.tensor([True, False])):
        root = sqrt(x)
        assert root.dtype == torch.sqrt(x).dtype == torch.float32
        assert torch.allclose(root, x.float().sqrt(), rtol=1e-7)
    assert sqrt(torch.tensor([2.0], dtype=torch.bfloat16)).dtype == torch.bfloat16
