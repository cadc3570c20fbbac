"""Model selection for domain generalisation (DomainBed: Gulrajani & Lopez-Paz, "In Search of Lost Domain
Generalization", ICLR 2021, Sec. 3), over a sweep's search draws and every evaluated round of each run.

A candidate is one (search draw, evaluated round) of a variant's runs for one target and seed; a rule scores the
candidates, and the best one's figures stand for the cell (per seed, as DomainBed selects per trial). Rules:

- ``train_domain``: the id metric, the model on the clients' own holdouts. The evaluator sums the clients' tallies
  per source domain (nothing pooled but additive counts) and ``id_<metric>`` is the mean over source domains of
  their scores, DomainBed's average of the training domains' validation accuracies
  (:func:`federated_validation`).
- ``lodo``: for test domain T, the mean over source domains D ≠ T of the ``val_<metric>`` of the runs that hold
  out D as validation and T as test (``split.protocol: ltdo`` pairs "D→T"); the reported figures are those runs'
  means at the chosen draw and round. Without such runs the rule is unavailable (:func:`unavailable`).
- ``oracle``: the unseen domain's own metric, ``ood_<metric>``, at each draw's last evaluated round (DomainBed's
  oracle: no early stopping; a draw whose last model's figure is not finite is no candidate): an upper bound,
  never a selection method, never the default.
- ``last``: no selection: the last round, every draw its own row (the sweep's ``table.md``).

Ties break towards the first draw, then the earliest round. A (draw, round) whose run is missing, or that lacks
the rule's score, is no candidate; a (variant, target, seed) with none has no figure (the cell shows fewer seeds).
A selection method never reports the figures it picks by (:func:`picks_by`): that would be selection on the
reported data (a federated sweep's only figures are the clients' holdouts, so it has no ``train_domain`` table).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args

import numpy as np

from feddg.evaluation.plots import read_metrics
from feddg.tasks import Task, TaskInfo

Rule = Literal["train_domain", "lodo", "oracle", "last"]
RULES: tuple[Rule, ...] = get_args(Rule)
ORACLE_NOTE = "oracle: picked by the test domain's own metric, an upper bound, not a way to select a model"
PAIR = "→"  # an ltdo cell's label: "<val>→<test>" (feddg.sweep)
Evaluations = Callable[[Path], list[dict[str, Any]]]
_DRAW = re.compile(r"^(?P<base>.*) #(?P<draw>\d+)(?P<tail> \(reconstructed\))?$")


def split_draw(variant: str) -> tuple[str, int]:
    """``"FedProx #2"`` -> ``("FedProx", 2)`` (``sweep.search``'s names); a variant without a draw is draw 0."""
    if (m := _DRAW.match(variant)) is None:
        return variant, 0
    return m["base"] + (m["tail"] or ""), int(m["draw"])


def score_key(rule: str, task: TaskInfo) -> str:
    """The metric key a rule picks by: id (train_domain), val (lodo) or ood (oracle)."""
    roles = {"train_domain": "id", "lodo": "val", "oracle": "ood"}
    if rule not in roles:
        raise ValueError(f"rule {rule!r} picks by no metric; rules that do: {list(roles)}")
    return task.key(roles[rule])


def default_rules(rows: list[dict[str, Any]], task: TaskInfo) -> list[Rule]:
    """train_domain (where a domain is held out: else the id figures it picks by are the only ones) and last, plus
    lodo when the sweep holds ltdo pairs; never the oracle."""
    train: list[Rule] = ["train_domain"] if any(task.key("ood") in r for r in rows) else []
    lodo: list[Rule] = ["lodo"] if any(PAIR in str(r["target"]) for r in rows) else []
    return [*train, *lodo, "last"]


def picks_by(rule: str, metric: str) -> bool:
    """Whether ``metric`` (``id_acc``, ``val_macro_f1/uci``, ...) is scored on the data a selection method picks by:
    the id holdouts for train_domain, the validation domains for lodo (the oracle, an upper bound by design, picks
    by the figures it reports)."""
    role = {"train_domain": "id", "lodo": "val"}.get(rule)
    return role is not None and metric.startswith((f"{role}_", f"global_{role}_"))


def unavailable(rule: str, rows: list[dict[str, Any]], task: TaskInfo) -> str | None:
    """Why ``rule`` cannot select in this sweep, in one line; ``None`` if it can."""
    if rule not in RULES:
        raise ValueError(f"unknown selection rule {rule!r}; rules: {list(RULES)}")
    if rule == "lodo" and not any(PAIR in str(r["target"]) for r in rows):
        return ("lodo: unavailable, the sweep has no runs holding out a source domain as validation beside the test "
                "domain (split.protocol: ltdo pairs)")
    if rule == "oracle" and not any(task.key("ood") in r for r in rows):
        return "oracle: unavailable, the runs hold out no test domain (no ood figures)"
    if rule == "train_domain" and not any(task.key("id") in r for r in rows):
        return "train_domain: unavailable, the runs have no id figures (partition.holdout: 0 keeps no client holdout)"
    return None


def federated_validation(client_tallies: list[np.ndarray], task: Task) -> float:
    """The training-domain validation score from the clients' ``[D, ...]`` holdout tallies: their sum per domain
    (tallies add: no sample leaves its client), scored per domain with samples and averaged over those domains,
    as ``id_<metric>`` in metrics.jsonl."""
    total = np.sum(client_tallies, axis=0)
    scores = [task.score(row) for row in total if task.count(row) > 0]
    if not scores:
        raise ValueError("no client holdout has a sample: there is no training-domain validation score")
    return float(np.mean(scores))


def select(rows: list[dict[str, Any]], rule: str, task: TaskInfo,
           evaluations: Evaluations = read_metrics) -> list[dict[str, Any]]:
    """One row per (variant, target, seed) with the chosen candidate's figures and ``draw``, ``round``,
    ``candidates``, ``score``; ``rows`` are the sweep's (variant, target, seed, run_dir[, dropped]). ``last``
    returns ``rows`` as they are (every draw its own row)."""
    if (why := unavailable(rule, rows, task)) is not None:
        raise ValueError(why)
    if rule == "last":
        return rows
    key, better = score_key(rule, task), (lambda a, b: a > b) if task.higher_is_better else (lambda a, b: a < b)
    groups = _lodo_groups(rows) if rule == "lodo" else _groups(rows)
    out = []
    for (variant, target, seed), draws in groups.items():
        candidates = [(draw, rnd, figures) for draw, runs in sorted(draws.items())
                      for rnd, figures in _rounds(runs, key, evaluations, last_only=rule == "oracle")]
        if not candidates:
            continue
        best = candidates[0]
        for c in candidates[1:]:  # strictly better only: ties keep the first draw, then the earliest round
            if better(c[2][key], best[2][key]):
                best = c
        dropped = max(int(r.get("dropped", 0)) for runs in draws.values() for r in runs)
        out.append({**best[2], "variant": variant, "target": target, "seed": seed, "draw": best[0],
                    "round": best[1], "candidates": len(candidates), "score": best[2][key], "dropped": dropped})
    return out


def _groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[int, list[dict[str, Any]]]]:
    """(variant, target, seed) -> draw -> its run (a list of one)."""
    out: dict[tuple[str, str, int], dict[int, list[dict[str, Any]]]] = defaultdict(dict)
    for r in rows:
        base, draw = split_draw(str(r["variant"]))
        out[(base, str(r["target"]), int(r["seed"]))][draw] = [r]
    return out


def _lodo_groups(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[int, list[dict[str, Any]]]]:
    """(variant, test domain, seed) -> draw -> its runs over every validation domain the sweep pairs with that test
    domain; a draw missing one of them has no candidates."""
    pairs = [(r, *_pair(str(r["target"]))) for r in rows if PAIR in str(r["target"])]
    vals: dict[tuple[str, str], set[str]] = defaultdict(set)
    for r, val, test in pairs:
        vals[(split_draw(str(r["variant"]))[0], test)].add(val)
    out: dict[tuple[str, str, int], dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r, _, test in pairs:
        base, draw = split_draw(str(r["variant"]))
        out[(base, test, int(r["seed"]))][draw].append(r)
    return {g: {d: runs if len(runs) == len(vals[(g[0], g[1])]) else [] for d, runs in draws.items()}
            for g, draws in out.items()}


def _pair(label: str) -> tuple[str, str]:
    """``"svhn→mnist"`` -> ``("svhn", "mnist")``: (validation, test)."""
    val, test = label.split(PAIR, 1)
    return val, test


def _rounds(runs: list[dict[str, Any]], key: str, evaluations: Evaluations,
            last_only: bool = False) -> list[tuple[int, dict[str, float]]]:
    """Per round evaluated in every run with a finite ``key``: the runs' mean of each figure they all hold.
    ``last_only`` (the oracle): each run's last round with ``key`` only, none where it is not finite (a draw whose
    last model diverged is no candidate; an earlier round of it would be early stopping on the test domain)."""
    per_run = []
    for r in runs:
        try:
            rows = evaluations(Path(r["run_dir"]))
        except FileNotFoundError:  # a missing run: no candidates
            return []
        evaluated = {int(m["round"]): m for m in rows if isinstance(m.get(key), (int, float))}
        if last_only and evaluated:
            evaluated = dict([max(evaluated.items())])
        per_run.append({rnd: m for rnd, m in evaluated.items() if math.isfinite(m[key])})
    if not per_run:
        return []
    out = []
    for rnd in sorted(set.intersection(*(set(p) for p in per_run))):
        evals = [p[rnd] for p in per_run]
        keys = [k for k, v in evals[0].items() if isinstance(v, (int, float)) and all(k in e for e in evals)]
        out.append((rnd, {k: float(np.mean([e[k] for e in evals])) for k in keys if k != "round"}))
    return out


def pick_notes(rows: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """Per (variant, target) cell, each seed's chosen draw and round (seed order) and the candidates each seed had:
    ``#2 r10, #0 r8 of 12`` (``of 12/9`` where seeds had different numbers)."""
    cells: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r["seed"]):
        cells[(r["variant"], r["target"])].append(r)
    return {c: ", ".join(f"#{r['draw']} r{r['round']}" for r in rs)
            + " of " + "/".join(dict.fromkeys(str(r["candidates"]) for r in rs)) for c, rs in cells.items()}
