"""Nothing changes without a record (issue 23): dropped clients in results, tables and reports; overrides that merge
and say which value won; sweeps that refuse colliding folders or name an invalid cell; --overwrite that keeps what
feddg did not write; resumes that refuse or say there is nothing to do; interrupts and full disks that say where the
run is; runs that would have no id figures; reports that cannot mislead in small cases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import pytest
import yaml
from toy import toy_federation

from feddg.algorithms.base import Reply
from feddg.config import ConfigError, build_config, load_config
from feddg.engines.inprocess import run_inprocess
from feddg.evaluation.plots import draw_metric
from feddg.evaluation.tables import DEGRADED, csv_table, markdown_table
from feddg.experiment import RunDirError, clear_run_dir, resume_experiment, run_experiment
from feddg.federation import checkpoint
from feddg.federation.server import Server, failure_record
from feddg.messages import WEIGHT_PREFIX, entries
from feddg.reports import figures
from feddg.reports.run import report
from feddg.sweep import run_sweep
from feddg.tasks import TaskInfo
from feddg.tasks.classification import Classification

ACC = TaskInfo.of(Classification(10).info())
TINY = {"data": {"dataset": "digits-dg", "max_per_domain": 40}, "partition": {"kind": "by_domain", "num_clients": 3},
        "model": {"name": "lenet"}, "federation": {"rounds": 2, "batch_size": 32}, "split": {"target": "uci"},
        "device": "cpu"}


@pytest.fixture
def cache(cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    return cache_dir


# 1 -------------------------------------------------------------------------------------------------------------
def test_a_dropped_client_is_recorded_in_results_tables_and_the_report(tmp_path):
    from support.faults import registered

    with registered():
        server = Server(toy_federation("method.name=faulty", "method.params.faults={'2:1': raise}"), tmp_path / "r")
        results = run_inprocess(server)
    failures = results["failures"]
    assert failures["rounds"] == [2] and failures["client_rounds_lost"] == 1
    assert list(failures["clients"]) == ["1"] and "injected failure" in failures["clients"]["1"][0]["reason"]
    rows = [{"variant": "A", "target": "c", "seed": s, "ood_acc": 50.0 + s, "dropped": int(s == 1)} for s in (0, 1)]
    rows += [{"variant": "B", "target": "c", "seed": s, "ood_acc": 40.0, "dropped": 0} for s in (0, 1)]
    md = markdown_table(rows)
    assert f"50.5 ± 0.7 {DEGRADED}" in md and "40.0 ± 0.0 |" in md and "dropped clients" in md
    assert [line.split(",")[-1] for line in csv_table(rows).splitlines()[1:]] == ["1", "1", "0", "0"]
    (tmp_path / "r" / "config.yaml").write_text(yaml.safe_dump({"data": {"dataset": "digits-dg"}}))
    assert "clients were dropped in rounds 2" in report(tmp_path / "r")[0].read_text()


def test_a_complete_run_records_no_failures(tmp_path):
    results = run_inprocess(Server(toy_federation("federation.rounds=1"), tmp_path / "r"))
    assert results["failures"] == {"rounds": [], "clients": {}, "client_rounds_lost": 0}


# 2 -------------------------------------------------------------------------------------------------------------
def test_a_mapping_override_merges_key_by_key_and_a_twice_given_key_says_which_won():
    cfg = build_config({"federation": {"batch_size": 16}}, ["federation.rounds=1", "federation={local_epochs: 2}"])
    assert (cfg.federation.rounds, cfg.federation.local_epochs, cfg.federation.batch_size) == (1, 2, 16)
    with pytest.warns(UserWarning, match=r"federation.rounds is overridden twice: the last value wins \(3 is replaced\)"):
        assert build_config({}, ["federation.rounds=3", "federation.rounds=1"]).federation.rounds == 1
    with pytest.warns(UserWarning, match="method.params is replaced whole: mu go back"):
        build_config({"method": {"name": "fedprox", "params": {"mu": 0.5}}}, ["method.params={}"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a variant that switches methods gives the new method's parameters, silently
        cfg = build_config({"method": {"name": "fedfa", "params": {"variant": "full"}}},
                           ["method.name=fedprox", "method.params={mu: 0.1}"])
    assert cfg.method.params == {"mu": 0.1}


# 3 -------------------------------------------------------------------------------------------------------------
def test_sweep_variants_that_share_a_folder_are_refused_before_any_run(tmp_path, cache):
    spec = {**TINY, "sweep": {"targets": ["uci"], "variants": {"a b": {}, "a_b": {"method.name": "fedprox"}}}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="'a b' and 'a_b' would share the folder 'a_b'"):
        run_sweep(tmp_path / "s.yaml", out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "a_b").exists()


def test_an_invalid_sweep_cell_names_its_variant_and_a_model_that_does_not_fit_is_refused_at_load(tmp_path, cache):
    spec = {**TINY, "sweep": {"targets": ["uci"], "variants": {"ok": {}, "typo": {"model.params.widht": 3}}}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match=r"^sweep variant 'typo', target uci, seed 0: model\.params\.widht: model "
                                          r"lenet has no such option; it takes none$"):
        run_sweep(tmp_path / "s.yaml", out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # nothing written, not even the sweep's folder
    with pytest.raises(ConfigError, match=r"^model\.name: model unet \(images → dense_masks\) does not fit"):
        build_config(TINY, ["model.name=unet"])


# 4 -------------------------------------------------------------------------------------------------------------
def test_overwrite_removes_only_what_feddg_wrote(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "metrics.jsonl", "checkpoint.pt", "events.out.tfevents.1.host", "NOTES.txt"):
        (run / name).write_text("x")
    (run / "client_store").mkdir()
    (run / "node-state" / "k" / "client-0").mkdir(parents=True)  # a Flower simulation's client states
    (run / "analysis").mkdir()
    (run / "analysis" / "fig.png").write_text("x")
    assert clear_run_dir(run) == ["NOTES.txt", "analysis"]
    assert sorted(p.name for p in run.iterdir()) == ["NOTES.txt", "analysis"]
    assert (run / "analysis" / "fig.png").is_file()


# 5 -------------------------------------------------------------------------------------------------------------
def test_a_resume_without_a_checkpoint_is_refused_and_a_finished_run_is_left_alone(tmp_path, cache):
    run = tmp_path / "run"
    run_experiment(build_config(TINY), run, progress=False)
    provenance = (run / "provenance.json").read_text()
    again = resume_experiment(run, progress=False)
    assert again["resumed"] is False and again["final"] == json.loads((run / "results.json").read_text())["final"]
    assert (run / "provenance.json").read_text() == provenance  # nothing recorded
    for name in ("checkpoint.pt", "checkpoint.prev.pt"):
        (run / name).unlink(missing_ok=True)
    (run / "results.json").unlink()
    with pytest.raises(RunDirError, match="nothing to resume .* has no checkpoint"):
        resume_experiment(run, progress=False)
    assert (run / "provenance.json").read_text() == provenance


# 6 -------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_an_interrupted_run_says_where_it_stopped_and_how_to_resume(tmp_path, cache, sig, code):
    args = ["run", "configs/demo.yaml", "-o", "data.max_per_domain=150", "-o", "partition.num_clients=3",
            "-o", "federation.rounds=40", "-o", "model.name=lenet", "-o", "split.target=uci", "--quiet",
            "--run-dir", str(tmp_path / "run")]
    proc = subprocess.Popen([sys.executable, "-m", "feddg", *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "checkpoint.pt").is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    line = (out + err).strip().splitlines()[-1]
    assert line.startswith(f"error: {signal.Signals(sig).name}: the run stopped during round"), line
    assert f"feddg run --resume {tmp_path / 'run'} continues it" in line


def test_a_full_disk_names_the_checkpoint_and_leaves_no_half_written_file(tmp_path, monkeypatch):
    def no_space(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.os, "fsync", no_space)
    with pytest.raises(OSError, match=rf"No space left on device while writing the checkpoint {tmp_path}.*intact"):
        checkpoint.save_checkpoint(tmp_path, {"round": 1})
    assert list(tmp_path.iterdir()) == []


# 7 -------------------------------------------------------------------------------------------------------------
def test_clients_without_any_holdout_and_an_empty_config_are_refused_in_one_line(tmp_path, cache):
    cfg = build_config(TINY, ["data.max_per_domain=10", "partition.kind=iid", "partition.num_clients=30"])
    with pytest.raises(ValueError, match=r"leaves no client a holdout sample \(clients of 1 sample\(s\) at most\)"):
        run_experiment(cfg, tmp_path / "run", progress=False)
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ConfigError, match="empty.yaml is empty: an experiment config names"):
        load_config(tmp_path / "empty.yaml")


# 8 -------------------------------------------------------------------------------------------------------------
def test_one_evaluation_gets_an_integer_axis_with_room_and_constant_panels_start_at_zero():
    fig, ax = plt.subplots()
    draw_metric(ax, [{"round": 2, "id_acc": 80.0, "ood_acc": 80.0}], ACC)
    lo, hi = ax.get_xlim()
    assert (lo, hi) == (1.5, 2.5)
    sizes = {ln.get_label(): ln.get_markersize() for ln in ax.get_lines() if not ln.get_label().startswith("chance")}
    assert sizes["id"] > sizes["ood"]  # equal figures stay visible: a hollow ring around the smaller marker
    plt.close(fig)
    rows = [{"round": r, "bytes_down": 1000, "bytes_up": 1000, "clients": 6, "lr": 0.1} for r in (1, 2, 3)]
    fig = figures.communication(rows)
    assert fig.axes[0].get_ylim()[0] == 0 and fig.axes[0].get_ylim()[1] > 1000 / 1024
    plt.close(fig)
    fig = figures.schedule(rows)
    clients = next(a for a in fig.axes if a.get_title() == "clients")
    assert clients.get_ylim() == (0.0, pytest.approx(6.9))
    plt.close(fig)


def test_a_collapsed_model_is_flagged_and_the_per_class_view_drawn(tmp_path):
    view = {"classes": ["a", "b", "c"], "ood": {"recall": [100.0, 0.0, 0.0], "predicted": [96.0, 2.0, 2.0]}}
    assert "gives 96 % of its ood predictions to class 'a'" in figures.collapsed(view)
    assert figures.collapsed({**view, "ood": {"recall": [50.0] * 3, "predicted": [40.0, 30.0, 30.0]}}) is None
    # a personalised run's view has global_<role> only; a federated split's has no ood: the headline's role is judged
    personal = {"classes": view["classes"], "global_id": {"recall": [50.0] * 3, "predicted": [40.0, 30.0, 30.0]},
                "global_ood": view["ood"]}
    assert "gives 96 % of its global_ood predictions to class 'a'" in figures.collapsed(personal)
    assert "of its id predictions" in figures.collapsed({"classes": view["classes"], "id": view["ood"]})
    fig = figures.per_class(view)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["a", "b", "c"]
    plt.close(fig)
    task = Classification(3)
    import torch

    tally = task.tally(torch.tensor([[5.0, 0, 0]] * 4), torch.tensor([0, 1, 2, 2]), np.zeros(4, dtype=np.int64), 1)
    assert task.class_view(tally[0]) == {"recall": [100.0, 0.0, 0.0], "predicted": [100.0, 0.0, 0.0]}


def test_a_two_seed_interval_is_clipped_to_the_metric_and_shows_its_n():
    rows = [{"variant": "A", "target": t, "seed": s, "ood_acc": v}
            for t, vals in (("x", (2.0, 30.0)), ("y", (1.0, 33.0))) for s, v in enumerate(vals)]
    md = markdown_table(rows, bounds=(0.0, 100.0))
    # per-seed averages 1.5, 31.5: 16.5 ± t(0.975, 1) · 21.21 / √2 = 16.5 ± 190.6 leaves 0-100 at both ends
    assert md.splitlines()[2].endswith("| 16.5 ± 21.2 | [0.0, 100.0] n=2 |")


def test_a_dropped_client_marks_its_own_cell_and_the_average_and_tables_keep_the_sweeps_order():
    """Variant B dropped a client on target y only: its x cell stays unmarked. Rows come as the sweep wrote them
    (B before A, y before x), not sorted."""
    rows = [{"variant": v, "target": t, "seed": 0, "ood_acc": 60.0 if v == "A" else 50.0,
             "dropped": int((v, t) == ("B", "y"))} for v in ("B", "A") for t in ("y", "x")]
    assert markdown_table(rows).splitlines()[:4] == [
        "| method | y | x | avg | avg 95 % CI |", "|---|---|---|---|---|",
        f"| B | 50.0 ± – {DEGRADED} | 50.0 ± – | 50.0 ± – | – |", "| A | 60.0 ± – | 60.0 ± – | 60.0 ± – | – |"]
    assert [line.split(",")[:2] + line.split(",")[-1:] for line in csv_table(rows).splitlines()[1:]] == [
        ["B", "y", "1"], ["B", "x", "0"], ["B", "avg", "1"], ["A", "y", "0"], ["A", "x", "0"], ["A", "avg", "0"]]


def test_a_paired_difference_keeps_its_interval_below_zero_where_the_metric_is_clipped():
    """Per seed: base 10, 50, 90; new 1, 2, 3 points above. The base's average, 50 ± 4.303 · 40 / √3, is clipped to
    0-100; the difference, 2 ± 4.303 · 1 / √3 = [-0.484, 4.484], is no accuracy and keeps its negative end."""
    rows = [{"variant": v, "target": "x", "seed": s, "ood_acc": base + (s + 1) * (v == "new")}
            for v in ("base", "new") for s, base in enumerate((10.0, 50.0, 90.0))]
    lines = csv_table(rows, baseline="base", bounds=(0.0, 100.0)).splitlines()
    assert "base,avg,50.000,40.000,0.000,100.000,3,0" in lines
    assert "new,avg - base,2.000,1.000,-0.484,4.484,3,0" in lines


def test_a_sweep_report_shows_what_each_variant_and_each_draw_changes(tmp_path, cache):
    spec = {**TINY, "federation": {"rounds": 1, "batch_size": 32},
            "sweep": {"targets": ["uci"], "search": {"n": 2}, "variants": {"FedProx": {"method.name": "fedprox"}}}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    run_sweep(tmp_path / "s.yaml", out_dir=tmp_path / "out", progress=False)
    table = (tmp_path / "out" / "table.md").read_text()
    drawn = json.loads((tmp_path / "out" / "sweep.json").read_text())["expanded"]["FedProx #1"]
    assert drawn["method.params.mu"] in (0.001, 0.01, 0.1, 1.0)
    assert f"| FedProx #1 | `method.name=\"fedprox\"`, `method.params.mu={drawn['method.params.mu']}` |" in table
    page = report(tmp_path / "out")[0].read_text()
    assert "What each variant changes" in page and "method.params.mu=" in page


# 9, 10 ---------------------------------------------------------------------------------------------------------
def test_feddg_methods_lists_the_augmentations_with_their_parameters():
    from feddg.catalog import build_catalog

    listing = dict(build_catalog()["augmentations"])
    assert set(listing) == {"mixup", "manifold_mixup", "mixstyle", "moex"}
    assert "alpha=0.1" in listing["mixstyle"] and "lam=0.9" in listing["moex"]


def test_mlflow_artifacts_leave_tensorboard_event_files_out(tmp_path, cache):
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    cfg = build_config({**TINY, "federation": {"rounds": 1, "batch_size": 32},
                        "logging": {"tensorboard": True, "mlflow": str(tmp_path / "mlruns")}})
    run_experiment(cfg, tmp_path / "run", progress=False)
    assert list((tmp_path / "run").glob("events.out.tfevents*"))
    stored = [p.name for p in (tmp_path / "mlruns").rglob("*") if p.is_file()]
    assert "metrics.jsonl" in stored and not any(n.startswith("events.out.tfevents") for n in stored)


def test_plain_logs_switch_off_colour_codes_where_stderr_is_redirected(monkeypatch):
    pytest.importorskip("flwr")
    from feddg.engines.flower import simulation

    monkeypatch.delenv("FEDDG_PLAIN_LOGS", raising=False)
    monkeypatch.delenv("RAY_COLOR_PREFIX", raising=False)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    simulation.plain_logs()
    assert os.environ["FEDDG_PLAIN_LOGS"] == "1" and os.environ["RAY_COLOR_PREFIX"] == "0"


def test_the_run_simulation_deprecation_notice_is_filtered():
    pytest.importorskip("flwr")
    import logging

    from feddg.engines.flower.simulation import _NotRunSimulationDeprecation

    keep = _NotRunSimulationDeprecation()
    record = logging.LogRecord("flwr", logging.WARNING, "", 0, "DEPRECATED FEATURE: %s", ("The `run_simulation` fn",),
                               None)
    assert not keep.filter(record)
    other = logging.LogRecord("flwr", logging.WARNING, "", 0, "something else %s", ("x",), None)
    assert keep.filter(other)


def test_the_cli_refuses_contradicting_flags_and_overrides_and_says_kib(tmp_path, cache):
    from typer.testing import CliRunner

    from feddg.cli import app, communication_table

    res = CliRunner().invoke(app, ["run", "configs/demo.yaml", "--engine", "inprocess", "-o",
                                   "federation.engine=flower"], terminal_width=300)
    assert res.exit_code == 2 and "--engine inprocess and -o federation.engine=flower contradict" in res.output
    assert communication_table({"bytes_per_round": {"bytes_up": 2048.0}}).columns[1].header == "KiB"
    listing = CliRunner().invoke(app, ["methods"], terminal_width=300).output
    assert "local augmentations" in listing and "manifold_mixup" in listing and "lam=0.9" in listing


def test_the_failure_record_counts_every_lost_client_round_and_lists_each_clients_rounds() -> None:
    rows = [{"round": 1}, {"round": 2, "clients_failed_reasons": {"0": "timeout", "3": "NaN"}},
            {"round": 3, "clients_failed_reasons": {"0": "raised"}}]
    assert failure_record(rows) == {
        "rounds": [2, 3],
        "clients": {"0": [{"round": 2, "reason": "timeout"}, {"round": 3, "reason": "raised"}],
                    "3": [{"round": 2, "reason": "NaN"}]},
        "client_rounds_lost": 3,  # client 0 twice, client 3 once
    }


def test_a_rounds_time_is_the_engines_phases_plus_aggregation_and_evaluation(tmp_path) -> None:
    server = Server(toy_federation("federation.rounds=1"), tmp_path / "run")
    sent = server.configure(1)
    fold = server.start_round(sent)
    server.receive(fold, Reply(0, {**entries(sent[0], WEIGHT_PREFIX), "num_examples": 5}))
    row = server.finish_round(1, fold, {"time_train_s": 2.0, "time_wait_s": 0.25})
    assert row["time_eval_s"] > 0  # round 1 of 1 is evaluated
    assert row["time_round_s"] == pytest.approx(2.25 + row["time_aggregate_s"] + row["time_eval_s"], rel=1e-12)
