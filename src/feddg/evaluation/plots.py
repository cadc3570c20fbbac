"""PNG plots of a run directory: the task's metric per round, and id/ood figures per domain.

Which keys hold the metric, its name, bounds and chance level come from the run's task (results.json's ``task``
block, :class:`~feddg.tasks.TaskInfo`), never from key names. Rounds are integers on every axis; metric plots
carry the chance line when the task has one; per-domain bars show sample counts when given, and error bars
(sample std) with one dot per seed when a domain has several values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import yaml
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator

from feddg.tasks import TaskInfo, info_for_dataset

ROLE_COLOURS = {"id": "tab:blue", "val": "tab:orange", "ood": "tab:red"}
#: more domains than this get a histogram of their figures instead of a bar each (writers, camera traps)
MAX_DOMAIN_BARS = 40
#: role, line style, marker size, hollow: larger hollow markers behind smaller ones, so equal figures stay visible
ROLE_STYLES = (("id", "-o", 8, True), ("val", "-s", 6, True), ("ood", "-^", 4, False), ("global_ood", "--", 3, False))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows; a line that is not JSON (a crash mid-write) is a ``ValueError`` naming file and line."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a feddg run directory?")
    return [_parsed(line, path, n) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON file at ``path`` (``None`` if absent); one that does not parse is a ``ValueError`` naming it."""
    return _parsed(path.read_text(), path) if path.is_file() else None


def _parsed(text: str, path: Path, line: int | None = None) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        where = f"{path}:{line if line is not None else err.lineno}"
        raise ValueError(f"{where}: not JSON ({err.msg}; the file is damaged, e.g. by a crash mid-write)") from None


def integer_rounds(ax: Axes, rounds: Sequence[float] = ()) -> None:
    """Round numbers as x ticks: never 2.5; a single round (or two) gets half a round of room on each side rather
    than an axis of 1.9…2.1. ``min_n_ticks=1``: MaxNLocator gives up on integers when fewer than two fit (one round's
    1.5–2.5 was ticked 1.5, 1.6, …, 2.5)."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlabel("round")
    if rounds and max(rounds) - min(rounds) < 2:
        ax.set_xlim(min(rounds) - 0.5, max(rounds) + 0.5)


def from_zero(ax: Axes, values: Sequence[float]) -> None:
    """A y axis from 0 to above the largest of non-negative ``values``, so a constant line sits inside the frame
    at its height (not on the frame, nor in a 5.8–6.2 window that suggests change)."""
    if values and min(values) >= 0 and max(values) > 0:
        ax.set_ylim(0, 1.15 * max(values))


def has_chance(task: TaskInfo, metric: str | None = None) -> bool:
    """Whether ``metric`` (default: the task's) has the task's chance level: macro-F1's chance is not accuracy's."""
    name = None if metric is None else metric.split("/")[0]  # ood_acc/<domain> is accuracy too
    return task.chance is not None and (name is None or name == task.metric or name.endswith(f"_{task.metric}"))


def chance_line(ax: Axes, task: TaskInfo, metric: str | None = None) -> None:
    if task.chance is not None and has_chance(task, metric):
        ax.axhline(task.chance, ls=":", color="grey", label=f"chance ({task.chance:.3g} {task.unit})".replace(" )", ")"))


def draw_metric(ax: Axes, metrics: list[dict[str, Any]], task: TaskInfo) -> None:
    """The task's metric, mean over domains, per evaluated round: id / val / ood."""
    rounds: list[float] = []
    for role, style, size, hollow in ROLE_STYLES:
        key = task.key(role)
        pts = [(m["round"], m[key]) for m in metrics if key in m]
        if pts:
            ax.plot(*zip(*pts), style, label=role, markersize=size, markerfacecolor="none" if hollow else None)
            rounds += [r for r, _ in pts]
    chance_line(ax, task)
    integer_rounds(ax, rounds)
    ax.set(ylabel=task.axis_label, ylim=task.bounds, title=task.label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_curves(metrics: list[dict[str, Any]], path: Path, task: TaskInfo, title: str = "") -> Path:
    """The task's metric (with the chance line) and training loss per round."""
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 3.8))
    draw_metric(ax_acc, metrics, task)
    ax_loss.plot([m["round"] for m in metrics], [m["train_loss"] for m in metrics], "-o", markersize=3)
    integer_rounds(ax_loss, [m["round"] for m in metrics])
    ax_loss.set(ylabel="loss", title="mean client training loss")
    ax_loss.grid(alpha=0.3)
    ax_acc.set_xlim(ax_loss.get_xlim())  # the same rounds side by side, however few of them were evaluated
    fig.suptitle(title)
    return save(fig, path)


def domain_bars(values: Mapping[str, float | Sequence[float]], task: TaskInfo) -> list[tuple[str, str, list[float]]]:
    """``(domain, role, values)`` for every per-domain key of the task's metric of the id / val / ood roles
    (``ood_acc/uci`` -> ``("uci", "ood", [...])``)."""
    bars = []
    for key, val in values.items():
        parsed = task.parse(key)
        if parsed is not None and parsed[1] is not None and parsed[0] in ROLE_COLOURS:
            vals = [float(val)] if isinstance(val, int | float) else [float(v) for v in val]
            bars.append((parsed[1], parsed[0], vals))
    return bars


def draw_domains(ax: Axes, values: Mapping[str, float | Sequence[float]], task: TaskInfo,
                 counts: Mapping[str, int] | None = None, title: str = "") -> None:
    """One bar per domain (mean); error bar = sample std and a dot per value where there are several;
    ``counts`` (same keys) put ``n=`` under each domain name."""
    bars = domain_bars(values, task)
    if len(bars) > MAX_DOMAIN_BARS:
        draw_domain_spread(ax, bars, task, title)
        return
    top = task.bounds[1]
    for i, (dom, kind, vals) in enumerate(bars):
        mean = float(np.mean(vals))
        err = bounded_error(mean, float(np.std(vals, ddof=1)), task.bounds) if len(vals) > 1 else None
        ax.bar(i, mean, color=ROLE_COLOURS.get(kind, "grey"), alpha=0.8, label=kind, yerr=err, capsize=4)
        if len(vals) > 1:
            ax.plot(i + np.linspace(-0.15, 0.15, len(vals)), vals, "o", color="black", markersize=3, zorder=3)
        above = mean + (err[1][0] if err is not None else 0.0)  # the error bar's top, within the bounds
        ax.text(i, min(above + 0.015 * top, 1.01 * top), f"{mean:.1f}", ha="center", fontsize=8)
    labels = [f"{dom}\nn={counts[task.key(kind, dom)]}" if counts and task.key(kind, dom) in counts else dom
              for dom, kind, _ in bars]
    ax.set_xticks(range(len(bars)), labels, fontsize=8)
    ax.set_ylabel(task.axis_label)
    legend_above(ax, task.bounds, max_columns=3)  # one row: id, val, ood
    ax.set_title(title or f"{task.label} per domain", wrap=True)  # a run's title is wider than four bars


def bounded_error(mean: float, std: float, bounds: tuple[float, float] | None) -> list[list[float]]:
    """``yerr`` of ``mean ± std`` cut at the metric's ``bounds`` (an accuracy of 95 ± 8 % reaches 100, not 103: past
    the scale it would run into the legend's band and under its own value label)."""
    low, high = bounds if bounds is not None else (-math.inf, math.inf)
    return [[min(std, mean - low)], [min(std, high - mean)]]


def legend_above(ax: Axes, bounds: tuple[float, float] | None, max_columns: int = 4) -> None:
    """The legend (one entry per label) in a band above ``bounds`` (the axes' own range where ``None``), ticks only
    within them: bars near the top of the scale stay clear of it (inside the bounds "best" lay over them)."""
    handles, names = ax.get_legend_handles_labels()
    entries = dict(zip(names, handles))
    low, top = bounds if bounds is not None else ax.get_ylim()
    columns = max(1, min(max_columns, len(entries)))
    rows = -(-len(entries) // columns)
    ax.set_ylim(low, top + (0.1 + 0.12 * rows) * (top - low))
    ax.set_yticks([t for t in ax.get_yticks() if low <= t <= top])
    ax.legend(entries.values(), entries.keys(), fontsize=8, loc="upper right", ncols=columns)


def draw_domain_spread(ax: Axes, bars: list[tuple[str, str, list[float]]], task: TaskInfo, title: str = "") -> None:
    """Too many domains for a bar each (natural clients: writers, cameras): per role, the histogram of the
    domains' figures (each domain's mean over its values), with the mean over domains as a dashed line."""
    roles: dict[str, list[float]] = {}
    for _, kind, vals in bars:
        roles.setdefault(kind, []).append(float(np.mean(vals)))
    edges = np.linspace(*task.bounds, 26).tolist()
    for kind, scores in roles.items():
        colour = ROLE_COLOURS.get(kind, "grey")
        ax.hist(scores, bins=edges, color=colour, alpha=0.6, label=f"{kind}: {len(scores):,} domains")
        ax.axvline(float(np.mean(scores)), color=colour, linestyle="--", linewidth=1)
    ax.legend(fontsize=8)
    ax.set(xlabel=task.axis_label, ylabel="domains", xlim=task.bounds,
           title=title or f"{task.label} per domain ({len(bars):,} domains; dashed: mean)")


def plot_domains(final: Mapping[str, float | Sequence[float]], path: Path, task: TaskInfo, title: str = "",
                 counts: Mapping[str, int] | None = None) -> Path:
    """Per-domain figures: id for source domains, ood (and val) for held-out ones."""
    n = len(domain_bars(final, task))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * n) if n <= MAX_DOMAIN_BARS else 7.0, 3.8))
    draw_domains(ax, final, task, counts, title)
    return save(fig, path)


def save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


EVERY_DOMAIN_TRAINS = "none (every domain trains)"  # split.protocol federated: no held-out domain


def method_name(method: str, merge: str | None) -> str:
    """A run's method as sweeps name it: a hierarchy's station merge after a ``+`` (``fedavg+hfedatm``: FedAvg
    clients, HFedATM stations); a flat run's method alone."""
    return method if merge is None else f"{method}+{merge}"


def run_method(results: Mapping[str, Any]) -> str:
    """:func:`method_name` of a run's results.json in its label: ``fedrc+avg (reconstructed)`` for FedRC clients under
    averaging stations (it read ``fedrc (reconstructed)+avg``)."""
    hierarchy = results.get("hierarchy")
    merge = hierarchy.get("merge") if isinstance(hierarchy, dict) else None
    method = str(results["method"])
    return str(results.get("method_label", method)).replace(method, method_name(method, merge), 1)


def run_title(run_dir: Path) -> str:
    """"FedAvg · digits-dg · held out synth · seed 0" from results.json, else the folder name."""
    path = run_dir / "results.json"
    if not path.is_file():
        return run_dir.name
    r = read_json(path) or {}
    held = (", ".join(r["target"]) or EVERY_DOMAIN_TRAINS) + (f" (val {', '.join(r['val_domain'])})"
                                                              if r.get("val_domain") else "")
    return f"{run_method(r)} · {r['dataset']} · held out {held} · seed {r['seed']}"


def run_task(run_dir: Path) -> TaskInfo | None:
    """What the run measures: results.json's ``task`` block; for a run that has not written it (still running, or
    from before the block), its dataset's task from the registry (config.yaml's, else results.json's)."""
    results = read_json(run_dir / "results.json")
    if results and isinstance(results.get("task"), dict):
        return TaskInfo.of(results["task"])
    config = run_dir / "config.yaml"
    try:
        raw = yaml.safe_load(config.read_text()) if config.is_file() else None
    except yaml.YAMLError as err:  # a hand-edited config: the file, not a traceback
        raise ValueError(f"{config}: not YAML ({' '.join(str(err).split())})") from None
    dataset = ((raw or {}).get("data") or {}).get("dataset") or (results or {}).get("dataset")
    return info_for_dataset(dataset) if isinstance(dataset, str) else None


def plot_run(run_dir: str | Path, task: TaskInfo | None = None, counts: Mapping[str, int] | None = None) -> list[Path]:
    """Write ``curves.png`` and ``domains.png`` into ``run_dir`` (``counts``: samples per key)."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    if not metrics:
        raise ValueError(f"{run_dir}/metrics.jsonl has no rounds yet")
    task = task or run_task(run_dir)
    if task is None:
        raise ValueError(f"{run_dir}: its task is unknown (no results.json task block, and no dataset in config.yaml)")
    title = run_title(run_dir)
    out = [plot_curves(metrics, run_dir / "curves.png", task, title)]
    results = read_json(run_dir / "results.json") or {}
    last = results.get("final") or next((m for m in reversed(metrics) if task.key("ood") in m), None)
    if last:
        figures = {k: v for k, v in last.items() if task.parse(k) is not None}
        out.append(plot_domains(figures, run_dir / "domains.png", task, title, counts or results.get("counts")))
    return out
