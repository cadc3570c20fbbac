"""A model's per-domain tally of an index set (evaluation/tally.py) against one rebuilt by hand from the model's
eval-mode outputs on the clean images: each sample counted under its own domain, however the indices are ordered
and batched, with no training augmentation and BatchNorm on its running statistics; and the figures from a tally."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.decisive import decisive_argmax
from torch import Tensor, nn
from toy import ToyDomains, ToyNet

from feddg.evaluation.tally import domain_metrics, tally_by_domain
from feddg.tasks.classification import Classification


class Augmented(ToyDomains):
    """ToyDomains whose training batches are rotated images: what an evaluation must never see."""

    def get_batch(self, indices: np.ndarray, train: bool,
                  generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        x, y = super().get_batch(indices, train, generator)
        return (x.rot90(1, (-2, -1)) if train else x), y


def _hand_tally(pred: np.ndarray, y: np.ndarray, domains: np.ndarray, num_domains: int, c: int) -> np.ndarray:
    """Per domain: correct, samples, then per class the correct predictions, the samples and the predictions."""
    rows = []
    for d in range(num_domains):
        p, t = pred[domains == d], y[domains == d]
        rows.append([int((p == t).sum()), len(t), *np.bincount(t[p == t], minlength=c), *np.bincount(t, minlength=c),
                     *np.bincount(p, minlength=c)])
    return np.array(rows, dtype=np.int64)


def test_a_tally_counts_each_sample_under_its_domain_on_clean_eval_mode_outputs():
    torch.manual_seed(0)
    ds, task = Augmented(per_class_domain=10), Classification(4)
    model = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(36), nn.Linear(36, 4))  # outputs that follow the pixels
    with torch.no_grad():  # BatchNorm running statistics far from any batch's
        model[1].running_mean.fill_(1.0)
        model[1].running_var.fill_(4.0)
    idx = np.random.default_rng(0).permutation(len(ds.labels))[:70]  # unsorted, the domains interleaved
    model.eval()
    with torch.no_grad():
        pred = decisive_argmax(model(ds.x[idx])).numpy()
    want = _hand_tally(pred, ds.labels[idx], ds.domain_ids[idx], 3, 4)
    assert len(np.unique(pred)) > 2 and (want[:, 1] > 0).all()  # a tally with something to get wrong
    model.train()  # as training leaves it: the tally must switch to eval mode itself
    got = tally_by_domain(model, ds, idx, task, batch_size=8)
    np.testing.assert_array_equal(got, want)


def test_an_empty_index_set_gives_a_zero_row_per_domain():
    got = tally_by_domain(ToyNet(), ToyDomains(per_class_domain=2), np.array([], dtype=np.int64), Classification(4))
    np.testing.assert_array_equal(got, np.zeros((3, 2 + 3 * 4), dtype=np.int64))


def test_the_mean_over_domains_weighs_each_domain_once_not_by_its_samples():
    """Domain a: 1 of 1 right, b: 1 of 3 right; c has no sample and no figure. The mean is (100 + 33.3) / 2, not
    the pooled 2 / 4 = 50 %."""
    task = Classification(2)
    tally = task.tally(torch.tensor([[1.0, 0], [1.0, 0], [1.0, 0], [1.0, 0]]), torch.tensor([0, 0, 1, 1]),
                       np.array([0, 1, 1, 1]), 3)
    assert domain_metrics(task, tally, ["a", "b", "c"], "id") == pytest.approx({
        "id_acc/a": 100.0, "id_acc/b": 100 / 3, "id_acc": (100.0 + 100 / 3) / 2})


def test_a_tally_scores_the_methods_predict_not_the_plain_forward():
    """A method's ``predict`` (FedSR's, FedBN's) is what the tally must score: here the negated logits."""
    torch.manual_seed(0)
    ds, task, model = ToyDomains(per_class_domain=5), Classification(4), ToyNet().eval()
    idx = np.arange(len(ds.labels))
    with torch.no_grad():
        logits = model(ds.x)
    want = _hand_tally(decisive_argmax(-logits).numpy(), ds.labels, ds.domain_ids, 3, 4)
    plain = _hand_tally(decisive_argmax(logits).numpy(), ds.labels, ds.domain_ids, 3, 4)
    assert not np.array_equal(want, plain)  # the predict shows in the tally
    got = tally_by_domain(model, ds, idx, task, batch_size=16, predict=lambda m, x: -m(x))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("amp", "dtype"), [("off", torch.float32), ("bf16", torch.bfloat16)])
def test_a_tally_runs_the_model_under_the_amp_asked_for(amp, dtype):
    seen: list[torch.dtype] = []

    def predict(m: nn.Module, x: Tensor) -> Tensor:
        out = m(x)
        seen.append(out.dtype)
        return out

    ds = ToyDomains(per_class_domain=2)
    tally_by_domain(ToyNet(), ds, np.arange(len(ds.labels)), Classification(4), batch_size=10, predict=predict, amp=amp)
    assert seen == [dtype] * 3  # 24 samples in batches of 10


def test_the_mean_over_three_domains_is_their_mean_not_their_median():
    """Domains a, b, c at 100 %, 0 % and 20 % (1, 2 and 5 samples): the mean is 40 % (the median would be 20 %)."""
    task = Classification(2)
    y = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0])
    out = torch.tensor([[1.0, 0]] + [[0, 1.0]] * 2 + [[1.0, 0]] + [[0, 1.0]] * 4)
    tally = task.tally(out, y, np.array([0, 1, 1, 2, 2, 2, 2, 2]), 3)
    assert domain_metrics(task, tally, ["a", "b", "c"], "ood") == pytest.approx({
        "ood_acc/a": 100.0, "ood_acc/b": 0.0, "ood_acc/c": 20.0, "ood_acc": 40.0})
