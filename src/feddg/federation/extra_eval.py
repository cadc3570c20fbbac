"""``feddg eval``: a run's last checkpoint on another dataset with the training data's classes, as ``eval.extra``
evaluates one during a run (:meth:`feddg.federation.evaluator.Evaluator.extra`)."""

from __future__ import annotations

from pathlib import Path

from feddg.config import ExtraEvalConfig, load_config
from feddg.data.registry import evaluation_mismatch
from feddg.federation.client_store import open_checkpoint
from feddg.federation.evaluator import Evaluator
from feddg.federation.setup import ExtraTarget, build_federation, load_extra_target
from feddg.tasks import TaskInfo


def evaluate_run(run_dir: str | Path, spec: ExtraEvalConfig, device: str | None = None, where: str | None = None
                 ) -> tuple[dict[str, float], ExtraTarget, int, TaskInfo]:
    """``spec`` evaluated with the last checkpoint of ``run_dir`` (its config.yaml rebuilds the model; ``device``
    overrides the one it ran on): the metrics, the loaded target, the checkpoint's round and the task. A refusal
    of the dataset starts with ``where`` (default: ``eval.extra <name>``, as during a run)."""
    where = where or f"eval.extra {spec.name}"
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.yaml)")
    overrides = ["eval.extra=[]"] + ([f"device={device}"] if device is not None else [])
    cfg = load_config(run_dir / "config.yaml", overrides)
    # the config's own check of eval.extra, here before the run's data load
    if why := evaluation_mismatch(spec.dataset, cfg.data.dataset, cfg.data.tokenizer or cfg.model.path):
        raise ValueError(f"{where}: {why}")
    ckpt = open_checkpoint(run_dir)
    if ckpt is None:
        raise ValueError(f"{run_dir} has no checkpoint.pt to evaluate")
    fed = build_federation(cfg)
    target = load_extra_target(spec, fed.cfg, fed.dataset, where)
    return (Evaluator(fed).extra(ckpt["server_state"], target), target, int(ckpt["round"]),
            TaskInfo.of(fed.task.info()))
