"""The segmentation task: Dice + cross-entropy against the closed form, and the Dice tally against hand-computed
masks and MONAI's ``compute_dice`` (empty prediction, empty truth, both empty, partial overlap)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from monai.metrics import compute_dice

from feddg.evaluation.tally import domain_metrics
from feddg.reports.figures import diagnostic_panels
from feddg.tasks import TaskInfo
from feddg.tasks.segmentation import Segmentation


def logits(mask: torch.Tensor, classes: int = 2) -> torch.Tensor:
    """Outputs whose argmax is ``mask``."""
    return 10.0 * F.one_hot(mask, classes).permute(0, 3, 1, 2).float()


def masks(*rows: str) -> torch.Tensor:
    """A 1×H×W mask from strings of 0/1/2."""
    return torch.tensor([[[int(c) for c in r] for r in rows]])


def test_dice_tally_on_hand_made_masks():
    task = Segmentation(2)
    truth = masks("0110", "0110", "0000")                      # T = 4
    pred = masks("0111", "0000", "0000")                       # P = 3, TP = 2
    tally = task.tally(logits(pred), truth, np.array([0]), 1)
    np.testing.assert_array_equal(tally[:, :3], [[1, 4, 7]])     # 1 slice, 2TP = 4, P + T = 7
    assert task.score(tally[0]) == pytest.approx(100 * 4 / 7)
    # slice_dice (HarmoFL's dice_coef): background too, 12 − |P ∪ T| = 7 both, 8 true, 9 predicted
    assert task.extra_score("slice_dice", tally[0]) == pytest.approx(100 * (14 / (17 + 1e-5) + 4 / (7 + 1e-5)) / 2)
    empty, full = masks("0000"), masks("0110")
    assert task.score(task.tally(logits(empty), full, np.array([0]), 1)[0]) == 0.0   # nothing predicted
    assert task.score(task.tally(logits(full), empty, np.array([0]), 1)[0]) == 0.0   # nothing there
    assert task.score(task.tally(logits(empty), empty, np.array([0]), 1)[0]) == 100.0  # both empty: nothing to miss


def test_slice_dice_is_the_mean_of_per_slice_all_class_dice_and_an_absent_class_scores_zero():
    """HarmoFL's and FedFA's code's metric: per slice, classes averaged with background, then slices averaged (not
    pooled): a slice with no prostate anywhere scores (100 + 0) / 2."""
    task = Segmentation(2).with_metrics(["slice_dice"])
    truth = torch.stack([masks("0110", "0000")[0], masks("0000", "0000")[0]])
    pred = torch.stack([masks("0110", "0000")[0], masks("0000", "0000")[0]])
    tally = task.tally(logits(pred), truth, np.array([0, 0]), 1)
    assert task.extra_score("slice_dice", tally[0]) == pytest.approx(100 * ((12 / (12 + 1e-5) + 4 / (4 + 1e-5)) / 2
                                                                            + (16 / (16 + 1e-5) + 0) / 2) / 2)
    assert task.score(tally[0]) == 100.0  # the pooled foreground Dice: both slices right
    halves = task.tally(logits(pred[:1]), truth[:1], np.array([0]), 1) + task.tally(logits(pred[1:]), truth[1:],
                                                                                      np.array([0]), 1)
    np.testing.assert_allclose(halves, tally)  # additive over any split of the slices
    assert task.extra_figures(tally, ["a"], "id")["id_slice_dice/a"] == task.extra_score("slice_dice", tally[0])


def test_the_ce_dice_all_loss_is_harmofls_joint_loss_by_hand():
    """(CE + 1 − mean over every class of (2Σp·y + ε) / (Σp + Σy + ε)) / 2, ε = 1e−5, batch pooled."""
    g = torch.Generator().manual_seed(0)
    out, y = torch.randn(3, 2, 5, 5, generator=g), torch.randint(0, 2, (3, 5, 5), generator=g)
    p, onehot = out.softmax(1), F.one_hot(y, 2).permute(0, 3, 1, 2).float()
    dice = ((2 * (p * onehot).sum((0, 2, 3)) + 1e-5) / (p.sum((0, 2, 3)) + onehot.sum((0, 2, 3)) + 1e-5)).mean()
    want = (F.cross_entropy(out, y) + 1 - dice) / 2
    assert float(Segmentation(2).with_loss("ce_dice_all").loss(out, y)) == pytest.approx(float(want), rel=1e-5)
    assert float(Segmentation(2).loss(out, y)) != pytest.approx(float(want), rel=1e-2)  # the default differs
    with pytest.raises(ValueError, match="trains with no loss 'dice'; it offers task, ce_dice_all"):
        Segmentation(2).with_loss("dice")


def test_a_loss_the_task_does_not_offer_is_refused_when_the_config_loads():
    from feddg.config import ConfigError, build_config

    cfg = build_config({"data": {"dataset": "synthetic-mri"}, "model": {"name": "unet"},
                        "optim": {"loss": "ce_dice_all"}, "eval": {"metrics": ["slice_dice"]}})
    assert cfg.optim.loss == "ce_dice_all"
    with pytest.raises(ConfigError, match="optim.loss: the classification task of digits-dg trains with no "
                                          "'ce_dice_all'; it offers task"):
        build_config({"optim": {"loss": "ce_dice_all"}})


def test_the_pooled_tally_equals_monai_on_the_pooled_masks_and_per_image_on_each():
    rng = np.random.default_rng(0)
    task = Segmentation(3)
    truth = torch.as_tensor(rng.integers(0, 3, size=(4, 8, 8)))
    pred = torch.where(torch.as_tensor(rng.random((4, 8, 8))) < 0.7, truth, torch.as_tensor(rng.integers(0, 3, (4, 8, 8))))
    domains = np.array([0, 0, 1, 1])
    tally = task.tally(logits(pred, 3), truth, domains, 2)
    onehot = lambda m: F.one_hot(m, 3).permute(0, 3, 1, 2)  # noqa: E731
    for d in (0, 1):  # a domain's pooled Dice = MONAI's Dice of its slices laid side by side as one image
        side = lambda m: torch.cat(list(m[domains == d]), dim=1)[None]  # noqa: E731
        want = compute_dice(onehot(side(pred)), onehot(side(truth)), include_background=False).mean()
        assert task.score(tally[d]) == pytest.approx(100 * float(want), rel=1e-6)
    for i in range(4):
        one = task.tally(logits(pred[i : i + 1], 3), truth[i : i + 1], np.array([0]), 1)[0]
        want = compute_dice(onehot(pred[i : i + 1]), onehot(truth[i : i + 1]), include_background=False).mean()
        assert task.score(one) == pytest.approx(100 * float(want), rel=1e-6)
    figures = domain_metrics(task, tally, ["a", "b"], "ood")
    assert figures["ood_dice"] == pytest.approx((figures["ood_dice/a"] + figures["ood_dice/b"]) / 2)


def test_loss_is_cross_entropy_plus_the_soft_dice_of_the_foreground():
    torch.manual_seed(0)
    out, y = torch.randn(2, 2, 5, 5), torch.randint(0, 2, (2, 5, 5))
    p = out.softmax(1)[:, 1]
    t = (y == 1).float()
    eps = 1e-5
    want = F.cross_entropy(out, y) + 1 - (2 * (p * t).sum() + eps) / (p.sum() + t.sum() + eps)
    assert float(Segmentation(2).loss(out, y)) == pytest.approx(float(want), rel=1e-5)


def test_a_segmentation_needs_a_foreground_class():
    with pytest.raises(ValueError, match="background and at least one class"):
        Segmentation(1)


def test_slice_dice_keys_are_not_read_as_the_dice_of_a_role_named_slice():
    """``ood_slice_dice/BIDMC`` was parsed as role ``ood_slice`` of ``dice``: the results table and the report
    listed it as Dice and dropped its curve from the diagnostics."""
    info = TaskInfo.of(Segmentation(2).with_metrics(["slice_dice"]).info())
    assert info.parse("ood_slice_dice/BIDMC") is None and info.parse("id_slice_dice") is None
    assert info.parse("ood_dice/BIDMC") == ("ood", "BIDMC") and info.parse("extra/rot_dice") == ("extra/rot", None)
    older = TaskInfo.of(Segmentation(2).info())  # a block without extra_metrics: the task's offers still tell
    assert older.parse("ood_slice_dice/a") is None
    panels = diagnostic_panels([{"round": 1, "ood_dice": 70.0, "ood_slice_dice": 80.0}], info)
    assert panels == {"other": {"ood_slice_dice": {"ood_slice_dice": [(1, 80.0)]}}}
