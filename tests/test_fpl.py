"""FPL: FINCH cluster prototypes, unbiased prototypes, CPCL and UPCR, the prototype upload."""

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from toy import toy_federation

from feddg.algorithms import fpl
from feddg.algorithms.base import ClientContext, Reply
from feddg.algorithms.fpl import (
    CLUSTER,
    CLUSTER_CLASS,
    FPL,
    HAS_UNBIASED,
    PROTO_MEAN,
    PROTO_PRESENT,
    UNBIASED,
    FPLParams,
    cluster_prototypes,
    cpcl_loss,
    upcr_loss,
)
from feddg.engines.inprocess import run_inprocess
from feddg.federation.client import client_context
from feddg.federation.server import Server


def test_cluster_and_unbiased_prototypes():
    # class 0: 3 client prototypes near (1, 0), 2 near (0, 1); class 1 held by one client; class 2 by none
    protos = np.zeros((5, 3, 2), np.float32)
    protos[:, 0] = [[1.0, 0.0], [1.0, 0.1], [1.0, 0.2], [0.0, 1.0], [0.2, 1.0]]
    protos[0, 1] = [3.0, 3.0]
    present = np.zeros((5, 3), np.int8)
    present[:, 0] = 1
    present[0, 1] = 1
    clusters, classes, unbiased, has = cluster_prototypes(protos, present)
    # FINCH's first neighbour graph: two components for class 0; the coarsest partition keeps them
    expected = sorted([(1.0, 0.1), (0.1, 1.0)])
    assert sorted(map(tuple, np.round(clusters[classes == 0], 5))) == expected
    assert np.allclose(unbiased[0], [0.55, 0.55])  # mean of cluster means, not of the 5 prototypes (0.64, 0.46)
    assert np.allclose(clusters[classes == 1], [[3.0, 3.0]]) and np.allclose(unbiased[1], [3.0, 3.0])
    assert list(has) == [1, 1, 0] and np.allclose(unbiased[2], 0)


def test_cpcl_hand_value():
    z = torch.tensor([[1.0, 0.0]])
    clusters = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-3.0, 0.0]])  # cosines 1, 0, -1
    classes = torch.tensor([0, 0, 1])
    tau = 0.5
    expected = -math.log((math.exp(2) + math.exp(0)) / (math.exp(2) + math.exp(0) + math.exp(-2)))
    assert cpcl_loss(z, torch.tensor([0]), clusters, classes, tau).item() == pytest.approx(expected, rel=1e-5)
    expected1 = -math.log(math.exp(-2) / (math.exp(2) + math.exp(0) + math.exp(-2)))
    assert cpcl_loss(z, torch.tensor([1]), clusters, classes, tau).item() == pytest.approx(expected1, rel=1e-5)


def test_upcr_reductions():
    z, u = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[0.0, 0.0, 1.0]])
    assert upcr_loss(z, u, "sum").item() == pytest.approx(9.0)
    assert upcr_loss(z, u, "mse").item() == pytest.approx(3.0)


def test_the_prototype_terms_are_summed_over_the_samples_with_prototypes_and_divided_by_the_batch():
    """The authors' ``loss_InfoNCE / i`` (``i`` counts every label): 2 of 8 samples with a prototype weigh 2/8."""
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(8, 3, generator=g), torch.tensor([0, 1, 1, 1, 1, 1, 1, 0])
    protos = {CLUSTER: torch.randn(2, 3, generator=g), CLUSTER_CLASS: torch.tensor([0, 1]),
              UNBIASED: torch.randn(2, 3, generator=g), HAS_UNBIASED: torch.tensor([1, 0])}  # class 0 only
    has = y == 0
    each = (cpcl_loss(z[has], y[has], protos[CLUSTER], protos[CLUSTER_CLASS], FPLParams().temperature)
            + upcr_loss(z[has], protos[UNBIASED][y[has]], FPLParams().upcr_reduction))
    assert FPL()._proto_terms(z, y, protos).item() == pytest.approx(each.sum().item() / 8, rel=1e-6)


def test_a_client_with_no_trainable_batch_is_refused_with_the_reason():
    """One sample under BatchNorm trains no batch (local_batches skips it): the client fails with why, as under every
    method (it was reported as trained, with no class present)."""
    import dataclasses

    fed = toy_federation("method.name=fpl")
    msg = {**fed.method.client_config(fed.method.server_init(fed.model, None), 0, 1), "lr": 0.1, "round": 1}
    ctx = client_context(fed, 0, 1)
    ctx = dataclasses.replace(ctx, train_idx=ctx.train_idx[:1])
    with pytest.raises(ValueError, match="^client 0 has nothing to train on: its 1 example"):
        fed.method.client_update(fed.model, msg, {}, ctx)


def test_uploaded_prototypes_are_class_means_of_the_features():
    fed = toy_federation("method.name=fpl")
    msg = {**fed.method.client_config(fed.method.server_init(fed.model, None), 0, 1), "lr": 0.0, "round": 1}
    reply, _ = fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 1))
    assert set(reply) == {f"w/{k}" for k in fed.model.state_dict()} | {
        "proto/mean", "proto/present", "num_examples", "train_loss"}
    # by hand: the same batches (same seed), the unchanged model in training mode
    fed.model.train()
    sums, counts = torch.zeros(4, 16), torch.zeros(4)
    with torch.no_grad():
        for x, y in client_context(fed, 0, 1).batches():
            sums.index_add_(0, y, fed.model.features(x))
            counts.index_add_(0, y, torch.ones(len(y)))
    assert np.array_equal(reply["proto/present"], (counts > 0).numpy().astype(np.int8))
    assert np.allclose(reply["proto/mean"], (sums / counts.clamp_min(1)[:, None]).numpy(), atol=1e-5)


def test_uploaded_prototypes_are_the_class_means_of_the_last_local_epoch_only(monkeypatch):
    """Two epochs at lr > 0 (the features move between them): the features and labels the loop sees are recorded,
    and the upload is the class means over the second epoch's alone (the authors' code)."""
    fed = toy_federation("method.name=fpl", "federation.local_epochs=2")
    seen: list[tuple[int, torch.Tensor]] = []  # (epoch, labels) of each batch, in order
    feats: list[torch.Tensor] = []  # the features of each batch, in the same order
    batches = fpl.local_batches

    def recording_batches(model: torch.nn.Module, ctx: ClientContext) -> Iterator[tuple[int, Any, torch.Tensor]]:
        for epoch, x, y in batches(model, ctx):
            seen.append((epoch, y.clone()))
            yield epoch, x, y

    monkeypatch.setattr(fpl, "local_batches", recording_batches)
    fed.model.fc.register_forward_hook(lambda m, i, out: feats.append(torch.relu(out).detach().clone()))
    msg = {**fed.method.client_config(fed.method.server_init(fed.model, None), 0, 1), "lr": 0.1, "round": 1}
    reply, _ = fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 1))
    assert [e for e, _ in seen] == [0] * 4 + [1] * 4 and len(feats) == 8  # 54 examples: 4 batches an epoch
    last = [i for i, (e, _) in enumerate(seen) if e == 1]
    z, y = torch.cat([feats[i] for i in last]), torch.cat([seen[i][1] for i in last])
    want = np.stack([z[y == k].mean(0).numpy() for k in range(4)])
    assert np.array_equal(reply["proto/present"], np.ones(4, np.int8))
    np.testing.assert_allclose(reply["proto/mean"], want, atol=1e-6)
    both = torch.cat(feats)[torch.cat([t for _, t in seen]) == 0].mean(0).numpy()
    assert np.abs(both - want[0]).max() > 1e-3  # the first epoch's features differ: they would move the means


def test_prototype_terms_join_the_loss_from_round_two(tmp_path):
    fed = toy_federation("method.name=fpl", "federation.rounds=2")
    server = Server(fed, tmp_path)
    run_inprocess(server)
    assert "proto/cluster" not in fed.method.client_config({"weights": {}}, 0, 1)
    msg = {**fed.method.client_config(server.state, 0, 3), "lr": 0.0, "round": 3}
    assert {"proto/cluster", "proto/cluster_class", "proto/unbiased", "proto/has"} <= set(msg)
    with_protos = fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 3))[0]["train_loss"]
    plain = {k: v for k, v in msg.items() if not k.startswith("proto/")}
    without = fed.method.client_update(fed.model, plain, {}, client_context(fed, 0, 3))[0]["train_loss"]
    assert with_protos > without
    assert server.metrics[-1]["proto_clusters"] >= 4  # at least one cluster prototype per class


def test_the_coarsest_finch_partition_is_kept():
    """One class, eight unit prototypes in four close pairs (0°, 2°), (10°, 12°), (90°, 92°), (100°, 102°): FINCH's
    first partition is the four pairs, its second (kept: the next merges all into one) the two groups of four."""
    angles = np.deg2rad([0.0, 2.0, 10.0, 12.0, 90.0, 92.0, 100.0, 102.0])
    rows = np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    clusters, classes, unbiased, _ = cluster_prototypes(rows[:, None, :], np.ones((8, 1), np.int8))
    assert list(classes) == [0, 0]
    by_x = clusters[np.argsort(clusters[:, 0])]  # the group near 95° first
    np.testing.assert_allclose(by_x, [rows[4:].mean(0), rows[:4].mean(0)], atol=1e-6)
    np.testing.assert_allclose(unbiased[0], (rows[:4].mean(0) + rows[4:].mean(0)) / 2, atol=1e-6)


def test_the_server_clusters_only_the_classes_a_client_reports_present():
    """Client 0 reports classes 0 and 1, client 1 class 0 only (its class-1 row, zeros, is not a prototype)."""
    method = FPL()
    mean = [np.array([[1.0, 0.0], [0.0, 2.0]], np.float32), np.array([[1.0, 0.1], [0.0, 0.0]], np.float32)]
    present = [np.array([1, 1], np.int8), np.array([1, 0], np.int8)]
    replies = [Reply(k, {"w/t": np.zeros(1, np.float32), "num_examples": 5, PROTO_MEAN: mean[k],
                         PROTO_PRESENT: present[k]}) for k in (0, 1)]
    state, metrics = method.aggregate({"weights": {}}, replies)
    clusters, classes, unbiased, has = state["protos"]
    np.testing.assert_allclose(unbiased[1], [0.0, 2.0])
    assert list(has) == [1, 1] and metrics["proto_clusters"] == len(classes) == len(clusters)


def test_the_prototype_terms_are_weighted_by_their_own_weights():
    g = torch.Generator().manual_seed(1)
    z, y = torch.randn(4, 3, generator=g), torch.tensor([0, 1, 0, 1])
    protos = {CLUSTER: torch.randn(3, 3, generator=g), CLUSTER_CLASS: torch.tensor([0, 1, 1]),
              UNBIASED: torch.randn(2, 3, generator=g), HAS_UNBIASED: torch.tensor([1, 1])}
    p = FPLParams(cpcl_weight=2.0, upcr_weight=0.5, upcr_reduction="sum", temperature=0.5)
    cpcl = cpcl_loss(z, y, protos[CLUSTER], protos[CLUSTER_CLASS], 0.5)
    upcr = ((z - protos[UNBIASED][y]) ** 2).sum(1)
    assert FPL(p)._proto_terms(z, y, protos).item() == pytest.approx((2 * cpcl + 0.5 * upcr).sum().item() / 4, rel=1e-6)


def test_defaults_are_the_documented_ones():
    p = FPLParams()
    assert (p.temperature, p.cpcl_weight, p.upcr_weight, p.upcr_reduction, p.dp) == (0.02, 1.0, 1.0, "mse", None)

