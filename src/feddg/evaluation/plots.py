"""PNG plots of a run directory: accuracy per round, and id/ood accuracy per domain."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a feddg run directory?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(metrics: list[dict[str, Any]], path: Path, title: str = "") -> Path:
    """Mean id / val / ood accuracy and training loss per round."""
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, style in (("id_acc", "-o"), ("val_acc", "-s"), ("ood_acc", "-^"), ("global_ood_acc", "--")):
        pts = [(m["round"], m[key]) for m in metrics if key in m]
        if pts:
            ax_acc.plot(*zip(*pts), style, label=key.replace("_acc", ""), markersize=3)
    ax_acc.set(xlabel="round", ylabel="accuracy (%)", title="accuracy")
    ax_acc.grid(alpha=0.3)
    ax_acc.legend()
    ax_loss.plot([m["round"] for m in metrics], [m["train_loss"] for m in metrics], "-o", markersize=3)
    ax_loss.set(xlabel="round", ylabel="loss", title="mean client training loss")
    ax_loss.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_domains(final: dict[str, float], path: Path, title: str = "") -> Path:
    """One bar per domain: id accuracy for source domains, ood (and val) for held-out ones."""
    bars = [(k.split("/", 1)[1], k.split("_acc")[0], v) for k, v in final.items() if "/" in k and not k.startswith("global")]
    colours = {"id": "tab:blue", "val": "tab:orange", "ood": "tab:red"}
    fig, ax = plt.subplots(figsize=(max(4, 1.1 * len(bars)), 3.8))
    for i, (dom, kind, val) in enumerate(bars):
        ax.bar(i, val, color=colours.get(kind, "grey"), label=kind)
        ax.text(i, val + 1, f"{val:.1f}", ha="center", fontsize=8)
    ax.set_xticks(range(len(bars)), [d for d, _, _ in bars], rotation=20)
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys())
    ax.set(ylabel="accuracy (%)", ylim=(0, 105), title=title or "accuracy per domain")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_title(run_dir: Path) -> str:
    """"FedAvg · digits-dg · held out synth · seed 0" from results.json, else the folder name."""
    path = run_dir / "results.json"
    if not path.is_file():
        return run_dir.name
    r = json.loads(path.read_text())
    held = ", ".join(r["target"]) + (f" (val {', '.join(r['val_domain'])})" if r.get("val_domain") else "")
    return f"{r['method']} · {r['dataset']} · held out {held} · seed {r['seed']}"


def report(run_dir: str | Path) -> list[Path]:
    """Write ``curves.png`` and ``domains.png`` into ``run_dir``."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    if not metrics:
        raise ValueError(f"{run_dir}/metrics.jsonl has no rounds yet")
    title = run_title(run_dir)
    out = [plot_curves(metrics, run_dir / "curves.png", title)]
    last = next((m for m in reversed(metrics) if "ood_acc" in m), None)
    if last is not None:
        out.append(plot_domains({k: v for k, v in last.items() if "acc" in k}, run_dir / "domains.png", title))
    from feddg.evaluation.style_grid import style_grid  # PARDON/CCST runs: styles.png (PARDON Fig. 8)

    grid = style_grid(run_dir)
    if grid is not None:
        out.append(grid)
    return out
