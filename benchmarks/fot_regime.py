"""Issue #15, "Where FOT matters": HFedATM with and without FOT across station drift, stations from
independent initialisations and CNN width, on Digits-DG (base config ``configs/hfedatm/fot-regime.yaml``).

    nice -n 5 python benchmarks/fot_regime.py                 # runs/fot-regime (resumable), table, figure
    python benchmarks/fot_regime.py --report-only             # table and figure from the finished runs

Every regime runs HFedATM (``hierarchy.merge: hfedatm``) through the library's topology, and at each merge
also merges the *same* station models and Grams without FOT (``hfedatm-no-fot``), with HFedAvg (``avg``)
and with FOT + mean (``hfedatm-no-regmean``), and evaluates all of them: a paired comparison without
seed noise. Regimes with more than one server round also run ``hfedatm-no-fot`` end to end (FOT's
effect then includes the training after a merge), except for a seed whose HFedATM run moved no filter
(identity permutations: the same computation); with one server round (one-shot) that run would equal
the paired merge. Stations from independent initialisations are not a topology option: the
script sets their weights in the server state before the first round.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from feddg.aggregation.merges import MERGES, StationMerge
from feddg.config import build_config, read_yaml
from feddg.engines.inprocess import run_inprocess
from feddg.federation.evaluator import Evaluator
from feddg.federation.server import Server
from feddg.federation.setup import Federation, build_federation
from feddg.federation.topology import StationTopology
from feddg.messages import Message, load_weights, weights_of
from feddg.models import create_model
from feddg.seeds import derived_seed

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/hfedatm/fot-regime.yaml"
#: merges evaluated on the same stations at every merge of an HFedATM run
PAIRED = ("hfedatm", "hfedatm-no-fot", "avg", "hfedatm-no-regmean")
Init = Literal["shared", "independent", "late"]

ONE_SHOT = ("federation.rounds=1", "hierarchy.station_rounds=5", "federation.local_epochs=2", "optim.lr=0.05")
HIGH_DRIFT = ("hierarchy.station_rounds=5", "federation.local_epochs=3", "optim.lr=0.2")


@dataclass(frozen=True)
class Regime:
    name: str
    group: str  # drift | init | width
    overrides: tuple[str, ...]
    init: Init = "shared"  # independent: stations 2..S from their own seeds; late: only station S


REGIMES = (
    Regime("one-shot, shared init", "init", ONE_SHOT),
    Regime("one-shot, 1 late station", "init", ONE_SHOT, "late"),
    Regime("one-shot, independent inits", "init", ONE_SHOT, "independent"),
    Regime("N=2 E=1 lr=0.05", "drift", ("hierarchy.station_rounds=2", "federation.local_epochs=1", "optim.lr=0.05")),
    Regime("N=2 E=1 lr=0.2", "drift", ("hierarchy.station_rounds=2", "federation.local_epochs=1", "optim.lr=0.2")),
    Regime("N=5 E=3 lr=0.05", "drift", ("hierarchy.station_rounds=5", "federation.local_epochs=3", "optim.lr=0.05")),
    Regime("N=5 E=3 lr=0.2", "drift", HIGH_DRIFT),
    Regime("one-shot, independent, width/2", "width", (*ONE_SHOT, "model.params.block_widths=[16,32,64,128]"),
           "independent"),
    Regime("one-shot, independent, width×2", "width", (*ONE_SHOT, "model.params.block_widths=[64,128,256,512]"),
           "independent"),
    Regime("N=5 E=3 lr=0.2, width/4", "width", (*HIGH_DRIFT, "model.params.block_widths=[8,16,32,64]")),
)


def safe(name: str) -> str:
    """A folder name for a regime (width/2 and width×2 stay apart)."""
    name = name.replace("/", " over ").replace("×", " times ")
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in name)


def accuracy(fed: Federation, weights: Message) -> dict[str, float]:
    """ood and id (clients' holdouts) accuracy of ``weights``, as the server evaluates."""
    figures = Evaluator(fed).evaluate({"weights": weights})
    return {"ood": figures["ood_acc"], "id": figures["id_acc"]}


class PairedMerge:
    """The topology's HFedATM merge, plus the other :data:`PAIRED` merges of the same stations, evaluated
    (so the run's ``hfl/time_merge_s`` includes these evaluations; ``hfl/time_fot_s`` does not)."""

    def __init__(self, fed: Federation) -> None:
        self.fed = fed
        self.records: list[dict[str, Any]] = []

    def __call__(self, weights: Sequence[Message], grams: Any, gammas: Sequence[float], spec: Any,
                 **kw: Any) -> tuple[Message, dict[str, float]]:
        keep = weights_of(self.fed.model)  # the merge runs mid-round: leave the model as it was
        record: dict[str, Any] = {"stations": [accuracy(self.fed, w)["ood"] for w in weights]}
        out: tuple[Message, dict[str, float]] | None = None
        for name in reversed(PAIRED):  # hfedatm last: its result is the run's
            m = MERGES[name]
            merged = m.fn(weights, grams if m.uses_grams else None, gammas, spec if m.uses_alignment else None, **kw)
            record[name] = accuracy(self.fed, merged[0])
            out = merged
        load_weights(self.fed.model, keep)
        self.records.append(record)
        assert out is not None
        return out


def independent_weights(fed: Federation, station: int) -> Message:
    """A fresh model from its own seed for ``station`` (the federation's init is ``derived_seed(seed, 23)``)."""
    cfg = fed.cfg
    torch.manual_seed(derived_seed(cfg.seed, 7919, station))
    c, h, _ = fed.dataset.image_shape
    model = create_model(cfg.model.name, num_classes=fed.dataset.num_classes, in_channels=c, image_size=h,
                         **cfg.model.params)
    return weights_of(fed.method.prepare_model(model))


def run_one(regime: Regime, merge: str, seed: int, run_dir: Path) -> dict[str, Any]:
    """One run (loaded when its summary exists): final accuracy, per-merge FOT diagnostics, paired merges."""
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        return dict(json.loads(summary_path.read_text()))
    over = [*regime.overrides, f"hierarchy.merge={merge}", f"seed={seed}"]
    cfg = build_config(read_yaml(CONFIG), over)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    fed = build_federation(cfg)
    topo = fed.topology
    assert isinstance(topo, StationTopology)
    paired = PairedMerge(fed)
    if merge == "hfedatm":
        topo.merge = StationMerge(paired, uses_grams=True, uses_alignment=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    for f in run_dir.iterdir():  # an interrupted run starts again
        f.unlink()
    server = Server(fed, run_dir)
    late = {"shared": [], "late": [topo.num_stations - 1], "independent": list(range(1, topo.num_stations))}[regime.init]
    for e in late:
        server.state["stations"][e] = {**server.state["stations"][e], "weights": independent_weights(fed, e)}
    results = run_inprocess(server)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    merges = [{k: v for k, v in r.items() if k.startswith("fot/")} for r in rows if "hfl/time_merge_s" in r]
    for m, rec in zip(merges, paired.records, strict=False):  # no records in a run without FOT
        m["paired"] = rec
    summary = {"regime": regime.name, "group": regime.group, "merge": merge, "seed": seed,
               "ood_acc": results["final"]["ood_acc"], "id_acc": results["final"]["id_acc"], "merges": merges,
               "wall_s": time.perf_counter() - t0, "load": [load0, os.getloadavg()[0]]}
    summary_path.write_text(json.dumps(summary, indent=1))
    return summary


def runs_of(regime: Regime) -> list[str]:
    """HFedATM, and HFedATM without FOT end to end when there is training after a merge."""
    rounds = build_config(read_yaml(CONFIG), list(regime.overrides)).federation.rounds
    return ["hfedatm", "hfedatm-no-fot"] if rounds > 1 else ["hfedatm"]


def unmoved(summaries: list[dict[str, Any]], regime: str, seed: int) -> bool:
    """Whether the HFedATM run of ``regime`` and ``seed`` moved no filter in any merge."""
    return any(s["regime"] == regime and s["seed"] == seed and s["merge"] == "hfedatm"
               and all(m["fot/moved"] == 0 for m in s["merges"]) for s in summaries)


def fot_means(merges: list[dict[str, Any]]) -> tuple[float, float, float, float]:
    """Mean over merges of: filters moved (mean over layers), moved in the first layer, and the transport cost
    per filter before and after alignment (mean over layers)."""
    def layer_mean(m: dict[str, Any], what: str) -> float:
        return float(np.mean([v for k, v in m.items() if k.endswith("/" + what) and k.count("/") == 2]))

    first = [next(k for k in m if k.endswith("/moved") and k.count("/") == 2) for m in merges]  # spec order
    return (float(np.mean([m["fot/moved"] for m in merges])), float(np.mean([m[f] for m, f in zip(merges, first)])),
            float(np.mean([layer_mean(m, "cost_before") for m in merges])),
            float(np.mean([layer_mean(m, "cost_after") for m in merges])))


def pm(xs: Sequence[float], digits: int = 1) -> str:
    return f"{np.mean(xs):.{digits}f} ± {np.std(xs, ddof=1) if len(xs) > 1 else 0.0:.{digits}f}"


def gain(merge: dict[str, Any]) -> float:
    """FOT's paired ood gain at one merge: HFedATM minus HFedATM w/o FOT on the same stations."""
    return float(merge["paired"]["hfedatm"]["ood"] - merge["paired"]["hfedatm-no-fot"]["ood"])


def report(summaries: list[dict[str, Any]], figure: Path) -> str:
    """The Markdown table (means ± sd over seeds) and the figure."""
    lines = ["| regime | filters moved: all layers / first layer | transport cost per filter: before → after "
             "| ood HFedATM | ood w/o FOT | Δ FOT end to end | Δ FOT paired: first / last merge "
             "| last merge, paired: HFedAvg · FOT + mean · stations mean / best |",
             "|---|---|---|---|---|---|---|---|"]
    rows: list[tuple[Regime, list[float], list[float], list[tuple[float, float]]]] = []
    for regime in REGIMES:
        fot = sorted((s for s in summaries if s["regime"] == regime.name and s["merge"] == "hfedatm"),
                     key=lambda s: s["seed"])
        if not fot:
            continue
        plain = {s["seed"]: s["ood_acc"] for s in summaries
                 if s["regime"] == regime.name and s["merge"] == "hfedatm-no-fot"}
        skipped = [s for s in fot if "hfedatm-no-fot" in runs_of(regime) and s["seed"] not in plain
                   and unmoved(fot, regime.name, s["seed"])]
        plain.update({s["seed"]: s["ood_acc"] for s in skipped})  # the same computation (main)
        e2e = [s["ood_acc"] - plain[s["seed"]] for s in fot if s["seed"] in plain]
        diag = [fot_means(s["merges"]) for s in fot]
        last = [s["merges"][-1]["paired"] for s in fot]
        first_gain, last_gain = [gain(s["merges"][0]) for s in fot], [gain(s["merges"][-1]) for s in fot]
        paired = (pm(first_gain) if len(fot[0]["merges"]) == 1 else f"{pm(first_gain)} / {pm(last_gain)}")
        lines.append(
            f"| {regime.name} | {100 * np.mean([d[0] for d in diag]):.1f} % / {100 * np.mean([d[1] for d in diag]):.1f} % "
            f"| {np.mean([d[2] for d in diag]):.3f} → {np.mean([d[3] for d in diag]):.3f} "
            f"| {pm([s['ood_acc'] for s in fot])} "
            f"| {pm(list(plain.values())) + ('*' if skipped else '') if plain else '= paired'} "
            f"| {pm(e2e) if e2e else '= paired'} | {paired} "
            f"| {np.mean([p['avg']['ood'] for p in last]):.1f} · {np.mean([p['hfedatm-no-regmean']['ood'] for p in last]):.1f}"
            f" · {np.mean([np.mean(p['stations']) for p in last]):.1f} / {np.mean([max(p['stations']) for p in last]):.1f} |")
        per_run = [float(np.mean([gain(m) for m in s["merges"]])) for s in fot]
        rows.append((regime, per_run, e2e, [(100 * m["fot/moved"], gain(m)) for s in fot for m in s["merges"]]))
    plot(rows, figure)
    seeds = sorted({s["seed"] for s in summaries})
    return "\n".join(lines) + (f"\n\nmeans ± sd over seeds {seeds}; accuracies in %, Δ in ood points; * FOT moved no "
                               "filter in any merge of the HFedATM run, so the run without FOT is the same computation "
                               "and was not run again\n")


def plot(rows: list[tuple[Regime, list[float], list[float], list[tuple[float, float]]]], path: Path) -> None:
    """Left: FOT's paired ood gain per regime (mean over a run's merges; sd over seeds) and its end-to-end gain.
    Right: paired gain at a merge against the filters FOT moved in it, one point per merge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"drift": "tab:blue", "init": "tab:red", "width": "tab:green"}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1.6, 1]})
    y = np.arange(len(rows))[::-1]
    for yi, (regime, paired, e2e, points) in zip(y, rows, strict=True):
        ax.barh(yi, np.mean(paired), xerr=np.std(paired, ddof=1) if len(paired) > 1 else 0.0,
                color=colours[regime.group], alpha=0.75, capsize=3)
        if e2e:
            ax.errorbar(np.mean(e2e), yi, xerr=np.std(e2e, ddof=1) if len(e2e) > 1 else 0.0, fmt="kD", ms=4,
                        capsize=3)
        bx.scatter(*zip(*points, strict=True), color=colours[regime.group], s=22, alpha=0.8)
    ax.set_yticks(y, [r[0].name for r in rows], fontsize=8)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_xlabel("ood gain of FOT (points): bars paired (mean over merges), ◆ end to end; ± sd over seeds")
    bx.axhline(0, color="grey", lw=0.8)
    bx.set_xlabel("filters FOT moved at a merge (%, mean over layers)")
    bx.set_ylabel("paired ood gain of FOT at that merge (points)")
    for group, colour in colours.items():
        bx.scatter([], [], color=colour, label=group)
    bx.legend(fontsize=8)
    fig.suptitle("Where FOT matters: HFedATM vs HFedATM w/o FOT, Digits-DG → mnist, FedAvg clients, 3 seeds",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs/fot-regime")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--regimes", nargs="+", help="regime names (default: all)")
    ap.add_argument("--figure", type=Path, default=ROOT / "docs/figures/fot-regime.png")
    ap.add_argument("--report-only", action="store_true", help="tabulate the finished runs, run nothing")
    args = ap.parse_args()
    torch.set_num_threads(1)
    chosen = [r for r in REGIMES if args.regimes is None or r.name in args.regimes]
    summaries: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for regime in chosen:
        for merge in runs_of(regime):
            for seed in args.seeds:
                run_dir = args.out / safe(regime.name) / merge / f"seed{seed}"
                identical = merge == "hfedatm-no-fot" and unmoved(summaries, regime.name, seed)
                if not (run_dir / "summary.json").is_file() and (args.report_only or identical):
                    continue  # identical: identity permutations, the same merges, hence the same run
                s = run_one(regime, merge, seed, run_dir)
                summaries.append(s)
                print(f"{regime.name:32s} {merge:15s} seed {seed}: ood {s['ood_acc']:5.1f}  "
                      f"moved {np.mean([m.get('fot/moved', 0.0) for m in s['merges']]):.3f}  "
                      f"{s['wall_s']:5.0f} s  load {s['load'][0]:.2f}", flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s, load average now {os.getloadavg()}\n")
    print(report(summaries, args.figure))


if __name__ == "__main__":
    main()
