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


LTDO = ("split.protocol=ltdo", "split.val_domain=b", "split.target=c", "partition.num_clients=2",
        "eval.metrics=[macro_f1]")
FEDERATED = ("split.protocol=federated", "split.target=null", "partition.num_clients=3")  # no domain held out


def _evaluated_under_ltdo(tmp_path: Path, method: str) -> tuple[Federation, dict, Evaluator, dict[str, float]]:
    """The untrained model(s) of ``method`` evaluated once under LTDO (b validation, c test) with macro F1 and an
    extra target."""
    fed = toy_federation(f"method.name={method}", *LTDO)
    fed.extra = [ExtraTarget("fresh", ToyDomains(per_class_domain=2))]
    state = Server(fed, tmp_path / "run").state
    evaluator = Evaluator(fed)
    return fed, state, evaluator, evaluator.evaluate(state)


@pytest.mark.parametrize("method", ["fedavg", "local"])
def test_an_evaluation_writes_every_key_counts_promises_and_scores_the_validation_domain(tmp_path: Path,
                                                                                          method: str) -> None:
    """Under ltdo with a further metric and an extra target, the keys of one evaluation are those of ``counts``
    (which filters results.json), and ``val_acc/b`` is the models' accuracy on b by hand (a personalised method's:
    the mean over its clients' models)."""
    fed, state, evaluator, figures = _evaluated_under_ltdo(tmp_path, method)
    assert set(figures) == evaluator.keys()
    assert {"val_acc/b", "val_macro_f1/b", "ood_macro_f1", "id_macro_f1", "extra/fresh_macro_f1"} <= set(figures)
    val = fed.split.val_idx
    models = [None] if method == "fedavg" else list(range(len(fed.clients)))
    want = np.mean([100.0 * _right(fed, state, cid, val).mean() for cid in models])
    assert figures["val_acc/b"] == figures["val_acc"] == pytest.approx(want)
    assert evaluator.counts()["val_macro_f1/b"] == len(val) == 120


def test_the_headline_is_the_held_out_domains_mean_or_the_holdouts_without_one() -> None:
    assert Evaluator(toy_federation()).headline == "ood_acc"
    assert Evaluator(toy_federation(*FEDERATED)).headline == "id_acc"


def test_the_holdout_loss_weighs_each_batch_by_its_samples(tmp_path: Path) -> None:
    """A last batch smaller than the others (``eval.batch_size=7``) counts for its samples only: the loss is the
    mean cross-entropy over every holdout sample."""
    fed = toy_federation("eval.batch_size=7")
    state = Server(fed, tmp_path / "run").state
    holdouts = np.concatenate([c.holdout_idx for c in fed.clients])
    assert len(holdouts) % 7 != 0
    load_weights(fed.model, fed.method.eval_weights(state, None))
    x, y = fed.dataset.get_batch(holdouts, train=False)
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(fed.model.eval()(x), y))
    assert Evaluator(fed).holdout_loss(state) == pytest.approx(want, rel=1e-6)


def test_results_keep_no_per_class_view_of_a_role_without_samples(tmp_path: Path) -> None:
    """The empty ood role of ``split.protocol: federated``: it used to get a per_class view of null recalls and 0 %
    shares, which the report plotted as a series."""
    fed = toy_federation(*FEDERATED)
    evaluator = Evaluator(fed)
    figures = evaluator.evaluate(Server(fed, tmp_path / "run").state)
    assert not any(k.startswith("ood_") for k in figures)  # no ood figure: no ood sample
    assert set(evaluator.results(figures)["per_class"]) == {"classes", "id"}


@pytest.mark.parametrize(("method", "roles"), [("fedavg", {"id", "ood", "val"}),
                                               ("local", {"global_id", "global_ood", "global_val"})])
def test_results_keep_the_global_models_per_class_view_of_each_role(tmp_path: Path, method: str, roles: set) -> None:
    """results.json's per_class: each role's view of the global model (a personalised method's: global_<role>),
    the test domain's recall of each class by hand."""
    fed, state, evaluator, figures = _evaluated_under_ltdo(tmp_path, method)
    view = evaluator.results(figures)["per_class"]
    assert set(view) == {"classes"} | roles
    test = fed.split.test_idx
    right, labels = _right(fed, state, None, test), fed.dataset.labels[test]
    ood = "ood" if method == "fedavg" else "global_ood"
    assert view[ood]["recall"] == pytest.approx([100.0 * right[labels == k].mean() for k in range(4)])


def test_results_count_only_the_figures_they_report() -> None:
    """A run without an evaluation row reports no figure and so no count; a figure outside the evaluator's keys
    (the round's loss) is not a result."""
    evaluator = Evaluator(toy_federation())
    assert {k: v for k, v in evaluator.results({}).items() if k in ("final", "counts")} == {"final": {}, "counts": {}}
    out = evaluator.results({"ood_acc": 50.0, "train_loss": 1.0})
    assert (out["final"], out["counts"]) == ({"ood_acc": 50.0}, {"ood_acc": 120})
