"""Model selection (evaluation/selection.py): each rule picks the hand-computed draw and round from fake runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from feddg.evaluation.selection import (
    default_rules,
    federated_validation,
    pick_notes,
    picks_by,
    select,
    split_draw,
    unavailable,
)
from feddg.reports.sweep import sweep_report
from feddg.sweep import SweepSpec, _per_domain_rows, run_sweep, write_rule_tables
from feddg.tasks import TaskInfo, make_task

ACC = TaskInfo("classification", "acc", "accuracy", "%", (0.0, 100.0), True, 10.0)


def _run(root: Path, name: str, evals: dict[int, dict[str, float]]) -> str:
    """A fake run directory: metrics.jsonl with a non-evaluated round 1 and ``evals`` per round."""
    d = root / name
    d.mkdir(parents=True)
    rows = [{"round": 1, "train_loss": 1.0}] + [{"round": r, "train_loss": 0.5, **f} for r, f in evals.items()]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(d)


def _row(variant: str, target: str, seed: int, run_dir: str) -> dict:
    """A runs.jsonl row: the cell, its run directory and its final figures (the last evaluated round's)."""
    metrics = Path(run_dir) / "metrics.jsonl"
    final = json.loads(metrics.read_text().splitlines()[-1]) if metrics.is_file() else {}
    final = {k: v for k, v in final.items() if k.endswith(("_acc", "_err"))}
    return {"variant": variant, "target": target, "seed": seed, "run_dir": run_dir, "dropped": 0, **final}


@pytest.fixture
def lodo_rows(tmp_path):
    """Two draws of FedAvg, seed 0. Seed 0 draw 0: r2 id 80 ood 50, r4 id 85 ood 55; draw 1: r2 id 85 ood 70,
    r4 id 84 ood 90; draw 2's run is missing. Seed 1: draw 0 only, r2 and r4 both id 70 (ood 40, 45)."""
    def ev(i: float, o: float) -> dict[str, float]:
        return {"id_acc": i, "ood_acc": o}

    return [
        _row("FedAvg #0", "mnist", 0, _run(tmp_path, "d0s0", {2: ev(80, 50), 4: ev(85, 55)})),
        _row("FedAvg #1", "mnist", 0, _run(tmp_path, "d1s0", {2: ev(85, 70), 4: ev(84, 90)})),
        _row("FedAvg #2", "mnist", 0, str(tmp_path / "never-ran")),
        _row("FedAvg #0", "mnist", 1, _run(tmp_path, "d0s1", {2: ev(70, 40), 4: ev(70, 45)})),
        _row("FedAvg #2", "mnist", 2, str(tmp_path / "never-ran-either")),
    ]


def _picked(rows: list[dict]) -> dict[int, tuple[int, int, int, float]]:
    return {r["seed"]: (r["draw"], r["round"], r["candidates"], r["ood_acc"]) for r in rows}


def test_training_domain_validation_picks_by_id_and_breaks_ties_by_first_draw_then_earliest_round(lodo_rows):
    chosen = select(lodo_rows, "train_domain", ACC)
    # seed 0: id 85 at (#0, r4) and (#1, r2): the first draw wins; seed 1: a tie over rounds, the earliest wins;
    # seed 2 has no run at all: no figure (a missing cell), and the missing draw 2 is no candidate
    assert _picked(chosen) == {0: (0, 4, 4, 55.0), 1: (0, 2, 2, 40.0)}
    assert {r["variant"] for r in chosen} == {"FedAvg"}
    assert pick_notes(chosen) == {("FedAvg", "mnist"): "#0 r4, #0 r2 of 4/2"}


def test_a_selected_cell_is_degraded_when_any_of_its_draws_dropped_clients(lodo_rows):
    lodo_rows[1]["dropped"] = 3  # seed 0, draw 1: not the pick of train_domain (draw 0), but a run of the cell
    chosen = {r["seed"]: r["dropped"] for r in select(lodo_rows, "train_domain", ACC)}
    assert chosen == {0: 3, 1: 0}


def test_the_oracle_picks_by_the_unseen_domain_at_each_draws_last_round_and_is_never_a_default(lodo_rows, tmp_path):
    # DomainBed's oracle: the draws' last checkpoints only (no early stopping on the test domain)
    assert _picked(select(lodo_rows, "oracle", ACC)) == {0: (1, 4, 2, 90.0), 1: (0, 4, 1, 45.0)}
    early = [_row("X #0", "t", 0, _run(tmp_path, "e0", {2: {"ood_acc": 71.0}, 4: {"ood_acc": 60.0}})),
             _row("X #1", "t", 0, _run(tmp_path, "e1", {2: {"ood_acc": 50.0}, 4: {"ood_acc": 65.0}}))]
    assert _picked(select(early, "oracle", ACC)) == {0: (1, 4, 2, 65.0)}  # not draw 0's round 2 (71)
    diverged = [_row("Y #0", "t", 0, _run(tmp_path, "n0", {2: {"ood_acc": 71.0}, 4: {"ood_acc": float("nan")}})),
                _row("Y #1", "t", 0, _run(tmp_path, "n1", {2: {"ood_acc": 50.0}, 4: {"ood_acc": 65.0}}))]
    assert _picked(select(diverged, "oracle", ACC)) == {0: (1, 4, 1, 65.0)}  # draw 0's last model is NaN: no candidate
    assert "oracle" not in default_rules(lodo_rows, ACC)
    assert "oracle" not in default_rules([{"target": "svhn→mnist"}], ACC)
    assert SweepSpec().selection is None  # the sweep's default is default_rules'


def test_last_keeps_every_draw_its_own_row(lodo_rows):
    assert select(lodo_rows, "last", ACC) is lodo_rows


def test_a_lower_is_better_metric_picks_the_minimum(tmp_path):
    loss = TaskInfo("toy", "err", "error", "%", (0.0, 100.0), False, None)
    rows = [_row("X", "a", 0, _run(tmp_path, "r", {2: {"id_err": 5.0, "ood_err": 9.0},
                                                    4: {"id_err": 3.0, "ood_err": 8.0}}))]
    assert [(r["round"], r["ood_err"]) for r in select(rows, "train_domain", loss)] == [(4, 8.0)]


def test_leave_one_domain_out_averages_the_validation_domains_of_each_test_domain(tmp_path):
    def ev(v: float, o: float) -> dict[str, float]:
        return {"val_acc": v, "ood_acc": o, "id_acc": 99.0}

    rows = [  # test domain c, validation a or b; draw 2 lacks its b→c run
        _row("P #0", "a→c", 0, _run(tmp_path, "0a", {1: ev(60, 30), 2: ev(70, 40)})),
        _row("P #0", "b→c", 0, _run(tmp_path, "0b", {1: ev(80, 50), 2: ev(60, 20)})),
        _row("P #1", "a→c", 0, _run(tmp_path, "1a", {1: ev(50, 10), 2: ev(90, 80)})),
        _row("P #1", "b→c", 0, _run(tmp_path, "1b", {1: ev(90, 10), 2: ev(80, 60)})),
        _row("P #2", "a→c", 0, _run(tmp_path, "2a", {1: ev(100, 100), 2: ev(100, 100)})),
    ]
    # scores: #0 r1 (60+80)/2 = 70, r2 65; #1 r1 70, r2 85 -> #1 r2, ood (80+60)/2 = 70; #2 is incomplete
    [chosen] = select(rows, "lodo", ACC)
    assert (chosen["target"], chosen["draw"], chosen["round"], chosen["candidates"]) == ("c", 1, 2, 4)
    assert (chosen["score"], chosen["ood_acc"]) == (85.0, 70.0)
    assert default_rules(rows, ACC) == ["train_domain", "lodo", "last"]


def test_lodo_scores_only_rounds_every_validation_run_evaluated_and_none_of_a_draw_with_a_run_missing(tmp_path):
    def ev(v: float, o: float) -> dict[str, float]:
        return {"val_acc": v, "ood_acc": o}

    rows = [  # draw 0: the a→c run evaluated rounds 2 and 4, the b→c run round 4 only; draw 1's b→c run never ran
        _row("P #0", "a→c", 0, _run(tmp_path, "0a", {2: ev(99, 99), 4: ev(60, 30)})),
        _row("P #0", "b→c", 0, _run(tmp_path, "0b", {4: ev(80, 50)})),
        _row("P #1", "a→c", 0, _run(tmp_path, "1a", {2: ev(100, 100), 4: ev(100, 100)})),
        _row("P #1", "b→c", 0, str(tmp_path / "never-ran")),
    ]
    [chosen] = select(rows, "lodo", ACC)  # round 2 is not a mean over both validation domains; draw 1 has one
    assert (chosen["draw"], chosen["round"], chosen["candidates"]) == (0, 4, 1)
    assert (chosen["score"], chosen["ood_acc"]) == (70.0, 40.0)


def test_a_round_whose_score_is_not_finite_is_no_candidate(tmp_path):
    rows = [_row("X", "a", 0, _run(tmp_path, "r", {2: {"id_acc": float("nan"), "ood_acc": 99.0},
                                                    4: {"id_acc": 60.0, "ood_acc": 40.0},
                                                    6: {"id_acc": 70.0, "ood_acc": 45.0}}))]
    [chosen] = select(rows, "train_domain", ACC)  # a NaN first would stay "best": nothing compares above it
    assert (chosen["round"], chosen["candidates"], chosen["ood_acc"]) == (6, 2, 45.0)


def test_a_draw_number_is_only_a_variant_names_last_word():
    assert split_draw("FedProx #2") == ("FedProx", 2)
    assert split_draw("FedProx #2 (reconstructed)") == ("FedProx (reconstructed)", 2)
    assert split_draw("FedProx #2b") == ("FedProx #2b", 0)  # not draw 2 of "FedProx"
    assert split_draw("FedProx") == ("FedProx", 0)


def test_pick_notes_list_the_seeds_in_seed_order_whatever_the_rows_order():
    rows = [{"variant": "V", "target": "t", "seed": s, "draw": d, "round": r, "candidates": c}
            for s, d, r, c in ((2, 1, 8, 6), (0, 0, 4, 6), (1, 2, 6, 4))]
    assert pick_notes(rows) == {("V", "t"): "#0 r4, #2 r6, #1 r8 of 6/4"}


def test_lodo_without_ltdo_pairs_is_unavailable_in_one_line(lodo_rows):
    why = unavailable("lodo", lodo_rows, ACC)
    assert why is not None and "\n" not in why and why.startswith("lodo: unavailable")
    with pytest.raises(ValueError, match="lodo: unavailable"):
        select(lodo_rows, "lodo", ACC)
    with pytest.raises(ValueError, match="unknown selection rule"):
        unavailable("best", lodo_rows, ACC)


def test_federated_validation_equals_the_pooled_holdouts():
    task = make_task("classification", 2)
    # per sample: (domain, correct) on three clients' holdouts; clients 0, 1 hold domain a, client 2 domain b
    clients = [[(0, 1), (0, 1), (0, 1), (0, 0)], [(0, 1), (0, 0)], [(1, 1), (1, 1), (1, 0), (1, 0), (1, 0)]]

    def tally(samples: list[tuple[int, int]]) -> np.ndarray:
        t = np.zeros((2, 2), dtype=np.int64)
        for d, ok in samples:
            t[d] += (ok, 1)
        return t

    pooled = [s for c in clients for s in c]
    per_domain = [100 * np.mean([ok for d, ok in pooled if d == k]) for k in (0, 1)]
    assert federated_validation([tally(c) for c in clients], task) == pytest.approx(np.mean(per_domain))
    assert federated_validation([tally(c) for c in clients], task) == pytest.approx((400 / 6 + 40) / 2)
    with pytest.raises(ValueError, match="no client holdout has a sample"):  # was nan, read as a score
        federated_validation([tally([])], task)


def test_rule_tables_carry_the_picks_and_never_mix_rules(lodo_rows, tmp_path, capsys):
    spec = SweepSpec(seeds=[0, 1], metrics=["ood_acc"], baseline="FedAvg #0")
    for rule in ("train_domain", "oracle", "lodo", "last"):
        write_rule_tables(tmp_path, rule, lodo_rows, lodo_rows, spec, ACC, None)
    md = (tmp_path / "table_ood_acc_train_domain.md").read_text()
    assert "| FedAvg | 47.5 ± 10.6 [#0 r4, #0 r2 of 4/2] |" in md
    oracle = (tmp_path / "table_ood_acc_oracle.md").read_text()
    assert "upper bound" in oracle and "67.5 ± 31.8" in oracle
    with (tmp_path / "table_ood_acc_train_domain.csv").open() as f:
        cell = next(r for r in csv.DictReader(f) if r["target"] == "mnist")
    assert (cell["mean"], cell["n"], cell["selected"]) == ("47.500", "2", "#0 r4, #0 r2 of 4/2")
    assert (tmp_path / "table_ood_acc_lodo.md").read_text().startswith("lodo: unavailable")
    assert not (tmp_path / "table_ood_acc_lodo.csv").exists()
    assert "lodo: unavailable" in capsys.readouterr().err  # and one line on the console
    assert "FedAvg #1" in (tmp_path / "table_ood_acc_last.md").read_text()  # every draw its own row


def test_a_searched_sweep_writes_a_table_per_rule_with_the_rounds_metrics_jsonl_supports(tmp_path, cache_dir,
                                                                                         monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({
        "name": "sel", "data": {"dataset": "digits-dg", "max_per_domain": 40},
        "partition": {"kind": "by_domain", "num_clients": 3}, "model": {"name": "lenet"},
        "federation": {"rounds": 2, "batch_size": 32}, "eval": {"every": 1},
        "sweep": {"targets": ["mnist"], "seeds": [0], "search": {"n": 2}, "baseline": "FedAvg #0",
                  "selection": ["train_domain", "oracle", "last"], "variants": {"FedAvg": {"method.name": "fedavg"}}}}))
    res = run_sweep(path, out_dir=tmp_path / "out", progress=False)
    out = Path(res["out_dir"])
    evals = [(k, m["round"], m["id_acc"], m["ood_acc"]) for k in (0, 1) for m in map(
        json.loads, (out / f"FedAvg__{k}" / "mnist" / "seed0" / "metrics.jsonl").read_text().splitlines())]
    best = evals[int(np.argmax([e[2] for e in evals]))]  # argmax keeps the first: draw, then round order
    with (out / "table_ood_acc_train_domain.csv").open() as f:
        cell = next(r for r in csv.DictReader(f) if r["target"] == "mnist")
    assert cell["selected"] == f"#{best[0]} r{best[1]} of 4" and float(cell["mean"]) == pytest.approx(best[3], abs=5e-4)
    assert (out / "table_ood_acc.csv").read_text() == (out / "table_ood_acc_last.csv").read_text()
    assert not (out / "table_ood_acc_lodo.md").exists()
    assert json.loads((out / "sweep.json").read_text())["selection"] == ["train_domain", "oracle", "last"]
    html = sweep_report(out).read_text()  # the report shows each rule's table, never as a metric of its own
    assert "Model selection" in html and "<h3>ood_acc_oracle</h3>" in html and 'id="ood_acc_oracle"' not in html


def test_the_default_rules_table_quietly_what_they_cannot_and_named_rules_say_it(tmp_path, cache_dir, monkeypatch,
                                                                                 capsys):
    """train_domain never tables id_acc: a sweep with the default rules (`make demo`) keeps that to the file; one
    that names its rules hears it on the console."""
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    why = "train_domain: no id_acc table"
    for named in (False, True):
        path = tmp_path / f"{named}.yaml"
        sweep = {"targets": ["mnist"], "seeds": [0], **({"selection": ["train_domain", "last"]} if named else {})}
        path.write_text(yaml.safe_dump({
            "name": "sel", "data": {"dataset": "digits-dg", "max_per_domain": 40},
            "partition": {"kind": "by_domain", "num_clients": 3}, "model": {"name": "lenet"},
            "federation": {"rounds": 1, "batch_size": 32}, "sweep": sweep}))
        out = Path(run_sweep(path, out_dir=tmp_path / str(named), progress=False)["out_dir"])
        assert (out / "table_id_acc_train_domain.md").read_text().startswith(why)
        assert (why in capsys.readouterr().err) == named


def test_a_selection_method_never_reports_the_figures_it_picks_by(lodo_rows, tmp_path, capsys):
    spec = SweepSpec(seeds=[0, 1], metrics=["ood_acc", "id_acc"])
    write_rule_tables(tmp_path, "train_domain", lodo_rows, lodo_rows, spec, ACC, None)
    assert "| FedAvg | 47.5 ± 10.6" in (tmp_path / "table_ood_acc_train_domain.md").read_text()
    why = "train_domain: no id_acc table, id_acc is scored on the data this rule picks by"
    assert (tmp_path / "table_id_acc_train_domain.md").read_text().startswith(why)
    assert not (tmp_path / "table_id_acc_train_domain.csv").exists() and why in capsys.readouterr().err
    assert not picks_by("oracle", "ood_acc") and picks_by("lodo", "val_acc/b") and picks_by("train_domain", "global_id_acc")


def test_a_federated_sweep_has_no_training_domain_table_and_no_mean_in_a_domains_column(tmp_path):
    # split.protocol: federated: the clients' holdouts are the only figures, so picking by them is test-set selection
    run = _run(tmp_path, "fed", {2: {"id_acc": 76.0}, 4: {"id_acc": 68.0}})  # eval.per_domain: false: means only
    rows = [{**_row("A", "all", 0, run), "id_acc/a": 60.0, "id_acc/b": 76.0}]  # the final figures have domains
    assert default_rules(rows, ACC) == ["last"]
    [a, b] = _per_domain_rows(rows, ["id_acc"], ["a", "b"])
    assert (a["target"], a["id_acc"], b["target"], b["id_acc"]) == ("a", 60.0, "b", 76.0)
    assert "id_acc" not in _per_domain_rows([{"target": "all", "id_acc": 68.0}], ["id_acc"], ["a"])[0]


def test_training_domain_validation_without_id_figures_is_unavailable_in_one_line(tmp_path):
    rows = [_row("A", "t", 0, _run(tmp_path, "r", {2: {"ood_acc": 50.0}}))]  # partition.holdout: 0
    assert unavailable("train_domain", rows, ACC) == (
        "train_domain: unavailable, the runs have no id figures (partition.holdout: 0 keeps no client holdout)")


def test_a_draw_number_of_several_digits_is_one_draw():
    assert split_draw("FedProx #12") == ("FedProx", 12)
    assert split_draw("FedProx #10 (reconstructed)") == ("FedProx (reconstructed)", 10)


def test_a_tie_goes_to_the_lowest_draw_whatever_the_rows_order(tmp_path):
    rows = [_row("X #1", "t", 0, _run(tmp_path, "d1", {2: {"id_acc": 80.0, "ood_acc": 10.0}})),
            _row("X #0", "t", 0, _run(tmp_path, "d0", {2: {"id_acc": 80.0, "ood_acc": 20.0}}))]
    assert _picked(select(rows, "train_domain", ACC)) == {0: (0, 2, 2, 20.0)}


def test_lodo_scores_the_mean_not_the_median_of_three_validation_domains(tmp_path):
    # test domain d; draw 0 val 10, 20, 90 (mean 40, median 20), draw 1 val 30, 30, 30: the mean picks draw 0
    rows = [_row(f"P #{k}", f"{v}→d", 0, _run(tmp_path, f"{k}{v}", {2: {"val_acc": s, "ood_acc": o}}))
            for k, scores in ((0, (10.0, 20.0, 90.0)), (1, (30.0, 30.0, 30.0)))
            for v, s, o in zip("abc", scores, (30.0, 60.0, 60.0), strict=True)]
    [chosen] = select(rows, "lodo", ACC)
    assert (chosen["draw"], chosen["score"], chosen["ood_acc"]) == (0, 40.0, 50.0)


def test_lodo_reports_the_figures_every_pair_run_holds_and_drops_each_runs_own_validation_domain(tmp_path):
    # each pair run writes its own validation domain's per-domain key: no mean of it exists over the pair runs
    rows = [_row("P", "a→c", 0, _run(tmp_path, "a", {2: {"val_acc": 60.0, "val_acc/a": 60.0, "ood_acc": 30.0,
                                                          "ood_acc/c": 30.0}})),
            _row("P", "b→c", 0, _run(tmp_path, "b", {2: {"val_acc": 80.0, "val_acc/b": 80.0, "ood_acc": 50.0,
                                                          "ood_acc/c": 50.0}}))]
    [chosen] = select(rows, "lodo", ACC)
    assert (chosen["score"], chosen["val_acc"], chosen["ood_acc"], chosen["ood_acc/c"]) == (70.0, 70.0, 40.0, 40.0)
    assert "val_acc/a" not in chosen and "val_acc/b" not in chosen


def test_the_oracle_without_ood_figures_is_unavailable_in_one_line(tmp_path):
    rows = [_row("A", "all", 0, _run(tmp_path, "r", {2: {"id_acc": 50.0}}))]  # split.protocol: federated
    assert unavailable("oracle", rows, ACC) == "oracle: unavailable, the runs hold out no test domain (no ood figures)"
    with pytest.raises(ValueError, match="^oracle: unavailable"):
        select(rows, "oracle", ACC)


def test_federated_validation_is_the_mean_of_three_domains_summed_over_clients():
    """Client 0 holds a (1 of 1 right) and c (1 of 2), client 1 holds b (0 of 2) and c (0 of 3): a 100 %, b 0 %,
    c 1 of 5 = 20 %; the mean is 40 % (the median 20 %, the first client's alone 75 %)."""
    task = make_task("classification", 2)

    def tally(rows: dict[int, tuple[int, int]]) -> np.ndarray:
        t = np.zeros((3, 2 + 3 * 2), dtype=np.int64)
        for d, (right, n) in rows.items():
            t[d, :2] = (right, n)
        return t

    clients = [tally({0: (1, 1), 2: (1, 2)}), tally({1: (0, 2), 2: (0, 3)})]
    assert federated_validation(clients, task) == pytest.approx(40.0)


def test_a_lower_is_better_tie_keeps_the_earliest_round(tmp_path):
    err = TaskInfo("toy", "err", "error", "%", (0.0, 100.0), False, None)
    rows = [_row("X", "a", 0, _run(tmp_path, "r", {2: {"id_err": 3.0, "ood_err": 9.0},
                                                    4: {"id_err": 3.0, "ood_err": 8.0}}))]
    assert [(r["round"], r["ood_err"]) for r in select(rows, "train_domain", err)] == [(2, 9.0)]
