"""Paper-style tables: mean ± sample std over seeds, one row per method, one column per target domain.

The std is the sample standard deviation (``ddof=1``); with one seed there is none ("–", never 0).
The "avg 95 % CI" column is a Student-t interval, ``mean ± t(0.975, n-1) · s / √n``, over the
per-seed averages across targets. With a ``baseline`` row, a last column gives each row's paired difference
from it: per seed, the row's average over targets minus the baseline's (same seed, same targets, so the same
splits and partitions), as mean and Student-t 95 % CI over seeds. Seed-to-seed variation that moves both rows
cancels, so it resolves differences the unpaired intervals cannot.

Intervals are clipped to the metric's bounds (``bounds``, the task's: an accuracy's interval never leaves 0–100)
and carry their ``n`` (two seeds give a wide, weak interval). A cell with a run that dropped clients
(``dropped`` > 0 in its row: results.json's ``failures``) is marked ``†`` with a footnote, so complete and degraded
runs are never averaged unawares.
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
DEGRADED = "†"
DEGRADED_NOTE = f"{DEGRADED} a run of this cell dropped clients in some round (its results.json `failures`)"
Bounds = tuple[float, float] | None
Picks = dict[tuple[str, str], str]  # (variant, target) -> the chosen draws and rounds (evaluation/selection.py)


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


def clipped_ci(values: list[float], bounds: Bounds = None) -> tuple[float, float] | None:
    """:func:`ci95` clipped to the metric's ``bounds``."""
    ci = ci95(values)
    if ci is None or bounds is None:
        return ci
    return max(ci[0], bounds[0]), min(ci[1], bounds[1])


def _ci_text(values: list[float], bounds: Bounds = None) -> str:
    ci = clipped_ci(values, bounds)
    return NONE if ci is None else f"[{ci[0]:.1f}, {ci[1]:.1f}] n={len(values)}"


def degraded(rows: list[dict[str, Any]], variant: str, target: str | None = None) -> bool:
    """Whether a run of the cell (or of the variant, ``target=None``) dropped clients."""
    return any(r.get("dropped", 0) for r in rows if r["variant"] == variant and target in (None, r["target"]))


def pivot(rows: list[dict[str, Any]], metric: str) -> tuple[list[str], list[str], dict[tuple[str, str], list[float]]]:
    """Group ``rows`` (variant, target, seed, metrics...) into cells of per-seed values."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    targets = list(dict.fromkeys(r["target"] for r in rows))
    cells: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in rows:
        if metric in r:
            cells[(r["variant"], r["target"])].append(float(r[metric]))
    return variants, targets, cells


def seed_averages(rows: list[dict[str, Any]], variant: str, targets: list[str], metric: str) -> dict[int, float]:
    """Per seed, the mean over targets (only seeds complete on every target)."""
    by_seed: dict[int, dict[str, float]] = defaultdict(dict)
    for r in rows:
        if r["variant"] == variant and metric in r:
            by_seed[r["seed"]][r["target"]] = float(r[metric])
    return {s: float(np.mean(list(v.values()))) for s, v in by_seed.items() if len(v) == len(targets)}


def _avg_over_targets(rows: list[dict[str, Any]], variant: str, targets: list[str], metric: str) -> list[float]:
    return list(seed_averages(rows, variant, targets, metric).values())


def paired_deltas(rows: list[dict[str, Any]], variant: str, baseline: str, metric: str = "ood_acc") -> list[float]:
    """Per seed complete on every target for both rows: ``variant``'s average over targets minus ``baseline``'s."""
    targets = pivot(rows, metric)[1]
    mine, ref = (seed_averages(rows, v, targets, metric) for v in (variant, baseline))
    return [mine[s] - ref[s] for s in sorted(mine.keys() & ref.keys())]


def _delta_text(deltas: list[float]) -> str:
    if not deltas:
        return NONE
    ci = ci95(deltas)
    return f"{np.mean(deltas):+.1f}" + ("" if ci is None else f" [{ci[0]:+.1f}, {ci[1]:+.1f}]")


def markdown_table(rows: list[dict[str, Any]], metric: str = "ood_acc", baseline: str | None = None,
                   bounds: Bounds = None, picks: Picks | None = None) -> str:
    """One row per variant: mean ± std per target, the average over targets and its CI (clipped to ``bounds``),
    and with ``baseline`` the paired difference of the average from that row's (mean [95 % CI] over seeds);
    ``picks`` (model selection) adds each cell's chosen draws and rounds beside it."""
    variants, targets, cells = pivot(rows, metric)
    picks = picks or {}
    head = ["method", *targets, "avg", "avg 95 % CI"] + ([f"Δ avg vs {baseline}, paired [95 % CI]"] if baseline else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        vals = [mean_std(cells.get((v, t), [])) + (f" {DEGRADED}" if degraded(rows, v, t) else "")
                + (f" [{picks[(v, t)]}]" if (v, t) in picks else "") for t in targets]
        avg = _avg_over_targets(rows, v, targets, metric)
        delta = [] if baseline is None else [NONE if v == baseline else _delta_text(paired_deltas(rows, v, baseline, metric))]
        lines.append("| " + " | ".join([v, *vals, mean_std(avg), _ci_text(avg, bounds), *delta]) + " |")
    if any(r.get("dropped", 0) for r in rows):
        lines.append(f"\n{DEGRADED_NOTE}")
    return "\n".join(lines)


def csv_table(rows: list[dict[str, Any]], metric: str = "ood_acc", baseline: str | None = None,
              bounds: Bounds = None, picks: Picks | None = None) -> str:
    """One line per (method, target) and per method's avg: mean, sample std, 95 % CI (clipped to ``bounds``), n
    (std and CI empty where n = 1), and whether a run of it dropped clients; with ``baseline``, a line
    ``avg - <baseline>`` of the paired differences too (unclipped: a difference has no such bounds); with ``picks``
    (model selection) a last column ``selected``: the cell's chosen draws and rounds."""
    variants, targets, cells = pivot(rows, metric)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["method", "target", "mean", "std_ddof1", "ci95_low", "ci95_high", "n", "dropped_clients"]
               + (["selected"] if picks is not None else []))
    for v in variants:
        groups = [(t, cells.get((v, t), [])) for t in targets] + [("avg", _avg_over_targets(rows, v, targets, metric))]
        if baseline is not None and v != baseline:
            groups.append((f"avg - {baseline}", paired_deltas(rows, v, baseline, metric)))
        for t, vals in groups:
            if vals:
                s = sample_std(vals)
                ci = ci95(vals) if t.startswith("avg - ") else clipped_ci(vals, bounds)
                cell_target = t if t in targets else None
                w.writerow([v, t, f"{np.mean(vals):.3f}", "" if s is None else f"{s:.3f}",
                            *(("", "") if ci is None else (f"{ci[0]:.3f}", f"{ci[1]:.3f}")), len(vals),
                            int(degraded(rows, v, cell_target))]
                           + ([] if picks is None else [picks.get((v, t), "")]))
    return buf.getvalue()
