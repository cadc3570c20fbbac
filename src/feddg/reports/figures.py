"""Figures of one run beyond curves.png and domains.png: bytes, time, and the method's diagnostics.

Diagnostics are drawn from whatever metrics.jsonl holds, grouped by key: ``prefix/name`` is one
panel, ``prefix/<layer>/name`` one panel per ``prefix/name`` with a line per layer, and
``name/<client id>`` one panel with a line per client, all of them in the figure ``per client``
(hFedF's GradAlign fusion weights and cosines).
"""

from __future__ import annotations

import base64
import io
import math
from collections import defaultdict
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from feddg.evaluation.plots import from_zero, integer_rounds
from feddg.tasks import TaskInfo

ENGINE_KEYS = {"round", "lr", "clients", "train_loss", "bytes_down", "bytes_up", "time_train_s", "time_aggregate_s",
               "time_eval_s",
               "time_round_s"}
TIME_PARTS = (("time_train_s", "train (clients)"), ("time_aggregate_s", "aggregate"), ("time_eval_s", "evaluate"))
Series = dict[str, list[tuple[int, float]]]


def png_uri(fig: plt.Figure) -> str:
    """``fig`` as a ``data:image/png;base64,...`` URI (closes it)."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def communication(metrics: list[dict[str, Any]]) -> plt.Figure:
    """Bytes sent down (server -> clients) and up (clients -> server) per round, all clients together."""
    peak = max(max(m["bytes_down"], m["bytes_up"]) for m in metrics)
    scale, unit = next((s, u) for s, u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B")) if peak >= s or s == 1)
    fig, ax = plt.subplots(figsize=(6, 3.2))
    rounds = [m["round"] for m in metrics]
    for key, style in (("bytes_down", "-o"), ("bytes_up", "-s")):
        ax.plot(rounds, [m[key] / scale for m in metrics], style, markersize=3, label=key.removeprefix("bytes_"))
    integer_rounds(ax, rounds)
    from_zero(ax, [peak / scale])
    ax.set(ylabel=unit, title="bytes per round, all clients")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def timing(metrics: list[dict[str, Any]]) -> plt.Figure:
    """Seconds per round, stacked: client training, aggregation, evaluation."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    rounds = [m["round"] for m in metrics]
    bottom = [0.0] * len(metrics)
    for key, label in TIME_PARTS:
        vals = [float(m.get(key, 0.0)) for m in metrics]
        ax.bar(rounds, vals, bottom=bottom, label=label, width=0.7)
        bottom = [b + v for b, v in zip(bottom, vals)]
    integer_rounds(ax, rounds)
    ax.set(ylabel="seconds", title="time per round")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def schedule(metrics: list[dict[str, Any]]) -> plt.Figure:
    """Learning rate sent to the clients and number of clients sampled, per round."""
    return diagnostics({k: {k: [(m["round"], m[k]) for m in metrics if k in m]} for k in ("lr", "clients")})


def diagnostic_panels(metrics: list[dict[str, Any]], task: TaskInfo) -> dict[str, dict[str, Series]]:
    """``{figure: {panel: {line: [(round, value), ...]}}}`` for every numeric key that is not an
    engine key or a figure of the task's metric; keys without a prefix go to the figure ``other``."""
    figs: dict[str, dict[str, Series]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for m in metrics:
        for key, val in m.items():
            if key in ENGINE_KEYS or task.parse(key) is not None or isinstance(val, bool) or not isinstance(val, int | float):
                continue
            parts = key.split("/")
            if len(parts) == 1:
                fig, panel, line = "other", key, key
            elif parts[-1].isdigit():
                fig, panel, line = "per client", "/".join(parts[:-1]), f"client {parts[-1]}"
            elif len(parts) > 2:
                fig, panel, line = parts[0], f"{parts[0]}/…/{parts[-1]}", "/".join(parts[1:-1])
            else:
                fig, panel, line = parts[0], key, key
            figs[fig][panel][line].append((m["round"], float(val)))
    return {f: {p: dict(lines) for p, lines in panels.items()} for f, panels in figs.items()}


def diagnostics(panels: dict[str, Series]) -> plt.Figure:
    """One panel per diagnostic, a line per layer or client (legend when there are few)."""
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols, 2.8 * rows), squeeze=False)
    for ax, (name, lines) in zip(axes.flat, sorted(panels.items())):
        for line, pts in lines.items():
            ax.plot(*zip(*pts), "-o", markersize=2, label=line)
        integer_rounds(ax, [r for pts in lines.values() for r, _ in pts])
        from_zero(ax, [v for pts in lines.values() for _, v in pts])
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        if len(lines) <= 10 and set(lines) != {name}:
            ax.legend(fontsize=6)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    return fig


def per_class(view: dict[str, Any]) -> plt.Figure:
    """Per class, each role's recall (bars) and the share of that role's predictions given to the class (dots):
    a model that predicts one class shows one tall dot."""
    classes = view["classes"]
    roles = [r for r in view if r != "classes"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(classes) * max(1, len(roles)) + 2), 3.4))
    width = 0.8 / max(1, len(roles))
    for j, role in enumerate(roles):
        x = [i - 0.4 + width * (j + 0.5) for i in range(len(classes))]
        recall = [math.nan if r is None else r for r in view[role]["recall"]]
        ax.bar(x, recall, width * 0.92, color=f"C{j}", alpha=0.7, label=f"{role}: recall")
        ax.plot(x, view[role]["predicted"], "D", color=f"C{j}", markeredgecolor="black", markersize=4,
                label=f"{role}: share of predictions")
    ax.set_xticks(range(len(classes)), classes, rotation=45 if len(classes) > 12 else 0, fontsize=7)
    ax.set(ylabel="%", ylim=(0, 105), title="per class: recall (bars) and share of the predictions (dots)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes: recalls near 100 % fill it
    return fig


#: the role whose collapse :func:`collapsed` reports by default: the first of these a run's per-class view holds (the
#: held-out domain; a personalised method's global model on it; the holdouts where no domain is held out)
HEADLINE_ROLES = ("ood", "global_ood", "id", "global_id")


def collapsed(view: dict[str, Any], role: str | None = None, share: float = 90.0) -> str | None:
    """A warning when ``role``'s predictions (default: the first of :data:`HEADLINE_ROLES` in ``view``) go to one
    class (at least ``share`` % of them, with more classes)."""
    role = role or next((r for r in HEADLINE_ROLES if r in view), None)
    if role is None or role not in view or len(view["classes"]) < 2:
        return None
    predicted = view[role]["predicted"]
    top = max(range(len(predicted)), key=predicted.__getitem__)
    if predicted[top] < share:
        return None
    return (f"the model gives {predicted[top]:.0f} % of its {role} predictions to class {view['classes'][top]!r} "
            f"(of {len(predicted)} classes): it has collapsed onto one class")
