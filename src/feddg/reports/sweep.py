"""The report of a sweep directory (feddg.sweep): mean ± sample std and 95 % CI per method and target,
bars with each seed as a dot, metric curves as mean ± std bands, per-domain bars over seeds, and with a
``sweep.baseline`` each variant's paired difference from it. The metric, its bounds and chance level come from the
runs' task (results.json)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from feddg.config import read_yaml
from feddg.evaluation.plots import (
    bounded_error,
    chance_line,
    draw_domains,
    has_chance,
    integer_rounds,
    legend_above,
    read_metrics,
)
from feddg.evaluation.selection import RULES
from feddg.evaluation.tables import (
    DEGRADED_NOTE,
    ci95,
    clipped_ci,
    degraded,
    paired_deltas,
    pivot,
    sample_std,
    seed_averages,
)
from feddg.reports.audit import sweep_audit_section
from feddg.reports.counts import run_counts
from feddg.reports.figures import png_uri
from feddg.reports.page import REPORT, page_context, render
from feddg.tasks import TaskInfo

RUNS = "runs.jsonl"
SPEC = "sweep.json"  # the sweep section as run (feddg.sweep writes it)
AVG = "avg"


@dataclass(frozen=True)
class Stat:
    """Mean, sample std and 95 % Student-t confidence interval of ``n`` seeds (std/CI NaN for n = 1)."""

    mean: float
    std: float
    lo: float
    hi: float
    n: int
    values: tuple[float, ...]


def stat(values: list[float], bounds: tuple[float, float] | None = None) -> Stat:
    """Mean, sample std and the 95 % interval clipped to the metric's ``bounds``."""
    mean, std, ci = float(np.mean(values)), sample_std(values), clipped_ci(values, bounds)
    lo, hi = ci if ci is not None else (math.nan, math.nan)
    return Stat(mean, math.nan if std is None else std, lo, hi, len(values), tuple(values))


def is_sweep_dir(path: Path) -> bool:
    return (path / RUNS).is_file() or any(path.glob("*/*/seed*/results.json"))


def sweep_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """runs.jsonl's rows (variant, target, seed, run_dir, final accuracies); for a sweep still running,
    the finished runs' results.json. ``run_dir`` is looked up inside ``sweep_dir`` first (it may have moved)."""
    if (sweep_dir / RUNS).is_file():
        rows = [json.loads(line) for line in (sweep_dir / RUNS).read_text().splitlines() if line.strip()]
    else:
        rows = []
        for res in sorted(sweep_dir.glob("*/*/seed*/results.json")):
            r = json.loads(res.read_text())
            variant = res.parts[-4] + (" (reconstructed)" if "method_label" in r else "")
            rows.append({"variant": variant, "target": res.parts[-3], "seed": r["seed"],
                         "run_dir": str(res.parent), **r["final"], "time_total_s": r["time_total_s"],
                         "dropped": r["failures"]["client_rounds_lost"]})
    for r in rows:
        given = Path(r["run_dir"])
        local = sweep_dir.joinpath(*given.parts[-3:])
        r["run_dir"] = str(local if local.is_dir() else given)
    return rows


def cells(rows: list[dict[str, Any]], metric: str, bounds: tuple[float, float] | None = None
          ) -> tuple[list[str], list[str], dict[tuple[str, str], Stat]]:
    """Variants, targets (+ ``avg``: per seed the mean over targets, seeds complete on all) and their stats."""
    variants, targets, vals = pivot(rows, metric)
    if len(targets) > 1:
        for v in variants:
            if avg := list(seed_averages(rows, v, targets, metric).values()):
                vals[(v, AVG)] = avg
    columns = targets + ([AVG] if len(targets) > 1 else [])
    return variants, columns, {k: stat(v, bounds) for k, v in vals.items()}


def bars(rows: list[dict[str, Any]], metric: str, task: TaskInfo) -> plt.Figure:
    """Grouped bars per target: mean per variant, error bar = sample std, a dot per seed."""
    variants, columns, st = cells(rows, metric)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(columns) * max(1, len(variants)) * 0.6 + 2), 3.8))
    width = 0.8 / len(variants)
    for j, v in enumerate(variants):
        for i, c in enumerate(columns):
            s = st.get((v, c))
            if s is None:
                continue
            x = i - 0.4 + width * (j + 0.5)
            ax.bar(x, s.mean, width * 0.92, color=f"C{j}", label=v if i == 0 else None,
                   yerr=None if math.isnan(s.std) else bounded_error(s.mean, s.std, task.bounds_of(metric)), capsize=3)
            ax.plot(x + np.linspace(-width / 5, width / 5, s.n), s.values, "o", color="black", markersize=2.5, zorder=3)
    chance_line(ax, task, metric)
    ax.set_xticks(range(len(columns)), columns)
    ax.set(ylabel=_axis_label(metric, task), title=f"{metric}: mean ± sample std (within the bounds), dots = seeds")
    ax.grid(axis="y", alpha=0.3)
    legend_above(ax, task.bounds_of(metric))
    return fig


def _axis_label(metric: str, task: TaskInfo) -> str:
    """``ood_acc (%)``; another figure (``time_total_s``) without the task's unit."""
    return f"{metric} ({task.unit})" if task.bounds_of(metric) is not None and task.unit else metric


def curves(rows: list[dict[str, Any]], metric: str, task: TaskInfo) -> plt.Figure:
    """Per target, ``metric`` per evaluated round: mean over seeds with a ± sample std band, per variant."""
    variants, columns, _ = cells(rows, metric)
    targets = [c for c in columns if c != AVG]
    fig, axes = plt.subplots(1, len(targets), figsize=(3.6 * len(targets) + 0.6, 3.2), squeeze=False, sharey=True)
    for ax, target in zip(axes[0], targets):
        for j, v in enumerate(variants):
            per_seed = [{m["round"]: m[metric] for m in read_metrics(Path(r["run_dir"])) if metric in m}
                        for r in rows if r["variant"] == v and r["target"] == target]
            rounds = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
            if not rounds:
                continue
            y = np.array([[s[k] for k in rounds] for s in per_seed])
            mean = y.mean(0)
            ax.plot(rounds, mean, "-o", color=f"C{j}", markersize=3, label=v)
            if len(per_seed) > 1:
                sd = y.std(0, ddof=1)
                ax.fill_between(rounds, mean - sd, mean + sd, color=f"C{j}", alpha=0.2)
        chance_line(ax, task, metric)
        integer_rounds(ax)
        ax.set(title=f"held out {target}", ylim=task.bounds_of(metric))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(_axis_label(metric, task))
    axes[0][0].legend(fontsize=7)
    return fig


def paired(rows: list[dict[str, Any]], metric: str, baseline: str) -> plt.Figure | None:
    """Per variant, its average over targets minus ``baseline``'s, paired by seed: mean with a Student-t 95 %
    CI (a forest plot), a dot per seed; ``None`` when no variant shares a complete seed with the baseline."""
    others = [(v, paired_deltas(rows, v, baseline, metric)) for v in dict.fromkeys(r["variant"] for r in rows)]
    others = [(v, d) for v, d in others if v != baseline and d]
    if not others:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 0.4 * len(others) + 1.4))
    for i, (v, d) in enumerate(others):
        mean, ci = float(np.mean(d)), ci95(d)
        xerr = None if ci is None else [[mean - ci[0]], [ci[1] - mean]]
        ax.errorbar(mean, i, xerr=xerr, fmt="s", color=f"C{i}", capsize=3)
        ax.plot(d, [i] * len(d), "o", color="black", markersize=2.5, zorder=3)
    ax.axvline(0.0, color="grey", linestyle="--", linewidth=1)
    ax.set_yticks(range(len(others)), [v for v, _ in others])
    ax.invert_yaxis()
    ax.set(xlabel=f"Δ {metric}, average over targets (points)", title=f"paired difference from {baseline}")
    ax.grid(axis="x", alpha=0.3)
    return fig


def domains(rows: list[dict[str, Any]], variant: str, counts: dict[str, dict[str, int]], task: TaskInfo) -> plt.Figure:
    """Per target (one panel each), the per-domain figures of ``variant`` over its seeds."""
    targets = list(dict.fromkeys(r["target"] for r in rows if r["variant"] == variant))
    fig, axes = plt.subplots(1, len(targets), figsize=(3.4 * len(targets) + 0.6, 3.6), squeeze=False)
    for ax, target in zip(axes[0], targets):
        runs = [r for r in rows if r["variant"] == variant and r["target"] == target]
        keys = [k for k in runs[0] if (parsed := task.parse(k)) is not None and parsed[1] is not None]
        draw_domains(ax, {k: [r[k] for r in runs if k in r] for k in keys}, task, counts.get(target),
                     f"held out {target}")
    return fig


def table(rows: list[dict[str, Any]], metric: str, task: TaskInfo) -> dict[str, Any]:
    """Header and rows of the HTML table: per cell its stats, whether it is the column's best (the task's
    direction) and whether a run of it dropped clients; intervals clipped to the metric's bounds."""
    variants, columns, st = cells(rows, metric, task.bounds_of(metric))
    pick = max if task.higher_is_better else min
    best = {c: pick((st[(v, c)].mean for v in variants if (v, c) in st), default=None) for c in columns}
    return {"columns": columns, "rows": [
        (v, [(st.get((v, c)), st.get((v, c)) is not None and st[(v, c)].mean == best[c],
              degraded(rows, v, None if c == AVG else c)) for c in columns])
        for v in variants], "degraded": any(r.get("dropped", 0) for r in rows)}


def sweep_report(sweep_dir: Path) -> Path:
    """Write ``report.html`` into ``sweep_dir``."""
    rows = sweep_rows(sweep_dir)
    if not rows:
        raise ValueError(f"{sweep_dir} holds no finished runs yet")
    first_cfg = Path(rows[0]["run_dir"]) / "config.yaml"
    name = read_yaml(first_cfg).get("name", sweep_dir.name) if first_cfg.is_file() else sweep_dir.name
    counts: dict[str, dict[str, int]] = {}
    task: TaskInfo | None = None
    notes: list[str] = []
    for r in rows:  # per target, the sample counts of its first run
        if r["target"] not in counts:
            c, task, notes = run_counts(Path(r["run_dir"]))
            counts[r["target"]] = c
    if task is None:
        raise ValueError(f"{sweep_dir}: the runs' task is unknown ({'; '.join(notes)})")
    spec = json.loads((sweep_dir / SPEC).read_text()) if (sweep_dir / SPEC).is_file() else {}
    tabled = spec.get("metrics") or [p.stem.removeprefix("table_") for p in sorted(sweep_dir.glob("table_*.csv"))
                                          if not p.stem.endswith(tuple(f"_{rule}" for rule in RULES))]  # rules: below
    selection = [{"title": p.stem.removeprefix("table_"), "text": p.read_text()}  # one per metric and rule
                 for p in sorted(sweep_dir.glob("table_*.md")) if p.stem.endswith(tuple(f"_{r}" for r in RULES))]
    metrics: list[str] = [m for m in (task.key(r) for r in ("ood", "val", "id"))
                          if m in tabled or (not tabled and m in rows[0])]
    metrics += [m for m in tabled if m not in metrics]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    seeds = sorted({r["seed"] for r in rows})
    summary = [("runs", len(rows)), ("variants", len(variants)), ("targets", len({r["target"] for r in rows})),
               ("seeds", ", ".join(map(str, seeds))), ("time (s)", f"{sum(r.get('time_total_s', 0) for r in rows):.0f}")]
    summary += [("metric", task.axis_label)]
    summary += [(f"chance ({task.unit})", f"{task.chance:.3g}")] if task.chance is not None else []
    baseline = spec.get("baseline")
    figures = {m: paired(rows, m, baseline) if baseline else None for m in metrics}
    sections = [{"metric": m, "label": _axis_label(m, task), "table": table(rows, m, task),
                 "paired": None if (fig := figures[m]) is None else {
                     "title": f"{m}: paired difference from {baseline}", "uri": png_uri(fig),
                     "caption": f"per seed, the variant's average over targets minus {baseline}'s (same splits); "
                                "square: mean, bar: Student-t 95 % CI over seeds, dots: seeds"},
                 "bars": {"title": f"{m} per target", "uri": png_uri(bars(rows, m, task)),
                          "caption": "bars: mean over seeds; error bars: sample std; dots: individual seeds"
                                     + ("; dotted: chance" if has_chance(task, m) else "")},
                 "curves": {"title": f"{m} per round", "uri": png_uri(curves(rows, m, task)),
                            "caption": "mean over seeds per evaluated round, band: ± sample std"}}
                for m in metrics]
    per_domain = [{"title": v, "uri": png_uri(domains(rows, v, counts, task)),
                   "caption": "mean over seeds, error bars: sample std, dots: seeds; n: samples evaluated"}
                  for v in variants]
    cfg_text = first_cfg.read_text() if first_cfg.is_file() else ""
    run_rows = [{**r, "rel": Path(r["run_dir"]).relative_to(sweep_dir).as_posix()
                 if Path(r["run_dir"]).is_relative_to(sweep_dir) else r["run_dir"]} for r in rows]
    return render("sweep.html.j2", sweep_dir / REPORT, **page_context(f"sweep: {name}", str(sweep_dir), notes),
                  subtitle=" × ".join(_count(n, noun) for n, noun in ((len(variants), "variant"),
                                                                       (len(counts), "target"), (len(seeds), "seed"))),
                  summary=summary, sections=sections, per_domain=per_domain, metrics=metrics, runs=run_rows,
                  metric_label=task.label, variants=spec.get("expanded", {}), degraded_note=DEGRADED_NOTE,
                  selection=selection, audit=sweep_audit_section(sweep_dir),
                  base_config=cfg_text)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
