"""A sweep's outputs mean what their labels say: refused specs, no stale tables, bounds only on the task's metric.

The cells' runs are stand-ins (``_run_or_load`` patched to write a run's metrics.jsonl and return its results), so
these tests exercise the sweep's bookkeeping, not training."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

import feddg.sweep as sweep
from feddg.config import ConfigError
from feddg.evaluation.tables import ci95
from feddg.reports.sweep import sweep_report
from feddg.tasks.info import TaskInfo

TASK = {"name": "classification", "metric": "acc", "label": "accuracy", "unit": "%", "bounds": [0, 100],
        "higher_is_better": True, "chance": 10.0}
BASE: dict[str, Any] = {"name": "s", "data": {"dataset": "digits-dg"},
                        "sweep": {"targets": ["uci"], "seeds": [0, 1, 2], "variants": {"FedAvg": {}}}}
SECONDS = {0: 290.0, 1: 310.0, 2: 330.0}  # three seeds' run times: a 95 % interval far above 100


@pytest.fixture
def stand_in_runs(monkeypatch):
    """Each cell 'runs' in no time: two evaluated rounds in metrics.jsonl, the last one's figures in results."""
    def run(cfg, run_dir: Path, progress: bool) -> dict[str, Any]:
        run_dir.mkdir(parents=True, exist_ok=True)
        rounds = [{"round": r, "id_acc": 50.0 + r + cfg.seed, "ood_acc": 40.0 + r}
                  for r in (1, 2)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rounds))
        final = {k: v for k, v in rounds[-1].items() if k != "round"}
        results = {"final": final, "time_total_s": SECONDS[cfg.seed], "failures": {"client_rounds_lost": 0},
                   "task": TASK, "source": ["mnist"], "seed": cfg.seed, "counts": {"ood_acc": 10, "id_acc": 10}}
        (run_dir / "results.json").write_text(json.dumps(results))
        return results
    monkeypatch.setattr(sweep, "_run_or_load", run)


def _sweep(tmp_path: Path, *overrides: str, section: dict[str, Any] | None = None) -> dict[str, Any]:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**BASE, "sweep": {**BASE["sweep"], **(section or {})}}))
    return sweep.run_sweep(path, list(overrides), out_dir=tmp_path / "out", progress=False)


@pytest.mark.parametrize(("section", "message"), [
    ({"seeds": [0, 0]}, "sweep.seeds: .*0 is listed twice"),
    ({"targets": ["uci", "uci"]}, "sweep.targets.*uci is listed twice"),
    ({"seeds": []}, "sweep.seeds: .*at least 1 item"),
    ({"targets": []}, "sweep.targets.*at least 1 item"),
    ({"variants": {}}, "sweep.variants: .*at least 1 item"),
    ({"targets": "uci"}, "sweep.targets"),  # a string other than 'all': formerly its letters were targets
    ({"pairs": [["uci", "mnist"]]}, "sweep.pairs are .* of split.protocol ltdo, not lodo"),
    ({"variants": {"Wide #1": {}, "Wide #2": {"method.name": "fedprox"}}}, "sweep variant 'Wide #1': a name ending"),
])
def test_a_spec_that_would_miscount_runs_is_refused_in_one_line_before_any_run(tmp_path, stand_in_runs, section,
                                                                               message):
    with pytest.raises(ConfigError, match=message) as err:
        _sweep(tmp_path, section=section)
    assert "\n" not in str(err.value).strip() and not (tmp_path / "out").exists()


def test_ltdo_takes_pairs_not_targets(tmp_path, stand_in_runs):
    with pytest.raises(ConfigError, match="split.protocol ltdo takes sweep.pairs"):
        _sweep(tmp_path, "split.protocol=ltdo", "data.domains=[mnist,uci,svhn]")
    res = _sweep(tmp_path, "split.protocol=ltdo", "data.domains=[mnist,uci,svhn]",
                 section={"targets": "all", "pairs": [["mnist", "uci"]]})
    assert {r["target"] for r in res["rows"]} == {"mnist→uci"}


def test_a_rerun_leaves_no_table_of_the_sweep_before(tmp_path, stand_in_runs):
    out = tmp_path / "out"
    _sweep(tmp_path, "sweep.selection=[train_domain,oracle,last]", "sweep.metrics=[ood_acc,id_acc,time_total_s]")
    assert (out / "table_ood_acc_oracle.md").is_file() and (out / "table_time_total_s.csv").is_file()
    _sweep(tmp_path, "federation.rounds=3")  # other rules and metrics: nothing of the first sweep's stays
    assert not list(out.glob("table_*oracle*")) and not list(out.glob("table_time_total_s*"))
    assert json.loads((out / "sweep.json").read_text())["selection"] == ["train_domain", "last"]
    report = sweep_report(out).read_text()
    assert "oracle" not in report and "time_total_s" not in report


def test_an_interrupted_rerun_reports_no_figure_of_the_run_before(tmp_path, stand_in_runs, monkeypatch):
    out = tmp_path / "out"
    _sweep(tmp_path)
    assert (out / "runs.jsonl").is_file()

    def killed(*args: Any) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(sweep, "_run_or_load", killed)
    with pytest.raises(KeyboardInterrupt):
        _sweep(tmp_path, "federation.rounds=3")
    assert not (out / "runs.jsonl").exists() and not list(out.glob("table*"))  # the report reads the runs' own


def test_a_figure_other_than_the_tasks_metric_keeps_its_own_interval_and_has_no_rule_table(tmp_path, stand_in_runs):
    out = tmp_path / "out"
    _sweep(tmp_path, "sweep.metrics=[ood_acc,time_total_s]")
    row = next(csv.DictReader((out / "table_time_total_s.csv").open()))
    lo, hi = ci95(list(SECONDS.values()))  # [260.3, 359.7]: clipped to accuracy's 0-100 it read [260.3, 100]
    assert float(row["ci95_low"]) == pytest.approx(lo, abs=1e-3) and float(row["ci95_high"]) == pytest.approx(hi, abs=1e-3)
    assert "not a figure of the evaluated rounds" in (out / "table_time_total_s_train_domain.md").read_text()
    assert not (out / "table_time_total_s_train_domain.csv").exists()
    acc = next(csv.DictReader((out / "table_ood_acc.csv").open()))
    assert float(acc["ci95_high"]) <= 100.0  # the metric's own interval stays clipped to its bounds


def test_a_metric_no_run_reports_is_refused_naming_the_figures(tmp_path, stand_in_runs):
    with pytest.raises(ConfigError, match=r"sweep.metrics: no run reports 'bogus' .*figures: .*ood_acc"):
        _sweep(tmp_path, "sweep.metrics=[ood_acc,bogus]")


def test_a_per_domain_metric_gets_a_table_file_of_its_own(tmp_path, monkeypatch, stand_in_runs):
    out = tmp_path / "out"
    original = sweep._run_or_load

    def with_domain(cfg, run_dir, progress):
        res = original(cfg, run_dir, progress)
        res["final"]["ood_acc/uci"] = res["final"]["ood_acc"]
        return res
    monkeypatch.setattr(sweep, "_run_or_load", with_domain)
    _sweep(tmp_path, "sweep.metrics=[ood_acc/uci]", "sweep.selection=[last]")
    row = next(csv.DictReader((out / "table_ood_acc_uci.csv").open()))
    assert (row["target"], row["mean"], row["n"]) == ("uci", "42.000", "3")
    assert "ood_acc/uci" in sweep_report(out).read_text()


def test_bounds_belong_to_the_tasks_own_keys():
    task = TaskInfo.of(TASK)
    assert task.bounds_of("ood_acc") == task.bounds_of("id_acc/uci") == (0.0, 100.0)
    assert task.bounds_of("time_total_s") is None and task.bounds_of("ood_macro_f1") is None


def test_a_refusal_only_the_data_can_make_names_its_cell(tmp_path, monkeypatch, stand_in_runs):
    original = sweep._run_or_load

    def few_shot(cfg, run_dir, progress):
        if cfg.split.few_shot_k:  # as the data set-up refuses it: more target samples than the domain has
            raise ValueError(f"split.few_shot_k={cfg.split.few_shot_k} for 4 clients needs more target samples")
        return original(cfg, run_dir, progress)
    monkeypatch.setattr(sweep, "_run_or_load", few_shot)
    with pytest.raises(ConfigError, match=r"^sweep variant 'B', target uci, seed 0: split.few_shot_k=9999 for 4"):
        _sweep(tmp_path, section={"variants": {"A": {}, "B": {"split.few_shot_k": 9999}}})


def test_a_row_without_the_metric_adds_no_value_to_its_cell_nor_a_seed_to_the_average():
    from feddg.evaluation.tables import csv_table, pivot

    rows = [{"variant": "A", "target": "t", "seed": 0, "ood_acc": 80.0},
            {"variant": "A", "target": "t", "seed": 1}]  # seed 1 reported no ood figure (e.g. a federated split)
    assert pivot(rows, "ood_acc")[2] == {("A", "t"): [80.0]}
    lines = list(csv.reader(csv_table(rows).splitlines()))
    assert [line[:7] for line in lines[1:]] == [["A", "t", "80.000", "", "", "", "1"], ["A", "avg", "80.000", "", "", "", "1"]]


def test_the_html_table_clips_intervals_to_the_bounds_and_marks_a_degraded_variants_average():
    from feddg.reports.sweep import AVG, table

    rows = [{"variant": "A", "target": t, "seed": s, "ood_acc": v, "dropped": int(t == "uci" and s == 1)}
            for t, vals in (("uci", (99.0, 100.0)), ("svhn", (50.0, 60.0))) for s, v in enumerate(vals)]
    out = table(rows, "ood_acc", TaskInfo.of(TASK))
    assert out["columns"] == ["uci", "svhn", AVG] and out["degraded"]
    (variant, cells_), = out["rows"]
    uci, svhn, avg = cells_
    assert variant == "A"
    assert uci[0].hi == 100.0 and uci[0].lo == pytest.approx(ci95([99.0, 100.0])[0])  # the t interval reaches 105.9
    assert [c[2] for c in cells_] == [True, False, True]  # the average over targets holds the degraded run too
    assert avg[0].values == (74.5, 80.0)


def test_curves_draw_only_the_rounds_every_seed_evaluated(tmp_path):
    from feddg.reports.sweep import curves

    rows = []
    for seed, rounds in ((0, (1, 2, 3)), (1, (2, 3))):  # seed 1 has no round-1 figure
        run_dir = tmp_path / f"seed{seed}"
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"round": r, "ood_acc": 10.0 * r + seed}) + "\n"
                                                       for r in rounds))
        rows.append({"variant": "A", "target": "uci", "seed": seed, "run_dir": str(run_dir), "ood_acc": 30.0 + seed})
    line = curves(rows, "ood_acc", TaskInfo.of(TASK)).axes[0].lines[0]
    assert list(line.get_xdata()) == [2, 3] and list(line.get_ydata()) == [20.5, 30.5]


def test_a_sweep_with_named_metrics_reports_only_those(tmp_path, stand_in_runs, monkeypatch):
    import feddg.reports.sweep as report

    drawn, bars = [], report.bars
    monkeypatch.setattr(report, "bars", lambda rows, metric, task: drawn.append(metric) or bars(rows, metric, task))
    _sweep(tmp_path, "sweep.metrics=[ood_acc]")
    sweep_report(tmp_path / "out")
    assert drawn == ["ood_acc"]  # the runs' id_acc is not tabled, so it gets no section


def test_all_targets_of_a_dataset_whose_domains_are_discovered_is_refused_but_named_targets_run(tmp_path, stand_in_runs,
                                                                                               monkeypatch):
    monkeypatch.setattr(sweep, "dataset_info", lambda name: {"domains": []})  # natural clients: found in the data
    with pytest.raises(ConfigError, match="^sweep over 'all' targets needs data.domains for digits-dg$"):
        _sweep(tmp_path, section={"targets": "all"})
    assert {r["target"] for r in _sweep(tmp_path)["rows"]} == {"uci"}


@pytest.fixture
def finished_cell(tmp_path, monkeypatch):
    """A cell folder whose stored config hash is the current one; ``run_experiment`` records how it is called."""
    cell = tmp_path / "cell"
    cell.mkdir()
    (cell / "results.json").write_text(json.dumps({"final": {"ood_acc": 1.0}}))
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(sweep, "stored_config_hash", lambda run_dir: "h")
    monkeypatch.setattr(sweep, "config_hash", lambda cfg: "h")
    monkeypatch.setattr(sweep, "changed_inputs", lambda run_dir, cfg: [])
    monkeypatch.setattr(sweep, "run_experiment", lambda cfg, run_dir, **kw: calls.append(kw) or {"final": {}})
    return cell, calls


def test_a_finished_cell_whose_input_files_changed_is_rerun_from_scratch(finished_cell, monkeypatch, capsys):
    cell, calls = finished_cell
    assert sweep._run_or_load(None, cell, False) == {"final": {"ood_acc": 1.0}} and calls == []  # loaded as it is
    monkeypatch.setattr(sweep, "changed_inputs", lambda run_dir, cfg: ["data.root"])
    sweep._run_or_load(None, cell, False)
    assert calls == [{"overwrite": True, "progress": False}]
    assert "the files of data.root changed since it ran" in capsys.readouterr().err.replace("\n", "")


def test_a_checkpoint_that_cannot_be_resumed_reruns_the_cell_from_scratch(finished_cell, monkeypatch, capsys):
    cell, calls = finished_cell
    (cell / "results.json").unlink()  # interrupted: a checkpoint, no results

    def unreadable(run_dir, cfg, argv):
        raise sweep.CheckpointError("checkpoint.pt is truncated")
    monkeypatch.setattr(sweep, "has_checkpoint", lambda run_dir: True)
    monkeypatch.setattr(sweep, "record_resume", unreadable)
    sweep._run_or_load(None, cell, False)
    assert calls == [{"overwrite": True, "progress": False}]
    assert f"rerunning {cell} from scratch: checkpoint.pt is truncated" in capsys.readouterr().err.replace("\n", "")
