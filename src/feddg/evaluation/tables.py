"""Paper-style tables: mean ± std over seeds, one row per method, one column per target domain."""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from typing import Any

import numpy as np


def mean_std(values: list[float]) -> str:
    if not values:
        return "–"
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}" if len(values) > 1 else f"{values[0]:.1f}"


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
    head = ["method", *targets, "avg"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for v in variants:
        vals = [mean_std(cells.get((v, t), [])) for t in targets]
        lines.append("| " + " | ".join([v, *vals, mean_std(_avg_over_targets(rows, v, targets, metric))]) + " |")
    return "\n".join(lines)


def csv_table(rows: list[dict[str, Any]], metric: str = "ood_acc") -> str:
    variants, targets, cells = pivot(rows, metric)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["method", "target", "mean", "std", "n"])
    for v in variants:
        for t in targets:
            vals = cells.get((v, t), [])
            if vals:
                w.writerow([v, t, f"{np.mean(vals):.3f}", f"{np.std(vals):.3f}", len(vals)])
        avg = _avg_over_targets(rows, v, targets, metric)
        if avg:
            w.writerow([v, "avg", f"{np.mean(avg):.3f}", f"{np.std(avg):.3f}", len(avg)])
    return buf.getvalue()
