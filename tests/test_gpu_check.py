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


def test_every_task_round_of_the_check_builds_and_one_runs_with_a_finite_score(cache_dir):
    from feddg.config import load_config

    for config, extra in gpu_check.TASK_CONFIGS.values():  # a moved or renamed demo config fails here, not on a GPU
        load_config(ROOT / config, extra)
    config, extra = gpu_check.TASK_CONFIGS["text: HFedATM on tiny RoBERTa (sentiment)"]
    row = gpu_check.task_round(config, extra, "bf16", "cpu", str(cache_dir))
    assert row["round"] == 1 and 0.0 <= row["ood_acc"] <= 100.0 and gpu_check.finite(row) == []


def test_the_check_runs_every_method_once_per_amp_on_a_task_that_provides_what_it_needs(monkeypatch):
    from feddg.algorithms.registry import list_methods, method_class
    from feddg.tasks.base import DENSE_MASKS

    seen: list[tuple[str, str]] = []  # (method, where)

    def fake_digits(method, merge, amp, device, cache, dp=False):
        if merge is None and not dp:
            seen.append((method, "digits"))
        if method == "fedsam":
            return {"round": 1, "id_acc": 50.0}  # an evaluation that gave no out-of-domain score
        return {"round": 1, "ood_acc": math.nan if method == "fedprox" else 50.0}

    def fake_task(config, extra, amp, device, cache):
        names = [o.removeprefix("method.name=") for o in extra if o.startswith("method.name=")]
        if not any("noise_multiplier" in o for o in extra):  # the dp rounds are counted apart
            seen.extend((n, config) for n in names)
        if "segmentation" in config and not names:
            raise RuntimeError("a failing round")
        return {"round": 1, "ood_dice/X": 10.0, "ood_dice": 10.0}

    monkeypatch.setattr(gpu_check, "one_round", fake_digits)
    monkeypatch.setattr(gpu_check, "task_round", fake_task)
    out = gpu_check.check_all("cpu", "unused", ["off", "bf16"])
    segmentation = gpu_check.TASK_CONFIGS[gpu_check.SEGMENTATION][0]
    for m in list_methods():
        expected = segmentation if DENSE_MASKS in method_class(m).requires else "digits"
        assert [w for n, w in seen if n == m] == [expected] * 2, m
    status = {(what, amp): s for what, amp, s in out}
    assert status[("fedprox", "bf16")].startswith("FAIL non-finite ['ood_acc']")
    assert status[("fedsam", "off")] == "FAIL no out-of-domain score in the round's metrics"
    assert status[(gpu_check.SEGMENTATION, "off")] == "FAIL RuntimeError: a failing round"
    assert status[("elcfs (prostate MRI)", "off")].startswith("ok") and "ood_dice 10.0" in status[("elcfs (prostate MRI)", "off")]
