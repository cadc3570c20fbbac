"""What a run measures and how many samples stand behind each of its figures: results.json's ``task`` and
``counts`` blocks, written by the run's evaluator (feddg.federation.evaluator). No dataset is rebuilt."""

from __future__ import annotations

import json
from pathlib import Path

from feddg.evaluation.plots import run_task
from feddg.tasks import TaskInfo


def run_counts(run_dir: Path) -> tuple[dict[str, int], TaskInfo | None, list[str]]:
    """Samples per figure key, the task, and notes saying what is unavailable and why."""
    path = run_dir / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    counts = results.get("counts")
    task = run_task(run_dir)
    notes = [] if counts else ["sample counts unavailable: the run has not written results.json (with its counts) yet"]
    notes += [] if task is not None else ["the task is unknown: no results.json task block and no dataset in config.yaml"]
    return dict(counts or {}), task, notes
