"""Image grids of an audit: true images (nearest to each reconstruction) over their reconstructions."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def draw_grid(rows: list[tuple[str, np.ndarray]], title: str, path: Path, max_cols: int = 12) -> Path:
    """One mosaic of ``[N, C, H, W]`` images in ``[0, 1]`` per labelled row (2 px white gaps), as a PNG."""
    n = min(max_cols, min(len(t) for _, t in rows))
    _, _, h, w = rows[0][1].shape
    gap = 2
    mosaic = np.ones((len(rows) * (h + gap), n * (w + gap), 3))
    for r, (_, tiles) in enumerate(rows):
        for c in range(n):
            tile = np.transpose(tiles[c], (1, 2, 0))
            mosaic[r * (h + gap) : r * (h + gap) + h, c * (w + gap) : c * (w + gap) + w] = tile if tile.shape[2] == 3 \
                else np.repeat(tile[..., :1], 3, axis=2)
    fig, ax = plt.subplots(figsize=(1.5 + 0.6 * n, 0.5 + 0.7 * len(rows)))
    ax.imshow(mosaic, interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([r * (h + gap) + h / 2 for r in range(len(rows))], [label for label, _ in rows], fontsize=7)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
