"""Overlay figures of a segmentation run: per site, a row per slice of the image, its ground truth and the final
model's prediction, drawn by :meth:`feddg.tasks.segmentation.Segmentation.examples` into ``examples/<site>.png``.

Each row shows the slice's centre channel in grey (de-normalised), then the ground truth and then the prediction as
a translucent fill (a colour per foreground class); the prediction panel also outlines the ground truth, so misses
and false positives are visible, and carries the slice's Dice in its title.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure

EXAMPLES = "examples"  # the run directory's folder of overlay figures
TRUTH, PREDICTION = "tab:green", "tab:red"  # the fills of class 1 (further classes: the next tab colours)
OUTLINE = "lime"  # the ground truth's outline


def example_path(run_dir: str | Path, site: str) -> Path:
    """``<run_dir>/examples/<site>.png``, the site's name with characters unsafe in a file name as ``_``."""
    return Path(run_dir) / EXAMPLES / (re.sub(r"[^\w.-]+", "_", site).strip(".") + ".png")


def _fill(ax: Axes, mask: np.ndarray, colour: str, num_classes: int) -> None:
    """``mask``'s foreground classes as a translucent fill, class 1 in ``colour``."""
    colours = [colour, *[f"C{c + 3}" for c in range(num_classes - 2)]]
    cmap = ListedColormap(colours[: num_classes - 1])
    ax.imshow(np.ma.masked_equal(mask, 0), cmap=cmap, vmin=0.5, vmax=num_classes - 0.5, alpha=0.45,
              interpolation="nearest")


def _outline(ax: Axes, mask: np.ndarray) -> None:
    if mask.any() and not mask.all():  # contour needs both levels
        ax.contour(mask > 0, levels=[0.5], colors=OUTLINE, linewidths=1.0)


def overlay_figure(site: str, images: np.ndarray, truth: np.ndarray, prediction: np.ndarray, dice: Sequence[float],
                   names: Sequence[str], num_classes: int, unit: str = "%") -> Figure:
    """A row per slice: ``images`` ``[n, H, W]`` in ``[0, 1]``, ``truth`` and ``prediction`` ``[n, H, W]`` class
    indices, each slice's ``dice`` (in ``unit``) and ``names`` (row titles)."""
    n = len(images)
    fig, axes = plt.subplots(n, 3, figsize=(7.2, 2.5 * n + 0.4), squeeze=False)
    for row, (image, true, pred) in enumerate(zip(images, truth, prediction, strict=True)):
        ax_image, ax_true, ax_pred = axes[row]
        for ax in axes[row]:
            ax.imshow(image, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
        _fill(ax_true, true, TRUTH, num_classes)
        _outline(ax_true, true)
        _fill(ax_pred, pred, PREDICTION, num_classes)
        _outline(ax_pred, true)
        ax_image.set_title(names[row], fontsize=9)
        ax_true.set_title("ground truth", fontsize=9)
        ax_pred.set_title(f"prediction · Dice {dice[row]:.1f} {unit}".rstrip(), fontsize=9)
    fig.suptitle(f"{site}: image, ground truth (green), prediction (red; line: ground truth)", fontsize=10)
    return fig
