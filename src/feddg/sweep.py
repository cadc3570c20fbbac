"""Sweeps: a method (or several variants) × every target domain × seeds, then a paper-style table.

A sweep file is an experiment config with one extra section::

    sweep:
      targets: all            # or a list of domains (lodo); ltdo takes pairs: [[val, test], ...] (default all)
      seeds: [0, 1, 2]
      variants:               # row name -> config overrides
        FedAvg: {method.name: fedavg}
        FedProx: {method.name: fedprox, method.params.mu: 0.01}

Finished runs (with results.json) are loaded and interrupted ones resumed, so a killed sweep
restarts where it stopped, but only while the cell's stored config hash (provenance.json, else its
config.yaml re-hashed) equals the current one: a cell whose config changed is rerun from scratch,
with one line saying so, so a table never mixes configs (docs/reliability.md).

``jobs > 1`` runs that many cells at once in spawned processes (one torch thread and one client
worker each): the bits of ``jobs=1`` with ``federation.workers: auto`` (the default); with ``workers: 1`` (torch's
threads) they differ by float rounding.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, NonNegativeInt, ValidationError, field_validator
from rich.markup import escape

from feddg.algorithms.registry import labelled, method_class
from feddg.config import (
    ConfigError,
    ExperimentConfig,
    build_config,
    config_tree,
    domain_names,
    format_errors,
    parse_overrides,
    read_yaml,
    set_dotted,
)
from feddg.data import dataset_info
from feddg.engines.workers import exit_with_parent, use_one_thread
from feddg.evaluation.selection import (
    ORACLE_NOTE,
    Rule,
    default_rules,
    pick_notes,
    picks_by,
    select,
    split_draw,
    unavailable,
)
from feddg.evaluation.tables import STATS_NOTE, csv_table, markdown_table
from feddg.experiment import console, progress_bar, run_experiment
from feddg.federation.checkpoint import CheckpointError, has_checkpoint
from feddg.federation.provenance import changed_inputs, config_hash, record_resume, stored_config_hash
from feddg.federation.server import RESULTS
from feddg.seeds import derived_seed
from feddg.settings import Settings
from feddg.tasks import TaskInfo, metric_key


class SearchSpec(Settings):
    """Random hyper-parameter search, DomainBed style: ``n`` draws per variant from its method's
    ``search_space`` (draw 0 keeps the method's defaults), seeded so a sweep is reproducible."""

    n: int = Field(ge=1, description="configurations per variant (the first keeps the defaults)")
    seed: int = Field(0, ge=0, description="seed of the draws (independent of the experiment seeds)")


class SweepSpec(Settings):
    targets: list[str] | Literal["all"] = Field("all", min_length=1, description="lodo target domains")
    pairs: list[tuple[str, str]] | None = Field(None, min_length=1,
                                                description="ltdo (val, test) pairs; default all ordered pairs")
    numbered_domains = field_validator("targets", "pairs", mode="before")(domain_names)
    seeds: list[NonNegativeInt] = Field(default_factory=lambda: [0], min_length=1)
    variants: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"default": dict[str, Any]()}, min_length=1)
    metrics: list[str] | None = Field(None, description="the tables' metric keys; default: the task's ood and id means "
                                      "(ood_acc, id_acc for classification)")
    search: SearchSpec | None = Field(None, description="random search over each variant's method.search_space")
    baseline: str | None = Field(None, description="a variant; tables add each row's paired difference from it")
    selection: list[Rule] | None = Field(
        None, description="model-selection rules, a table_<metric>_<rule> each (docs/selection.md); default: "
                          "train_domain and last, plus lodo with ltdo pairs")

    @field_validator("targets", "pairs", "seeds", "metrics")
    @classmethod
    def _once_each(cls, value: Any) -> Any:
        """A repeated seed, target or pair would count one run as several in every mean."""
        if isinstance(value, list) and (twice := [v for i, v in enumerate(value) if v in value[:i]]):
            raise ValueError(f"{twice[0]} is listed twice")
        return value


LR_FACTORS = (0.1, 0.3, 1.0, 3.0)  # the learning rates searched for a method without a search_space, × optim.lr


def search_variants(spec: SweepSpec, raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The sweep's variants, each expanded into ``search.n`` draws from its method's ``search_space``:
    ``"<variant> #k"`` with ``method.params.<name>`` overrides (none for ``#0``); a method without a search space
    (FedAvg, FedBN) searches ``optim.lr`` over :data:`LR_FACTORS` × its configured rate."""
    if spec.search is None:
        return spec.variants
    out: dict[str, dict[str, Any]] = {}
    for v, (variant, extra) in enumerate(spec.variants.items()):
        cfg = build_config(raw, [_override(k, x) for k, x in extra.items()])
        space = {f"method.params.{name}": values for name, values in method_class(cfg.method.name).search_space.items()}
        if not space:  # a method without hyper-parameters of its own (FedAvg, FedBN): its learning rate
            space = {"optim.lr": [float(f"{cfg.optim.lr * f:.3g}") for f in LR_FACTORS]}
        for k in range(spec.search.n):
            rng = np.random.default_rng(derived_seed(spec.search.seed, v, k))
            draw = {} if k == 0 else {key: values[int(rng.integers(len(values)))] for key, values in sorted(space.items())}
            out[f"{variant} #{k}"] = {**extra, **draw}
    return out


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> tuple[SweepSpec, dict[str, Any]]:
    """The sweep section and the validated base config (as a plain tree, overrides applied)."""
    raw = read_yaml(path)
    section = raw.pop("sweep", {}) or {}
    sweep_over = [o for o in overrides or [] if o.startswith("sweep.")]  # -o sweep.search.n=8 edits the sweep
    for key, value in parse_overrides(sweep_over):
        set_dotted(section, key.removeprefix("sweep."), value)
    overrides = [o for o in overrides or [] if not o.startswith("sweep.")]
    try:
        spec = SweepSpec.model_validate(section)
    except ValidationError as err:
        raise ConfigError(format_errors(err, prefix="sweep", model=SweepSpec)) from None
    return spec, config_tree(build_config(raw, overrides))


def _cells(spec: SweepSpec, base: ExperimentConfig) -> list[tuple[str, list[str]]]:
    """(label, split overrides) for every target (lodo) or (val, test) pair (ltdo); one cell (federated, or a
    held-out fraction of the domains: ``split.target_fraction``)."""
    ltdo = base.split.protocol == "ltdo"
    if spec.targets != "all" and ltdo:
        raise ConfigError("sweep.targets names lodo targets; split.protocol ltdo takes sweep.pairs: [[val, test], ...]")
    if spec.pairs is not None and not ltdo:
        raise ConfigError(f"sweep.pairs are (validation, test) pairs of split.protocol ltdo, not {base.split.protocol}")
    if base.split.protocol == "federated":
        return [("all", [])]
    if base.split.target_fraction is not None:  # natural clients: one seeded draw of held-out domains
        return [(f"unseen {base.split.target_fraction:g}", [])]
    domains = base.data.domains or dataset_info(base.data.dataset)["domains"]
    named = spec.pairs is not None if ltdo else spec.targets != "all"
    if not domains and not named:  # discovered domains (natural clients): only named cells
        raise ConfigError(f"sweep over 'all' targets needs data.domains for {base.data.dataset}")
    if ltdo:
        pairs = spec.pairs or list(itertools.permutations(domains, 2))
        return [(f"{v}→{t}", [_override("split.val_domain", v), _override("split.target", t)]) for v, t in pairs]
    targets = domains if spec.targets == "all" else spec.targets
    return [(t, [_override("split.target", t)]) for t in targets]


def _override(key: str, value: Any) -> str:
    return f"{key}={json.dumps(value)}"  # JSON is YAML: "0" stays a string


def run_sweep(path: str | Path, overrides: list[str] | None = None, out_dir: str | Path | None = None,
              progress: bool = True, jobs: int = 1) -> dict[str, Any]:
    """Run every (variant, target, seed) cell and write table.md, table_<metric>.csv, runs.jsonl and sweep.json
    (the sweep section as run); returns the rows, the markdown and each cell's config."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    spec, raw = load_sweep(path, overrides)
    base = build_config(raw)
    out = Path(out_dir) if out_dir is not None else Path(base.output_dir) / base.name
    if spec.search is None and (drawn := [v for v in spec.variants if split_draw(v) != (v, 0)]):
        raise ConfigError(f"sweep variant {drawn[0]!r}: a name ending in ' #<k>' is a sweep.search draw's, and the "
                          "selection tables would pool it with its namesakes; rename it")
    variants = search_variants(spec, raw)
    _distinct_folders("variant", list(variants))
    if spec.baseline is not None and spec.baseline not in variants:
        raise ConfigError(f"sweep.baseline {spec.baseline!r} is not a variant; variants: {list(variants)}")
    _distinct_folders("target", [label for label, _ in _cells(spec, base)])
    cells = []
    for variant, extra in variants.items():
        for label, split_over in _cells(spec, base):
            for seed in spec.seeds:
                over = [_override(k, v) for k, v in extra.items()] + split_over + [f"seed={seed}"]
                try:  # every cell validated before anything runs
                    cfg = build_config(raw, over)
                except ConfigError as err:
                    raise ConfigError(f"{_name(variant, label, seed)}: {err}") from None
                cells.append(({"variant": variant, "target": label, "seed": seed},
                              cfg, out / _safe(variant) / _safe(label) / f"seed{seed}"))
    if len({cfg.reproducibility for _, cfg, _ in cells}) > 1:
        raise ConfigError("reproducibility: every cell of a sweep runs with the same CPU kernels; set it in the base "
                          "config, not in a variant")
    out.mkdir(parents=True, exist_ok=True)  # only once every cell is valid: a refused sweep leaves no folder
    _clear_tables(out)
    if jobs == 1:
        results = [_in_cell(cell, _run_or_load, cfg, run_dir, progress) for cell, cfg, run_dir in cells]
    else:
        results = _run_parallel(cells, jobs, progress)
    rows = [{**cell, "variant": labelled(str(cell["variant"]), cfg.method.name), "run_dir": str(run_dir),
             "config_hash": config_hash(cfg), **res["final"], "time_total_s": res["time_total_s"],
             "dropped": res["failures"]["client_rounds_lost"]}
            for (cell, cfg, run_dir), res in zip(cells, results, strict=True)]
    if spec.baseline is not None:  # named as its rows are
        spec.baseline = next(r["variant"] for (cell, _, _), r in zip(cells, rows, strict=True)
                             if cell["variant"] == spec.baseline)
    task = TaskInfo.of(results[0]["task"])
    federated = base.split.protocol == "federated"
    if spec.metrics is None:  # the task's ood and id means, as the runs wrote them (id only: no domain held out)
        spec.metrics = [task.key("id")] if federated else [task.key("ood"), task.key("id")]
    table_rows = _per_domain_rows(rows, spec.metrics, results[0]["source"]) if federated else rows
    if missing := [m for m in spec.metrics if not any(m in r for r in table_rows)]:
        keys = sorted({k for r in table_rows for k in r if isinstance(r[k], float)})
        raise ConfigError(f"sweep.metrics: no run reports {missing[0]!r} (the runs finished and are kept; their "
                          f"figures: {', '.join(keys)})")
    (out / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    asked = spec.selection is not None  # rules the user named: say on the console what each cannot table
    spec.selection = spec.selection or default_rules(rows, task)  # resolved, for sweep.json
    record = {**spec.model_dump(mode="json"), "expanded": {labelled(v, build_config(raw, [
        _override(k, x) for k, x in extra.items()]).method.name): extra for v, extra in variants.items()}}
    (out / "sweep.json").write_text(json.dumps(record, indent=1))
    tables = {m: markdown_table(table_rows, m, spec.baseline, task.bounds_of(m)) for m in spec.metrics}
    md = "\n\n".join(f"### {m} over seeds {spec.seeds}: {STATS_NOTE}\n\n{t}" for m, t in tables.items())
    md += "\n\n" + variants_table(record["expanded"])
    (out / "table.md").write_text(f"# {base.name}\n\n{md}\n")
    for m in spec.metrics:
        (out / f"table_{_safe(m)}.csv").write_text(csv_table(table_rows, m, spec.baseline, task.bounds_of(m)))
    for rule in spec.selection:
        write_rule_tables(out, rule, rows, table_rows, spec, task, results[0]["source"] if federated else None,
                          say_skips=asked)
    return {"out_dir": str(out), "rows": rows, "markdown": md, "configs": [cfg for _, cfg, _ in cells]}


def write_rule_tables(out: Path, rule: str, rows: list[dict[str, Any]], last_rows: list[dict[str, Any]],
                      spec: SweepSpec, task: TaskInfo, domains: list[str] | None, say_skips: bool = True) -> None:
    """table_<metric>_<rule>.md/.csv: the cells each selection rule picks (evaluation/selection.py), with the
    chosen draw and round beside each; ``last`` is table.md's content. An unavailable rule is one line, in its files
    and on the console; a metric the rule cannot table (one it picks by: selection on the reported data; one no
    round reports) is one line in its file, and on the console with ``say_skips`` (the default rules' train_domain
    never tables id_acc: no news to a user who did not name the rule)."""
    assert spec.metrics is not None
    if (why := unavailable(rule, rows, task)) is not None:
        _say(why)
        for m in spec.metrics:
            (out / f"table_{_safe(m)}_{rule}.md").write_text(why + "\n")
        return
    picks, baseline = None, spec.baseline
    chosen = last_rows
    if rule != "last":
        chosen = select(rows, rule, task)
        chosen = _per_domain_rows(chosen, spec.metrics, domains) if domains is not None else chosen
        picks, baseline = pick_notes(chosen), None if spec.baseline is None else split_draw(spec.baseline)[0]
    how = {"train_domain": "training-domain validation (id, the clients' holdouts)",
           "lodo": "leave-one-domain-out validation (val, mean over the source domains)", "oracle": ORACLE_NOTE,
           "last": "none: the last round, every draw its own row"}[rule]
    for m in spec.metrics:
        name = f"table_{_safe(m)}_{rule}"
        why = None
        if picks_by(rule, m):
            why = (f"{rule}: no {m} table, {m} is scored on the data this rule picks by (selection on the reported "
                   "data)")
        elif not any(m in r for r in chosen):  # time_total_s: a run's figure, not a round's
            why = f"{rule}: no {m} table, {m} is not a figure of the evaluated rounds this rule picks among"
        if why is not None:
            if say_skips:
                _say(why)
            (out / f"{name}.md").write_text(why + "\n")
            continue
        note = "" if picks is None else "; beside each cell: per seed, the chosen search draw #k and round, of N candidates"
        md = markdown_table(chosen, m, baseline, task.bounds_of(m), picks)
        (out / f"{name}.md").write_text(
            f"### {m} over seeds {spec.seeds}, model selection: {how}\n\n{STATS_NOTE}{note}\n\n{md}\n")
        (out / f"{name}.csv").write_text(csv_table(chosen, m, baseline, task.bounds_of(m), picks))


def _per_domain_rows(rows: list[dict[str, Any]], metrics: list[str], domains: list[str]) -> list[dict[str, Any]]:
    """Federated sweeps (every domain trains): a table column per domain, from each run's ``<metric>/<domain>``, so
    the table's avg is the mean over domains (FedFA Table 4's "Average"); a run without ``<metric>/<domain>`` has no
    figure in that column (never its mean over domains)."""
    return [{**{k: v for k, v in r.items() if k not in metrics}, "target": d,
             **{m: r[f"{m}/{d}"] for m in metrics if f"{m}/{d}" in r}} for r in rows for d in domains]


def _name(variant: str, target: str, seed: int) -> str:
    return f"sweep variant {variant!r}, target {target}, seed {seed}"


def _in_cell(cell: dict[str, Any], fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``fn(*args)`` for ``cell``; a refusal only its data can make (``split.few_shot_k`` beyond the target's
    samples) names the cell."""
    try:
        return fn(*args)
    except (ConfigError, ValueError) as err:
        raise ConfigError(f"{_name(cell['variant'], cell['target'], cell['seed'])}: {err}") from err


def _clear_tables(out: Path) -> None:
    """Remove a previous sweep's tables, runs.jsonl and sweep.json from ``out``: written at the end from this sweep's
    runs, any left from another sweep (other rules, metrics or configs) would stand beside them as current in the
    report, or alone if this one is interrupted. The runs' folders stay (cells whose config is unchanged load)."""
    for path in [out / "table.md", *out.glob("table_*.md"), *out.glob("table_*.csv"), out / "runs.jsonl",
                 out / "sweep.json"]:
        path.unlink(missing_ok=True)


def _run_parallel(cells: list[tuple[dict[str, Any], ExperimentConfig, Path]], jobs: int,
                  progress: bool = True) -> list[dict[str, Any]]:
    """Cells in ``jobs`` spawned processes under one progress bar (cells done / total, and the running
    cells' variant · target · seed); a line as each finishes; results in cell order."""
    ctx = multiprocessing.get_context("spawn")  # torch and fork do not mix
    label = [f"{c['variant']} · {c['target']} · seed {c['seed']}" for c, _, _ in cells]
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_init_job) as pool, \
            progress_bar(progress) as bar:
        futures = [pool.submit(_in_cell, cell, _run_or_load, _one_worker(cfg), run_dir, False)
                   for cell, cfg, run_dir in cells]
        task = bar.add_task(f"sweep, {jobs} at once", total=len(cells), status="")
        pending = set(range(len(cells)))
        while pending:
            done, _ = wait([futures[i] for i in pending], return_when=FIRST_COMPLETED)
            for i in sorted(i for i in pending if futures[i] in done):
                pending.discard(i)
                res = futures[i].result()
                means = [f"{k} {res['final'][k]:.1f}" for k in (metric_key(r, res["task"]["metric"]) for r in ("id", "ood"))
                         if k in res["final"]]
                bar.console.print(f"[{len(cells) - len(pending)}/{len(cells)}] {escape(label[i])}: " + ", ".join(means))
            running = [label[i] for i in sorted(pending) if futures[i].running()]
            bar.update(task, completed=len(cells) - len(pending), status=escape("running: " + "; ".join(running)))
        return [f.result() for f in futures]


def _init_job() -> None:
    exit_with_parent()
    use_one_thread()


def _one_worker(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with its clients run sequentially: a parallel sweep already fills the cores."""
    return cfg.model_copy(update={"federation": cfg.federation.model_copy(update={"workers": 1})})


def _run_or_load(cfg: ExperimentConfig, run_dir: Path, progress: bool) -> dict[str, Any]:
    """The cell's results: loaded if finished for this very config, else resumed or (re)run."""
    if run_dir.is_dir() and any(run_dir.iterdir()):
        stored = stored_config_hash(run_dir)
        if stored != config_hash(cfg):
            why = "its config changed" if stored else "it has no provenance.json or config.yaml to compare"
            _say(f"rerunning {run_dir} from scratch: {why}")
            return run_experiment(cfg, run_dir, overwrite=True, progress=progress)
        if changed := changed_inputs(run_dir, cfg):
            _say(f"rerunning {run_dir} from scratch: the files of {', '.join(changed)} changed since it ran")
            return run_experiment(cfg, run_dir, overwrite=True, progress=progress)
    results = _results(run_dir)
    if results is not None:
        _say(f"[dim]done already: {escape(str(run_dir))}[/dim]", markup=True)
        return results
    if has_checkpoint(run_dir):
        try:
            record_resume(run_dir, cfg, [])  # the resumed process's code and kernels, as feddg run --resume notes them
            return run_experiment(cfg, run_dir, resume=True, progress=progress)
        except CheckpointError as err:
            _say(f"rerunning {run_dir} from scratch: {err}")
    return run_experiment(cfg, run_dir, overwrite=True, progress=progress)


def _results(run_dir: Path) -> dict[str, Any] | None:
    """results.json of a finished cell; ``None`` if absent or unreadable (the cell is then resumed)."""
    try:
        return json.loads((run_dir / RESULTS).read_text())
    except (OSError, ValueError):
        return None


def _say(line: str, markup: bool = False) -> None:
    """One line on the console, never wrapped (paths are long)."""
    console.print(line if markup else escape(line), soft_wrap=True, highlight=False)


def variants_table(expanded: dict[str, dict[str, Any]]) -> str:
    """What each variant (and each draw of ``sweep.search``) changes in the base config, as a Markdown table."""
    lines = ["### what each variant changes", "", "| variant | overrides |", "|---|---|"]
    for name, extra in expanded.items():
        text = ", ".join(f"`{k}={json.dumps(v)}`" for k, v in extra.items()) or "– (the base config)"
        lines.append(f"| {name} | {text} |")
    return "\n".join(lines)


def _distinct_folders(what: str, names: list[str]) -> None:
    """Refuse names that map to one folder (``a b`` and ``a_b``): their runs would overwrite each other."""
    seen: dict[str, str] = {}
    for name in names:
        if (other := seen.setdefault(_safe(name), name)) != name:
            raise ConfigError(f"sweep: {what}s {other!r} and {name!r} would share the folder {_safe(name)!r}; "
                              f"rename one")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.+" else "_" for c in name)
