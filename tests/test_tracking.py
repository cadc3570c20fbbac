"""logging.tensorboard / logging.mlflow: what a tiny run leaves in TensorBoard and MLflow, resume, missing packages."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from feddg.cli import app
from feddg.config import ConfigError, build_config
from feddg.experiment import run_experiment
from feddg.tracking import MLFLOW_RUN_ID, Tracking, flat_params, scalars

TINY = {"data": {"dataset": "digits-dg", "max_per_domain": 40}, "partition": {"kind": "by_domain", "num_clients": 3},
        "model": {"name": "lenet"}, "federation": {"rounds": 3, "batch_size": 32}, "eval": {"every": 2},
        "split": {"target": "uci"}, "device": "cpu"}


def _scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _hparams(run_dir) -> tuple[set[str], dict[str, float]]:
    """The metric tags and numeric hparams of the run's TensorBoard hparams summary."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    experiment = HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    return {m.name.tag for m in experiment.metric_infos}, {k: v.number_value for k, v in start.hparams.items()}


def _mlflow(store):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=store.resolve().as_uri())


def test_a_tiny_run_logs_to_tensorboard_and_mlflow(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # restored after the test
    store = tmp_path / "mlruns"
    cfg = build_config({**TINY, "logging": {"tensorboard": True, "mlflow": str(store)}})
    run_dir = tmp_path / "run"
    results = run_experiment(cfg, run_dir, progress=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [(r["round"], r["ood_acc"]) for r in rows if "ood_acc" in r]
    assert [step for step, _ in evaluated] == [2, 3]  # eval.every=2 and the last round

    tb = _scalars(run_dir, "ood_acc")
    assert [s for s, _ in tb] == [2, 3] and [v for _, v in tb] == pytest.approx([v for _, v in evaluated])
    assert [s for s, _ in _scalars(run_dir, "train_loss")] == [1, 2, 3]
    metrics, hparams = _hparams(run_dir)  # the final figures, and the config as dotted keys
    assert metrics == set(results["final"]) and {"ood_acc", "id_acc/mnist"} <= metrics
    assert hparams["federation.rounds"] == 3 and hparams["eval.every"] == 2

    client = _mlflow(store)
    run = client.get_run((run_dir / MLFLOW_RUN_ID).read_text().strip())
    assert run.info.status == "FINISHED"
    assert run.data.params["method.name"] == "fedavg" and run.data.params["federation.rounds"] == "3"
    assert run.data.metrics["ood_acc"] == pytest.approx(results["final"]["ood_acc"])
    assert run.data.metrics["id_acc.mnist"] == pytest.approx(results["final"]["id_acc/mnist"])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "ood_acc")] == [2, 3]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"metrics.jsonl", "results.json", "config.yaml"} <= artifacts
    assert not [a for a in artifacts if a.startswith("events.out.tfevents")]  # TensorBoard's files stay out


def test_a_resumed_run_continues_its_tensorboard_steps_and_mlflow_run(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    store = tmp_path / "mlruns"
    cfg = build_config({**TINY, "logging": {"tensorboard": True, "mlflow": str(store)}})
    run_dir = tmp_path / "FedAvg" / "uci" / "seed0"  # a sweep cell's folder
    run_dir.mkdir(parents=True)
    first = Tracking(cfg, run_dir)
    for r in (1, 2, 3):  # round 3 was logged, then the run died before checkpointing it
        first.log_round({"round": r, "train_loss": float(r)})
    first.sinks[0]._writer.flush()
    second = Tracking(cfg, run_dir)  # the resumed run redoes round 3
    for r in (3, 4):
        second.log_round({"round": r, "train_loss": 10.0 * r})
    (run_dir / "examples").mkdir()  # a folder of the run's files goes up as one
    (run_dir / "examples" / "uci.png").write_bytes(b"png")
    second.finish({"final": {}, "rounds": 4, "time_total_s": 9.5, "bytes_up_total": 100, "bytes_down_total": 200})
    assert _scalars(run_dir, "train_loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    client = _mlflow(store)
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.name).experiment_id])  # one run, continued
    history = sorted((m.step, m.timestamp, m.value) for m in client.get_metric_history(run.info.run_id, "train_loss"))
    assert [(step, value) for step, _, value in history] == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 30.0), (4, 40.0)]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "examples")] == ["examples/uci.png"]
    assert run.info.run_name == "FedAvg/uci/seed0"  # variant/target/seed, not three runs named seed0
    totals = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
              for k in ("time_total_s", "bytes_up_total", "bytes_down_total")}
    assert totals == {"time_total_s": [(4, 9.5)], "bytes_up_total": [(4, 100.0)], "bytes_down_total": [(4, 200.0)]}


def test_a_rows_scalars_are_its_finite_numbers_and_the_config_flattens_to_dotted_keys():
    row = {"round": 4, "train_loss": 1, "ood_acc": 52.5, "evaluated": True, "phase": "fit",
           "val_acc": float("nan"), "grad_norm": float("inf")}
    assert scalars(row) == {"train_loss": 1.0, "ood_acc": 52.5}
    params = flat_params(build_config({**TINY, "method": {"name": "fedprox", "params": {"mu": 0.1}},
                                       "data": {**TINY["data"], "domains": ["mnist", "uci"]}}))
    assert (params["method.name"], params["method.params.mu"], params["federation.rounds"]) == ("fedprox", 0.1, 3)
    assert (params["data.domains"], params["split.val_domain"]) == ('["mnist", "uci"]', "null")  # JSON text
    assert params["model.params"] == "{}"  # an empty mapping is a param too, not left out


def test_an_mlflow_store_inside_the_run_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="logging.mlflow: the store .* must be outside the run directory"):
        Tracking(build_config({**TINY, "logging": {"mlflow": str(tmp_path / "run" / "mlruns")}}), tmp_path / "run")


@pytest.mark.parametrize(("key", "module"), [("tensorboard", "torch.utils.tensorboard"), ("mlflow", "mlflow.tracking")])
def test_a_sink_without_its_package_is_one_clear_line(key, module, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    value = "true" if key == "tensorboard" else str(tmp_path / "mlruns")
    with pytest.raises(ConfigError, match=rf"logging\.{key} needs .*pip install 'feddg\[logging\]'"):
        Tracking(build_config({**TINY, "logging": {key: value}}), tmp_path)
    res = CliRunner().invoke(app, ["run", "configs/demo.yaml", "-o", f"logging.{key}={value}", "--run-dir",
                                   str(tmp_path / "run"), "--quiet"])
    assert res.exit_code == 2 and "feddg[logging]" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # it stopped before training
