"""``feddg`` command line: run | sweep | report | datasets | methods | models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from feddg.config import ConfigError, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Federated domain generalization.")
out = Console()

Overrides = Annotated[list[str] | None, typer.Option("--set", "-o", help="override a key: -o federation.rounds=5")]


def _fail(msg: str) -> NoReturn:
    out.print(f"[red]error:[/red] {msg}")
    raise typer.Exit(2)


def results_table(results: dict) -> Table:
    """id / val / ood accuracy per domain of one run."""
    t = Table(title=f"{results['method']} on {results['dataset']} (held out: {', '.join(results['target'])})")
    t.add_column("domain")
    t.add_column("role")
    t.add_column("accuracy (%)", justify="right")
    final = results["final"]
    for key, val in final.items():
        if "/" in key:
            kind, dom = key.split("/", 1)
            t.add_row(dom, kind.removesuffix("_acc"), f"{val:.2f}")
    for key in ("id_acc", "val_acc", "ood_acc", "global_ood_acc"):
        if key in final:
            t.add_row("[bold]mean[/bold]", key.removesuffix("_acc"), f"[bold]{final[key]:.2f}[/bold]")
    return t


def communication_table(results: dict) -> Table:
    """Mean bytes per round: all clients together (engine) and each method's own per-client counts."""
    t = Table(title="communication per round (mean over rounds)")
    t.add_column("what")
    t.add_column("KB", justify="right")
    for key, val in results.get("bytes_per_round", {}).items():
        t.add_row(key, f"{val / 1024:,.2f}")
    return t


@app.command()
def run(
    config: Annotated[Path | None, typer.Argument(help="experiment YAML")] = None,
    overrides: Overrides = None,
    run_dir: Annotated[Path | None, typer.Option(help="run directory (default: output_dir/name-...)")] = None,
    resume: Annotated[Path | None, typer.Option(help="continue a killed run from its checkpoint")] = None,
    engine: Annotated[str | None, typer.Option(help="inprocess | flower")] = None,
    weights: Annotated[Path | None, typer.Option(help="local .pth state_dict to start from (= -o model.weights=)")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
) -> None:
    """Train one experiment and print its per-domain accuracy."""
    from feddg.experiment import resume_experiment, run_experiment

    try:
        if resume is not None:
            results = resume_experiment(resume, progress=not quiet)
        else:
            if config is None:
                _fail("give a config file, or --resume RUN_DIR")
            if weights is not None and not weights.is_file():
                _fail(f"--weights: no such file: {weights}")
            extra = list(overrides or []) + ([f"federation.engine={engine}"] if engine else [])
            extra += [f"model.weights={json.dumps(str(weights))}"] if weights is not None else []
            results = run_experiment(load_config(config, extra), run_dir, progress=not quiet)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        _fail(str(err))
    out.print(results_table(results))
    out.print(communication_table(results))
    out.print(f"run directory: {results['run_dir']}")


@app.command()
def sweep(
    config: Annotated[Path, typer.Argument(help="sweep YAML (an experiment config with a 'sweep:' section)")],
    overrides: Overrides = None,
    out_dir: Annotated[Path | None, typer.Option(help="where runs and tables go")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress bars")] = False,
    jobs: Annotated[int, typer.Option(help="runs at once, one torch thread each")] = 1,
) -> None:
    """Run variants × target domains × seeds and write a mean ± std table (Markdown and CSV)."""
    from feddg.sweep import run_sweep

    try:
        res = run_sweep(config, overrides, out_dir, progress=not quiet, jobs=jobs)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        _fail(str(err))
    out.print(res["markdown"])
    out.print(f"tables and runs in: {res['out_dir']}")


@app.command()
def report(run_dir: Annotated[Path, typer.Argument(help="a run directory")]) -> None:
    """Draw accuracy-per-round curves and a per-domain bar chart (PNG) into RUN_DIR."""
    from feddg.evaluation.plots import report as make_report

    try:
        paths = make_report(run_dir)
    except (FileNotFoundError, ValueError) as err:
        _fail(str(err))
    results = run_dir / "results.json"
    if results.is_file():
        out.print(results_table(json.loads(results.read_text())))
    for p in paths:
        out.print(f"wrote {p}")


@app.command()
def datasets(
    name: Annotated[str | None, typer.Argument(help="show domains, classes and counts of one dataset")] = None,
    root: Annotated[Path | None, typer.Option(help="folder of a real dataset")] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="cache for built-in datasets")] = None,
) -> None:
    """List datasets; with NAME, its domains, classes and sample counts."""
    from feddg.data import dataset_info, list_datasets, load_dataset

    if name is None:
        t = Table(title="datasets")
        for col in ("name", "domains", "classes", "needs --root"):
            t.add_column(col)
        for n in list_datasets():
            info = dataset_info(n)
            t.add_row(n, ", ".join(info["domains"]) or "(from folders)", str(info["num_classes"] or "?"),
                      "yes" if info["needs_root"] else "no")
        out.print(t)
        return
    try:
        ds = load_dataset(name, root=str(root) if root else None, cache_dir=str(cache_dir) if cache_dir else None)
    except (ValueError, FileNotFoundError) as err:
        _fail(str(err))
    counts = ds.counts()
    t = Table(title=f"{name}: {len(ds)} images, {ds.num_classes} classes, shape {tuple(ds.image_shape)}")
    t.add_column("class")
    for d in ds.domains:
        t.add_column(d, justify="right")
    for c in ds.classes:
        t.add_row(c, *(str(counts[d][c]) for d in ds.domains))
    t.add_row("[bold]total[/bold]", *(f"[bold]{sum(counts[d].values())}[/bold]" for d in ds.domains))
    out.print(t)


@app.command()
def methods() -> None:
    """List methods with their hyper-parameters and defaults."""
    from feddg.algorithms import METHODS

    t = Table(title="methods")
    t.add_column("name")
    t.add_column("hyper-parameters (default)")
    for name, cls in sorted(METHODS.items()):
        params = ", ".join(f"{k}={f.default}" for k, f in cls.Params.model_fields.items())
        t.add_row(name, params or "–")
    out.print(t)


@app.command()
def models() -> None:
    """List the model zoo."""
    from feddg.models import list_models

    out.print(", ".join(list_models()))


bench_app = typer.Typer(no_args_is_help=True, help="Speed benchmarks (numbers for docs/benchmarks.md).")
app.add_typer(bench_app, name="bench")


@bench_app.command("models")
def bench_models(
    names: Annotated[str, typer.Option(help="comma-separated model@size list")] = "cnn@28,lenet@28,resnet18@32",
    threads: Annotated[int, typer.Option(help="torch threads")] = 2,
    seconds: Annotated[float, typer.Option(help="seconds per timing round (best of 3)")] = 2.0,
) -> None:
    """Training throughput (images/s, batch 32, SGD) of zoo models on this machine's CPU."""
    import torch

    from feddg.bench import train_images_per_second

    torch.set_num_threads(threads)
    t = Table(title=f"training throughput, batch 32, {threads} torch threads")
    t.add_column("model")
    t.add_column("px", justify="right")
    t.add_column("img/s", justify="right")
    for item in names.split(","):
        name, _, px = item.partition("@")
        t.add_row(name, px or "28", f"{train_images_per_second(name, int(px or 28), seconds=seconds):,.0f}")
    out.print(t)


@bench_app.command("engine")
def bench_engine(
    config: Annotated[Path, typer.Argument(help="experiment YAML")],
    overrides: Overrides = None,
    engines: Annotated[str, typer.Option(help="comma-separated: sequential, workers, flower")] = "sequential,workers",
) -> None:
    """Wall time per round of the same config on several engines."""
    from feddg.bench import engine_seconds_per_round

    variants = {
        "sequential": ["federation.engine=inprocess", "federation.workers=1"],
        "workers": ["federation.engine=inprocess", "federation.workers=auto"],
        "flower": ["federation.engine=flower"],
    }
    t = Table(title=f"seconds per round: {config}")
    for col in ("engine", "rounds", "mean s/round", "min s/round", "start-up s", "total s"):
        t.add_column(col, justify="right" if col != "engine" else "left")
    for engine in engines.split(","):
        if engine not in variants:
            _fail(f"unknown engine {engine!r}; expected one of {sorted(variants)}")
        cfg = load_config(config, list(overrides or []) + variants[engine])
        r = engine_seconds_per_round(cfg)
        t.add_row(engine, str(r["rounds"]), f"{r['mean_round_s']:.2f}", f"{r['min_round_s']:.2f}",
                  f"{r['overhead_s']:.1f}", f"{r['total_s']:.1f}")
    out.print(t)
