"""The GPU check behind ``benchmarks/gpu_check.sh`` (docs/benchmarks.md, "GPU check").

(a) every registered method and every station merge, one short round on ``--device`` under ``optim.amp`` off and
bf16, and one round of each other task's demo (segmentation, text, natural clients): fails on an error or a
non-finite metric; (b) W1 (feddg and a plain PyTorch loop) and M1 (HFedATM's merge, its FOT cost GEMMs on the
device) against the same work on the CPU, in this run; (c) one table. Runs on a CPU too
(``--device cpu``: the same code paths, no CUDA), which is how it is checked before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from feddg.config import ExperimentConfig

#: what a method needs to run one round on Digits-DG (flat federation, 3 source domains, 3 clients)
METHOD_OVERRIDES: dict[str, list[str]] = {
    "central": ["partition.kind=iid", "partition.num_clients=1"],
    "scaffold": ["optim.momentum=0"],
    "mtgc": ["optim.momentum=0", "hierarchy.stations=2"],
    "fedrc": ["hierarchy.stations=2"],
}


#: one round of each task beside image classification: its demo config, cut to one short round
SEGMENTATION = "segmentation: FedFA+ on a U-Net (prostate MRI)"
TASK_CONFIGS: dict[str, tuple[str, list[str]]] = {
    SEGMENTATION: ("configs/segmentation/demo.yaml", ["federation.local_epochs=1"]),
    "text: HFedATM on tiny RoBERTa (sentiment)": ("configs/text/demo.yaml", ["hierarchy.station_rounds=1"]),
    "natural clients: 3,060 writers, 50 a round": ("configs/fedfa/writers.yaml", []),
}


def run_round(cfg: ExperimentConfig) -> dict[str, Any]:
    """One round of the experiment ``cfg`` in this process; its last metrics row."""
    from feddg.engines.inprocess import run_inprocess
    from feddg.federation.server import Server
    from feddg.federation.setup import build_federation

    with tempfile.TemporaryDirectory() as tmp:
        server = Server(build_federation(cfg), Path(tmp) / "run")
        run_inprocess(server)
        return server.metrics[-1]


def task_round(config: str, extra: list[str], amp: str, device: str, cache: str) -> dict[str, Any]:
    """One round of the task demo ``config`` (relative to the checkout) on ``device`` under ``amp``."""
    from feddg.config import load_config

    over = [*extra, "federation.rounds=1", "eval.every=1", f"optim.amp='{amp}'", f"device={device}",
            f"data.cache_dir='{cache}'"]
    return run_round(load_config(Path(__file__).resolve().parent.parent / config, over))


def one_round(method: str, merge: str | None, amp: str, device: str, cache: str, dp: bool = False) -> dict[str, Any]:
    """One round of ``method`` (with ``merge`` as the station merge; ``dp``: its shared statistics or Grams under DP)
    on a tiny Digits-DG; the last metrics row."""
    from feddg.config import build_config

    over = [f"method.name={method}", f"optim.amp='{amp}'", f"device={device}", *METHOD_OVERRIDES.get(method, [])]
    if merge is not None:
        over += ["hierarchy.stations=2", f"hierarchy.merge={merge}"] + (["hierarchy.params.dp_epsilon=1.0"] * dp)
    elif dp:
        over += ["method.params.dp={noise_multiplier: 1.0}"]
    raw = {"data": {"dataset": "digits-dg", "max_per_domain": 64, "cache_dir": cache},
           "partition": {"kind": "by_domain", "num_clients": 3}, "split": {"target": "mnistm"},
           "federation": {"rounds": 1, "batch_size": 32}, "model": {"name": "cnn"}}
    return run_round(build_config(raw, over))


def finite(row: dict[str, Any]) -> list[str]:
    """The metrics of ``row`` that are not finite numbers."""
    return [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]


def check_all(device: str, cache: str, amps: list[str]) -> list[tuple[str, str, str]]:
    """(what, amp, "ok ..." or the failure) for every method, station merge and task."""
    from feddg.aggregation.merges import MERGES
    from feddg.algorithms.registry import list_methods, method_class
    from feddg.tasks.base import DENSE_MASKS

    on_masks = {m for m in list_methods() if DENSE_MASKS in method_class(m).requires}  # on the segmentation demo
    cases: list[tuple[str, str | None, bool]] = [(m, None, False) for m in list_methods() if m not in on_masks]
    cases += [("fedavg", merge, False) for merge in sorted(MERGES)]
    cases += [(m, None, True) for m in list_methods() if "dp" in method_class(m).Params.model_fields and m not in on_masks]
    cases += [("fedavg", "hfedatm", True)]
    rounds: dict[str, Callable[[str, str, str], dict[str, Any]]] = {  # what -> round(amp, device, cache)
        (method if merge is None else f"fedavg + {merge}") + " (dp)" * dp: partial(one_round, method, merge, dp=dp)
        for method, merge, dp in cases}
    segmentation, seg_over = TASK_CONFIGS[SEGMENTATION]
    tasks = dict(TASK_CONFIGS)
    for m in sorted(on_masks):
        tasks[f"{m} (prostate MRI)"] = (segmentation, [*seg_over, f"method.name={m}", "method.params={}"])
        if "dp" in method_class(m).Params.model_fields:
            tasks[f"{m} (dp) (prostate MRI)"] = (segmentation, [*seg_over, f"method.name={m}",
                                                               "method.params={dp: {noise_multiplier: 1.0}}"])
    rounds |= {what: partial(task_round, config, extra) for what, (config, extra) in tasks.items()}
    out = []
    for what, round_under in rounds.items():
        for amp in amps:
            t0 = time.perf_counter()
            try:
                row = round_under(amp, device, cache)
                bad = finite(row)
                score = next((f"{k} {row[k]:.1f}" for k in row if k.startswith("ood_") and "/" not in k), None)
                status = (f"FAIL non-finite {bad}" if bad else "FAIL no out-of-domain score in the round's metrics"
                          if score is None else f"ok ({time.perf_counter() - t0:.1f} s, {score})")
            except Exception as err:  # reported in the table, the run goes on
                status = "FAIL " + " ".join(f"{type(err).__name__}: {err}".split())[:200]
                traceback.print_exc(file=sys.stderr)
            print(f"  {what:48s} amp {amp:4s} {status}", file=sys.stderr, flush=True)
            out.append((what, amp, status))
    return out


def w1_rows(device: str, images: int, repeats: int) -> list[tuple[str, str, str]]:
    """W1 through feddg and as a plain loop, on ``device`` and on the CPU, interleaved; min of ``repeats``."""
    from feddg.bench.w1 import run_feddg, run_plain, run_plain_on

    variants = {f"feddg W1 on {device}": lambda: run_feddg("auto", images, device),
                f"plain loop on {device}": lambda: run_plain_on(device, images),
                "feddg W1 on cpu (workers auto)": lambda: run_feddg("auto", images, "cpu"),
                "plain loop on cpu (2 x 1 thread)": lambda: run_plain(images)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name].append(fn())
    cpu = min(times["feddg W1 on cpu (workers auto)"])
    return [(name, f"{min(t):.2f} s", f"{cpu / min(t):.2f}x the CPU's feddg") for name, t in times.items()]


def m1_rows(device: str, stations: int, repeats: int) -> list[tuple[str, str, str]]:
    """HFedATM's merge of ResNet-18 stations with FOT's GEMMs on ``device`` and on the CPU, interleaved."""
    import numpy as np

    from feddg.aggregation.merges import merge_stations
    from feddg.bench.merge import resnet18_stations, time_merges

    case = resnet18_stations(stations)

    def merge(on: str) -> Any:
        return lambda: merge_stations(case.weights, case.grams, case.gammas, case.spec, device=on)

    gpu, cpu = merge(device)(), merge("cpu")()
    same = all(np.array_equal(gpu[0][k], cpu[0][k]) for k in cpu[0])
    times = time_merges({device: merge(device), "cpu": merge("cpu")}, repeats, threads=os.cpu_count() or 1)
    note = "same merged weights" if same else "merged weights differ (float rounding of the GEMMs)"
    return [(f"M1 ({stations} ResNet-18 stations) FOT on {on}", f"{min(t):.2f} s",
             f"{min(times['cpu']) / min(t):.2f}x the CPU; {note}") for on, t in times.items()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--amps", default="off,bf16")
    parser.add_argument("--w1-images", type=int, default=2000)
    parser.add_argument("--m1-stations", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cache", default=os.environ.get("FEDDG_CACHE", str(Path(tempfile.gettempdir()) / "feddg")))
    args = parser.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); nothing was run")
        return 2
    name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    t0 = time.perf_counter()
    checks = check_all(args.device, args.cache, args.amps.split(","))
    timings = w1_rows(args.device, args.w1_images, args.repeats) + m1_rows(args.device, args.m1_stations, args.repeats)
    failed = [c for c in checks if not c[2].startswith("ok")]
    print(f"\n## GPU check on {name} (torch {torch.__version__}), {time.perf_counter() - t0:.0f} s\n")
    print(f"every method, station merge and task, one round, amp {args.amps}: {len(checks) - len(failed)} of "
          f"{len(checks)} ok\n")
    print("| what | amp | result |\n|---|---|---|")
    for what, amp, status in checks:
        print(f"| {what} | {amp} | {status} |")
    print("\n| timing (min of interleaved repeats) | seconds | ratio |\n|---|---|---|")
    for row in timings:
        print("| " + " | ".join(row) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
