"""Natural client groups (a writer, a camera): ``partition.kind: natural`` makes each group one client, a fraction
split holds out whole domains, and ``eval.per_domain: false`` keeps metrics.jsonl to the means."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from toy import toy_federation

from feddg.config import build_config
from feddg.data.base import DomainDataset
from feddg.data.registry import PLUGINS, Plugin
from feddg.engines.inprocess import run_inprocess
from feddg.federation.server import Server
from feddg.federation.setup import make_clients, make_split

GROUPS_PER_DOMAIN, DOMAINS = 170, 21  # 20 source domains × 170 = 3,400 writers, and a held-out one


class Writers(DomainDataset):
    """21 domains of 170 writers, 3 tiny images each, writer ids in ``groups``."""

    name = "toy-writers"

    def __init__(self) -> None:
        n = DOMAINS * GROUPS_PER_DOMAIN * 3
        self.groups = np.repeat(np.arange(DOMAINS * GROUPS_PER_DOMAIN), 3)
        self.domain_ids = self.groups // GROUPS_PER_DOMAIN
        self.labels = np.arange(n, dtype=np.int64) % 4
        self.domains = [f"d{d}" for d in range(DOMAINS - 1)] + ["heldout"]
        self.classes = ["0", "1", "2", "3"]
        self.image_shape = (1, 2, 2)

    def get_batch(self, indices, train, generator=None):
        return torch.zeros(len(indices), 1, 2, 2), torch.as_tensor(self.labels[indices])


@pytest.fixture(scope="module")
def writers():
    ds = Writers()
    PLUGINS[ds.name] = Plugin(lambda **_: ds, domains=ds.domains, classes=ds.classes)
    yield ds
    del PLUGINS[ds.name]


def _clients(ds, **split):
    cfg = build_config({"data": {"dataset": ds.name}, "partition": {"kind": "natural"}, "split": split})
    split_ = make_split(ds, cfg)
    return split_, make_clients(ds, split_, cfg)


def test_natural_partition_makes_every_group_a_client_with_no_sample_in_two(writers):
    split, clients = _clients(writers, target="heldout")
    assert len(clients) == 3400
    every = np.concatenate([np.concatenate([c.train_idx, c.holdout_idx]) for c in clients])
    assert len(every) == len(np.unique(every)) == len(split.source_idx)  # no sample twice, none lost
    np.testing.assert_array_equal(np.sort(every), split.source_idx)
    for c in clients[:50]:  # each client is exactly one writer's samples
        assert len(np.unique(writers.groups[np.concatenate([c.train_idx, c.holdout_idx])])) == 1


def test_a_fraction_split_holds_out_whole_domains_and_their_groups(writers):
    split, clients = _clients(writers, target_fraction=0.2)
    assert len(split.test_domains) == round(0.2 * DOMAINS)
    held = set(np.unique(writers.groups[split.test_idx]).tolist())
    trained = set(np.unique(writers.groups[np.concatenate([c.train_idx for c in clients])]).tolist())
    assert held and not held & trained and len(trained) == len(clients)
    assert set(np.unique(writers.domain_ids[split.test_idx]).tolist()) == set(split.test_domains)
    again, _ = _clients(writers, target_fraction=0.2)
    assert again.test_domains == split.test_domains  # a seeded draw


@pytest.mark.parametrize(("config", "message"), [
    ({"partition": {"kind": "natural", "num_clients": 5}}, "makes one client per natural group"),
    ({"partition": {"kind": "natural"}, "split": {"target": "heldout", "target_fraction": 0.1}}, "drop split.target"),
])
def test_natural_partition_and_fraction_refuse_what_they_cannot_do(writers, config, message):
    cfg = build_config({"data": {"dataset": writers.name}, "split": {"target": "heldout"}, **config})
    with pytest.raises(ValueError, match=message):
        make_clients(writers, make_split(writers, cfg), cfg)


def test_natural_partition_needs_a_dataset_with_groups():
    fed = toy_federation()
    cfg = build_config({"partition": {"kind": "natural"}, "split": {"target": "c"}})
    with pytest.raises(ValueError, match="has none"):
        make_clients(fed.dataset, make_split(fed.dataset, cfg), cfg)


def test_per_domain_false_keeps_the_means_in_metrics_and_the_domains_in_results(tmp_path):
    server = Server(toy_federation("eval.per_domain=false", "federation.rounds=2"), tmp_path / "run")
    results = run_inprocess(server)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("ood_acc" in r and "id_acc" in r and not any("_acc/" in k for k in r) for r in rows)
    assert results["final"]["ood_acc/c"] == results["final"]["ood_acc"] == rows[-1]["ood_acc"]
    assert {"id_acc/a", "id_acc/b"} <= set(results["final"]) and results["counts"]["ood_acc/c"] == 120


def test_train_fraction_keeps_a_seeded_share_of_each_clients_training_samples():
    full = toy_federation()
    part = toy_federation("partition.train_fraction=0.25")
    for a, b in zip(full.clients, part.clients, strict=True):
        np.testing.assert_array_equal(a.holdout_idx, b.holdout_idx)  # the holdout is drawn first, unchanged
        assert set(b.train_idx) <= set(a.train_idx) and len(b.train_idx) == round(0.25 * len(a.train_idx))
    again = toy_federation("partition.train_fraction=0.25")
    assert all(np.array_equal(x.train_idx, y.train_idx) for x, y in zip(part.clients, again.clients, strict=True))


def test_train_min_keeps_at_least_that_many_training_samples_or_all():
    full = toy_federation()
    sizes = sorted(len(c.train_idx) for c in full.clients)
    floor = sizes[0] + 1  # above the smallest client's size: it keeps all it has
    part = toy_federation("partition.train_fraction=0.1", f"partition.train_min={floor}")
    for a, b in zip(full.clients, part.clients, strict=True):
        want = max(round(0.1 * len(a.train_idx)), min(floor, len(a.train_idx)))
        assert len(b.train_idx) == want and set(b.train_idx) <= set(a.train_idx)
    assert any(len(b.train_idx) == len(a.train_idx) for a, b in zip(full.clients, part.clients, strict=True))


def test_a_natural_run_rebuilds_from_its_config_yaml_and_a_sweep_tree():
    """A natural partition leaves the client count to the data; the written config (config.yaml, a sweep's cell
    tree, a spawned worker's tree) must build the same federation again, not refuse the default count."""
    from feddg.config import build_config, config_tree, dump_config

    cfg = build_config({"data": {"dataset": "writers"}, "split": {"target_fraction": 0.1},
                        "partition": {"kind": "natural"}})
    again = build_config(yaml.safe_load(dump_config(cfg)))
    assert "num_clients" not in again.partition.model_fields_set and again == cfg
    assert "num_clients" not in config_tree(cfg)["partition"]
    fixed = build_config({"partition": {"kind": "natural", "num_clients": 7}})
    assert config_tree(fixed)["partition"]["num_clients"] == 7  # set by the user: kept, and checked at build
