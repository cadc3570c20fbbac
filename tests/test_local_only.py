"""Local-only: every client trains alone from a common start; the server only stores for evaluation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.decisive import decisive_argmax
from toy import toy_federation

from feddg.algorithms import Reply, ServerContext
from feddg.algorithms.local_only import LocalOnly
from feddg.engines.inprocess import run_inprocess
from feddg.federation.client import client_context
from feddg.federation.server import Server
from feddg.messages import load_weights, weights_of

OVER = ("method.name=local", "partition.num_clients=2", "federation.rounds=3")


def _run(tmp_path, *over):
    server = Server(toy_federation(*OVER, *over), tmp_path / "run")
    sent = []
    configure = server.configure
    server.configure = lambda r: sent.append(configure(r)) or sent[-1]
    res = run_inprocess(server)
    return server, res, sent


def test_each_client_model_is_what_training_alone_gives(tmp_path):
    server, _, _ = _run(tmp_path)
    fed = toy_federation(*OVER)  # the same initial model, trained by hand: client c alone for 3 rounds
    init = weights_of(fed.model)
    for cid in range(2):
        load_weights(fed.model, init)
        for r in (1, 2, 3):
            ctx = client_context(fed, cid, r)
            fed.method.client_update(fed.model, {"lr": server.lr(r)}, weights_of(fed.model), ctx)
        alone = weights_of(fed.model)
        stored = fed.method.eval_weights(server.state, cid)
        assert all(np.array_equal(alone[k], stored[k]) for k in alone)
    a, b = (server.fed.method.eval_weights(server.state, c) for c in (0, 1))
    assert any(not np.allclose(a[k], b[k]) for k in a)  # nothing was mixed


def test_only_the_common_initial_model_is_ever_sent_down(tmp_path):
    server, _, sent = _run(tmp_path)
    first = sent[0]
    init = weights_of(toy_federation(*OVER).model)  # the seeded initial model
    for cid in (0, 1):
        assert {k for k in first[cid] if k.startswith("w/")} == set(init)
        assert all(np.array_equal(first[cid][k], init[k]) for k in init)
    for later in sent[1:]:
        assert all(set(m) == {"lr", "round"} for m in later.values())  # no weights after round 1
    assert server.metrics[1]["bytes_down"] < 100


def test_global_diagnostic_is_the_weighted_mean_and_results_are_personalised(tmp_path):
    """Clients of unequal size (a label-Dirichlet split), so a plain mean of the two models differs from it."""
    server, res, _ = _run(tmp_path, "partition.kind=dirichlet_labels", "partition.params.alpha=0.5")
    st, fed = server.state, server.fed
    n = [len(fed.clients[c].train_idx) for c in (0, 1)]
    assert n[0] != n[1] and st["num_examples"] == {0: n[0], 1: n[1]}
    key = "w/fc.weight"
    a, b = st["clients"][0][key].astype(np.float64), st["clients"][1][key].astype(np.float64)
    got = fed.method.eval_weights(st, None)[key]
    assert np.allclose(got, (n[0] * a + n[1] * b) / sum(n), atol=1e-6)
    assert not np.allclose(got, (a + b) / 2, atol=1e-4)
    assert {"id_acc", "ood_acc", "global_ood_acc"} <= set(res["final"])


def _accuracy(fed, weights, indices) -> float:
    """The percentage of ``indices`` that ``weights`` classify right, by hand."""
    load_weights(fed.model, weights)
    fed.model.eval()
    with torch.no_grad():
        x, y = fed.dataset.get_batch(indices, train=False)
        return 100.0 * float((decisive_argmax(fed.model(x)) == y).float().mean())


def test_under_ltdo_the_validation_domain_is_scored_like_the_test_domain(tmp_path):
    # the lodo selection rule picks by val_acc: a personalised method must write it (the clients' models' mean)
    server, res, _ = _run(tmp_path, "split.protocol=ltdo", "split.val_domain=b", "split.target=c")
    fed, st, final = server.fed, server.state, res["final"]
    method, val, test = fed.method, fed.split.val_idx, fed.split.test_idx
    for role, idx in (("val", val), ("ood", test)):
        per_client = [_accuracy(fed, method.eval_weights(st, c), idx) for c in (0, 1)]
        assert final[f"{role}_acc"] == pytest.approx(np.mean(per_client))
        assert final[f"global_{role}_acc"] == pytest.approx(_accuracy(fed, method.eval_weights(st, None), idx))
    assert set(final) == server.evaluator.keys()  # every key the evaluator promises (counts), and no other
    assert res["counts"]["val_acc"] == res["counts"]["global_val_acc"] == len(val)


def _reply(cid, value, n):
    return Reply(cid, {"w/weight": np.array([[value]], np.float32), "num_examples": n, "train_loss": 0.0})


def test_clients_absent_from_a_round_or_never_heard_from_keep_their_models_and_counts():
    """Three clients; round 1: clients 0 (10 examples) and 1 (30); round 2: client 0 alone. Client 1 keeps its
    round-1 model and its count in the global diagnostic; client 2, never heard from, has the initial model."""
    method = LocalOnly()
    state = method.server_init(torch.nn.Linear(1, 1, bias=False), ServerContext(3, 2, 0))
    init = dict(state["weights"])
    assert all(np.array_equal(method.eval_weights(state, c)["w/weight"], init["w/weight"]) for c in (None, 2))
    state, _ = method.aggregate(state, [_reply(0, 1.0, 10), _reply(1, 5.0, 30)])
    state, _ = method.aggregate(state, [_reply(0, 3.0, 10)])
    mine = [method.eval_weights(state, c) for c in (0, 1, 2)]
    assert all(set(m) == {"w/weight"} for m in mine)  # the stored model only, not its count
    assert [m["w/weight"].item() for m in mine[:2]] == [3.0, 5.0]
    assert np.array_equal(mine[2]["w/weight"], init["w/weight"])
    assert method.eval_weights(state, None)["w/weight"].item() == pytest.approx((10 * 3.0 + 30 * 5.0) / 40, rel=1e-6)
