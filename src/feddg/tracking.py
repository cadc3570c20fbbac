"""Copies of a run's metrics for the tools people use: TensorBoard and MLflow (the ``logging:`` section).

metrics.jsonl stays the record; a sink receives each round's row as the round ends and, at the
end, the results. A resumed run continues: TensorBoard purges the steps after the checkpoint,
MLflow continues the same run (its id is kept in ``mlflow_run_id`` in the run directory) and, unable to remove
a point, holds a redone round's metrics twice at its step.
Both need the ``logging`` extra (``pip install 'feddg[logging]'``).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

from feddg.config import ConfigError, ExperimentConfig

EXTRA = "pip install 'feddg[logging]'"
MLFLOW_RUN_ID = "mlflow_run_id"


class Sink(Protocol):
    def log_round(self, row: dict[str, Any]) -> None: ...
    def finish(self, results: dict[str, Any]) -> None: ...


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (bools and strings left out), without ``round``."""
    return {k: float(v) for k, v in row.items()
            if k != "round" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def flat_params(cfg: ExperimentConfig) -> dict[str, str | int | float | bool]:
    """The resolved config as dotted keys; lists, mappings and None as JSON text."""
    out: dict[str, str | int | float | bool] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for k, v in node.items():
            if isinstance(v, dict) and v:
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v if isinstance(v, str | int | float | bool) else json.dumps(v)

    walk(cfg.model_dump(mode="json"), "")
    return out


def final_metrics(results: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in results.get("final", {}).items()}


class TensorBoardSink:
    """Scalars per round (step = round) and, at the end, the config as hparams, in the run directory."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(f"logging.tensorboard needs the tensorboard package: {EXTRA}") from None
        self._cls, self.cfg, self.run_dir = SummaryWriter, cfg, run_dir
        self._writer: Any = None

    def _open(self, purge_step: int | None) -> Any:
        if self._writer is None:  # on resume, steps from purge_step on (a round redone) are dropped
            self._writer = self._cls(str(self.run_dir), purge_step=purge_step, flush_secs=10)
        return self._writer

    def log_round(self, row: dict[str, Any]) -> None:
        writer = self._open(row["round"])
        for key, val in scalars(row).items():
            writer.add_scalar(key, val, row["round"])

    def finish(self, results: dict[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        writer = self._open(None)
        # the hparams plugin reads the metrics' values from the scalars of the same names logged per round
        for summary in hparams(flat_params(self.cfg), final_metrics(results)):
            writer._get_file_writer().add_summary(summary)
        writer.close()


def mlflow_key(key: str) -> str:
    """``id_acc/mnist`` -> ``id_acc.mnist``: MLflow's file store keeps ``a/b`` as a file in a folder ``a``,
    which clashes with the metric ``a`` itself; other characters MLflow rejects become ``_``."""
    return re.sub(r"[^\w\-. :]", "_", key.replace("/", "."))


class MlflowSink:
    """Params (the resolved config), metrics per round (step = round; ``/`` in names becomes ``.``), the run
    directory as artifacts (without TensorBoard's event files)."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, target: str) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError(f"logging.mlflow needs the mlflow-skinny package: {EXTRA}") from None
        if "://" not in target and not target.startswith("file:"):  # a directory: MLflow's file store
            store = Path(target).expanduser().resolve()
            if store.is_relative_to(run_dir.resolve()):
                raise ConfigError(f"logging.mlflow: the store {store} must be outside the run directory (its artifacts)")
            target = store.as_uri()
        if target.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # asked for by name; MLflow 3 wants an opt-in
        self.client, self.cfg, self.run_dir = MlflowClient(tracking_uri=target), cfg, run_dir
        self.run_id: str | None = None

    def _run(self) -> str:
        if self.run_id is None:
            id_file = self.run_dir / MLFLOW_RUN_ID
            if id_file.is_file():  # a resumed run continues its MLflow run
                self.run_id = id_file.read_text().strip()
            else:
                self.run_id = self._create()
                id_file.write_text(self.run_id + "\n")
        return self.run_id

    def _create(self) -> str:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        name = self.cfg.name
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            try:
                exp_id = self.client.create_experiment(name)
            except MlflowException:  # another sweep job created it first
                exp = self.client.get_experiment_by_name(name)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        run_name = "/".join(self.run_dir.parts[-3:]) if re.fullmatch(r"seed\d+", self.run_dir.name) else self.run_dir.name
        run = self.client.create_run(exp_id, run_name=run_name, tags={"feddg.run_dir": str(self.run_dir.resolve())})
        params = [Param(k, str(v)) for k, v in flat_params(self.cfg).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(run.info.run_id, params=params[i : i + 100])
        return run.info.run_id

    def _log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self._run(), metrics=metrics[i : i + 1000])

    def log_round(self, row: dict[str, Any]) -> None:
        self._log(scalars(row), row["round"])

    def finish(self, results: dict[str, Any]) -> None:
        keys = ("time_total_s", "bytes_up_total", "bytes_down_total")
        totals: dict[str, float] = {k: float(results[k]) for k in keys if k in results}
        self._log(totals, int(results.get("rounds", 0)))
        for path in sorted(self.run_dir.iterdir()):
            if path.name.startswith("events.out.tfevents"):  # TensorBoard's own files: a copy in the MLflow store
                continue  # would show the run twice to a `tensorboard --logdir` above both
            if path.is_dir():
                self.client.log_artifacts(self._run(), str(path), artifact_path=path.name)
            else:
                self.client.log_artifact(self._run(), str(path))
        self.client.set_terminated(self._run())


class Tracking:
    """The sinks the config asks for; missing packages fail here, before the run starts."""

    def __init__(self, cfg: ExperimentConfig, run_dir: str | Path) -> None:
        run_dir = Path(run_dir)
        self.sinks: list[Sink] = []
        if cfg.logging.tensorboard:
            self.sinks.append(TensorBoardSink(cfg, run_dir))
        if cfg.logging.mlflow:
            self.sinks.append(MlflowSink(cfg, run_dir, cfg.logging.mlflow))

    def log_round(self, row: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.log_round(row)

    def finish(self, results: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.finish(results)
