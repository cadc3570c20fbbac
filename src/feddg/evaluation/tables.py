"""Paper-style tables: mean ± sample std over seeds, one row per method, one column per target domain.

The std is the sample standard deviation (``ddof=1``); with one seed there is none ("–", never 0).
The "avg 95 % CI" column is a Student-t interval, ``mean ± t(0.975, n-1) · s / √n``, over the
per-seed averages across targets.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from typing import Any

import numpy as np
from scipy import stats

STATS_NOTE = "mean ± sample std (ddof=1); avg 95 % CI: Student-t over per-seed averages"
NONE = "–"


def sample_std(values: list[float]) -> float | None:
    """Sample standard deviation (ddof=1); ``None`` for fewer than two values."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else None


def ci95(values: list[float]) -> tuple[float, float] | None:
    """Student-t 95 % confidence interval of the mean; ``None`` for fewer than two values."""
    s = sample_std(values)
    if s is None:
        return None
    mean, half = float(np.mean(values)), float(stats.t.ppf(0.975, len(values) - 1)) * s / np.sqrt(len(values))
    return mean - half, mean + half


def mean_std(values: list[float]) -> str:
    """``"mean ± std"`` (``"mean ± –"`` for one value, ``"–"`` for none)."""
    if not values:
        return NONE
    s = sample_std(values)
    return f"{np.mean(values):.1f} ± {NONE if s is None else f'{s:.1f}'}"


def _ci_text(values: list[float]) -> str:
    ci = ci95(values)
    return NONE if ci is None else f"[{ci[0]:.1f}, {ci[1]:.1f}]"


def pivot(rows: list[dict[str, Any]], metric: str) -> tuple[list[str], list[str], dict[tuple[str, str], list[float]]]:
    """Group ``rows`` (variant, target, seed, metrics...) into cells of per-seed values."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    targets = list(dict.fromkeys(r["target"] for r in rows))
    cells: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        if metric in r:
            cells[(r["variant"], r["target"])].append(float(r[metric]))
    return variants, targets, cells


def _avg_over_targets(rows: list[dict[str, Any]], variant: str, targets: list[str], metric: str) -> list[float]:
    """Per seed, the mean over targets (only seeds complete on every target)."""
    by_seed: dict[int, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["variant"] == variant and metric in r:
            by_seed[r["seed"]][r["target"]] = float(r[metric])
    return [float(np.mean(list(v.values()))) for v in by_seed.values() if len(v) == len(targets)]


def markdown_table(rows: list[dict[str, Any]], metric: str = "ood_acc") -> str:
    variants, targets, cells = pivot(rows, metric)
    head = ["method", *targets, "avg", "avg 95 % CI"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        vals = [mean_std(cells.get((v, t), [])) for t in targets]
        avg = _avg_over_targets(rows, v, targets, metric)
        lines.append("| " + " | ".join([v, *vals, mean_std(avg), _ci_text(avg)]) + " |")
    return "\n".join(lines)


def csv_table(rows: list[dict[str, Any]], metric: str = "ood_acc") -> str:
    """One line per (method, target) and per method's avg: mean, sample std, 95 % CI, n (empty where n = 1)."""
    variants, targets, cells = pivot(rows, metric)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["method", "target", "mean", "std_ddof1", "ci95_low", "ci95_high", "n"])
    for v in variants:
        groups = [(t, cells.get((v, t), [])) for t in targets] + [("avg", _avg_over_targets(rows, v, targets, metric))]
        for t, vals in groups:
            if vals:
                s, ci = sample_std(vals), ci95(vals)
                w.writerow([v, t, f"{np.mean(vals):.3f}", "" if s is None else f"{s:.3f}",
                            *(("", "") if ci is None else (f"{ci[0]:.3f}", f"{ci[1]:.3f}")), len(vals)])
    return buf.getvalue()
