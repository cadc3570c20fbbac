"""What the commands do with their input: the tables and lines they print (values checked by hand), and what their
glue hands on to the library (run, eval, report, datasets, export, bench, flower, audit), with the heavy work stubbed."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import typer
from support.tables import rendered, text_rows
from typer.testing import CliRunner, Result

from feddg import cli
from feddg.cli import _counts_table, _pin_kernels, _run_dir_mode, app, communication_table, privacy_line, results_table
from feddg.config import AuditConfig, build_config, dump_config
from feddg.reproducibility import PORTABLE_ENV
from feddg.tasks import TaskInfo

DICE = {"name": "segmentation", "metric": "dice", "label": "Dice", "unit": "%", "bounds": [0, 100],
        "higher_is_better": True}
ACC = {"name": "classification", "metric": "acc", "label": "accuracy", "unit": "%", "bounds": [0, 100],
       "higher_is_better": True, "chance": 10.0}


def _feddg(*args: str) -> Result:
    res = CliRunner().invoke(app, list(args))
    assert "Traceback" not in res.output, res.output
    return res


def _record(store: list[Any], value: Any = None) -> Any:
    """A stub that appends its arguments to ``store`` and returns ``value``."""
    def stub(*args: Any, **kwargs: Any) -> Any:
        store.append((args, kwargs))
        return value
    return stub


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The modes the command asked exec_pinned for (it never re-executes the test)."""
    calls: list[Any] = []
    monkeypatch.setattr("feddg.reproducibility.exec_pinned", _record(calls))
    return calls


# results_table / communication_table / privacy_line


def test_results_table_reads_the_results_task_block_and_lists_domains_then_means() -> None:
    final = {"id_dice/a": 81.234, "ood_dice/c": 70.0, "id_dice/b": 60.0, "id_dice": 70.617, "ood_dice": 70.0,
             "id_acc/a": 12.0, "train_loss": 0.5, "id_slice_dice/a": 1.0}  # other metrics' keys are left out
    res = {"dataset": "digits-dg", "method": "fedavg", "method_label": "FedAvg (lr 0.1)", "target": ["c"],
           "task": {**DICE, "extra_metrics": ["slice_dice"]}, "final": final}
    table = results_table(res)
    assert table.title == "FedAvg (lr 0.1) on digits-dg (held out: c)"
    assert text_rows(rendered(table)) == [["domain", "role", "Dice (%)"], ["a", "id", "81.23"], ["c", "ood", "70.00"],
                                          ["b", "id", "60.00"], ["mean", "id", "70.62"], ["mean", "ood", "70.00"]]


def test_results_table_without_a_task_block_takes_the_datasets_task() -> None:
    res = {"dataset": "digits-dg", "method": "fedavg", "target": [], "final": {"id_acc/mnist": 50.0, "id_acc": 50.0}}
    table = results_table(res)
    assert table.title == "fedavg on digits-dg (every domain trains)"
    # FedAvg clients under HFedATM stations are not a flat FedAvg run: the title names the station merge
    assert results_table({**res, "hierarchy": {"merge": "hfedatm"}}).title == (
        "fedavg+hfedatm on digits-dg (every domain trains)")
    assert text_rows(rendered(table)) == [["domain", "role", "accuracy (%)"], ["mnist", "id", "50.00"],
                                          ["mean", "id", "50.00"]]


def test_results_table_of_an_unknown_dataset_without_a_task_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as stop:
        results_table({"dataset": "nope", "method": "fedavg", "target": [], "final": {}})
    assert stop.value.exit_code == 2 and "results of nope: unknown task" in capsys.readouterr().out


def test_communication_table_gives_kib_per_key() -> None:
    table = communication_table({"bytes_per_round": {"bytes_up": 2048.0, "hfl/bytes_station_down": 1536.0,
                                                     "bytes_down": 3 * 1024 * 1024.0}})
    assert text_rows(rendered(table)) == [["what", "KiB"], ["bytes_up", "2.00"], ["hfl/bytes_station_down", "1.50"],
                                          ["bytes_down", "3,072.00"]]
    assert text_rows(rendered(communication_table({}))) == [["what", "KiB"]]


def test_privacy_line_puts_each_field_of_the_record_in_its_place() -> None:
    rec = {"epsilon": 1.234567, "delta": 1e-5, "releases": 7, "accountant": "rdp", "unit": "sample",
           "noise_multiplier": 0.8, "clip": 2.5}
    assert privacy_line("Gram matrices", rec) == (
        "privacy of the Gram matrices: ε = 1.235 at δ = 1e-05 over 7 release(s) (rdp accountant, per sample, "
        "noise multiplier 0.8, clip 2.5)")


# _counts_table


def test_counts_table_has_a_column_per_domain_and_a_total_row_for_classes() -> None:
    counts = {"a": {"cat": 3, "dog": 5}, "b": {"cat": 0, "dog": 7}}
    assert text_rows(rendered(_counts_table(counts, ["b", "a"], "images"))) == [
        ["class", "b", "a"], ["cat", "0", "3"], ["dog", "7", "5"], ["total", "7", "8"]]
    slices = {"A": {"Case00": 20, "Case01": 24}}  # cases and their slices: no total row, no "class" header
    assert text_rows(rendered(_counts_table(slices, ["A"], "slices"))) == [["", "A"], ["Case00", "20"], ["Case01", "24"]]


def test_counts_table_of_many_domains_gives_total_min_median_max_per_row() -> None:
    domains = [f"d{k}" for k in range(13)]  # one past MAX_DOMAIN_COLUMNS (12)
    counts = {d: {"x": k + 1, "y": 2 * k} for k, d in enumerate(domains)}
    # x: 1..13, sum 91, median 7; y: 0,2,..,24, sum 156, median 12; total per domain 3k+1: 1..37, sum 247, median 19
    assert text_rows(rendered(_counts_table(counts, domains, "images"))) == [
        ["class", "total (13 domains)", "min", "median", "max"], ["x", "91", "1", "7", "13"],
        ["y", "156", "0", "12", "24"], ["total", "247", "1", "19", "37"]]
    even = {d: {"x": k} for k, d in enumerate(domains[:12])}  # 12 domains still get a column each
    assert text_rows(rendered(_counts_table(even, domains[:12], "images")))[0] == ["class", *domains[:12]]
    many = {d: {"x": k} for k, d in enumerate(domains + ["d13"])}  # 14: median of 0..13 is 6.5
    assert text_rows(rendered(_counts_table(many, [*domains, "d13"], "images")))[1] == ["x", "91", "0", "6.5", "13"]


# _run_dir_mode / _pin_kernels


def test_run_dir_mode_reads_the_config_and_falls_back_to_native(tmp_path: Path) -> None:
    assert _run_dir_mode(tmp_path) == "native"  # no config.yaml
    (tmp_path / "config.yaml").write_text("reproducibility: portable\n")
    assert _run_dir_mode(tmp_path) == "portable"
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    assert _run_dir_mode(tmp_path) == "native"
    (tmp_path / "config.yaml").write_text("reproducibility: [portable]\n")
    assert _run_dir_mode(tmp_path) == "native"
    (tmp_path / "config.yaml").write_text("reproducibility: portable\nseed: [\n")  # not YAML
    assert _run_dir_mode(tmp_path) == "native"


def test_pin_kernels_pins_only_for_portable(pinned: list[Any]) -> None:
    for mode in ("portable", "native", "Portable"):
        _pin_kernels(mode)
    assert [args for args, _ in pinned] == [("portable",), ("native",), ("native",)]


# run


def _results(run_dir: Path) -> dict[str, Any]:
    dp = {"epsilon": 2.5, "delta": 1e-5, "releases": 3, "accountant": "rdp", "unit": "client", "noise_multiplier": 1.1,
          "clip": 1.0}
    return {"run_dir": str(run_dir), "dataset": "digits-dg", "method": "fedavg", "target": ["uci"], "task": ACC,
            "final": {"ood_acc/uci": 41.5, "ood_acc": 41.5}, "bytes_per_round": {"bytes_up": 4096.0},
            "privacy": {**dp, "epsilon": 0.75}, "hierarchy": {"privacy": {**dp, "epsilon": 9.5}},
            "weights_privacy": {**dp, "epsilon": None, "noise_multiplier": 0.0}}


@pytest.fixture
def training(monkeypatch: pytest.MonkeyPatch, pinned: list[Any]) -> dict[str, list[Any]]:
    """run_experiment, resume_experiment, method_figures and the audit stubbed: what each was given."""
    calls: dict[str, list[Any]] = {"run": [], "figures": [], "audit": [], "pin": pinned}

    def run(cfg: Any, run_dir: Path, **kw: Any) -> dict[str, Any]:
        calls["run"].append((cfg, run_dir, kw))
        return _results(run_dir)

    def audit(*args: Any) -> Path:
        calls["audit"].append(args)
        return Path(args[0]) / "audit.json"

    monkeypatch.setattr("feddg.experiment.run_experiment", run)
    monkeypatch.setattr("feddg.reports.run.method_figures", _record(calls["figures"]))
    monkeypatch.setattr(cli, "_audit_with_bar", audit)
    return calls


def test_run_hands_the_config_and_flags_on_and_prints_figures_bytes_and_each_epsilon(
        tmp_path: Path, training: dict[str, list[Any]]) -> None:
    weights = tmp_path / "w.pth"
    weights.write_bytes(b"")
    res = _feddg("run", "configs/demo.yaml", "-o", "reproducibility=portable", "-o", "federation.rounds=2",
                 "--engine", "inprocess", "--weights", str(weights), "--run-dir", str(tmp_path / "r"), "--overwrite",
                 "--quiet")
    assert res.exit_code == 0, res.output
    [(cfg, run_dir, kw)] = training["run"]
    assert run_dir == tmp_path / "r" and kw == {"overwrite": True, "progress": False}
    assert cfg.federation.rounds == 2 and cfg.federation.engine == "inprocess" and cfg.model.weights == str(weights)
    assert training["pin"] == [(("portable",), {})]
    assert training["figures"] == [((str(tmp_path / "r"),), {})] and training["audit"] == []  # no audit: section
    assert ["uci", "ood", "41.50"] in text_rows(res.output) and ["bytes_up", "4.00"] in text_rows(res.output)
    lines = res.output.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("privacy of")] == [
        "privacy of the shared statistics", "privacy of the Gram matrices"]  # the weights' ε is null: no line
    assert any(line.startswith("privacy of the shared statistics: ε = 0.75 at") for line in lines)
    assert any(line.startswith("privacy of the Gram matrices: ε = 9.5 at") for line in lines)
    assert lines[-1] == f"run directory: {tmp_path / 'r'}"
    again = _feddg("run", "configs/demo.yaml", "--run-dir", str(tmp_path / "n"))  # defaults: progress, no overwrite
    assert again.exit_code == 0 and training["run"][1][2] == {"overwrite": False, "progress": True}
    assert training["pin"][1] == (("native",), {})


def test_run_audits_with_the_configs_audit_section(tmp_path: Path, training: dict[str, list[Any]]) -> None:
    res = _feddg("run", "configs/demo.yaml", "-o", "audit.per_client=5", "--run-dir", str(tmp_path / "r"))
    assert res.exit_code == 0, res.output
    assert training["audit"] == [(tmp_path / "r", AuditConfig(per_client=5), False)]
    assert f"privacy audit: wrote {tmp_path / 'r' / 'audit.json'}" in res.output


def test_a_resume_pins_the_run_dirs_kernels_passes_its_overrides_and_audits_with_its_section(
        tmp_path: Path, training: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    cfg = build_config({"reproducibility": "portable", "audit": {"per_client": 3}})
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    resumed: list[Any] = []

    def resume(path: Path, overrides: list[str], progress: bool) -> dict[str, Any]:
        resumed.append((path, overrides, progress))  # a finished run says resumed: false; a resumed one no "resumed"
        return {**_results(path), "resumed": False} if len(resumed) == 1 else _results(path)

    monkeypatch.setattr("feddg.experiment.resume_experiment", resume)
    res = _feddg("run", "--resume", str(run_dir), "-o", "federation.rounds=9", "--quiet")
    assert res.exit_code == 0, res.output
    assert resumed == [(run_dir, ["federation.rounds=9"], False)] and training["pin"] == [(("portable",), {})]
    assert "finished all its rounds already" in res.output  # resumed: false
    assert training["audit"] == [(run_dir, AuditConfig(per_client=3), True)]  # the run's own audit: section
    res = _feddg("run", "--resume", str(run_dir))
    assert res.exit_code == 0 and "finished all its rounds" not in res.output and resumed[1][2] is True


# report / eval


def test_report_prints_the_results_table_and_every_file_but_the_page(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    page, figure = tmp_path / "report.html", tmp_path / "curves.png"
    asked: list[Any] = []
    monkeypatch.setattr("feddg.reports.run.report", _record(asked, [page, figure]))
    res = _feddg("report", str(tmp_path))  # no results.json: no table
    assert res.exit_code == 0 and asked == [((tmp_path,), {})] and text_rows(res.output) == []
    assert f"wrote {figure}" in res.output and f"wrote {page}" not in res.output
    assert res.output.splitlines()[-1] == f"report: {page.resolve().as_uri()}"
    (tmp_path / "results.json").write_text(json.dumps(_results(tmp_path)))
    assert ["uci", "ood", "41.50"] in text_rows(_feddg("report", str(tmp_path)).output)


def test_eval_hands_its_options_on_and_tables_each_domain_with_the_global_model(
        tmp_path: Path, pinned: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.yaml").write_text("reproducibility: portable\n")
    role = "extra/digits-dg"
    metrics = {f"{role}_acc/a": 10.0, f"{role}_acc/b": 30.0, f"{role}_acc": 20.0,
               f"{role}_global_acc/a": 11.0, f"{role}_global_acc/b": 33.0, f"{role}_global_acc": 22.0}
    target = SimpleNamespace(dataset=SimpleNamespace(domains=["a", "b"]))
    asked: list[Any] = []
    monkeypatch.setattr("feddg.federation.extra_eval.evaluate_run",
                        _record(asked, (metrics, target, 4, TaskInfo.of(ACC))))
    res = _feddg("eval", str(tmp_path), "--dataset", "digits-dg", "--domains", "a,b", "--domains", "c",
                 "--max-per-domain", "7", "--root", "/data", "--device", "cpu")
    assert res.exit_code == 0, res.output
    [((run_dir, spec, device), options)] = asked
    assert run_dir == tmp_path and device == "cpu" and pinned == [(("portable",), {})]
    assert options == {"where": "--dataset digits-dg"}  # a refusal names the option the user typed
    assert (spec.dataset, spec.domains, spec.max_per_domain, spec.root) == ("digits-dg", ["a", "b", "c"], 7, "/data")
    assert text_rows(res.output)[1:] == [["a", "10.00", "11.00"], ["b", "30.00", "33.00"], ["mean", "20.00", "22.00"]]
    shared = {k: v for k, v in metrics.items() if "_global" not in k}  # a shared model: one column
    monkeypatch.setattr("feddg.federation.extra_eval.evaluate_run", _record(asked, (shared, target, 4, TaskInfo.of(ACC))))
    res = _feddg("eval", str(tmp_path), "--dataset", "digits-dg")
    assert text_rows(res.output) == [["domain", "accuracy (%)"], ["a", "10.00"], ["b", "30.00"], ["mean", "20.00"]]
    assert asked[1][0][1].domains is None and asked[1][0][2] is None


# datasets / export / env


def test_datasets_lists_which_need_a_root() -> None:
    res = CliRunner().invoke(app, ["datasets"], env={"COLUMNS": "250"})
    needs = {row[0]: row[-1] for row in text_rows(res.output)}
    assert needs["pacs"] == "yes" and needs["folder"] == "yes" and needs["digits-dg"] == "no"


def test_export_synthetic_mri_refuses_a_cache_dir_alone(tmp_path: Path) -> None:
    res = _feddg("export", "synthetic-mri", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c"))
    assert res.exit_code == 2 and "takes no --max-per-domain or --cache-dir" in res.output
    assert not (tmp_path / "out").exists()


def test_export_hands_its_options_to_export_dataset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []
    monkeypatch.setattr("feddg.data.export.export_dataset", _record(asked, 12))
    res = _feddg("export", "digits-dg", str(tmp_path / "o"), "--cache-dir", "/c", "--image-size", "20",
                 "--max-per-domain", "3")
    assert res.exit_code == 0 and "wrote 12 PNGs" in res.output
    assert asked == [(("digits-dg", tmp_path / "o"), {"cache_dir": "/c", "image_size": 20, "max_per_domain": 3})]


def test_env_portable_exports_each_pinned_variable() -> None:
    res = _feddg("env", "portable")
    assert res.exit_code == 0
    for key, value in PORTABLE_ENV.items():
        assert f"export {key}='{value}'" in res.output.splitlines()


# bench


def test_bench_memory_hands_the_parsed_counts_on(monkeypatch: pytest.MonkeyPatch) -> None:
    fold: list[Any] = []
    store: list[Any] = []
    monkeypatch.setattr("feddg.bench.memory.fold_memory_table", _record(fold, "fold table"))
    monkeypatch.setattr("feddg.bench.store_memory.store_memory_report", _record(store, ["store line"]))
    res = _feddg("bench", "memory", "--params", "10", "--clients", "3, 5", "--max-list-mb", "2.5")
    assert res.exit_code == 0 and "fold table" in res.output and fold == [((10, [3, 5], 2.5), {})]
    res = _feddg("bench", "memory", "--params", "10", "--per-client", "4,8", "--budgets-mb", "none,0,16")
    assert res.exit_code == 0 and "store line" in res.output and store == [(([4, 8], 10, [None, 0.0, 16.0]), {})]
    assert len(fold) == 1  # --per-client measures the store instead


def test_bench_w1_runs_plain_first_once_and_the_variants_given(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []
    monkeypatch.setattr("feddg.bench.w1.w1_report", _record(asked, ["w1 line"]))
    res = _feddg("bench", "w1", "--variants", " 2,plain,,1 ", "--repeats", "4", "--images", "9", "--load", "1")
    assert res.exit_code == 0 and "w1 line" in res.output
    assert asked == [((4, 9, ["plain", "2", "1"], 1), {})]


def test_bench_data_hands_digits_settings_in_order_or_none(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []
    monkeypatch.setattr("feddg.bench.data.data_report", _record(asked, []))
    assert _feddg("bench", "data", "--images", "5", "--size", "6", "--repeats", "2", "--threads", "3",
                  "--loader-workers", "1", "--digits-rounds", "7", "--digits-max-per-domain", "8",
                  "--digits-seeds", "9").exit_code == 0
    assert _feddg("bench", "data", "--no-digits").exit_code == 0
    assert asked == [((5, 6, 2, 3, 1, (7, 8, 9)), {}), ((2100, 224, 3, 1, 0, None), {})]


def test_bench_models_engine_scale_and_portable_hand_their_options_on(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, list[Any]] = {k: [] for k in ("models", "loops", "engine", "scale", "portable")}
    monkeypatch.setattr("feddg.bench.throughput.models_table", _record(calls["models"], "t"))
    monkeypatch.setattr("feddg.bench.throughput.loops_table", _record(calls["loops"], "t"))
    monkeypatch.setattr("feddg.bench.throughput.engine_table", _record(calls["engine"], "t"))
    monkeypatch.setattr("feddg.bench.scale.scale_report", _record(calls["scale"], []))
    monkeypatch.setattr("feddg.bench.portable.portable_table", _record(calls["portable"], "t"))
    common = ["--names", "cnn@28,lenet@28", "--threads", "1", "--seconds", "0.5", "--batch", "4", "--repeats", "2"]
    assert _feddg("bench", "models", *common).exit_code == 0
    assert _feddg("bench", "models", *common, "--feddg", "--steps", "6").exit_code == 0
    assert calls["models"] == [((["cnn@28", "lenet@28"], 1, 0.5, 4, 2), {})]
    assert calls["loops"] == [((["cnn@28", "lenet@28"], 1, 0.5, 4, 2, 6), {})]
    assert _feddg("bench", "engine", "c.yaml", "-o", "seed=1", "--engines", "workers,flower").exit_code == 0
    assert calls["engine"] == [((Path("c.yaml"), ["seed=1"], ["workers", "flower"]), {})]
    assert _feddg("bench", "scale").exit_code == 0
    assert _feddg("bench", "scale", "a.yaml", "b.yaml", "--rounds", "3", "--repeats", "1", "-o", "seed=2").exit_code == 0
    assert calls["scale"] == [(([Path("configs/scale/femnist-scale.yaml"), Path("configs/scale/writers-scale.yaml"),
                                 Path("configs/scale/iwildcam-scale.yaml")], 2, [], 2), {}),
                              (([Path("a.yaml"), Path("b.yaml")], 3, ["seed=2"], 1), {})]
    assert _feddg("bench", "portable", "c.yaml", "--repeats", "2", "-o", "a=1", "-o", "b=2").exit_code == 0
    assert calls["portable"] == [((Path("c.yaml"), 2, ["-o", "a=1", "-o", "b=2"]), {})]


def test_bench_portable_reports_a_failed_run_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any) -> None:
        raise RuntimeError("the portable run failed: boom")

    monkeypatch.setattr("feddg.bench.portable.portable_table", fail)
    res = _feddg("bench", "portable")
    assert res.exit_code == 2 and res.output.strip() == "error: the portable run failed: boom"


# flower


def test_flower_run_submits_the_config_and_exits_1_on_a_failure(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    outcomes = iter([None, "the run stopped: status failed"])
    asked: list[Any] = []

    def submit(*args: Any, resume: bool) -> str | None:
        asked.append((*args, resume))
        return next(outcomes)

    monkeypatch.setattr("feddg.engines.flower.launch.submit", submit)
    args = ["flower", "run", "configs/demo.yaml", "--run-dir", str(tmp_path), "--connection", "lab",
            "-o", "federation.rounds=3"]
    ok = _feddg(*args)
    assert ok.exit_code == 0 and ok.output.strip() == f"run directory: {tmp_path}"
    [(cfg, run_dir, connection, app_dir, resume)] = asked
    assert cfg.federation.rounds == 3 and (run_dir, connection, app_dir) == (tmp_path, "lab", Path("flower"))
    assert resume is False
    failed = _feddg(*args, "--app-dir", "app")
    assert failed.exit_code == 1 and failed.output.strip() == "error: the run stopped: status failed"
    assert asked[1][3] == Path("app")


def test_flower_run_resume_submits_the_runs_own_config_or_says_it_finished(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[Any] = []
    prepared: list[Any] = []
    config = build_config({}, ["federation.rounds=9"])
    monkeypatch.setattr("feddg.engines.flower.launch.submit", lambda *a, resume: asked.append((*a, resume)))
    monkeypatch.setattr("feddg.experiment.prepare_resume",
                        lambda run, o, restart: prepared.append((run, o)) or config)
    ok = _feddg("flower", "run", "--resume", str(tmp_path), "--connection", "lab", "-o", "federation.rounds=9")
    assert ok.exit_code == 0 and ok.output.strip() == f"run directory: {tmp_path}"
    assert prepared == [(tmp_path, ["federation.rounds=9"])]
    assert asked == [(config, tmp_path, "lab", Path("flower"), True)]
    monkeypatch.setattr("feddg.experiment.prepare_resume", lambda run, o, restart: None)  # finished, nothing to grow
    done = _feddg("flower", "run", "--resume", str(tmp_path), "--connection", "lab")
    assert done.exit_code == 0 and " ".join(done.output.split()) == (
        f"{tmp_path} finished all its rounds already: nothing resumed (grow it with -o federation.rounds=N)")
    assert len(asked) == 1
    both = _feddg("flower", "run", "configs/demo.yaml", "--resume", str(tmp_path), "--connection", "lab")
    assert both.exit_code == 2 and " ".join(both.output.split()) == (
        "error: --resume continues a run with its own config.yaml: drop CONFIG (-o changes the keys a resume may "
        "change)")
    monkeypatch.undo()
    (tmp_path / "config.yaml").write_text(dump_config(config))  # a run that stopped before its first checkpoint
    early = _feddg("flower", "run", "--resume", str(tmp_path), "--connection", "lab")
    assert early.exit_code == 2 and " ".join(early.output.split()) == (
        f"error: nothing to resume in {tmp_path}: it has no checkpoint (it stopped before its first round ended); "
        "start it again into a new --run-dir")
    neither = _feddg("flower", "run", "configs/demo.yaml", "--connection", "lab")
    assert neither.exit_code == 2 and neither.output.strip() == "error: give a config file and --run-dir, or --resume RUN_DIR"


def test_flower_keys_prints_each_pairs_paths_and_its_public_keys_sha256(tmp_path: Path) -> None:
    res = _feddg("flower", "keys", str(tmp_path), "--node", "n1", "--node", "n2")
    assert res.exit_code == 0, res.output
    expected = []
    for name in ("n1", "n2"):
        blob = base64.b64decode((tmp_path / f"{name}.pub").read_text().split()[1])  # OpenSSH: type, base64 blob
        digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
        expected += [str(tmp_path / name), str(tmp_path / f"{name}.pub"), f"SHA256:{digest}"]
    assert res.output.split() == expected  # long paths wrap: compare word by word


# audit privacy


@pytest.fixture
def audit_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[Any]]:
    """A run directory whose config has an audit: section, and the settings the (stubbed) audit got."""
    cfg = build_config({"method": {"name": "ccst"}, "audit": {"attacks": ["sample-style"], "per_client": 4,
                                                              "noise_multipliers": [0.0, 1.0], "seed": 3}})
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    got: list[Any] = []

    def audit(run_dir: Path, settings: Any, step: Any) -> Path:
        got.append(settings)
        step("rebuilding the run")
        step("sample-style, third-party")
        return run_dir / "audit" / "privacy.json"

    monkeypatch.setattr("feddg.audit.privacy.audit_privacy", audit)
    return tmp_path, got


def test_audit_options_override_the_runs_section_and_unset_ones_keep_it(audit_run: tuple[Path, list[Any]]) -> None:
    run_dir, got = audit_run
    res = _feddg("audit", "privacy", str(run_dir), "--noise", "0.5", "--per-client", "2", "--no-fid")
    assert res.exit_code == 0 and f"wrote {run_dir / 'audit' / 'privacy.json'}" in res.output, res.output
    s = got[0]
    assert (s.noise_multipliers, s.per_client, s.fid) == ([0.5], 2, False)  # given
    assert (s.attacks, s.seed, s.generator_steps, s.style_path) == (["sample-style"], 3, 300, None)  # the run's
    assert _feddg("audit", "privacy", str(run_dir), "--steps", "7", "--seed", "0", "--style-path",
                  "feature").exit_code == 0
    assert (got[1].generator_steps, got[1].seed, got[1].style_path, got[1].per_client) == (7, 0, "feature", 4)


def test_audit_attack_all_chooses_every_attack(audit_run: tuple[Path, list[Any]]) -> None:
    run_dir, got = audit_run
    assert _feddg("audit", "privacy", str(run_dir), "--attack", "all").exit_code == 0
    assert got[0].attacks == ["sample-style", "client-style", "fedfa-moments", "fpl-prototypes", "gram", "update-dlg"]
    assert _feddg("audit", "privacy", str(run_dir), "--attack", "gram", "--attack", "update-dlg").exit_code == 0
    assert got[1].attacks == ["gram", "update-dlg"]
