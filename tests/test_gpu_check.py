"""benchmarks/gpu_check.sh: where there is no GPU it stops at once with one line; its round runner works (on the
CPU here), so the script does not rot between the rare runs on a GPU."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402  (a script of benchmarks/, imported by path)


def test_without_cuda_the_check_exits_at_once_with_one_line():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the script would run the whole check")
    res = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env={**os.environ, "PYTHON": sys.executable},
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 2
    assert len(res.stdout.strip().splitlines()) == 1 and "no CUDA GPU" in res.stdout


def test_one_checked_round_reports_its_metrics_and_flags_non_finite_ones(cache_dir):
    row = gpu_check.one_round("fedavg", None, "bf16", "cpu", str(cache_dir))
    assert row["round"] == 1 and math.isfinite(row["ood_acc"]) and gpu_check.finite(row) == []
    assert gpu_check.finite({**row, "train_loss": math.nan}) == ["train_loss"]
