"""Segmentation: a class per pixel; Dice + cross-entropy loss; Dice from additive per-domain tallies.

The loss is pixel-wise cross-entropy plus the soft Dice loss of the foreground classes (MONAI's ``DiceLoss`` with
the batch pooled, softmax probabilities, one-hot targets)::

    L = CE(p, y) + 1 − (2 Σ p·y + ε) / (Σ p + Σ y + ε)          (per foreground class, then their mean)

HarmoFL's code (``utils/loss.py: JointLoss``, which FedFA's reuses) trains with ``(CE + soft Dice over every class,
background included) / 2`` instead: another objective (0.4–0.5× this one on random logits: this one is 2.0–2.4× it),
against which a method's added terms (FedProx's μ, FedFA's λ_h) weigh about twice as much.

The metric is the Dice of the hard prediction (argmax) per foreground class, pooled over a domain's slices:
``Dice = 2 TP / (P + T)`` with ``TP`` the pixels predicted and truly of the class, ``P`` the pixels predicted of it,
``T`` the true ones. Its tally per domain is ``[slices, 2TP_1, (P+T)_1, 2TP_2, ...]``: sums, so a site's Dice over
any split of its slices (batches, workers, Flower replies) is exact. A domain with no foreground at all, predicted
or true (``P + T = 0``), scores 100 % (nothing to find, nothing found). ``tests/test_segmentation.py`` checks the
tally against MONAI's ``compute_dice`` on the same masks and the loss against the closed form. HarmoFL's and FedFA's
code report another Dice (``dice_coef``: per slice, the mean over every class, background included, of
``2|P∩T| / (|P| + |T| + 1e−5)``, then the mean over slices); background scores near 100, so their figures run higher
than this one and their gaps are about half as wide (docs/benchmarks.md, "Segmentation").

:meth:`Segmentation.examples` draws, per site, a few of its evaluation slices with their ground truth and the final
model's prediction (``examples/<site>.png`` in the run directory; the plotting is in ``evaluation/overlays.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from feddg.tasks.base import DENSE_MASKS, Predictor, Task

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from feddg.data.base import DomainDataset

EXAMPLES_PER_SITE = 4  # slices per site in examples/<site>.png
SLICE_EPS = 1e-5  # slice_dice's denominator term (HarmoFL's dice_coef)


class Segmentation(Task):
    """Dense masks ``[B, H, W]`` of ``num_classes`` classes (0 = background); outputs ``[B, num_classes, H, W]``."""

    name = "segmentation"
    metric = "dice"
    label = "Dice"
    targets: ClassVar[frozenset[str]] = frozenset({DENSE_MASKS})
    offers: ClassVar[tuple[str, ...]] = ("slice_dice",)
    losses: ClassVar[tuple[str, ...]] = ("ce_dice_all",)

    def __init__(self, num_classes: int, inputs: str = "images") -> None:
        super().__init__(num_classes, inputs)
        if num_classes < 2:
            raise ValueError(f"segmentation needs a background and at least one class, got {num_classes} classes")
        from monai.losses import DiceLoss  # seconds to import: only where a segmentation task is made

        self.dice = DiceLoss(include_background=False, to_onehot_y=True, softmax=True, batch=True)
        self.dice_all = DiceLoss(include_background=True, to_onehot_y=True, softmax=True, batch=True)

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """CE + the foreground's soft Dice; ``ce_dice_all``: HarmoFL's ``JointLoss``, (CE + soft Dice over every
        class) / 2 (MONAI's ε = 1e−5 is the code's ``smooth``)."""
        if self.loss_name == "ce_dice_all":
            return (F.cross_entropy(output, target) + self.dice_all(output, target.unsqueeze(1))) / 2
        return F.cross_entropy(output, target) + self.dice(output, target.unsqueeze(1))

    def tally_zeros(self, num_domains: int) -> np.ndarray:
        return np.zeros((num_domains, 2 + 2 * (self.num_classes - 1)), dtype=np.float64)

    def tally(self, output: Tensor, target: Tensor, domains: np.ndarray, num_domains: int) -> np.ndarray:
        """``[num_domains, 2 + 2(C−1)]``: slices, then per foreground class ``2·TP`` and ``P + T`` (pixels), then the
        sum over slices of each slice's Dice averaged over every class, background included (``slice_dice``)."""
        pred, true = output.argmax(1).cpu(), target.cpu()
        out = self.tally_zeros(num_domains)
        np.add.at(out[:, 0], domains, 1)
        per_slice = torch.zeros(len(pred), dtype=torch.float64)
        for c in range(self.num_classes):
            p, t = (pred == c).flatten(1), (true == c).flatten(1)
            tp2, pt = 2 * (p & t).sum(1), p.sum(1) + t.sum(1)
            per_slice += tp2.double() / (pt.double() + SLICE_EPS)
            if c:
                np.add.at(out[:, 2 * c - 1], domains, tp2.numpy())
                np.add.at(out[:, 2 * c], domains, pt.numpy())
        np.add.at(out[:, -1], domains, (per_slice / self.num_classes).numpy())
        return out

    def score(self, tally: np.ndarray) -> float:
        """Mean over the foreground classes of ``100 · 2TP / (P + T)`` (100 where ``P + T = 0``)."""
        fg = tally[1:-1]
        dice = [100.0 * float(tp2) / float(pt) if pt else 100.0 for tp2, pt in zip(fg[0::2], fg[1::2], strict=True)]
        return float(np.mean(dice))

    def extra_score(self, name: str, tally: np.ndarray) -> float:
        """``slice_dice``: HarmoFL's and FedFA's code's Dice (``dice_coef``): per slice the mean over every class,
        background included, of ``2|P∩T| / (|P| + |T| + 1e−5)`` (an empty class scores 0), then the mean over slices."""
        if name != "slice_dice":
            return super().extra_score(name, tally)
        return 100.0 * float(tally[-1]) / float(tally[0])

    def count(self, tally: np.ndarray) -> int:
        return int(tally[0])

    def examples(self, dataset: DomainDataset, indices_by_domain: Mapping[str, np.ndarray],
                 predict: Predictor, per_site: int = EXAMPLES_PER_SITE) -> dict[str, Figure]:
        """Per site, ``per_site`` of its evaluation slices (:func:`example_slices`), each drawn as the image (the
        centre channel, de-normalised), its ground truth and the prediction with the slice's own Dice
        (:meth:`score` of the slice's tally)."""
        from feddg.evaluation.overlays import overlay_figure  # matplotlib: only where a run directory is written

        channel = dataset.image_shape[0] // 2  # a 2.5-D slice's own channel, between its neighbours
        mean, std = getattr(dataset, "mean", (0.0,) * 3)[channel], getattr(dataset, "std", (1.0,) * 3)[channel]
        out = {}
        for site, pool in indices_by_domain.items():
            chosen = example_slices(dataset, pool, per_site)
            if not len(chosen):
                continue
            x, truth = dataset.get_batch(chosen, train=False)
            assert isinstance(x, Tensor), "segmentation inputs are images"
            output = predict(chosen).float().cpu()
            dice = [self.score(row) for row in self.tally(output, truth, np.arange(len(chosen)), len(chosen))]
            images = (x[:, channel] * std + mean).clamp(0.0, 1.0).numpy()
            cases = dataset.cases
            names = [f"slice {i}" + ("" if cases is None else f" (case {cases[i]})") for i in chosen]
            out[site] = overlay_figure(site, images, truth.numpy(), output.argmax(1).numpy(), dice, names,
                                       self.num_classes, self.unit)
        return out


def example_slices(dataset: DomainDataset, pool: np.ndarray, k: int, batch_size: int = 64) -> np.ndarray:
    """``k`` slices of ``pool`` for the overlays, deterministically: evenly spaced, in index order, over the slices
    whose ground truth has foreground (over all of ``pool`` where none has), so they span the site's cases."""
    pool = np.sort(np.asarray(pool, dtype=np.int64))
    has = np.concatenate([dataset.get_batch(pool[i:i + batch_size], train=False)[1].flatten(1).gt(0).any(1).numpy()
                          for i in range(0, len(pool), batch_size)]) if len(pool) else np.zeros(0, dtype=bool)
    candidates = pool[has] if has.any() else pool
    if len(candidates) <= k:
        return candidates
    return candidates[np.unique(np.linspace(0, len(candidates) - 1, k).round().astype(np.int64))]
