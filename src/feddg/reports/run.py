"""``feddg report``: a self-contained report.html for a run directory (or a sweep directory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from feddg.config import read_yaml
from feddg.evaluation.communication import bytes_per_round
from feddg.evaluation.overlays import EXAMPLES, example_path
from feddg.evaluation.plots import EVERY_DOMAIN_TRAINS, plot_run, read_json, read_metrics, run_method, run_title
from feddg.reports import figures
from feddg.reports.audit import audit_section
from feddg.reports.counts import run_counts
from feddg.reports.page import REPORT, file_uri, page_context, render
from feddg.reports.style_grid import style_grid
from feddg.tasks import TaskInfo
from feddg.tasks.base import ROLES


def method_figures(run_dir: str | Path) -> list[Path]:
    """Figures that rebuild the run's federation: ``styles.png`` for PARDON/CCST runs (PARDON Fig. 8)."""
    grid = style_grid(Path(run_dir))
    return [grid] if grid is not None else []


def report(path: str | Path) -> list[Path]:
    """``report.html`` (first) and the PNGs drawn for it, for a run or a sweep directory."""
    from feddg.reports.sweep import is_sweep_dir, sweep_report

    path = Path(path)
    if is_sweep_dir(path):
        return [sweep_report(path)]
    if not (path / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{path} is neither a run directory (metrics.jsonl) nor a sweep directory (runs.jsonl)")
    return run_report(path)


def _held_out(results: dict[str, Any], split: dict[str, Any]) -> str:
    """The held-out domains; "none" where every domain trains (``split.protocol: federated``)."""
    if "target" in results:
        return ", ".join(results["target"]) or EVERY_DOMAIN_TRAINS
    if split.get("protocol") == "federated":
        return EVERY_DOMAIN_TRAINS
    target = split.get("target")
    return ", ".join(target) if isinstance(target, list) else str(target or "?")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError


def _flat(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested dicts as dotted ``(key, value)`` rows."""
    rows: list[tuple[str, Any]] = []
    for k, v in tree.items():
        rows += _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [(f"{prefix}{k}", v)]
    return rows


#: the "who took part" table's columns (one row per client of a Flower run's session)
PARTICIPANT_COLUMNS = ("from round", "client", "site", "identified by", "key", "node", "state-dir (its word)")


#: clients tabled per session; a larger federation (a simulation of thousands of writers) is counted, not listed
MAX_PARTICIPANT_ROWS = 100


def participants(provenance: Any) -> list[dict[str, Any]]:
    """provenance.json's ``flower_nodes`` (a Flower run's start and resumes): per session its rows (one per client,
    :data:`PARTICIPANT_COLUMNS`, the first :data:`MAX_PARTICIPANT_ROWS`), how many more there are, and the refused
    nodes' lines; none for another run."""
    sessions = provenance.get("flower_nodes", []) if isinstance(provenance, dict) else []
    out = []
    for s in (s for s in sessions if isinstance(s, dict)):  # a hand-edited file must not stop the report
        clients = {cid: c for cid, c in (s.get("clients") or {}).items() if isinstance(c, dict)}
        start = s["after_round"] + 1 if isinstance(s.get("after_round"), int) else "?"
        out.append({"rows": [(start, cid, c.get("name", "–"), c.get("by", "?"), c.get("key", "–"), c.get("node", "?"),
                              _yes_no(c.get("state_dir")))
                             for cid, c in list(clients.items())[:MAX_PARTICIPANT_ROWS]],
                    "more": max(len(clients) - MAX_PARTICIPANT_ROWS, 0), "refused": list(s.get("refused") or [])})
    return out


def _yes_no(value: Any) -> str:
    return "yes" if value is True else "no" if value is False else "?"


def _untabled(provenance: Any) -> Any:
    """provenance.json as the page prints it: ``flower_nodes`` (thousands of lines for a simulation of writers) is in
    the "who took part" tables already."""
    if not isinstance(provenance, dict) or "flower_nodes" not in provenance:
        return provenance
    return {**provenance, "flower_nodes": f"{len(provenance['flower_nodes'])} session(s): tabled above"}


def domain_rows(final: dict[str, float], counts: dict[str, int], task: TaskInfo) -> list[dict[str, Any]]:
    """One row per ``<role>_<metric>/<domain>`` key: the figure and the samples behind it."""
    rows = []
    for key, value in final.items():
        parsed = task.parse(key)
        if parsed is not None and parsed[1] is not None:
            rows.append({"domain": parsed[1], "role": parsed[0], "value": value, "n": counts.get(key)})
    rank = {r: i for i, r in enumerate(ROLES)}
    return sorted(rows, key=lambda r: rank.get(r["role"], len(rank)))


def example_figures(run_dir: Path, rows: list[dict[str, Any]], task: TaskInfo) -> list[dict[str, str]]:
    """The run's ``examples/*.png`` (a segmentation's overlays, one per site), captioned with the site: the sites of
    the per-domain table in its order (:func:`domain_rows`), then any other PNG of the folder by name."""
    pngs = {p.name: p for p in sorted((run_dir / EXAMPLES).glob("*.png"))}
    out = []
    for r in rows:
        if (path := pngs.pop(example_path(run_dir, r["domain"]).name, None)) is not None:
            out.append({"title": r["domain"], "uri": file_uri(path),
                        "caption": f"{r['domain']} ({r['role']}, {task.label} {r['value']:.1f} {task.unit})"})
    return out + [{"title": p.stem, "uri": file_uri(p), "caption": p.stem} for p in pngs.values()]


def failure_notes(failures: dict[str, Any] | None) -> list[str]:
    """One note when the run dropped clients: which rounds, how many client-rounds, and a first reason."""
    if not failures or not failures.get("client_rounds_lost"):
        return []
    first_client, events = next(iter(failures["clients"].items()))
    return [f"clients were dropped in rounds {', '.join(map(str, failures['rounds']))}: "
            f"{failures['client_rounds_lost']} client-round(s) lost (e.g. client {first_client} in round "
            f"{events[0]['round']}: {events[0]['reason']}); the figures are those of the degraded run"]


def _planned_rounds(raw: dict[str, Any]) -> int | None:
    """The engine rounds config.yaml asks for (``federation.rounds``, × ``hierarchy.station_rounds`` under a
    hierarchy), ``None`` where it does not say."""
    rounds = (raw.get("federation") or {}).get("rounds")
    station_rounds = (raw.get("hierarchy") or {}).get("station_rounds", 1)
    ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (rounds, station_rounds))
    return rounds * station_rounds if ok else None


def run_report(run_dir: Path) -> list[Path]:
    """Write curves.png, domains.png, the method's figures and report.html into ``run_dir``."""
    metrics = read_metrics(run_dir)
    if not metrics:
        raise ValueError(f"{run_dir}/metrics.jsonl has no rounds yet")
    results = read_json(run_dir / "results.json") or {}
    counts, task, notes = run_counts(run_dir)
    if task is None:
        raise ValueError(f"{run_dir}: {'; '.join(notes)}")
    headline = task.key("ood") if any(task.key("ood") in m for m in metrics) else task.key("id")  # federated: id
    last = next((m for m in reversed(metrics) if headline in m), metrics[-1])
    final = results.get("final") or {k: v for k, v in last.items() if task.parse(k) is not None}
    pngs = plot_run(run_dir, task, counts)
    rows = domain_rows(final, counts, task)
    notes += failure_notes(results.get("failures"))
    view = results.get("per_class")
    if view and (warning := figures.collapsed(view)):
        notes.append(warning)
    extra = method_figures(run_dir)
    config_path = run_dir / "config.yaml"
    config_text = config_path.read_text() if config_path.is_file() else ""
    raw = read_yaml(config_path) if config_text else {}
    given = {k: (raw.get(k) or {}) for k in ("method", "data", "split", "federation")}  # a run still in progress
    provenance = read_json(run_dir / "provenance.json")
    planned = None if "final" in results else _planned_rounds(raw)
    unfinished = planned is not None and metrics[-1]["round"] < planned
    mark = read_json(run_dir / "status.json")  # only a Flower deployment's ServerApp writes one: its state
    deployed = isinstance(mark, dict)
    if unfinished:
        state = (f"status.json: {mark.get('status')}{': ' + mark['error'] if mark.get('error') else ''}; feddg flower run "
                 f"--resume {run_dir} --connection NAME continues it" if isinstance(mark, dict)
                 else f"the run is still going, or it stopped: feddg run --resume {run_dir} continues it")
        notes.append(f"unfinished: round {metrics[-1]['round']} of {planned} is the last in metrics.jsonl ({state}); "
                     f"the figures are those of round {last['round']}")
    summary = [("method", run_method(results) if "method" in results else given["method"].get("name", "?")),
               ("dataset", results.get("dataset", given["data"].get("dataset", "?"))),
               ("held out", _held_out(results, given["split"])),
               ("seed", results.get("seed", raw.get("seed", "?"))),
               ("rounds", f"{len(metrics)} of {planned}" if unfinished else len(metrics)),
               ("clients", results["num_clients"]) if "num_clients" in results
               else ("clients sampled (last round)", metrics[-1].get("clients", "?")),
               ("engine", "flower deployment" if deployed else given["federation"].get("engine", "inprocess"))]
    summary += [(f"{k} ({task.unit})", f"{final[k]:.2f}") for k in map(task.key, ("ood", "val", "id", "global_ood"))
                if k in final]
    summary += [(f"chance ({task.unit})", f"{task.chance:.3g}")] if task.chance is not None else []
    summary += [("time (s)", f"{sum(m.get('time_round_s', 0.0) for m in metrics):.1f}"),
                ("sent down / up", " / ".join(_size(sum(m[k] for m in metrics)) for k in ("bytes_down", "bytes_up")))]
    out = render(
        "run.html.j2", run_dir / REPORT, **page_context(run_title(run_dir), str(run_dir), notes),
        subtitle=f"run directory {run_dir}", summary=summary, last_round=last["round"],
        method=summary[0][1],
        curves={"title": f"{task.label} and loss", "uri": file_uri(pngs[0]),
                "caption": f"mean {task.label} over domains per evaluated round"
                           + ("; dotted: chance level" if task.chance is not None else "")},
        domains={"title": "per domain", "uri": file_uri(pngs[1]), "caption": "n = samples evaluated"}
        if len(pngs) > 1 else None,
        domain_rows=rows, metric_label=task.axis_label, examples=example_figures(run_dir, rows, task),
        communication={"title": "bytes per round", "uri": figures.png_uri(figures.communication(metrics)),
                       "caption": "message bytes (arrays + scalars) over all sampled clients"},
        bytes_rows=[(k, v / 1024) for k, v in bytes_per_round(metrics).items()],
        timing={"title": "time per round", "uri": figures.png_uri(figures.timing(metrics)),
                "caption": "wall-clock seconds: client training (all clients), aggregation, evaluation"},
        schedule={"title": "schedule", "uri": figures.png_uri(figures.schedule(metrics)), "caption": ""},
        diagnostics=[{"title": name, "uri": figures.png_uri(figures.diagnostics(panels)), "caption": ""}
                     for name, panels in sorted(figures.diagnostic_panels(metrics, task).items())],
        method_figures=[{"title": p.name, "uri": file_uri(p), "caption": ""} for p in extra],
        audit=audit_section(run_dir),
        per_class={"title": "per class (last evaluation)", "uri": figures.png_uri(figures.per_class(view)),
                   "caption": "bars: recall of each class; dots: the share of the predictions given to it"}
        if view else None,
        hierarchy=_flat(results["hierarchy"]) if "hierarchy" in results else [],
        method_params=_flat(results.get("method_params", {})),
        participants=participants(provenance), participant_columns=PARTICIPANT_COLUMNS,
        config_text=config_text, provenance_text=json.dumps(_untabled(provenance), indent=2) if provenance else "",
        files=[(p.name, _size(p.stat().st_size)) for p in sorted(run_dir.iterdir())
               if p.is_file() and p.name != REPORT],
    )
    return [out, *pngs, *extra]
