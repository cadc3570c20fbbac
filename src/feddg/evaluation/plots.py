"""PNG plots of a run directory: accuracy per round, and id/ood accuracy per domain.

Rounds are integers on every axis; accuracy plots carry the chance line (100 / classes) when
the number of classes is known; per-domain bars show sample counts when given, and error bars
(sample std) with one dot per seed when a domain has several values.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.ticker import MaxNLocator

ROLE_COLOURS = {"id": "tab:blue", "val": "tab:orange", "ood": "tab:red"}
ACC_STYLES = (("id_acc", "-o"), ("val_acc", "-s"), ("ood_acc", "-^"), ("global_ood_acc", "--"))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a feddg run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def integer_rounds(ax: Axes) -> None:
    """Round numbers as x ticks: never 2.5."""
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")


def chance_line(ax: Axes, num_classes: int | None) -> None:
    if num_classes:
        ax.axhline(100.0 / num_classes, ls=":", color="grey", label=f"chance ({100.0 / num_classes:.3g} %)")


def draw_accuracy(ax: Axes, metrics: list[dict[str, Any]], num_classes: int | None = None) -> None:
    """Mean id / val / ood accuracy per evaluated round."""
    for key, style in ACC_STYLES:
        pts = [(m["round"], m[key]) for m in metrics if key in m]
        if pts:
            ax.plot(*zip(*pts), style, label=key.removesuffix("_acc"), markersize=3)
    chance_line(ax, num_classes)
    integer_rounds(ax)
    ax.set(ylabel="accuracy (%)", ylim=(0, 100), title="accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_curves(metrics: list[dict[str, Any]], path: Path, title: str = "", num_classes: int | None = None) -> Path:
    """Mean id / val / ood accuracy (with the chance line) and training loss per round."""
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 3.8))
    draw_accuracy(ax_acc, metrics, num_classes)
    ax_loss.plot([m["round"] for m in metrics], [m["train_loss"] for m in metrics], "-o", markersize=3)
    integer_rounds(ax_loss)
    ax_loss.set(ylabel="loss", title="mean client training loss")
    ax_loss.grid(alpha=0.3)
    fig.suptitle(title)
    return save(fig, path)


def domain_bars(values: Mapping[str, float | Sequence[float]]) -> list[tuple[str, str, list[float]]]:
    """``(domain, role, values)`` for every per-domain key (``ood_acc/uci`` -> ``("uci", "ood", [...])``)."""
    bars = []
    for key, val in values.items():
        if "/" in key and not key.startswith("global"):
            kind, dom = key.split("/", 1)
            vals = [float(val)] if isinstance(val, int | float) else [float(v) for v in val]
            bars.append((dom, kind.removesuffix("_acc"), vals))
    return bars


def draw_domains(ax: Axes, values: Mapping[str, float | Sequence[float]], counts: Mapping[str, int] | None = None,
                 title: str = "") -> None:
    """One bar per domain (mean); error bar = sample std and a dot per value where there are several;
    ``counts`` (same keys) put ``n=`` under each domain name."""
    bars = domain_bars(values)
    for i, (dom, kind, vals) in enumerate(bars):
        mean = float(np.mean(vals))
        std = float(np.std(vals, ddof=1)) if len(vals) > 1 else None
        ax.bar(i, mean, color=ROLE_COLOURS.get(kind, "grey"), alpha=0.8, label=kind, yerr=std, capsize=4)
        if len(vals) > 1:
            ax.plot(i + np.linspace(-0.15, 0.15, len(vals)), vals, "o", color="black", markersize=3, zorder=3)
        ax.text(i, min(mean + (std or 0) + 1.5, 101), f"{mean:.1f}", ha="center", fontsize=8)
    labels = [f"{dom}\nn={counts[f'{kind}_acc/{dom}']}" if counts and f"{kind}_acc/{dom}" in counts else dom
              for dom, kind, _ in bars]
    ax.set_xticks(range(len(bars)), labels, fontsize=8)
    handles, names = ax.get_legend_handles_labels()
    uniq = dict(zip(names, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    ax.set(ylabel="accuracy (%)", ylim=(0, 108), title=title or "accuracy per domain")


def plot_domains(final: Mapping[str, float | Sequence[float]], path: Path, title: str = "",
                 counts: Mapping[str, int] | None = None) -> Path:
    """Per-domain accuracy: id for source domains, ood (and val) for held-out ones."""
    n = len(domain_bars(final))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * n), 3.8))
    draw_domains(ax, final, counts, title)
    return save(fig, path)


def save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def run_title(run_dir: Path) -> str:
    """"FedAvg · digits-dg · held out synth · seed 0" from results.json, else the folder name."""
    path = run_dir / "results.json"
    if not path.is_file():
        return run_dir.name
    r = json.loads(path.read_text())
    held = ", ".join(r["target"]) + (f" (val {', '.join(r['val_domain'])})" if r.get("val_domain") else "")
    return f"{r['method']} · {r['dataset']} · held out {held} · seed {r['seed']}"


def known_num_classes(run_dir: Path) -> int | None:
    """Classes of the run's dataset where the registry knows them without loading it."""
    from feddg.data import dataset_info

    path = run_dir / "results.json"
    if not path.is_file():
        return None
    try:
        return dataset_info(json.loads(path.read_text())["dataset"])["num_classes"]
    except (KeyError, ValueError):
        return None


def plot_run(run_dir: str | Path, num_classes: int | None = None, counts: Mapping[str, int] | None = None) -> list[Path]:
    """Write ``curves.png`` and ``domains.png`` into ``run_dir`` (``counts``: samples per ``<role>_acc/<domain>``)."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    if not metrics:
        raise ValueError(f"{run_dir}/metrics.jsonl has no rounds yet")
    title = run_title(run_dir)
    out = [plot_curves(metrics, run_dir / "curves.png", title, num_classes or known_num_classes(run_dir))]
    last = next((m for m in reversed(metrics) if "ood_acc" in m), None)
    if last is not None:
        out.append(plot_domains({k: v for k, v in last.items() if "acc" in k}, run_dir / "domains.png", title, counts))
    return out
