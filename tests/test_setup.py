"""Building a federation from a config (src/feddg/federation/setup.py): the clients' holdouts and kept training
samples, the LTDO roles of the domains, the method's and model's options, and the workers' devices."""

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from toy import ToyDomains, ToyNet

from feddg.config import build_config
from feddg.federation.setup import (
    build_federation,
    make_clients,
    make_split,
    make_topology,
    text_options,
    worker_device,
)

# ToyDomains: 3 domains (a, b, c) x 4 classes x 30 = 120 samples a domain
TOY = {"partition": {"kind": "by_domain", "num_clients": 4}, "split": {"target": "c"}, "device": "cpu"}


def test_each_client_holds_out_floor_fraction_of_its_own_samples_and_trains_on_the_rest() -> None:
    ds = ToyDomains()
    cfg = build_config(TOY, ["partition.holdout=0.25"])
    clients = make_clients(ds, make_split(ds, cfg), cfg)
    # by_domain: 4 clients over the 2 source domains a, b -> 60 samples each, floor(0.25 * 60) = 15 held out
    assert [(len(c.train_idx), len(c.holdout_idx)) for c in clients] == [(45, 15)] * 4
    for c in clients:
        assert not np.intersect1d(c.train_idx, c.holdout_idx).size
        assert {int(d) for d in ds.domain_ids[np.concatenate([c.train_idx, c.holdout_idx])]} == set(c.domains)
    every = np.concatenate([np.concatenate([c.train_idx, c.holdout_idx]) for c in clients])
    assert np.array_equal(np.sort(every), np.flatnonzero(ds.domain_ids != 2))  # the source samples, each once


def test_train_fraction_keeps_at_least_train_min_samples() -> None:
    ds = ToyDomains()
    cfg = build_config(TOY, ["partition.train_fraction=0.5", "partition.train_min=40"])
    clients = make_clients(ds, make_split(ds, cfg), cfg)
    # 60 samples a client, 6 held out: 54 train, round(0.5 * 54) = 27 < train_min = 40 -> 40 kept
    assert [len(c.train_idx) for c in clients] == [40] * 4
    assert [len(c.holdout_idx) for c in clients] == [6] * 4


def test_ltdo_validation_domain_is_neither_trained_on_nor_tested() -> None:
    ds = ToyDomains()
    cfg = build_config(TOY, ["split.protocol=ltdo", "split.val_domain=a"])
    split = make_split(ds, cfg)
    assert np.array_equal(split.val_idx, np.arange(0, 120)) and np.array_equal(split.test_idx, np.arange(240, 360))
    assert split.val_domains == [0] and split.test_domains == [2] and split.source_domains == [1]
    clients = make_clients(ds, split, cfg)
    trained = np.concatenate([np.concatenate([c.train_idx, c.holdout_idx]) for c in clients])
    assert np.array_equal(np.sort(trained), np.arange(120, 240))


def test_the_method_and_model_options_of_the_config_reach_the_federation(cache_dir: Path) -> None:
    cfg = build_config({}, ["data.dataset=digits-dg", f"data.cache_dir={cache_dir}", "data.max_per_domain=20",
                            "model.name=cnn", "model.params.block_widths=[4,6]", "method.name=fedprox",
                            "method.params.mu=0.37", "split.target=uci", "partition.num_clients=3", "device=cpu"])
    fed = build_federation(cfg)
    assert fed.method.params.mu == 0.37  # type: ignore[attr-defined]
    convs = [m.out_channels for m in fed.model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convs == [4, 6]
    fed.model.eval()
    logits = fed.model(torch.zeros(2, *fed.dataset.image_shape))
    assert logits.shape == (2, 10)  # Digits-DG: the 10 digits


def test_target_fraction_holds_out_the_rounded_share_of_the_domains() -> None:
    ds = ToyDomains()
    cfg = build_config({**TOY, "split": {"target_fraction": 0.6}})
    split = make_split(ds, cfg)  # round(0.6 * 3) = 2 of the 3 domains held out
    assert len(split.test_domains) == 2 and len(split.source_domains) == 1
    assert sorted([*split.test_domains, *split.source_domains]) == [0, 1, 2]


def test_few_shot_may_deal_out_every_target_sample() -> None:
    ds = ToyDomains()
    cfg = build_config(TOY, ["partition.num_clients=2", "split.few_shot_k=60"])  # 2 x 60 = the 120 samples of c
    split = make_split(ds, cfg)
    clients = make_clients(ds, split, cfg)
    shots = [np.setdiff1d(c.train_idx, np.flatnonzero(ds.domain_ids != 2)) for c in clients]
    assert [len(s) for s in shots] == [60, 60]
    assert np.array_equal(np.sort(np.concatenate(shots)), np.arange(240, 360)) and split.test_idx.size == 0


def test_cuda_workers_go_round_robin_over_the_gpus_unless_one_is_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert [worker_device("cuda", i) for i in range(5)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:0", "cuda:1"]
    assert [worker_device("auto", i) for i in (1, 5)] == ["cuda:1", "cuda:2"]
    assert [worker_device("cuda:2", i) for i in range(3)] == ["cuda:2"] * 3
    assert worker_device("cpu", 4) == "cpu"


def test_a_token_datasets_tokenizer_is_data_tokenizer_else_the_models_directory() -> None:
    text = ["data.dataset=synthetic-sentiment", "data.max_length=24"]
    own = build_config({}, [*text, "model.name=transformer", "model.path=/model", "data.tokenizer=/tok"])
    assert text_options(own) == {"tokenizer": "/tok", "max_length": 24, "vocab_size": 4000}
    assert text_options(build_config({}, [*text, "model.name=transformer", "model.path=/model"]))["tokenizer"] == "/model"


def test_lodo_holds_out_the_first_domain_when_no_target_is_named() -> None:
    ds = ToyDomains()
    split = make_split(ds, build_config({"partition": {"kind": "by_domain", "num_clients": 4}}))
    assert split.test_domains == [0] and split.source_domains == [1, 2]  # domain a
    assert np.array_equal(split.test_idx, np.arange(0, 120))


@pytest.mark.parametrize(("split", "match"), [
    ({"target_fraction": 0.9}, "holds out all 3 domains"),  # round(0.9 · 3) = 3 of 3
    ({"protocol": "ltdo", "target": "c", "val_domain": "c"}, "must differ from split.target"),
    ({"protocol": "ltdo", "target": ["b", "c"], "val_domain": "a"}, "holds out one test domain"),
    ({"protocol": "lodo", "target": "c", "val_domain": "a"}, "only used with split.protocol=ltdo"),
])
def test_splits_that_would_leave_no_source_or_mix_the_roles_of_domains_are_refused(split: dict[str, Any],
                                                                                   match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_split(ToyDomains(), build_config({**TOY, "split": split}))


def test_train_fraction_keeps_the_rounded_share_and_leaves_the_holdouts_as_without_it() -> None:
    ds = ToyDomains()
    full = make_clients(ds, make_split(ds, cfg := build_config(TOY)), cfg)
    kept = make_clients(ds, make_split(ds, cfg := build_config(TOY, ["partition.train_fraction=0.35"])), cfg)
    # 54 training samples a client: round(0.35 * 54) = round(18.9) = 19 kept, drawn from its own training samples
    assert [len(c.train_idx) for c in kept] == [19] * 4
    for f, k in zip(full, kept, strict=True):
        assert np.array_equal(f.holdout_idx, k.holdout_idx)  # its own random stream: the holdouts do not move
        assert np.isin(k.train_idx, f.train_idx).all()


class _ToyVolumes(ToyDomains):
    """ToyDomains whose samples come in the given cases (volumes of slices)."""

    def __init__(self, cases: np.ndarray) -> None:
        super().__init__()
        self.cases = cases


def test_a_clients_holdout_is_made_of_whole_cases() -> None:
    cases = np.arange(360) // 5  # cases of 5 consecutive slices, 24 a domain
    ds = _ToyVolumes(cases)
    cfg = build_config(TOY, ["partition.holdout=0.25"])
    clients = make_clients(ds, make_split(ds, cfg), cfg)
    for c in clients:  # by_domain: 12 cases a client, floor(0.25 · 12) = 3 held out with their 5 slices each
        assert (len(c.train_idx), len(c.holdout_idx)) == (45, 15)
        assert not np.intersect1d(cases[c.train_idx], cases[c.holdout_idx]).size


def test_the_hierarchy_section_reaches_the_station_topology() -> None:
    ds = ToyDomains()
    cfg = build_config(TOY, ["hierarchy.stations=2", "hierarchy.assignment=round_robin",
                             "hierarchy.station_fraction=0.5"])
    topo = make_topology(cfg, make_clients(ds, make_split(ds, cfg), cfg), ToyNet())
    assert [topo.station_of(c) for c in range(4)] == [0, 1, 0, 1]
    draws = {tuple(topo.sample(t, 1.0, seed=0)) for t in range(1, 9)}
    assert draws <= {(0, 2), (1, 3)}  # round(0.5 · 2) = 1 station a server round, with all its clients
