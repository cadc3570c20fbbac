"""Sweeps: every (variant, target, seed) cell runs once, tables aggregate them, jobs run in parallel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from feddg.config import ConfigError, ExperimentConfig
from feddg.experiment import run_experiment
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


def _ood(rows: list[dict]) -> dict[tuple[str, str, int], float]:
    return {(r["variant"], r["target"], r["seed"]): r["ood_acc"] for r in rows}


def _cell_of(run_dir: Path) -> tuple[str, str, int]:
    """(variant, target, seed) of a cell's folder <variant>/<target>/seed<k>."""
    return run_dir.parts[-3], run_dir.parts[-2], int(run_dir.name.removeprefix("seed"))


def _losses(out: Path) -> dict[tuple[str, str, int], list[float]]:
    """Per cell, the train_loss of every round in its metrics.jsonl."""
    return {_cell_of(p.parent): [json.loads(line)["train_loss"] for line in p.read_text().splitlines()]
            for p in out.glob("*/*/seed*/metrics.jsonl")}


def _configs(out: Path) -> dict[tuple[str, str, int], dict]:
    """Per cell, its config.yaml."""
    return {_cell_of(p.parent): yaml.safe_load(p.read_text()) for p in out.glob("*/*/seed*/config.yaml")}


def test_sweep_runs_each_cell_once_tables_it_and_parallel_jobs_agree(sweep_file, tmp_path):
    sweep_file.write_text(yaml.safe_dump({**SWEEP, "sweep": {**SWEEP["sweep"], "seeds": [0, 1]}}))
    seq = run_sweep(sweep_file, out_dir=tmp_path / "seq", progress=False)
    cells = [(v, t, s) for v in ("FedAvg", "FedProx") for t in ("mnist", "uci") for s in (0, 1)]
    assert sorted(_ood(seq["rows"])) == cells
    table = (tmp_path / "seq" / "table.md").read_text()
    assert "| FedAvg |" in table and "| FedProx |" in table and "uci" in table
    runs = [json.loads(line) for line in (tmp_path / "seq" / "runs.jsonl").read_text().splitlines()]
    assert _ood(runs) == _ood(seq["rows"])
    configs, losses = _configs(tmp_path / "seq"), _losses(tmp_path / "seq")
    for (variant, target, seed), cfg in configs.items():  # each folder holds the run of its own cell
        assert (cfg["method"]["name"], cfg["split"]["target"], cfg["seed"]) == (variant.lower(), target, seed)
    assert sorted(configs) == sorted(losses) == cells
    assert len({tuple(v) for v in losses.values()}) == len(cells)  # every cell trains differently: a swap shows

    stamp = (tmp_path / "seq" / "FedAvg" / "uci" / "seed0" / "results.json").stat().st_mtime_ns
    again = run_sweep(sweep_file, out_dir=tmp_path / "seq", progress=False)  # finished cells are loaded
    assert (tmp_path / "seq" / "FedAvg" / "uci" / "seed0" / "results.json").stat().st_mtime_ns == stamp
    assert _ood(again["rows"]) == _ood(seq["rows"])

    par = run_sweep(sweep_file, out_dir=tmp_path / "par", progress=False, jobs=2)
    assert _ood(par["rows"]).keys() == _ood(seq["rows"]).keys()
    assert _losses(tmp_path / "par") == losses  # federation.workers auto: the bits of jobs=1 (module docstring)
    par_configs = _configs(tmp_path / "par")
    assert {cfg["federation"].pop("workers") for cfg in par_configs.values()} == {1}  # one client worker per job
    assert {cfg["federation"].pop("workers") for cfg in configs.values()} == {"auto"}
    assert par_configs == configs


def test_a_bad_variant_fails_before_any_run(sweep_file, tmp_path):
    bad = {**SWEEP, "sweep": {**SWEEP["sweep"], "variants": {"ok": {}, "bad": {"method.name": "nope"}}}}
    sweep_file.write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match=r"^sweep variant 'bad', target \w+, seed 0: unknown method 'nope'"):
        run_sweep(sweep_file, out_dir=tmp_path / "out", progress=False)
    assert not list((tmp_path / "out").glob("*/*/seed0/results.json"))
    with pytest.raises(ValueError, match="jobs"):
        run_sweep(sweep_file, out_dir=tmp_path / "out", progress=False, jobs=0)
    mixed = {**SWEEP, "sweep": {**SWEEP["sweep"], "variants": {"ok": {}, "pinned": {"reproducibility": "portable"}}}}
    sweep_file.write_text(yaml.safe_dump(mixed))
    with pytest.raises(ConfigError, match="reproducibility: every cell of a sweep runs with the same CPU kernels"):
        run_sweep(sweep_file, out_dir=tmp_path / "out", progress=False)
    sweep_file.write_text(yaml.safe_dump(SWEEP))
    with pytest.raises(ConfigError, match=r"sweep.baseline 'FedAVG' is not a variant; variants: \['FedAvg', 'FedProx'\]"):
        run_sweep(sweep_file, ["sweep.baseline=FedAVG"], out_dir=tmp_path / "out", progress=False)


def test_a_changed_config_reruns_its_cells_an_unchanged_one_does_not_and_an_interrupted_one_resumes(
        sweep_file, tmp_path, capsys, monkeypatch):
    one = {**SWEEP, "sweep": {"targets": ["uci"], "seeds": [0], "variants": {"FedAvg": {}}}}
    sweep_file.write_text(yaml.safe_dump(one))
    out, cell = tmp_path / "out", tmp_path / "out" / "FedAvg" / "uci" / "seed0"
    calls: list[tuple[Path, bool, bool]] = []  # (run_dir, resume, overwrite) of every run the sweep starts

    def recording(cfg: ExperimentConfig, run_dir: Path, **kw: bool) -> dict:
        calls.append((Path(run_dir), kw.get("resume", False), kw.get("overwrite", False)))
        return run_experiment(cfg, run_dir, **kw)

    monkeypatch.setattr("feddg.sweep.run_experiment", recording)
    first = run_sweep(sweep_file, out_dir=out, progress=False)
    assert calls == [(cell, False, True)]
    stamp = (cell / "results.json").stat().st_mtime_ns
    capsys.readouterr()

    again = run_sweep(sweep_file, out_dir=out, progress=False)
    assert calls == [(cell, False, True)]  # finished: loaded, no run started
    assert (cell / "results.json").stat().st_mtime_ns == stamp and "done already" in capsys.readouterr().err
    assert again["rows"] == first["rows"]

    changed = run_sweep(sweep_file, ["optim.lr=0.05"], out_dir=out, progress=False)
    assert calls == [(cell, False, True)] * 2
    err = capsys.readouterr().err
    assert (cell / "results.json").stat().st_mtime_ns != stamp
    assert f"rerunning {cell} from scratch: its config changed" in err.replace("\n", "")
    assert changed["rows"][0]["config_hash"] != first["rows"][0]["config_hash"]
    assert yaml.safe_load((cell / "config.yaml").read_text())["optim"]["lr"] == 0.05

    (cell / "results.json").unlink()  # interrupted after its last checkpoint: resumed, not rerun
    resumed = run_sweep(sweep_file, ["optim.lr=0.05"], out_dir=out, progress=False)
    assert calls == [(cell, False, True)] * 2 + [(cell, True, False)]
    assert "rerunning" not in capsys.readouterr().err
    assert resumed["rows"][0]["ood_acc"] == changed["rows"][0]["ood_acc"]


def test_tables_use_the_sample_std_and_a_student_t_interval():
    from feddg.evaluation.tables import csv_table, markdown_table

    rows = [{"variant": "A", "target": t, "seed": s, "ood_acc": v}
            for t, vals in (("x", [10.0, 20.0, 30.0]), ("y", [50.0, 50.0, 50.0])) for s, v in enumerate(vals)]
    rows.append({"variant": "B", "target": "x", "seed": 0, "ood_acc": 42.0})
    md = markdown_table(rows, "ood_acc")
    assert "| A | 20.0 ± 10.0 | 50.0 ± 0.0 | 35.0 ± 5.0 | [22.6, 47.4] n=3 |" in md  # t(0.975, 2) = 4.303
    assert "| B | 42.0 ± – | – | – | – |" in md  # one seed: no std, never 0
    lines = csv_table(rows, "ood_acc").splitlines()
    assert lines[0] == "method,target,mean,std_ddof1,ci95_low,ci95_high,n,dropped_clients"
    assert "A,x,20.000,10.000,-4.841,44.841,3,0" in lines and "B,x,42.000,,,,1,0" in lines


def test_paired_differences_cancel_what_moves_both_rows():
    from feddg.evaluation.tables import csv_table, markdown_table, paired_deltas

    # per-seed averages over targets x, y: base 10, 50, 90 (seeds 0-2); new = base + 1, + 2, + 3; new has a
    # seed 3 the baseline lacks (left out of the pairs)
    base = {0: (5.0, 15.0), 1: (45.0, 55.0), 2: (85.0, 95.0)}
    rows = [{"variant": "base", "target": t, "seed": s, "ood_acc": v}
            for s, vals in base.items() for t, v in zip("xy", vals, strict=True)]
    rows += [{"variant": "new", "target": t, "seed": s, "ood_acc": v + s + 1}
             for s, vals in base.items() for t, v in zip("xy", vals, strict=True)]
    rows += [{"variant": "new", "target": t, "seed": 3, "ood_acc": 0.0} for t in "xy"]
    assert paired_deltas(rows, "new", "base") == [1.0, 2.0, 3.0]
    md = markdown_table(rows, "ood_acc", baseline="base")
    assert md.splitlines()[0].endswith("| Δ avg vs base, paired [95 % CI] |")
    assert md.splitlines()[2].endswith("| 50.0 ± 40.0 | [-49.4, 149.4] n=3 | – |")  # t(0.975, 2) = 4.303
    assert md.splitlines()[3].endswith("| +2.0 [-0.5, +4.5] |")  # 2 ± 4.303 · 1 / √3
    assert "new,avg - base,2.000,1.000,-0.484,4.484,3,0" in csv_table(rows, "ood_acc", baseline="base").splitlines()
    assert "Δ" not in markdown_table(rows, "ood_acc")


def test_search_draws_seeded_configurations_from_the_methods_search_space():
    from feddg.algorithms.fedprox import FedProx
    from feddg.sweep import SweepSpec, search_variants

    spec = SweepSpec.model_validate({"variants": {"prox": {"method.name": "fedprox"}}, "search": {"n": 4, "seed": 3}})
    drawn = search_variants(spec, {})
    assert list(drawn) == ["prox #0", "prox #1", "prox #2", "prox #3"]
    assert drawn["prox #0"] == {"method.name": "fedprox"}  # draw 0 keeps the defaults
    mus = [drawn[f"prox #{k}"]["method.params.mu"] for k in (1, 2, 3)]
    assert all(mu in FedProx.search_space["mu"] for mu in mus)
    assert search_variants(spec, {}) == drawn  # seeded
    other = SweepSpec.model_validate({"variants": {"prox": {"method.name": "fedprox"}}, "search": {"n": 12, "seed": 4}})
    assert len({v.get("method.params.mu") for v in search_variants(other, {}).values()}) > 2
    assert search_variants(SweepSpec.model_validate({"variants": {"a": {}}}), {}) == {"a": {}}  # no search: unchanged


def test_search_draws_the_learning_rate_of_a_method_without_a_search_space():
    from feddg.sweep import LR_FACTORS, SweepSpec, search_variants

    spec = SweepSpec.model_validate({"variants": {"avg": {"method.name": "fedavg", "optim.lr": 0.05}},
                                     "search": {"n": 12}})
    drawn = search_variants(spec, {})
    assert drawn["avg #0"] == {"method.name": "fedavg", "optim.lr": 0.05}
    lrs = {drawn[f"avg #{k}"]["optim.lr"] for k in range(1, 12)}
    assert lrs <= {0.005, 0.015, 0.05, 0.15} and len(lrs) > 2 and len(LR_FACTORS) == 4
    assert not any(k.startswith("method.params") for v in drawn.values() for k in v)


def test_sweep_overrides_reach_the_sweep_section(tmp_path):
    from feddg.sweep import load_sweep

    path = tmp_path / "s.yaml"
    path.write_text("name: s\nsweep:\n  seeds: [0, 1]\n  variants: {prox: {method.name: fedprox}}\n")
    spec, base = load_sweep(path, ["sweep.search.n=3", "sweep.seeds=[4]", "federation.rounds=2"])
    assert spec.search is not None and spec.search.n == 3 and spec.seeds == [4]
    assert base["federation"]["rounds"] == 2


def test_a_reconstructed_method_is_named_so_in_tables_runs_and_the_report(sweep_file, tmp_path):
    from feddg.reports.sweep import sweep_rows

    hier = {**SWEEP, "hierarchy": {"stations": 2, "station_rounds": 1},
            "sweep": {"targets": ["uci"], "seeds": [0], "baseline": "FedRC",
                      "variants": {"FedAvg": {"method.name": "fedavg"}, "FedRC": {"method.name": "fedrc"}}}}
    sweep_file.write_text(yaml.safe_dump(hier))
    res = run_sweep(sweep_file, out_dir=tmp_path / "out", progress=False)
    assert {r["variant"] for r in res["rows"]} == {"FedAvg", "FedRC (reconstructed)"}
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| FedRC (reconstructed) |" in table and "vs FedRC (reconstructed)" in table
    assert json.loads((tmp_path / "out" / "sweep.json").read_text())["baseline"] == "FedRC (reconstructed)"
    (tmp_path / "out" / "runs.jsonl").unlink()  # a sweep still running: rows from the runs' results.json
    assert {r["variant"] for r in sweep_rows(tmp_path / "out")} == {"FedAvg", "FedRC (reconstructed)"}


def test_a_sweep_over_natural_clients_holds_out_one_seeded_fraction_of_the_domains():
    """``split.target_fraction`` (writers, cameras) is one cell per variant and seed, not one per domain: the
    fraction is drawn from the seed inside the run, so the sweep adds no split override."""
    from feddg.config import build_config
    from feddg.sweep import SweepSpec, _cells

    base = build_config({"data": {"dataset": "writers"}, "split": {"target_fraction": 0.1},
                         "partition": {"kind": "natural"}})
    assert _cells(SweepSpec(), base) == [("unseen 0.1", [])]


def test_each_row_and_folder_holds_the_figures_of_its_own_cells_run(sweep_file, tmp_path, monkeypatch):
    """Stand-in runs (no training) whose figures encode their cell's method, target and seed: every row carries its
    own cell's figures, folder and dropped clients, and the default metrics are the task's ood and id means."""
    codes = {"fedavg": 0, "fedprox": 100, "mnist": 10, "uci": 20}
    task = {"name": "classification", "metric": "acc", "label": "accuracy", "unit": "%", "bounds": [0, 100],
            "higher_is_better": True, "chance": 10.0}

    def stand_in(cfg: ExperimentConfig, run_dir: Path, progress: bool) -> dict:
        code = float(codes[cfg.method.name] + codes[str(cfg.split.target)] + cfg.seed)
        run_dir.mkdir(parents=True)
        return {"final": {"ood_acc": code, "id_acc": code + 0.5}, "time_total_s": 1.0, "source": ["svhn"],
                "failures": {"client_rounds_lost": cfg.seed}, "task": task}

    monkeypatch.setattr("feddg.sweep._run_or_load", stand_in)
    sweep_file.write_text(yaml.safe_dump({**SWEEP, "sweep": {**SWEEP["sweep"], "seeds": [0, 1]}}))
    out = tmp_path / "out"
    rows = run_sweep(sweep_file, ["sweep.selection=[last]"], out_dir=out, progress=False)["rows"]
    cells = [(v, t, s) for v in ("FedAvg", "FedProx") for t in ("uci", "mnist") for s in (0, 1)]  # the sweep's order
    assert [(r["variant"], r["target"], r["seed"]) for r in rows] == cells
    for r in rows:
        code = {"FedAvg": 0, "FedProx": 100}[r["variant"]] + codes[r["target"]] + r["seed"]
        assert (r["ood_acc"], r["id_acc"], r["dropped"]) == (code, code + 0.5, r["seed"])
        assert r["run_dir"] == str(out / r["variant"] / r["target"] / f"seed{r['seed']}")
    assert json.loads((out / "sweep.json").read_text())["metrics"] == ["ood_acc", "id_acc"]
    assert (out / "table_ood_acc.csv").is_file() and (out / "table_id_acc.csv").is_file()


def test_cells_are_each_target_once_or_every_ordered_ltdo_pair():
    from feddg.config import build_config
    from feddg.sweep import SweepSpec, _cells

    data = {"dataset": "digits-dg", "domains": ["mnist", "uci", "svhn"]}
    lodo = build_config({"data": data})
    assert _cells(SweepSpec(), lodo) == [(d, [f'split.target="{d}"']) for d in ("mnist", "uci", "svhn")]
    named = SweepSpec.model_validate({"targets": ["svhn", "mnist"]})
    assert _cells(named, lodo) == [(d, [f'split.target="{d}"']) for d in ("svhn", "mnist")]
    ltdo = _cells(SweepSpec(), build_config({"data": data, "split": {"protocol": "ltdo"}}))
    pairs = [("mnist", "uci"), ("mnist", "svhn"), ("uci", "mnist"), ("uci", "svhn"), ("svhn", "mnist"), ("svhn", "uci")]
    assert ltdo == [(f"{v}→{t}", [f'split.val_domain="{v}"', f'split.target="{t}"']) for v, t in pairs]


def test_search_draw_k_of_the_vth_variant_is_seeded_by_the_search_seed_v_and_k():
    """Each draw is rebuilt from its own generator, ``derived_seed(search.seed, v, k)``: another search seed draws
    anew, and two variants of one method draw independently."""
    import numpy as np

    from feddg.algorithms.fedprox import FedProx
    from feddg.seeds import derived_seed
    from feddg.sweep import SweepSpec, search_variants

    mus = FedProx.search_space["mu"]
    variants = {"a": {"method.name": "fedprox"}, "b": {"method.name": "fedprox"}}
    for seed in (3, 4):
        spec = SweepSpec.model_validate({"variants": variants, "search": {"n": 6, "seed": seed}})
        drawn = search_variants(spec, {})
        for v, name in enumerate(variants):
            expected = [mus[int(np.random.default_rng(derived_seed(seed, v, k)).integers(len(mus)))] for k in range(1, 6)]
            assert [drawn[f"{name} #{k}"]["method.params.mu"] for k in range(1, 6)] == expected
