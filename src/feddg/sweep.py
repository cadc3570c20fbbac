"""Sweeps: a method (or several variants) × every target domain × seeds, then a paper-style table.

A sweep file is an experiment config with one extra section::

    sweep:
      targets: all            # or a list of domains (lodo); for ltdo: pairs [[val, test], ...]
      seeds: [0, 1, 2]
      variants:               # row name -> config overrides
        FedAvg: {method.name: fedavg}
        FedProx: {method.name: fedprox, method.params.mu: 0.01}

Finished runs (with results.json) are skipped and interrupted ones resumed, so a killed
sweep restarts where it stopped. ``jobs > 1`` runs that many cells at once in spawned processes
(one torch thread and one client worker each); results agree with ``jobs=1`` up to float
rounding (thread count and summation order differ).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from feddg.config import ConfigError, ExperimentConfig, Strict, build_config, format_errors, read_yaml
from feddg.data import dataset_info
from feddg.evaluation.tables import csv_table, markdown_table
from feddg.experiment import console, run_experiment
from feddg.federation.checkpoint import CHECKPOINT
from feddg.federation.server import RESULTS
from feddg.federation.workers import exit_with_parent


class SweepSpec(Strict):
    targets: list[str] | str = "all"
    pairs: list[tuple[str, str]] | None = Field(None, description="ltdo (val, test) pairs; default all ordered pairs")
    seeds: list[int] = [0]
    variants: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"default": {}})
    metrics: list[str] = ["ood_acc", "id_acc"]


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> tuple[SweepSpec, dict[str, Any]]:
    """The sweep section and the validated base config (as a plain tree, overrides applied)."""
    raw = read_yaml(path)
    try:
        spec = SweepSpec.model_validate(raw.pop("sweep", {}))
    except ValidationError as err:
        raise ConfigError(format_errors(err, prefix="sweep")) from None
    return spec, build_config(raw, overrides).model_dump(mode="json")


def _cells(spec: SweepSpec, base: ExperimentConfig) -> list[tuple[str, list[str]]]:
    """(label, split overrides) for every target (lodo) or (val, test) pair (ltdo)."""
    domains = base.data.domains or dataset_info(base.data.dataset)["domains"]
    if not domains:
        raise ConfigError(f"sweep over 'all' targets needs data.domains for {base.data.dataset}")
    if base.split.protocol == "ltdo":
        pairs = spec.pairs or list(itertools.permutations(domains, 2))
        return [(f"{v}→{t}", [_override("split.val_domain", v), _override("split.target", t)]) for v, t in pairs]
    targets = domains if spec.targets == "all" else spec.targets
    return [(t, [_override("split.target", t)]) for t in targets]


def _override(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value)}"  # JSON is YAML: "0" stays a string


def run_sweep(path: str | Path, overrides: list[str] | None = None, out_dir: str | Path | None = None,
              progress: bool = True, jobs: int = 1) -> dict[str, Any]:
    """Run every (variant, target, seed) cell and write table.md, table.csv and runs.jsonl."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    spec, raw = load_sweep(path, overrides)
    base = build_config(raw)
    out = Path(out_dir) if out_dir is not None else Path(base.output_dir) / base.name
    out.mkdir(parents=True, exist_ok=True)
    cells = []
    for variant, extra in spec.variants.items():
        for label, split_over in _cells(spec, base):
            for seed in spec.seeds:
                over = [_override(k, v) for k, v in extra.items()] + split_over + [f"seed={seed}"]
                cfg = build_config(raw, over)  # every cell validated before anything runs
                cells.append(({"variant": variant, "target": label, "seed": seed},
                              cfg, out / _safe(variant) / _safe(label) / f"seed{seed}"))
    if jobs == 1:
        results = [_run_or_load(cfg, run_dir, progress) for _, cfg, run_dir in cells]
    else:
        results = _run_parallel(cells, jobs)
    rows = [{**cell, "run_dir": str(run_dir), **res["final"], "time_total_s": res["time_total_s"]}
            for (cell, _, run_dir), res in zip(cells, results)]
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tables = {m: markdown_table(rows, m) for m in spec.metrics}
    md = "\n\n".join(f"### {m} (mean ± std over seeds {spec.seeds})\n\n{t}" for m, t in tables.items())
    (out / "table.md").write_text(f"# {base.name}\n\n{md}\n")
    for m in spec.metrics:
        (out / f"table_{m}.csv").write_text(csv_table(rows, m))
    return {"out_dir": str(out), "rows": rows, "markdown": md}


def _run_parallel(cells: list[tuple[dict[str, Any], ExperimentConfig, Path]], jobs: int) -> list[dict[str, Any]]:
    """Cells in ``jobs`` spawned processes, a line as each finishes; results in cell order."""
    ctx = multiprocessing.get_context("spawn")  # torch and fork do not mix
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_init_job) as pool:
        futures = [pool.submit(_run_or_load, _one_worker(cfg), run_dir, False) for _, cfg, run_dir in cells]
        for i, fut in enumerate(futures):
            res = fut.result()
            cell = cells[i][0]
            console.print(f"[{i + 1}/{len(cells)}] {cell['variant']} · {cell['target']} · seed {cell['seed']}: "
                          + ", ".join(f"{k} {v:.1f}" for k, v in res["final"].items() if k.endswith("acc")))
        return [f.result() for f in futures]


def _init_job() -> None:
    import torch

    exit_with_parent()
    torch.set_num_threads(1)


def _one_worker(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with its clients run sequentially: a parallel sweep already fills the cores."""
    return cfg.model_copy(update={"federation": cfg.federation.model_copy(update={"workers": 1})})


def _run_or_load(cfg: ExperimentConfig, run_dir: Path, progress: bool) -> dict[str, Any]:
    if (run_dir / RESULTS).is_file():
        console.print(f"[dim]done already: {run_dir}[/dim]")
        return json.loads((run_dir / RESULTS).read_text())
    resume = (run_dir / CHECKPOINT).is_file()
    return run_experiment(cfg, run_dir, resume=resume, progress=progress)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.+" else "_" for c in name)
