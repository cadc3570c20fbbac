"""The evaluation's figures and the samples behind them, rebuilt by hand from the clients' holdouts and models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from support.decisive import decisive_argmax
from toy import ToyDomains, toy_federation

from feddg.engines.inprocess import run_inprocess
from feddg.federation.evaluator import Evaluator
from feddg.federation.examples import final_predictor
from feddg.federation.server import Server
from feddg.federation.setup import ExtraTarget, Federation
from feddg.messages import load_weights


def _right(fed: Federation, state: dict, client_id: int | None, indices: np.ndarray) -> np.ndarray:
    """Whether the model ``client_id`` is evaluated with (``None``: the global one) classifies each of ``indices``
    of the toy data right, by hand."""
    load_weights(fed.model, fed.method.eval_weights(state, client_id))
    fed.model.eval()
    x, y = fed.dataset.get_batch(indices, train=False)
    with torch.no_grad():
        return (decisive_argmax(fed.model(x)) == y).numpy()


def _local_run(tmp_path: Path) -> tuple[Server, dict]:
    """One round of local training (a personalised method) on the toy data, c held out."""
    server = Server(toy_federation("method.name=local", "federation.rounds=1"), tmp_path / "run")
    return server, run_inprocess(server)


def test_a_personalised_id_figure_pools_each_clients_model_on_its_holdout_and_global_id_every_holdout(tmp_path: Path) -> None:
    server, results = _local_run(tmp_path)
    fed, final = server.fed, results["final"]
    ids = fed.dataset.domain_ids
    own = [(_right(fed, server.state, cid, c.holdout_idx), ids[c.holdout_idx]) for cid, c in enumerate(fed.clients)]
    right, domain = np.concatenate([r for r, _ in own]), np.concatenate([d for _, d in own])
    holdouts = np.concatenate([c.holdout_idx for c in fed.clients])
    glob = _right(fed, server.state, None, holdouts)
    for d, name in enumerate("ab"):  # the source domains; c is held out
        assert final[f"id_acc/{name}"] == pytest.approx(100.0 * right[domain == d].mean())
        assert final[f"global_id_acc/{name}"] == pytest.approx(100.0 * glob[ids[holdouts] == d].mean())
    assert [final[f"id_acc/{d}"] for d in "ab"] != pytest.approx([final[f"global_id_acc/{d}"] for d in "ab"])
    labels = fed.dataset.labels[holdouts]  # the global model's recall of each class over every holdout
    assert results["per_class"]["global_id"]["recall"] == pytest.approx([100.0 * glob[labels == k].mean()
                                                                         for k in range(4)])


def test_the_counts_are_the_samples_behind_each_figure(tmp_path: Path) -> None:
    server, results = _local_run(tmp_path)
    fed = server.fed
    ids = fed.dataset.domain_ids
    holdouts = np.concatenate([c.holdout_idx for c in fed.clients])
    per = {name: sum(int(ids[i]) == d for i in holdouts) for d, name in enumerate("ab")}
    assert min(per.values()) > 0
    want = {"ood_acc": 120, "ood_acc/c": 120, "global_ood_acc": 120, "global_ood_acc/c": 120,  # 4 classes x 30
            "id_acc": len(holdouts), "global_id_acc": len(holdouts),
            **{f"{role}/{name}": n for name, n in per.items() for role in ("id_acc", "global_id_acc")}}
    assert results["counts"] == want and set(results["final"]) == set(want)


def test_the_final_predictor_scores_in_eval_mode_whatever_mode_the_model_was_left_in(tmp_path: Path) -> None:
    server, _ = _local_run(tmp_path)
    fed, idx = server.fed, server.fed.split.test_idx
    load_weights(fed.model, fed.method.eval_weights(server.state, None))
    with torch.no_grad():
        want = fed.model.eval()(fed.dataset.get_batch(idx, train=False)[0])  # BatchNorm with its running statistics
        batch_stats = fed.model.train()(fed.dataset.get_batch(idx, train=False)[0])
    assert not torch.allclose(want, batch_stats, atol=1e-3)  # the mode shows in the outputs
    fed.model.train()  # as a training step would leave it
    assert torch.allclose(final_predictor(server)(idx), want, atol=1e-6)


def test_the_aggregate_keys_are_the_means_over_domains_extra_targets_included() -> None:
    fed = toy_federation()
    fed.extra = [ExtraTarget("fresh", ToyDomains(per_class_domain=2))]  # 3 domains x 4 classes x 2
    evaluator = Evaluator(fed)
    assert evaluator.aggregate_keys() == {"id_acc", "ood_acc", "extra/fresh_acc"}
    counts = evaluator.counts()
    assert counts["extra/fresh_acc"] == 24 and [counts[f"extra/fresh_acc/{d}"] for d in "abc"] == [8, 8, 8]


def test_eval_per_domain_false_keeps_the_means_each_round_and_results_still_have_every_domain(tmp_path: Path) -> None:
    # two runs on the same seed: the same model, so the same figures; per_domain false only thins metrics.jsonl
    full = Server(toy_federation("federation.rounds=2"), tmp_path / "full")
    full_results = run_inprocess(full)
    means = Server(toy_federation("federation.rounds=2", "eval.per_domain=false"), tmp_path / "means")
    results = run_inprocess(means)
    for row, whole in zip(means.metrics, full.metrics, strict=True):
        assert {k for k in row if k.endswith("_acc") or "_acc/" in k} == {"id_acc", "ood_acc"}
        assert (row["id_acc"], row["ood_acc"]) == (whole["id_acc"], whole["ood_acc"])
    assert "id_acc/a" in full.metrics[-1]
    assert results["final"] == full_results["final"] and {"id_acc/a", "id_acc/b", "ood_acc/c"} <= set(results["final"])
