"""What the set-up's refusals and draws promise beyond tests/test_setup.py (found by mutating
src/feddg/federation/setup.py and examples.py): the held-out domains' order, few-shot's exact sample budget, an
extra target's class order, an LTDO validation domain that is the data's official ood test split, and the
examples' sites."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from support.natural_fixtures import iwildcam_tree

from feddg.config import ExtraEvalConfig, build_config
from feddg.data import load_dataset
from feddg.federation import setup
from feddg.federation.examples import evaluation_sites
from feddg.federation.setup import few_shot_samples, held_out, load_extra_target, make_split


@pytest.mark.parametrize("seed", range(4))
def test_a_drawn_fraction_of_domains_is_listed_in_the_datasets_domain_order(seed: int) -> None:
    data = SimpleNamespace(domain_ids=np.repeat(np.arange(10), 2), domains=[f"d{i}" for i in range(10)])
    drawn = held_out(data, build_config({}, ["split.target_fraction=0.5", f"seed={seed}"]))  # type: ignore[arg-type]
    assert len(set(drawn)) == 5 and drawn == sorted(drawn) and set(drawn) <= set(range(10))


def test_few_shot_takes_every_target_sample_it_may_and_refuses_one_more_in_one_line() -> None:
    data = SimpleNamespace(cases=None, domain_ids=np.array([0] * 4 + [1] * 6))  # 6 samples of target domain 1
    cfg = build_config({}, ["split.few_shot_k=2", "partition.num_clients=3"])
    shots = few_shot_samples(data, [1], cfg)  # type: ignore[arg-type]  # 3 clients × 2 = all 6
    assert sorted(np.concatenate(shots).tolist()) == list(range(4, 10))
    assert all(s.tolist() == sorted(s.tolist()) for s in shots)
    short = SimpleNamespace(cases=None, domain_ids=np.array([0] * 4 + [1] * 5))
    with pytest.raises(ValueError, match=r"^split\.few_shot_k=2 for 3 clients needs 6 target samples, there are 5$"):
        few_shot_samples(short, [1], cfg)  # type: ignore[arg-type]


def test_an_extra_target_with_the_training_classes_in_another_order_is_refused(monkeypatch) -> None:
    reference = SimpleNamespace(inputs="images", task="classification", mean=(0.5,), std=(0.5,),
                                image_shape=(1, 8, 8), classes=["cat", "dog"])
    loaded = SimpleNamespace(classes=["dog", "cat"], image_shape=(1, 8, 8))  # the same names, the order swapped
    monkeypatch.setattr(setup, "load_dataset", lambda *args, **kwargs: loaded)
    with pytest.raises(ValueError, match=r"needs the same classes in the same order$"):
        load_extra_target(ExtraEvalConfig(name="x", dataset="digits-dg"), build_config({}), reference)  # type: ignore[arg-type]


def test_ltdo_may_validate_on_the_official_ood_test_split_and_test_on_the_official_validation_split(tmp_path) -> None:
    root = iwildcam_tree(tmp_path)
    ds = load_dataset("iwildcam", root=str(root), cache_dir=root / "cache", image_size=8, transforms="none")
    assert (ds.ood_test, ds.ood_validation) == ("test", "val")
    split = make_split(ds, build_config({"data": {"dataset": "iwildcam"},
                                         "split": {"protocol": "ltdo", "val_domain": "test", "target": "val"}}))
    assert [ds.domains[d] for d in split.test_domains] == ["val"]  # neither official split trains
    assert {ds.domains[d] for d in split.source_domains} == set(ds.domains) - {"test", "val"}


def test_the_examples_show_every_held_out_validation_and_holdout_domain_with_its_own_samples() -> None:
    domain_ids = np.array([0, 0, 1, 1, 2, 2, 3, 3])  # domains: test, val, source a, source b (unused here)
    server = SimpleNamespace(
        fed=SimpleNamespace(split=SimpleNamespace(test_idx=np.array([0, 1]), val_idx=np.array([3])),
                            dataset=SimpleNamespace(domain_ids=domain_ids, domains=["test", "val", "a", "b"])),
        evaluator=SimpleNamespace(holdouts=np.array([5])))
    sites = evaluation_sites(server)  # type: ignore[arg-type]
    assert list(sites) == ["test", "val", "a"]  # the dataset's domain order; b has no evaluation sample
    assert [sites[k].tolist() for k in sites] == [[0, 1], [3], [5]]


def test_the_final_predictor_reads_its_samples_as_evaluation_does_without_training_augmentation(tmp_path) -> None:
    from toy import toy_federation

    from feddg.federation.examples import final_predictor
    from feddg.federation.server import Server

    server = Server(toy_federation("federation.rounds=1"), tmp_path / "run")
    asked: list[bool] = []
    read = server.fed.dataset.get_batch

    def recording(indices, train, generator=None):
        asked.append(train)
        return read(indices, train, generator)

    server.fed.dataset.get_batch = recording
    final_predictor(server)(server.fed.split.test_idx)
    assert asked == [False]


def test_a_clients_kept_training_fraction_is_listed_in_sample_order() -> None:
    from toy import ToyDomains

    ds = ToyDomains()
    cfg = build_config({"partition": {"kind": "by_domain", "num_clients": 4}, "split": {"target": "c"}},
                       ["partition.train_fraction=0.5"])
    clients = setup.make_clients(ds, make_split(ds, cfg), cfg)
    # 60 samples a client, ⌊0.1 · 60⌋ = 6 held out (the default holdout), round(0.5 · 54) = 27 kept
    assert all(len(c.train_idx) == 27 and c.train_idx.tolist() == sorted(c.train_idx.tolist()) for c in clients)


def test_few_shot_with_natural_clients_is_refused_in_one_line(tmp_path) -> None:
    root = iwildcam_tree(tmp_path)
    ds = load_dataset("iwildcam", root=str(root), cache_dir=root / "cache", image_size=8, transforms="none")
    cfg = build_config({"data": {"dataset": "iwildcam"}, "partition": {"kind": "natural"},
                        "split": {"target": ["test", "val"], "few_shot_k": 1}})
    with pytest.raises(ValueError, match=r"^split\.few_shot_k deals target samples to partition\.num_clients clients; "
                                         r"with natural groups the clients are the groups"):
        setup.make_clients(ds, make_split(ds, cfg), cfg)


def test_few_shot_samples_join_each_clients_training_data_in_sample_order() -> None:
    from toy import ToyDomains

    ds = ToyDomains()
    cfg = build_config({"partition": {"kind": "by_domain", "num_clients": 4}, "split": {"target": "a"}},
                       ["split.few_shot_k=2"])
    clients = setup.make_clients(ds, make_split(ds, cfg), cfg)
    for c in clients:  # 54 source samples (6 of 60 held out) and 2 of domain a, whose samples come first
        assert len(c.train_idx) == 56 and (ds.domain_ids[c.train_idx] == 0).sum() == 2
        assert c.train_idx.tolist() == sorted(c.train_idx.tolist())
