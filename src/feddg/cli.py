"""``feddg`` command line: run | sweep | report | eval | datasets | methods | models | audit."""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn

import click
import typer
import typer.core
from pydantic import ValidationError
from rich.console import Console, RenderableType
from rich.markup import escape
from rich.table import Table

from feddg.config import AuditConfig, ConfigError, format_errors, load_config, one_line, parse_overrides, read_yaml


def _keep_argument_help() -> None:
    """Typer <= 0.20 sets an argument's ``help`` and then calls ``click.Argument.__init__``, which since
    click 8.5 takes a ``help`` of its own and resets it to ``None``: argument help vanished from ``--help``
    (pallets/click#3473). Set it again after the call (a no-op with older click)."""
    init = typer.core.TyperArgument.__init__
    if getattr(init, "keeps_help", False):
        return

    def init_keeping_help(self: typer.core.TyperArgument, *args: Any, help: str | None = None, **kwargs: Any) -> None:
        init(self, *args, help=help, **kwargs)
        self.help = help

    init_keeping_help.keeps_help = True  # type: ignore[attr-defined]
    typer.core.TyperArgument.__init__ = init_keeping_help  # type: ignore[method-assign]


_keep_argument_help()
app = typer.Typer(add_completion=False, no_args_is_help=True, help="Federated domain generalization.",
                  pretty_exceptions_enable=False)  # --debug shows a plain traceback, without local variables
# written to a file or a pipe, rich would wrap tables at 80 columns; keep their rows whole there (COLUMNS still wins)
out = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
_DEBUG = {"on": False}

Overrides = Annotated[list[str] | None, typer.Option(
    "--set", "-o", help="override a config key, repeatable; the value is YAML: -o federation.rounds=5 -o method.name=fedprox")]
#: a float option that must be above 0 (typer's ``min`` includes the bound)
POSITIVE = click.FloatRange(min=0, min_open=True)


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="show the full traceback of an error")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="Flower's and Ray's own INFO logs (default: warnings only)")]
    = False,
) -> None:
    """Federated domain generalization."""
    _DEBUG["on"] = debug
    if verbose:
        os.environ["FEDDG_VERBOSE"] = "1"  # read by the Flower engine (engines/flower/simulation.py)
    if not debug:
        warnings.formatwarning = _one_line_warning


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      line: str | None = None) -> str:
    return f"warning: {one_line(str(message))}\n"


def _fail(msg: str) -> NoReturn:
    """``error: msg`` on one line and exit code 2; with ``--debug``, re-raise the error being handled instead."""
    err = sys.exc_info()[1]
    if _DEBUG["on"] and err is not None:
        raise err
    out.print(f"[red]error:[/red] {escape(one_line(msg))}", soft_wrap=True, highlight=False)
    raise typer.Exit(2)


@contextmanager
def _user_errors() -> Iterator[None]:
    """User mistakes (config, run directory, checkpoint, missing or unreadable files) end in :func:`_fail`."""
    from feddg.experiment import Interrupted
    from feddg.federation.checkpoint import CheckpointError  # imports torch: only commands that train need it
    from feddg.federation.validation import RunStopped

    try:
        yield
    except Interrupted as err:  # where the run stopped and how it continues; the shell's code for the signal
        out.print(f"[red]error:[/red] {escape(one_line(str(err)))}", soft_wrap=True, highlight=False)
        raise typer.Exit(err.code) from None
    except ValidationError as err:  # a settings model built from options: its keys, not pydantic's page
        _fail(format_errors(err))
    except (ConfigError, CheckpointError, RunStopped, OSError, ValueError) as err:
        _fail(str(err))


def _pin_kernels(mode: str) -> None:
    """``reproducibility: portable``: start this command again with the CPU kernels pinned (no-op once they are)."""
    from feddg.reproducibility import exec_pinned

    exec_pinned("portable" if mode == "portable" else "native")


def _run_dir_mode(run_dir: Path) -> str:
    """The ``reproducibility`` of a run directory's config.yaml (native where it cannot be read: the command that
    reads it properly says why)."""
    try:
        mode = read_yaml(run_dir / "config.yaml").get("reproducibility", "native")
    except ConfigError:
        return "native"
    return mode if isinstance(mode, str) else "native"


def results_table(results: dict) -> Table:
    """The task's figures of one run (id / val / ood / extra), per domain and their means."""
    from feddg.evaluation.plots import run_method
    from feddg.tasks import TaskInfo, info_for_dataset

    task = TaskInfo.of(results["task"]) if "task" in results else info_for_dataset(results["dataset"])
    if task is None:
        _fail(f"results of {results['dataset']}: unknown task (no task block)")
    method = run_method(results)
    held = f"held out: {', '.join(results['target'])}" if results["target"] else "every domain trains"
    t = Table(title=f"{method} on {results['dataset']} ({held})")
    t.add_column("domain")
    t.add_column("role")
    t.add_column(task.axis_label, justify="right")
    means = []
    for key, val in results["final"].items():
        if (parsed := task.parse(key)) is None:
            continue
        role, dom = parsed
        if dom is None:
            means.append((role, val))
        else:
            t.add_row(dom, role, f"{val:.2f}")
    for role, val in means:
        t.add_row("[bold]mean[/bold]", role, f"[bold]{val:.2f}[/bold]")
    return t


def communication_table(results: dict) -> Table:
    """Mean bytes per round: all clients together (engine) and each method's own per-client counts."""
    t = Table(title="communication per round (mean over rounds)")
    t.add_column("what")
    t.add_column("KiB", justify="right")
    for key, val in results.get("bytes_per_round", {}).items():
        t.add_row(key, f"{val / 1024:,.2f}")
    return t


def privacy_line(what: str, rec: dict) -> str:
    """One line of a results.json ``privacy`` record (docs/privacy.md)."""
    return (f"privacy of the {what}: ε = {rec['epsilon']:.4g} at δ = {rec['delta']:g} over {rec['releases']} "
            f"release(s) ({rec['accountant']} accountant, per {rec['unit']}, noise multiplier {rec['noise_multiplier']:g}, "
            f"clip {rec['clip']:g})")


@app.command()
def run(
    config: Annotated[Path | None, typer.Argument(
        help="experiment YAML (configs/...; a sweep file runs its base config)")] = None,
    overrides: Overrides = None,
    run_dir: Annotated[Path | None, typer.Option(help="run directory (default: output_dir/name-...)")] = None,
    resume: Annotated[Path | None, typer.Option(help="continue a killed (or extend a finished) run")] = None,
    overwrite: Annotated[bool, typer.Option(help="clear a non-empty --run-dir holding another run")] = False,
    engine: Annotated[Literal["inprocess", "flower"] | None, typer.Option(
        help="where clients train: inprocess (this machine) or flower (Flower simulation) (= -o federation.engine=)")] = None,
    weights: Annotated[Path | None, typer.Option(help="local .pth state_dict to start from (= -o model.weights=)")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
) -> None:
    """Train one experiment and print its per-domain figures."""
    from feddg.config import build_config
    from feddg.experiment import resume_experiment, run_experiment
    from feddg.reports.run import method_figures

    with _user_errors():
        if resume is not None:
            extra = [name for name, given in (("CONFIG", config), ("--run-dir", run_dir), ("--engine", engine),
                                              ("--weights", weights), ("--overwrite", overwrite or None))
                     if given is not None]
            if extra:
                _fail(f"--resume continues a run with its own config.yaml: drop {', '.join(extra)} "
                      "(-o changes the keys a resume may change)")
            _pin_kernels(_run_dir_mode(resume))
            results = resume_experiment(resume, list(overrides or []), progress=not quiet)
            if results.get("resumed") is False:
                out.print(f"{resume} finished all its rounds already: nothing resumed (grow it with "
                          "-o federation.rounds=N)", soft_wrap=True, highlight=False)
        else:
            if config is None:
                _fail("give a config file, or --resume RUN_DIR")
            if weights is not None and not weights.is_file():
                _fail(f"--weights: no such file: {weights}")
            given = dict(parse_overrides(list(overrides or [])))
            for flag, key, value in (("--engine", "federation.engine", engine),
                                     ("--weights", "model.weights", None if weights is None else str(weights))):
                if value is not None and key in given and given[key] != value:
                    _fail(f"{flag} {value} and -o {key}={given[key]} contradict each other: give one")
            extra = list(overrides or []) + ([f"federation.engine={engine}"] if engine else [])
            extra += [f"model.weights={json.dumps(str(weights))}"] if weights is not None else []
            cfg = load_config(config, extra)
            _pin_kernels(cfg.reproducibility)
            results = run_experiment(cfg, run_dir, overwrite=overwrite, progress=not quiet)
        method_figures(results["run_dir"])
        audit = cfg.audit if resume is None else build_config(read_yaml(resume / "config.yaml")).audit
    out.print(results_table(results))
    out.print(communication_table(results))
    for what, rec in (("shared statistics", results.get("privacy")),
                      ("Gram matrices", results.get("hierarchy", {}).get("privacy")),
                      ("weights (DP-FedAvg)", results.get("weights_privacy"))):
        if rec and rec.get("epsilon") is not None:  # the weights' epsilon is null with noise_multiplier 0
            out.print(privacy_line(what, rec), soft_wrap=True, highlight=False)
    if audit is not None:  # the config's audit: section
        with _user_errors():
            out.print(f"privacy audit: wrote {_audit_with_bar(Path(results['run_dir']), audit, quiet)}")
    out.print(f"run directory: {results['run_dir']}")


@app.command()
def sweep(
    config: Annotated[Path, typer.Argument(help="sweep YAML (an experiment config with a 'sweep:' section)")],
    overrides: Overrides = None,
    out_dir: Annotated[Path | None, typer.Option(help="where runs and tables go (default: output_dir/name)")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress bars")] = False,
    jobs: Annotated[int, typer.Option(help="runs at once, one torch thread each", min=1)] = 1,
) -> None:
    """Run variants × target domains × seeds and write a mean ± std table with 95 % CIs (Markdown and CSV)."""
    from feddg.audit.sweep import audit_cells, markdown, summarise, write_tables
    from feddg.sweep import load_sweep, run_sweep

    with _user_errors():
        _pin_kernels(load_sweep(config, overrides)[1]["reproducibility"])
        res = run_sweep(config, overrides, out_dir, progress=not quiet, jobs=jobs)
        audits = [cfg.audit for cfg in res["configs"]]
        summary = summarise(audit_cells(res["rows"], audits, lambda d, s: _audit_with_bar(d, s, quiet)))
    out.print(res["markdown"])
    if summary:
        write_tables(Path(res["out_dir"]), summary, res["configs"][0].name)
        out.print(markdown(summary))
    out.print(f"tables and runs in: {res['out_dir']}")


@app.command()
def report(
    directory: Annotated[Path, typer.Argument(help="a run directory (metrics.jsonl) or a sweep directory (runs.jsonl)")],
) -> None:
    """Write DIRECTORY/report.html: one self-contained page (figures embedded) for a run or a sweep."""
    from feddg.reports.run import report as make_report

    with _user_errors():
        if not directory.is_dir():
            _fail(f"no such run or sweep directory: {directory}")
        paths = make_report(directory)
        results = directory / "results.json"
        summary = json.loads(results.read_text()) if results.is_file() else None
    if summary is not None:
        out.print(results_table(summary))
    for p in paths[1:]:
        out.print(f"wrote {p}")
    out.print(f"report: {paths[0].resolve().as_uri()}")


@app.command("eval")
def eval_run(
    run_dir: Annotated[Path, typer.Argument(help="a run directory (config.yaml and checkpoint.pt)")],
    dataset: Annotated[str, typer.Option(help="a dataset with the run's classes (feddg datasets)")],
    root: Annotated[Path | None, typer.Option(help="its folder, for a folder dataset")] = None,
    domains: Annotated[list[str] | None, typer.Option(help="only these of its domains (repeat, or a,b)")] = None,
    max_per_domain: Annotated[int | None, typer.Option(help="at most this many samples of each domain", min=1)] = None,
    device: Annotated[str | None, typer.Option(help="evaluate on this device (default: the run's own)")] = None,
) -> None:
    """Evaluate a run's last checkpoint on another dataset with the same classes (as eval.extra does during
    a run) and print the task's metric per domain."""
    from feddg.config import ExtraEvalConfig
    from feddg.federation.extra_eval import evaluate_run

    chosen = [d for item in domains or [] for d in item.split(",") if d] or None
    with _user_errors():
        _pin_kernels(_run_dir_mode(run_dir))
        spec = ExtraEvalConfig(name=dataset, dataset=dataset, root=str(root) if root else None, domains=chosen,
                               max_per_domain=max_per_domain)
        metrics, target, round, task = evaluate_run(run_dir, spec, device, where=f"--dataset {dataset}")
    role = f"extra/{dataset}"
    personal = task.key(f"{role}_global") in metrics
    t = Table(title=f"{run_dir.name} (round {round}) on {dataset}")
    t.add_column("domain")
    t.add_column(f"clients' models, mean {task.label} ({task.unit})" if personal else task.axis_label, justify="right")
    if personal:
        t.add_column(f"global model ({task.unit})", justify="right")
    for dom, name in [(d, d) for d in target.dataset.domains] + [(None, "[bold]mean[/bold]")]:
        keys = [task.key(role, dom)] + ([task.key(f"{role}_global", dom)] if personal else [])
        t.add_row(name, *(f"{metrics[k]:.2f}" for k in keys))
    out.print(t)



MAX_DOMAIN_COLUMNS = 12  # past this many domains (FEMNIST writers, camera traps) a summary replaces a column each


def _counts_table(counts: dict[str, dict[str, int]], domains: list[str], unit: str) -> Table:
    """Rows (classes, or cases and slices) × a column per domain with totals; with many domains, per row the total
    and its min / median / max over the domains."""
    import numpy as np

    rows = list(counts[domains[0]])
    t = Table()
    t.add_column("" if unit == "slices" else "class")
    if len(domains) > MAX_DOMAIN_COLUMNS:
        for col in (f"total ({len(domains)} domains)", "min", "median", "max"):
            t.add_column(col, justify="right")
        for row in [*rows, "total"]:
            per = np.array([sum(counts[d].values()) if row == "total" else counts[d][row] for d in domains])
            t.add_row(row, str(int(per.sum())), str(int(per.min())), f"{float(np.median(per)):g}", str(int(per.max())))
        return t
    for d in domains:
        t.add_column(d, justify="right")
    for row in rows:
        t.add_row(row, *(str(counts[d][row]) for d in domains))
    if unit != "slices":
        t.add_row("[bold]total[/bold]", *(f"[bold]{sum(counts[d].values())}[/bold]" for d in domains))
    return t

@app.command()
def datasets(
    name: Annotated[str | None, typer.Argument(
        help="a dataset of the list (digits-dg, pacs, ...): show its domains, classes and counts")] = None,
    root: Annotated[Path | None, typer.Option(help="folder of a real dataset: root/<domain>/<class>/<image>")] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="cache for built-in datasets")] = None,
    image_size: Annotated[int | None, typer.Option(help="image side (= data.image_size)", min=1)] = None,
    check: Annotated[bool, typer.Option(help="decode every image and list every problem; exit 1 on any")] = False,
) -> None:
    """List datasets; with NAME, its domains, classes and sample counts (a folder is scanned and a natural source
    such as iwildcam read from its metadata, neither decoded; a built-in is built into its cache)."""
    from feddg.data import dataset_info, list_datasets
    from feddg.data.inspect import check_dataset, describe_dataset
    from feddg.data.registry import NATURAL_SOURCES

    if name is None:
        t = Table(title="datasets")
        for col in ("name", "task", "inputs", "domains", "classes", "needs --root"):
            t.add_column(col)
        for n in list_datasets():
            info = dataset_info(n)
            t.add_row(n, info["task"], info["inputs"], ", ".join(info["domains"]) or "(from the data)",
                      str(info["num_classes"] or "?"), "yes" if info["needs_root"] else "no")
        out.print(t)
        return
    folder = str(root) if root else None
    try:
        if check:
            problems = check_dataset(name, root=folder)
            for p in problems:
                out.print(f"problem: {p}", soft_wrap=True, markup=False, highlight=False)
            if problems:
                out.print(f"[red]{len(problems)} problem(s)[/red] in {name} at {root}")
                raise typer.Exit(1)
            what = ("every case reads and matches its mask" if name == "prostate"
                    else "every file and line reads" if dataset_info(name)["inputs"] != "images"
                    or name in NATURAL_SOURCES
                    else "every image decodes, every domain has every class")
            out.print(f"[green]no problems[/green] in {name}: {what}")
        s = describe_dataset(name, root=folder, cache_dir=str(cache_dir) if cache_dir else None, image_size=image_size)
    except (ValueError, OSError) as err:  # OSError: a --cache-dir that is a file, an unreadable --root
        _fail(str(err))
    t = _counts_table(s.counts, s.domains, s.unit)
    out.print(f"{name}: {s.total} {s.unit}, {len(s.classes)} classes ({', '.join(s.classes)}), shape {s.image_shape}",
              soft_wrap=True)
    out.print(t)
    if s.unit == "texts":
        out.print("no training augmentation (texts are tokenised once into the cache)")
    elif s.transforms is None:
        out.print("transforms: fixed (each volume scaled to 0..255 at its 99th percentile, normalised with 0.5; "
                  "training flips left-right)", soft_wrap=True)
    else:
        out.print(f"training transforms: {s.transforms.describe()}", soft_wrap=True, markup=False)


@app.command()
def export(
    dataset: Annotated[str, typer.Argument(help="a built-in dataset, e.g. digits-dg or synthetic-mri")],
    out_dir: Annotated[Path, typer.Argument(help="new or empty folder to write root/<domain>/<class>/<i>.png "
                                                 "(synthetic-mri: root/<SITE>/CaseNN.nii.gz) into")],
    cache_dir: Annotated[Path | None, typer.Option(help="cache for built-in datasets")] = None,
    image_size: Annotated[int | None, typer.Option(help="image side (default: the dataset's native one)", min=1)] = None,
    max_per_domain: Annotated[int | None, typer.Option(help="export at most this many images per domain", min=1)] = (
        None),
) -> None:
    """Write a built-in dataset to DomainBed folders (lossless PNG) plus a feddg.json of its defaults; synthetic-mri
    to the prostate layout (NIfTI volumes and masks)."""
    from feddg.data.export import export_dataset, export_volumes
    from feddg.data.synthetic_mri import NAME as SYNTHETIC_MRI

    try:
        if dataset == SYNTHETIC_MRI:
            if max_per_domain is not None or cache_dir is not None:  # its volumes are synthesised whole, uncached
                raise ValueError("export synthetic-mri writes every site's volumes: it takes no --max-per-domain "
                                 "or --cache-dir")
            count = export_volumes(out_dir, image_size=image_size)
            out.print(f"wrote {count} NIfTI volumes with their masks to {out_dir}; "
                      f"use -o data.dataset=prostate -o data.root={out_dir}", soft_wrap=True)
            return
        count = export_dataset(dataset, out_dir, cache_dir=str(cache_dir) if cache_dir else None,
                               image_size=image_size, max_per_domain=max_per_domain)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        _fail(str(err))
    out.print(f"wrote {count} PNGs to {out_dir}; use -o data.dataset=folder -o data.root={out_dir}")


@app.command()
def methods() -> None:
    """List methods with their hyper-parameters and defaults."""
    from feddg.catalog import catalog  # cached: a warm call imports no torch

    listing = catalog()
    t = Table(title="client methods (method.name)")
    t.add_column("name")
    t.add_column("hyper-parameters (default)")
    for name, params in listing["methods"]:
        t.add_row(name, params or "–")
    out.print(t)
    merges = Table(title="station merges (hierarchy.merge; any client method trains inside the stations)")
    merges.add_column("name")
    merges.add_column("what")
    for name, what in listing["merges"]:
        merges.add_row(name, what)
    out.print(merges)
    out.print(f"hfedatm parameters (hierarchy.params): {listing['hierarchy']}")
    augment = Table(title="local augmentations (optim.augment: [{name: ..., ...}]; with any client method, "
                    "docs/methods/augmentation.md)")
    augment.add_column("name")
    augment.add_column("parameters (default)")
    for name, params in listing["augmentations"]:
        augment.add_row(name, params)
    out.print(augment)


@app.command()
def models() -> None:
    """List the model zoo: the names model.name accepts, what each takes and predicts, what it offers methods, and
    the keys of its model.params."""
    from rich.table import Table

    from feddg.models import list_models, model_capabilities, model_inputs, model_targets
    from feddg.models.registry import options_text

    table = Table("model.name", "takes", "predicts", "offers methods", "model.params")
    for name in list_models():
        offers = sorted(model_capabilities(name) - {model_inputs(name), model_targets(name)})
        table.add_row(name, model_inputs(name), model_targets(name), ", ".join(offers) or "—", options_text(name))
    out.print(table)


@app.command("env")
def env(
    mode: Annotated[Literal["portable"], typer.Argument(help="portable: the kernels of reproducibility: portable")],
) -> None:
    """Print the shell exports that pin the CPU kernels (eval "$(feddg env portable)" before a program that drives
    feddg as a library, or a Flower SuperNode, with reproducibility: portable)."""
    from feddg.reproducibility import shell_exports

    print(shell_exports())


bench_app = typer.Typer(no_args_is_help=True, help="Speed benchmarks (numbers for docs/benchmarks.md).")
app.add_typer(bench_app, name="bench")


def _print_all(items: Iterable[RenderableType]) -> None:
    """Print a benchmark's tables and lines as it yields them."""
    for item in items:
        out.print(item)


@bench_app.command("all")
def bench_all(
    quick: Annotated[bool, typer.Option(help="smaller sizes: a smoke run of every figure (minutes)")] = False,
    repeats: Annotated[int, typer.Option(help="interleaved repeats of every timed figure", min=1)] = 3,
) -> None:
    """The headline figures in one table: W1, M1, server memory, `feddg methods`, worker start, scale, with ratios
    and CPU seconds."""
    from feddg.bench.summary import summary_report

    with out.status("benchmarking") as status:
        report = summary_report(quick, repeats, lambda name: status.update(f"benchmarking: {name}"))
    _print_all(report)


@bench_app.command("models")
def bench_models(
    names: Annotated[str, typer.Option(help="comma-separated model@size[:key=value...] list (unet@64:width=8)")] = (
        "cnn@28,lenet@28,resnet18@32"),
    threads: Annotated[int, typer.Option(help="torch threads", min=1)] = 2,
    seconds: Annotated[float, typer.Option(help="seconds per timing round", click_type=POSITIVE)] = 2.0,
    batch: Annotated[int, typer.Option(help="images per batch", min=1)] = 32,
    repeats: Annotated[int, typer.Option(help="timing rounds (with --feddg: interleaved feddg, plain, ...)", min=1)] = 3,
    feddg: Annotated[bool, typer.Option("--feddg", help="feddg's client loop (train_local, Adam, the task's loss, the "
                                        "dataset's batches) against a plain PyTorch loop on the same data as tensors; "
                                        "segmentation on synthetic-mri for dense-output models (unet)")] = False,
    steps: Annotated[int, typer.Option(help="with --feddg: batches per timed run (0: about --seconds' worth)", min=0)] = 0,
) -> None:
    """Training throughput (images/s, SGD on random data; with --feddg, feddg's loop next to a plain PyTorch loop) of
    zoo models on this machine's CPU."""
    from feddg.bench.throughput import loops_table, models_table

    with _user_errors():
        if feddg:
            table = loops_table(names.split(","), threads, seconds, batch, repeats, steps)
        else:
            table = models_table(names.split(","), threads, seconds, batch, repeats)
    out.print(table)


@bench_app.command("engine")
def bench_engine(
    config: Annotated[Path, typer.Argument(help="experiment YAML")],
    overrides: Overrides = None,
    engines: Annotated[str, typer.Option(help="comma-separated: sequential, workers, flower")] = "sequential,workers",
) -> None:
    """Wall time per round of the same config on several engines."""
    from feddg.bench.throughput import engine_table

    with _user_errors():
        table = engine_table(config, list(overrides or []), engines.split(","))
    out.print(table)


@bench_app.command("data")
def bench_data(
    images: Annotated[int, typer.Option(help="JPEGs in the generated folder (4 domains × 7 classes)", min=1)] = 2100,
    size: Annotated[int, typer.Option(help="training resolution (px)", min=1)] = 224,
    repeats: Annotated[int, typer.Option(help="interleaved rounds of every variant", min=1)] = 3,
    threads: Annotated[int, typer.Option(help="torch threads", min=1)] = 1,
    loader_workers: Annotated[int, typer.Option(help="also time epochs 2+ with this many DataLoader workers", min=0)] = 0,
    digits: Annotated[bool, typer.Option(help="also FedAvg on Digits-DG: built-in vs exported folders")] = True,
    digits_rounds: Annotated[int, typer.Option(help="rounds of each Digits-DG run", min=1)] = 3,
    digits_max_per_domain: Annotated[int, typer.Option(help="Digits-DG images per domain", min=1)] = 1000,
    digits_seeds: Annotated[int, typer.Option(help="experiment seeds of each Digits-DG variant", min=1)] = 2,
) -> None:
    """Folder data: images/s of epoch 1 (cache build) and epochs 2+ vs decoding every epoch; Digits-DG per round."""
    from feddg.bench.data import data_report

    _print_all(data_report(images, size, repeats, threads, loader_workers,
                           (digits_rounds, digits_max_per_domain, digits_seeds) if digits else None))


@bench_app.command("w1")
def bench_w1(
    repeats: Annotated[int, typer.Option(help="interleaved rounds of every variant", min=1)] = 3,
    images: Annotated[int, typer.Option(help="images per client (W1: 2000)", min=1)] = 2000,
    variants: Annotated[str, typer.Option(help="comma-separated, among plain,1,1-threads-2,2,auto (plain: "
                                          "the yardstick, always run)")] = "plain,1,1-threads-2,2,auto",
    load: Annotated[int, typer.Option(help="busy-loop processes (one core each) running throughout: W1 under "
                                      "load", min=0)] = 0,
) -> None:
    """W1: FedAvg, 4 clients, cnn4, 5 rounds, in-process (workers 1 and 2) vs a plain PyTorch loop on 2 processes."""
    from feddg.bench.w1 import check_variants, w1_report

    keys = ["plain", *[k for v in variants.split(",") if (k := v.strip()) and k != "plain"]]
    try:
        check_variants(keys)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--variants") from None
    _print_all(w1_report(repeats, images, keys, load))


@bench_app.command("memory")
def bench_memory(
    params: Annotated[int, typer.Option(help="model parameters (float32)", min=1)] = 1_000_000,
    clients: Annotated[str, typer.Option(help="comma-separated client counts")] = "100,200,1000,3400",
    max_list_mb: Annotated[float, typer.Option(help="allocate the all-at-once list only up to this size", min=0)] = (
        1024.0),
    per_client: Annotated[str, typer.Option(help="instead: Local-only's per-client state on the server at these "
                                            "comma-separated client counts, per budget")] = "",
    budgets_mb: Annotated[str, typer.Option(help="with --per-client: federation.client_state_budget_mb values "
                                            "(comma-separated; none = unlimited)")] = "none,1024,16",
) -> None:
    """Server peak extra memory of a FedAvg round: streaming fold vs the all-at-once list of replies; with
    --per-client, the client store's RAM, peaks and disk for Local-only at each budget."""
    if per_client:
        from feddg.bench.store_memory import store_memory_report

        _print_all(store_memory_report(_numbers(per_client, int, "--per-client"), params,
                                       _numbers(budgets_mb, float, "--budgets-mb", budgets=True)))
        return
    from feddg.bench.memory import fold_memory_table

    out.print(fold_memory_table(params, _numbers(clients, int, "--clients"), max_list_mb))


def _numbers(text: str, kind: type[int] | type[float], option: str, budgets: bool = False) -> list[Any]:
    """A comma-separated list of counts (> 0), or with ``budgets`` of sizes (>= 0) and ``none``; else a one-line usage
    error naming the option."""
    values: list[Any] = []
    for item in (i.strip() for i in text.split(",")):
        if budgets and item == "none":
            values.append(None)
            continue
        try:
            value = kind(item)
        except ValueError:
            value = None
        if value is None or not value >= 0 or (value == 0 and not budgets):  # "not >=": NaN too
            what = "sizes >= 0 or none" if budgets else "whole numbers > 0" if kind is int else "numbers > 0"
            raise typer.BadParameter(f"expected comma-separated {what}, got {text!r}", param_hint=option)
        values.append(value)
    return values


@bench_app.command("scale")
def bench_scale(
    configs: Annotated[list[Path] | None, typer.Argument(help="experiment YAMLs")] = None,
    rounds: Annotated[int, typer.Option(help="rounds of each config", min=1)] = 2,
    repeats: Annotated[int, typer.Option(help="interleaved runs of feddg and of the plain loop", min=1)] = 2,
    overrides: Overrides = None,
) -> None:
    """The papers' client counts end to end: each config's last round against a plain PyTorch loop of the same
    clients and evaluation, wall and CPU seconds, peak RSS."""
    from feddg.bench.scale import scale_report

    paths = configs or [Path("configs/scale/femnist-scale.yaml"), Path("configs/scale/writers-scale.yaml"),
                        Path("configs/scale/iwildcam-scale.yaml")]
    with _user_errors():
        _print_all(scale_report(paths, rounds, list(overrides or []), repeats))


@bench_app.command("portable", help="The cost of reproducibility: portable: the same short run with this CPU's own "
                   "kernels and with the pinned ones, interleaved")  # one line: a docstring's line break would show
def bench_portable(
    config: Annotated[Path, typer.Argument(help="experiment YAML")] = Path("configs/demo.yaml"),
    repeats: Annotated[int, typer.Option(help="interleaved runs of each kernel choice", min=1)] = 3,
    overrides: Overrides = None,
) -> None:
    from feddg.bench.portable import portable_table

    extra = [arg for item in overrides or [] for arg in ("-o", item)]
    try:
        table = portable_table(config, repeats, extra)
    except RuntimeError as err:  # a run failed: its last line of stderr
        _fail(str(err))
    out.print(table)


flower_app = typer.Typer(no_args_is_help=True, help="A secure Flower deployment: certificates, node keys, runs "
                         "(docs/flower.md, 'Secure deployment').")
app.add_typer(flower_app, name="flower")


@flower_app.command("certs")
def flower_certs(
    out_dir: Annotated[Path, typer.Argument(help="where ca.pem, ca.key, server.pem and server.key go")],
    host: Annotated[list[str], typer.Option(help="a name or IP the SuperLink is reached at (repeat)")],
    days: Annotated[int, typer.Option(help="validity in days", min=1)] = 365,
) -> None:
    """A test CA and a SuperLink certificate for the given hosts (a real deployment uses its own PKI)."""
    from feddg.engines.flower.security import make_certificates

    with _user_errors():
        paths = make_certificates(out_dir, host, days)
    out.print(f"CA {paths['ca']}, server certificate {paths['server']} (SANs: {', '.join(host)})", highlight=False)


@flower_app.command("keys")
def flower_keys(
    out_dir: Annotated[Path, typer.Argument(help="where NAME (private) and NAME.pub go")],
    node: Annotated[list[str], typer.Option(help="a node's name (repeat)")],
) -> None:
    """ECDSA P-384 key pairs (OpenSSH) for Flower's SuperNode authentication and feddg's roster."""
    from feddg.engines.flower.security import key_fingerprint, load_public_key, make_node_keys

    with _user_errors():
        pairs = make_node_keys(out_dir, node)
    for private, public in pairs:
        out.print(f"{private} {public} {key_fingerprint(load_public_key(public.read_text()))}", highlight=False)


@flower_app.command("run")
def flower_run(
    connection: Annotated[str, typer.Option(help="the SuperLink connection in $FLWR_HOME/config.toml")],
    config: Annotated[Path | None, typer.Argument(help="experiment YAML")] = None,
    run_dir: Annotated[Path | None, typer.Option(
        help="run directory the ServerApp writes (readable from here)")] = None,
    resume: Annotated[Path | None, typer.Option(
        help="continue a stopped (or extend a finished) run from its checkpoint; nodes with a state-dir keep "
             "their clients' state")] = None,
    app_dir: Annotated[Path, typer.Option(help="the Flower App directory")] = Path("flower"),
    overrides: Overrides = None,
) -> None:
    """Submit an experiment with `flwr run --stream`; exit 1 unless the run completed (status.json, results.json)."""
    from feddg.engines.flower.launch import submit
    from feddg.experiment import prepare_resume

    with _user_errors():
        if resume is not None:
            if extra := [name for name, given in (("CONFIG", config), ("--run-dir", run_dir)) if given is not None]:
                _fail(f"--resume continues a run with its own config.yaml: drop {', '.join(extra)} "
                      "(-o changes the keys a resume may change)")
            cfg = prepare_resume(resume, list(overrides or []), restart="into a new --run-dir")
            if cfg is None:
                out.print(f"{resume} finished all its rounds already: nothing resumed (grow it with "
                          "-o federation.rounds=N)", soft_wrap=True, highlight=False)
                return
            run_dir = resume
        elif config is None or run_dir is None:
            _fail("give a config file and --run-dir, or --resume RUN_DIR")
        else:
            cfg = load_config(config, list(overrides or []))
        failure = submit(cfg, run_dir, connection, app_dir, resume=resume is not None)
    if failure is not None:
        out.print(f"[red]error:[/red] {escape(one_line(failure))}", soft_wrap=True, highlight=False)
        raise typer.Exit(1)
    out.print(f"run directory: {run_dir}", highlight=False)


audit_app = typer.Typer(no_args_is_help=True, help="Audits of a finished run (docs/privacy.md).")
app.add_typer(audit_app, name="audit")


def _audit_with_bar(run_dir: Path, settings: AuditConfig, quiet: bool = False) -> Path:
    """The privacy audit of one run (``settings``), one progress step per attack and attacker."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from feddg.audit.privacy import audit_privacy as run_audit
    from feddg.config import audit_attacks, audit_problem, build_config

    cfg = build_config(read_yaml(run_dir / "config.yaml"))
    if (why := audit_problem(cfg, settings.attacks)) is not None:  # a task the attacks do not fit: before the bar
        raise ValueError(why)
    todo = settings.attacks or audit_attacks(cfg)
    total = 1 + sum(2 if a not in ("gram", "update-dlg") else 1 for a in todo)
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=out,
                  disable=quiet) as bar:
        task = bar.add_task(f"audit {run_dir.name}", total=total)

        def step(name: str) -> None:
            bar.update(task, advance=0 if name == "rebuilding the run" else 1, description=name)

        path = run_audit(run_dir, settings, step)
        bar.update(task, completed=total)
    return path


@audit_app.command("privacy")
def audit_privacy(
    run_dir: Annotated[Path, typer.Argument(help="a run directory (config.yaml; checkpoint.pt for the trained model)")],
    attack: Annotated[list[str] | None, typer.Option(help="an attack (repeat; default: the run's audit.attacks, else "
                                                      "those on what its method shares, and update-dlg); 'all' for "
                                                      "every one")] = None,
    noise: Annotated[list[float] | None, typer.Option(help="a DP noise multiplier z (repeat; 0: no DP)", min=0)] = None,
    per_client: Annotated[int | None, typer.Option(
        help="victim images per client (default: the run's audit.per_client, else 32)", min=1)] = None,
    steps: Annotated[int | None, typer.Option(
        help="generator training steps (default: the run's audit.generator_steps, else 300)", min=1)] = None,
    seed: Annotated[int | None, typer.Option(
        help="the audit's seed: images, generator, noise (default: the run's audit.seed, else its seed)", min=0)] = None,
    fid: Annotated[bool | None, typer.Option("--fid/--no-fid", help="compute FID (EfficientNet-Lite0 features) "
                                             "(default: the run's audit.fid, else yes)")] = None,
    style_path: Annotated[str | None, typer.Option(help="the style attacks' path (pixel | feature | adain-vgg); "
                                                   "default: the run's")] = None,
) -> None:
    """Reconstruct client data from what the run's clients share, at each DP noise level: RUN_DIR/audit/privacy.json.
    Defaults: the run's audit: section (docs/privacy.md); the options override it."""
    from feddg.audit.privacy import ATTACKS, check_attacks, run_settings
    from feddg.reports.audit import audit_section

    with _user_errors():
        if not (run_dir / "config.yaml").is_file():
            _fail(f"no config.yaml in {run_dir}: not a run directory")
        chosen = list(ATTACKS) if attack == ["all"] else attack
        check_attacks(tuple(chosen or ()))
        given = {"attacks": chosen, "noise_multipliers": noise, "per_client": per_client, "generator_steps": steps,
                 "seed": seed, "fid": fid, "style_path": style_path}
        base = run_settings(run_dir)
        settings = AuditConfig.model_validate({**base.model_dump(), **{k: v for k, v in given.items() if v is not None}})
        path = _audit_with_bar(run_dir, settings)
    section = audit_section(run_dir)
    if section is None:  # only a stand-in audit writes nothing
        out.print(f"wrote {path}")
        return
    t = Table(title=f"privacy audit of {run_dir.name}")
    for c in section["columns"]:
        t.add_column(c, justify="left" if c in ("attack", "attacker") else "right")
    for row in section["rows"]:
        t.add_row(*row)
    out.print(t)
    out.print(f"wrote {path} and its grids ({', '.join(g['title'] for g in section['grids'])}); "
              f"feddg report {run_dir} shows them", soft_wrap=True)
