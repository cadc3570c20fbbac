"""``split.protocol: federated`` (FedFA Tables 3-5): no domain is held out, every figure is a client's own holdout,
and a sweep tables one column per domain."""

from __future__ import annotations

import numpy as np
import pytest
import yaml
from toy import toy_federation

from feddg.config import build_config
from feddg.engines.inprocess import run_inprocess
from feddg.federation.server import Server
from feddg.federation.setup import make_split
from feddg.sweep import run_sweep


def test_every_domain_is_a_source_and_nothing_is_held_out():
    fed = toy_federation("split.protocol=federated", "split.target=null", "partition.num_clients=3")
    split = fed.split
    assert split.test_domains == [] and split.val_domains == [] and len(split.test_idx) == 0
    assert split.source_domains == sorted(set(fed.dataset.domain_ids.tolist()))
    assert len(split.source_idx) == len(fed.dataset)


@pytest.mark.parametrize("over", ["split.target=a", "split.target_fraction=0.5", "split.few_shot_k=1"])
def test_a_held_out_domain_is_refused_in_one_line(over):
    fed = toy_federation()
    cfg = build_config({"data": {"dataset": fed.cfg.data.dataset}}, ["split.protocol=federated", over])
    with pytest.raises(ValueError, match=f"split.protocol=federated holds no domain out: drop {over.split('=')[0]}"):
        make_split(fed.dataset, cfg)


def test_results_are_the_clients_holdouts_only(tmp_path):
    fed = toy_federation("split.protocol=federated", "split.target=null", "partition.num_clients=3", "federation.rounds=1")
    results = run_inprocess(Server(fed, tmp_path / "run"))
    final = results["final"]
    assert results["target"] == [] and "id_acc" in final and not any(k.startswith("ood") for k in final)
    per_domain = {k: v for k, v in final.items() if k.startswith("id_acc/")}
    assert set(per_domain) == {f"id_acc/{d}" for d in fed.dataset.domains}
    holdouts = np.concatenate([c.holdout_idx for c in fed.clients])
    assert results["counts"]["id_acc"] == len(holdouts)


def test_a_federated_sweep_tables_a_column_per_domain_averaged_over_domains(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "name": "fed", "data": {"dataset": "digits-dg", "max_per_domain": 40}, "split": {"protocol": "federated"},
        "partition": {"kind": "by_domain", "num_clients": 4}, "model": {"name": "lenet"},
        "federation": {"rounds": 1, "batch_size": 32, "workers": 1},
        "sweep": {"seeds": [0], "variants": {"FedAvg": {}}}}))
    res = run_sweep(path, out_dir=tmp_path / "out", progress=False)
    (row,) = res["rows"]
    header, _, line = res["markdown"].split("\n\n")[1].splitlines()
    assert header == "| method | mnist | uci | synth | mnistm | avg | avg 95 % CI |"
    cells = [c.strip() for c in line.strip("|").split("|")]
    per_site = [row[f"id_acc/{d}"] for d in ("mnist", "uci", "synth", "mnistm")]
    assert cells[1:5] == [f"{v:.1f} ± –" for v in per_site]
    assert cells[5] == f"{np.mean(per_site):.1f} ± –"  # the mean over sites (FedFA Table 4's "Average")
