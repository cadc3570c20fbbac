"""`feddg bench models --feddg`: the U-Net's segmentation training (and a tiny transformer's text classification)
through feddg's client loop next to a plain PyTorch loop (tiny settings; no timing threshold: timing targets live
in docs/benchmarks.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from typer.testing import CliRunner

from feddg.bench.throughput import loop_bench, parse_model_spec
from feddg.cli import app


def test_bench_models_feddg_times_both_loops_of_the_unet_and_their_ratio(cache_dir):
    res = CliRunner().invoke(
        app, ["bench", "models", "--feddg", "--names", "unet@32:width=4", "--batch", "4", "--steps", "2",
              "--repeats", "2", "--threads", "1"],
        env={"COLUMNS": "240", "FEDDG_CACHE": str(cache_dir)},
    )
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # the title wraps at the table's width
    assert "unet width=4 @ 32 px; batch 4, Adam, 1 torch threads, 2 interleaved repeats" in text
    assert "load average before:" in text
    rows = {line.split("│")[5].strip(): [c.strip() for c in line.split("│")[1:-1]]
            for line in res.output.splitlines() if line.startswith("│")}
    assert set(rows) == {"feddg train_local", "plain PyTorch"}
    for cells in rows.values():
        assert cells[:4] == ["unet width=4", "32", "segmentation", "2"]
        assert all(v.endswith(" img") and float(v[:-4].replace(",", "")) > 0 for v in cells[5:7])  # images/s
    ratios = [float(v) for v in rows["feddg train_local"][7].split(",")]
    assert len(ratios) == 2 and all(math.isfinite(r) and r > 0 for r in ratios)


def test_model_specs_carry_size_and_options():
    assert parse_model_spec("unet@64:width=8:depth=3") == ("unet", 64, {"width": 8, "depth": 3})
    assert parse_model_spec("cnn") == ("cnn", 28, {})
    with pytest.raises(ValueError, match="key=value"):
        parse_model_spec("unet@64:width")


def test_a_text_model_times_against_transformers_forward_and_counts_non_padding_tokens(cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    bench = loop_bench("tiny-roberta", 24, batch=4, steps=2)
    unit, amount = bench.units
    used = bench.train_idx % len(bench.y)
    assert unit == "tokens" and amount == float(np.minimum(bench.dataset.lengths[used], 24).sum())
    assert bench.plain(0) > 0 and bench.feddg(0) > 0
