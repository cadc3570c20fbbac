"""provenance.json: the config hash (what a run computed), versions, commit and machine."""

from __future__ import annotations

import json

import feddg
from feddg.config import build_config, dump_config
from feddg.federation import provenance
from feddg.federation.provenance import (
    PROVENANCE,
    config_hash,
    git_state,
    record_resume,
    stored_config_hash,
    write_provenance,
)


def test_the_hash_follows_what_is_computed_not_where_or_how_fast():
    base = config_hash(build_config({}))
    assert base == config_hash(build_config({}))
    assert len(base) == 64
    for same in ("output_dir=elsewhere", "name=other", "federation.workers=4", "device=cpu",
                 "federation.checkpoint_every=3", "logging.tensorboard=true", "data.loader_workers=2",
                 "flower.round_timeout_s=60", "flower.client_num_cpus=2"):
        assert config_hash(build_config({}, [same])) == base, same
    for different in ("optim.lr=0.02", "seed=1", "federation.rounds=11", "eval.every=2", "method.name=fedprox",
                      "flower.secaggplus.clipping_range=4"):  # SecAgg+'s quantisation changes the aggregate
        assert config_hash(build_config({}, [different])) != base, different


def test_every_excluded_key_is_a_config_key():
    """A renamed key must not silently fall back into the hash."""
    from feddg.config import ExperimentConfig

    for dotted in provenance.HASH_EXCLUDES:
        model = ExperimentConfig
        for part in dotted.split("."):
            assert part in model.model_fields, f"HASH_EXCLUDES names {dotted!r}, which the config has not"
            model = model.model_fields[part].annotation


def test_provenance_json_records_hash_versions_and_machine(tmp_path):
    cfg = build_config({}, ["seed=3"])
    write_provenance(tmp_path, cfg)
    rec = json.loads((tmp_path / PROVENANCE).read_text())
    assert rec["config_hash"] == config_hash(cfg) and rec["feddg"] == feddg.__version__
    assert {"torch", "numpy", "flwr", "python", "git_commit", "git_dirty"} <= rec.keys()
    assert rec["machine"]["cpus"] >= 1 and rec["machine"]["device"].startswith(("cpu", "cuda"))
    assert stored_config_hash(tmp_path) == config_hash(cfg)

    resumed = build_config({}, ["seed=3", "federation.rounds=20"])
    record_resume(tmp_path, resumed, ["federation.rounds=20"])
    rec = json.loads((tmp_path / PROVENANCE).read_text())
    assert rec["config_hash"] == config_hash(resumed) and rec["resumed"][0]["overrides"] == ["federation.rounds=20"]


def test_without_provenance_json_the_config_yaml_is_rehashed(tmp_path):
    assert stored_config_hash(tmp_path) is None
    cfg = build_config({}, ["optim.lr=0.05"])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    assert stored_config_hash(tmp_path) == config_hash(cfg)
    (tmp_path / PROVENANCE).write_text("{truncated")  # unreadable: fall back to config.yaml
    assert stored_config_hash(tmp_path) == config_hash(cfg)


def test_no_git_commit_outside_a_checkout_and_no_failure_without_git(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance.feddg, "__file__", str(tmp_path / "feddg" / "__init__.py"))
    (tmp_path / "feddg").mkdir()
    assert git_state() == {"git_commit": None, "git_dirty": None}
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable at all
    write_provenance(tmp_path, build_config({}))
    assert json.loads((tmp_path / PROVENANCE).read_text())["git_commit"] is None
