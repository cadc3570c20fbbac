"""Sweeps: every (variant, target, seed) cell runs once, tables aggregate them, jobs run in parallel."""

from __future__ import annotations

import json

import pytest
import yaml

from feddg.config import ConfigError
from feddg.sweep import run_sweep

SWEEP = {
    "name": "tiny-sweep",
    "data": {"dataset": "digits-dg", "max_per_domain": 60},
    "partition": {"kind": "by_domain", "num_clients": 3},
    "model": {"name": "lenet"},
    "federation": {"rounds": 1, "batch_size": 32},
    "sweep": {
        "targets": ["uci", "mnist"],
        "seeds": [0],
        "variants": {"FedAvg": {"method.name": "fedavg"},
                     "FedProx": {"method.name": "fedprox", "method.params.mu": 0.1}},
    },
}


@pytest.fixture
def sweep_file(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SWEEP))
    return path


def _ood(rows: list[dict]) -> dict[tuple[str, str], float]:
    return {(r["variant"], r["target"]): r["ood_acc"] for r in rows}


def test_sweep_runs_each_cell_once_tables_it_and_parallel_jobs_agree(sweep_file, tmp_path):
    seq = run_sweep(sweep_file, out_dir=tmp_path / "seq", progress=False)
    assert sorted(_ood(seq["rows"])) == [("FedAvg", "mnist"), ("FedAvg", "uci"),
                                         ("FedProx", "mnist"), ("FedProx", "uci")]
    table = (tmp_path / "seq" / "table.md").read_text()
    assert "| FedAvg |" in table and "| FedProx |" in table and "uci" in table
    runs = [json.loads(line) for line in (tmp_path / "seq" / "runs.jsonl").read_text().splitlines()]
    assert _ood(runs) == _ood(seq["rows"])

    stamp = (tmp_path / "seq" / "FedAvg" / "uci" / "seed0" / "results.json").stat().st_mtime_ns
    again = run_sweep(sweep_file, out_dir=tmp_path / "seq", progress=False)  # finished cells are loaded
    assert (tmp_path / "seq" / "FedAvg" / "uci" / "seed0" / "results.json").stat().st_mtime_ns == stamp
    assert _ood(again["rows"]) == _ood(seq["rows"])

    par = run_sweep(sweep_file, out_dir=tmp_path / "par", progress=False, jobs=2)
    assert _ood(par["rows"]).keys() == _ood(seq["rows"]).keys()
    for cell, acc in _ood(par["rows"]).items():  # one vs two torch threads: float rounding only
        assert acc == pytest.approx(_ood(seq["rows"])[cell], abs=2.0), cell


def test_a_bad_variant_fails_before_any_run(sweep_file, tmp_path):
    bad = {**SWEEP, "sweep": {**SWEEP["sweep"], "variants": {"ok": {}, "bad": {"method.name": "nope"}}}}
    sweep_file.write_text(yaml.safe_dump(bad))
    with pytest.raises((ConfigError, ValueError)):
        run_sweep(sweep_file, out_dir=tmp_path / "out", progress=False)
    assert not list((tmp_path / "out").glob("*/*/seed0/results.json"))
    with pytest.raises(ValueError, match="jobs"):
        run_sweep(sweep_file, out_dir=tmp_path / "out", progress=False, jobs=0)
