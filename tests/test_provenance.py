"""provenance.json: the config hash (what a run computed), versions, commit and machine."""

from __future__ import annotations

import json
import os
import platform
import socket
import sys

import numpy as np
import pytest
import torch

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
                 "flower.round_timeout_s=60", "flower.client_num_cpus=2", "federation.client_state_budget_mb=64",
                 "flower.roster=/tmp/roster.yaml", "audit.attacks=[gram]"):
        assert config_hash(build_config({}, [same])) == base, same
    for different in ("optim.lr=0.02", "seed=1", "federation.rounds=11", "eval.every=2", "method.name=fedprox"):
        assert config_hash(build_config({}, [different])) != base, different
    secagg = ["federation.engine=flower", "flower.secure_aggregation=secaggplus"]  # its quantisation changes the
    assert config_hash(build_config({}, [*secagg, "flower.secaggplus.clipping_range=4"])) != config_hash(  # aggregate
        build_config({}, secagg))
    assert config_hash(build_config({}, ["flower.secaggplus.clipping_range=4"])) == base  # without SecAgg+: nothing
    pfedhn = config_hash(build_config({}, ["method.name=pfedhn"]))  # a default written out, alone, is no change
    assert config_hash(build_config({}, ["method.name=pfedhn", "method.params.server_lr=0.01"])) == pfedhn


def test_every_excluded_key_is_a_config_key():
    """A renamed key must not silently fall back into the hash."""
    from feddg.config import ExperimentConfig

    for dotted in provenance.HASH_EXCLUDES:
        model = ExperimentConfig
        for part in dotted.split("."):
            assert part in model.model_fields, f"HASH_EXCLUDES names {dotted!r}, which the config has not"
            model = model.model_fields[part].annotation


def test_provenance_json_records_hash_versions_and_machine(tmp_path):
    cfg = build_config({}, ["seed=3", "device=cpu"])
    write_provenance(tmp_path, cfg)
    rec = json.loads((tmp_path / PROVENANCE).read_text())
    assert rec["config_hash"] == config_hash(cfg) and rec["feddg"] == feddg.__version__
    assert {"flwr", "git_commit", "git_dirty"} <= rec.keys()
    # each version under its own name, read here from the packages themselves
    assert (rec["torch"], rec["numpy"], rec["python"]) == (torch.__version__, np.__version__,
                                                           platform.python_version())
    assert rec["command"] == sys.argv and rec["hash_excludes"] == list(provenance.HASH_EXCLUDES)
    assert rec["machine"] == {"cpus": os.cpu_count(), "device": "cpu", "hostname": socket.gethostname()}
    assert stored_config_hash(tmp_path) == config_hash(cfg)

    resumed = build_config({}, ["seed=3", "federation.rounds=20"])
    record_resume(tmp_path, resumed, ["federation.rounds=20"])
    rec = json.loads((tmp_path / PROVENANCE).read_text())
    assert rec["config_hash"] == config_hash(resumed) and rec["resumed"][0]["overrides"] == ["federation.rounds=20"]
    assert (rec["resumed"][0]["torch"], rec["resumed"][0]["numpy"]) == (torch.__version__, np.__version__)


def test_without_provenance_json_the_config_yaml_is_rehashed(tmp_path):
    assert stored_config_hash(tmp_path) is None
    cfg = build_config({}, ["optim.lr=0.05"])
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    assert stored_config_hash(tmp_path) == config_hash(cfg)
    (tmp_path / PROVENANCE).write_text("{truncated")  # unreadable: fall back to config.yaml
    assert stored_config_hash(tmp_path) == config_hash(cfg)
    yaml = (tmp_path / "config.yaml").read_text()
    assert yaml.count("\ndevice: auto\n") == 1
    (tmp_path / "config.yaml").write_text(yaml.replace("\ndevice: auto\n", "\ndevice: cuda:7\n"))  # not on this machine
    assert stored_config_hash(tmp_path) == config_hash(cfg)  # the device is not hashed, nor checked here


def test_no_git_commit_outside_a_checkout_and_no_failure_without_git(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance.feddg, "__file__", str(tmp_path / "feddg" / "__init__.py"))
    (tmp_path / "feddg").mkdir()
    assert git_state() == {"git_commit": None, "git_dirty": None}
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable at all
    write_provenance(tmp_path, build_config({}))
    assert json.loads((tmp_path / PROVENANCE).read_text())["git_commit"] is None


def test_method_and_hierarchy_parameters_are_hashed_resolved():
    """``{}`` and the defaults written out are the same computation (a sweep used to rerun the cell)."""
    bare = config_hash(build_config({"method": {"name": "fedprox"}}))
    assert config_hash(build_config({"method": {"name": "fedprox", "params": {"mu": 0.01}}})) == bare
    assert config_hash(build_config({"method": {"name": "fedprox", "params": {"mu": 0.1}}})) != bare
    tree = {"hierarchy": {"stations": 2, "merge": "hfedatm"}, "partition": {"num_clients": 4}}
    written = {**tree, "hierarchy": {**tree["hierarchy"], "params": {"alpha": 0.75}}}
    assert config_hash(build_config(tree)) == config_hash(build_config(written))


def test_a_sweep_cell_whose_input_files_changed_is_rerun(tmp_path, monkeypatch):
    """The hash covers the paths; the inputs stamp their files: weights rewritten in place rerun the cell."""
    from feddg import sweep

    weights = tmp_path / "start.pth"
    weights.write_bytes(b"one")
    cfg = build_config({"model": {"weights": str(weights)}})
    run = tmp_path / "cell"
    run.mkdir()
    write_provenance(run, cfg)
    (run / "results.json").write_text("{}")
    calls = []
    monkeypatch.setattr(sweep, "run_experiment", lambda cfg, run_dir, **kw: calls.append(kw) or {"rerun": True})
    assert sweep._run_or_load(cfg, run, progress=False) == {}  # unchanged: loaded
    weights.write_bytes(b"two, longer")  # another file under the same name
    assert provenance.changed_inputs(run, cfg) == ["model.weights"]
    write_provenance(run, cfg)
    stat = weights.stat()
    weights.write_bytes(b"owt, longer")  # rewritten in place with as many bytes: only its time tells
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert provenance.changed_inputs(run, cfg) == ["model.weights"]
    tokenizer = build_config({"model": {"weights": str(weights)}, "data": {"tokenizer": str(tmp_path / "tok")}})
    assert provenance.changed_inputs(run, tokenizer) == ["data.tokenizer", "model.weights"]  # one it did not read
    assert sweep._run_or_load(cfg, run, progress=False) == {"rerun": True} and calls == [{"overwrite": True,
                                                                                          "progress": False}]
    assert provenance.inputs_stamp(build_config({"data": {"root": str(tmp_path / "nowhere")}})) == {
        "data.root": "missing"}
    (data := tmp_path / "data").mkdir()
    (data / "a.png").write_bytes(b"x")
    folder = build_config({"data": {"root": str(data), "cache_dir": str(data / "cache")}})
    before = provenance.inputs_stamp(folder)
    (data / "cache").mkdir()
    (data / "cache" / "images.npy").write_bytes(b"feddg's own")  # a cache under the root is not an input
    assert provenance.inputs_stamp(folder) == before
    (data / "b.png").write_bytes(b"y")
    assert provenance.inputs_stamp(folder) != before


def test_a_resume_keeps_the_hash_only_where_a_fresh_run_computes_the_same(tmp_path):
    from feddg.config import ConfigError
    from feddg.experiment import _same_as_fresh, resume_experiment

    two = build_config({"federation": {"rounds": 2}, "eval": {"every": 2}})
    assert _same_as_fresh(two, build_config({"federation": {"rounds": 4}, "eval": {"every": 2}}))
    assert not _same_as_fresh(two, build_config({"federation": {"rounds": 4}, "eval": {"every": 3}}))  # eval.every
    odd = build_config({"federation": {"rounds": 3}, "eval": {"every": 2}})  # round 3 was evaluated as the last
    assert not _same_as_fresh(odd, build_config({"federation": {"rounds": 4}, "eval": {"every": 2}}))
    run = tmp_path / "run"
    run.mkdir()
    write_provenance(run, odd)
    record_resume(run, two, [], same_as_fresh=False)
    assert stored_config_hash(run) == provenance.CHANGED_ON_RESUME + config_hash(two) != config_hash(two)
    record_resume(run, two, [])  # a later plain resume does not clear the mark
    assert stored_config_hash(run) != config_hash(two)
    (ga := tmp_path / "ga").mkdir()
    (ga / "config.yaml").write_text(dump_config(build_config({"method": {"name": "feddg_ga"},
                                                              "federation": {"rounds": 2}})))
    with pytest.raises(ConfigError, match="cannot change on resume with feddg_ga"):  # its step decays over R
        resume_experiment(ga, ["federation.rounds=4"], progress=False)
