"""Issue 27: one client cannot take over the global model (docs/reliability.md, "A client cannot take over the
model"): scaled and huge weights are refused by the default update-norm bound, an inflated ``num_examples`` is
capped at the client's data, robust aggregation rules give their hand-computed values, and a non-finite aggregate
is rolled back, never checkpointed, and a resumed run goes on as the uninterrupted one."""

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import Field
from toy import toy_federation_of

from feddg.aggregation.robust import coordinate_median, krum_scores, krum_select, trimmed_mean
from feddg.algorithms.base import Accumulator, ClientContext, ClientState, Params, Reply
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.registry import METHODS
from feddg.config import ConfigError, build_config
from feddg.engines.inprocess import run_inprocess
from feddg.federation.checkpoint import load_checkpoint
from feddg.federation.integrity import LossGuard, NormBound, cap_examples, non_finite, robust_replies, weights_norm
from feddg.federation.server import Server
from feddg.federation.validation import RunStopped
from feddg.messages import Message

BASE = {"partition": {"kind": "by_domain", "num_clients": 4}, "split": {"target": "c"},
        "federation": {"rounds": 3, "batch_size": 16, "workers": 1}, "optim": {"lr": 0.1}, "device": "cpu"}
ATTACKER = 3


class AttackParams(Params):
    #: ``"round:client"`` -> x1000 | huge | claim | poison | flip
    faults: dict[str, str] = Field(default_factory=dict)


class Malicious(FedAvg):
    """FedAvg whose client misbehaves as an attacker would: ``x1000`` (weights × 1000), ``huge`` (every weight
    1e30), ``claim`` (``num_examples`` = 10⁹ and its biases + 1), ``poison`` (a finite reply that makes the
    server's step non-finite, as a diverging server optimiser would), ``flip`` (its classifier weights × −3: within the
    update-norm bound, but the mean's classifier is near 0). Like tests/support/faults.py's ``faulty``,
    registered for each test only, and run sequentially (``workers: 1``) so that no worker needs to import it."""

    name = "malicious"
    Params = AttackParams

    def client_update(
        self, model: torch.nn.Module, msg: Message, client_state: ClientState, ctx: ClientContext
    ) -> tuple[Message, ClientState]:
        fault = self.params.faults.get(f"{ctx.round}:{ctx.client_id}")
        reply, state = super().client_update(model, msg, client_state, ctx)
        floats = [k for k, v in reply.items() if isinstance(v, np.ndarray) and v.dtype.kind == "f"]
        if fault == "x1000":
            reply.update({k: reply[k] * 1000 for k in floats})
        if fault == "huge":
            reply.update({k: np.full_like(reply[k], 1e30) for k in floats})
        if fault == "claim":
            reply.update({"num_examples": 10**9, **{k: reply[k] + 1 for k in floats if k.endswith(".bias")}})
        if fault == "poison":
            reply["poison"] = 1.0
        if fault == "flip":
            reply["w/classifier.weight"] = -3 * reply["w/classifier.weight"]
        return reply, state

    def keep(self, reply: Reply) -> Message | None:
        return {"poison": 1.0} if "poison" in reply.message else None

    def finish(self, state, acc: Accumulator):
        state, metrics = super().finish(state, acc)
        if acc.kept:
            state = {**state, "weights": {k: v * np.nan for k, v in state["weights"].items()}}
        return state, metrics


@pytest.fixture(autouse=True)
def malicious() -> Iterator[None]:
    METHODS[Malicious.name] = Malicious
    try:
        yield
    finally:
        METHODS.pop(Malicious.name, None)


def run(tmp_path, name: str, attacks: dict[str, str], *overrides: str, drop_attacker: bool = False) -> Server:
    """A toy run with ``attacks``; ``drop_attacker``: the honest reference, whose server never sends to the attacker
    in the attacked rounds."""
    cfg = build_config({**BASE, "method": {"name": "malicious", "params": {"faults": attacks}}}, list(overrides))
    server = Server(toy_federation_of(cfg), tmp_path / name)
    if drop_attacker:
        rounds = {int(k.split(":")[0]) for k in attacks}
        configure = server.configure
        server.configure = lambda r: {c: m for c, m in configure(r).items() if not (r in rounds and c == ATTACKER)}
    run_inprocess(server)
    return server


def rows(server: Server) -> list[dict]:
    return [json.loads(line) for line in (server.run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_close(got: dict, want: dict, rtol: float = 1e-5) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=rtol, atol=1e-6, err_msg=k)


# --- the pieces, by hand ---------------------------------------------------------------------------
# five clients' one-number models, the last one an attacker; and an integer buffer
FIVE: list[Message] = [{"w/a": np.array([v], np.float32), "w/n": np.array(v, np.int64)} for v in (1, 2, 3, 5, 100)]


def test_the_median_and_the_trimmed_mean_ignore_the_attacker():
    assert coordinate_median(FIVE, "w/") == {"w/a": np.array([3], np.float32), "w/n": np.array(3)}
    got = trimmed_mean(FIVE, "w/", 0.2)  # one cut at each end: (2 + 3 + 5) / 3
    np.testing.assert_array_equal(got["w/a"], np.array([10 / 3], np.float32))
    assert got["w/n"] == 3 and got["w/n"].dtype == np.int64
    assert coordinate_median(FIVE[:4], "w/")["w/a"] == np.float32(2.5)  # even count: the middle pair's mean
    assert coordinate_median([FIVE[1], FIVE[3]], "w/")["w/n"] == 4  # an integer buffer's 3.5 rounded, not cut to 3
    with pytest.raises(ValueError, match=r"trim fraction must be in \[0, 0.5\), got 0.5"):
        trimmed_mean(FIVE, "w/", 0.5)  # scipy would take the middle value of an odd count: a median, not a trim


def test_krum_scores_its_nearest_neighbours_and_selects_the_lowest():
    # f = 1: each client's 5 - 1 - 2 = 2 nearest others; squared distances of 1, 2, 3, 5, 100
    scores = krum_scores(FIVE, "w/", malicious=1)
    np.testing.assert_array_equal(scores, [1 + 4, 1 + 1, 1 + 4, 4 + 9, 95**2 + 97**2])
    assert krum_select(FIVE, "w/", 1) == [1]
    assert krum_select(FIVE, "w/", 1, keep=3) == [0, 1, 2]


@pytest.mark.parametrize(("over", "kept", "a"), [
    (["federation.aggregation=median"], [0, 1, 2, 3, 4], 3.0),
    (["federation.aggregation=trimmed_mean", "federation.trim_fraction=0.2"], [0, 1, 2, 3, 4], 10 / 3),
    # f = 2: each client's 5 - 2 - 2 = 1 nearest other; scores 1, 1, 1, 4, 95² select the first of the three ties
    (["federation.aggregation=krum", "federation.krum_malicious=2"], [0], None),
    (["federation.aggregation=multi_krum", "federation.krum_malicious=1", "federation.krum_keep=3"], [0, 1, 2], None),
])
def test_robust_replies_fold_the_rules_values_or_the_selected_replies(over: list[str], kept: list[int],
                                                                     a: float | None) -> None:
    replies = [Reply(i, {**m, "num_examples": 10}) for i, m in enumerate(FIVE)]
    got, left_out = robust_replies(replies, build_config(BASE, over).federation)
    assert [r.client_id for r in got] == kept and sorted(left_out) == sorted(set(range(5)) - set(kept))
    assert all(r.num_examples == 10 for r in got)
    if a is not None:  # median / trimmed mean: every reply carries the robust arrays
        assert all(r.message["w/a"] == np.float32(a) and r.message["w/n"] == 3 for r in got)
    else:  # krum: the selected replies unchanged
        assert all(r.message["w/a"] is FIVE[r.client_id]["w/a"] for r in got)


def test_multi_krum_keeps_every_reply_when_failures_leave_fewer_than_krum_keep() -> None:
    # krum_keep=4 passes the run's check with 5 sampled; a round where 2 of them failed has only 3 replies
    replies = [Reply(i, {**m, "num_examples": 10}) for i, m in enumerate(FIVE[:3])]
    fc = build_config(BASE, ["federation.aggregation=multi_krum", "federation.krum_keep=4"]).federation
    got, left_out = robust_replies(replies, fc)
    assert [r.client_id for r in got] == [0, 1, 2] and left_out == {}


def test_the_rules_agree_with_flowers_own():
    aggregate = pytest.importorskip("flwr.server.strategy.aggregate")
    results = [([m["w/a"]], 10) for m in FIVE]
    assert aggregate.aggregate_median(results)[0] == coordinate_median(FIVE, "w/")["w/a"]
    np.testing.assert_allclose(aggregate.aggregate_trimmed_avg(results, 0.2)[0], trimmed_mean(FIVE, "w/", 0.2)["w/a"])
    assert aggregate.aggregate_krum(results, 1, 0)[0] == FIVE[krum_select(FIVE, "w/", 1)[0]]["w/a"]


def test_the_norm_bound_uses_the_last_rounds_median_or_the_sent_weights():
    bound, sent = NormBound(10.0), {"w/a": np.array([3.0, 4.0], np.float32), "w/n": np.array(7)}  # |w_sent| = 5
    assert bound.check(50.0, sent) is None
    assert bound.check(50.5, sent) == "update norm 50.5 > 10 x |w_sent| (federation.update_norm_factor)"
    bound.update([1.0, 2.0, 1e6])  # the attacker's norm does not move the median
    assert bound.check(20.0, sent) is None
    assert bound.check(21.0, sent) == ("update norm 21 > 10 x median 2 of the last round "
                                       "(federation.update_norm_factor)")


def test_the_norm_bound_falls_back_to_the_sent_weights_on_a_zero_median_and_keeps_it_without_replies() -> None:
    sent: Message = {"w/a": np.array([3.0, 4.0], np.float32), "w/n": np.array(7), "gram/g": np.array([12.0])}
    assert weights_norm(sent) == 5.0  # the float w/ arrays only
    assert weights_norm({"w/h": np.array([300.0, 400.0], np.float16)}) == 500.0  # in float64: 300² overflows float16
    bound = NormBound(10.0)
    bound.update([0.0, 0.0, 1.0])  # most clients echoed the weights: a median of 0 would refuse any change
    assert bound.reference == 0.0 and bound.check(50.0, sent) is None and bound.check(50.5, sent) is not None
    bound.update([2.0])
    bound.update([])  # a round with no accepted reply keeps the last median
    assert bound.reference == 2.0 and bound.check(20.0, sent) is None


def test_a_claim_beyond_the_clients_data_is_capped_and_others_pass():
    reply = Reply(3, {"num_examples": 10**9, "w/a": np.ones(1)})
    capped, claim = cap_examples(reply, 40)
    assert capped.num_examples == 40 and claim == 10**9 and reply.num_examples == 10**9
    assert cap_examples(Reply(3, {"num_examples": 40}), 40) == (Reply(3, {"num_examples": 40}), None)


def test_the_loss_guard_compares_with_the_best_applied_round():
    guard = LossGuard(2.0)
    assert guard.check(100.0) is None  # no applied round yet
    guard.update(1.0)
    guard.update(0.5)
    guard.update(0.9)  # the best stays 0.5
    assert guard.check(1.0) is None
    assert guard.check(1.01) == "evaluated loss 1.01 > 2 x best 0.5 (federation.rollback_loss_factor)"
    assert guard.check(float("nan")) == "evaluated loss nan"
    assert LossGuard(2.0).check(float("inf")) == "evaluated loss inf"  # refused before any applied round too


def test_the_holdout_loss_of_a_model_that_outputs_zero_logits_is_log_of_the_classes(tmp_path):
    server = Server(toy_federation_of(build_config({**BASE, "method": {"name": "fedavg"}}, [])), tmp_path / "run")
    zero = {k: np.zeros_like(v) for k, v in server.state["weights"].items()}  # every logit 0: uniform over 4
    assert server.evaluator.holdout_loss({"weights": zero}) == pytest.approx(np.log(4), rel=1e-6)


def test_non_finite_names_the_array():
    state = {"weights": {"w/a": np.ones(2), "w/b": np.array([1.0, np.inf])}, "count": np.array([1]), "t": [0.5]}
    assert non_finite(state) == "state/weights/w/b"
    assert non_finite({"weights": {"w/a": np.ones(2)}}) is None
    assert non_finite({"z": (np.ones(1), np.array([1 + 1j, complex(0, np.nan)]))}) == "state/z/1"  # complex too


# --- whole runs ---------------------------------------------------------------------------------------
def test_scaled_and_huge_weights_are_refused_by_default(tmp_path):
    attacks = {"1:3": "x1000", "2:3": "x1000", "3:3": "huge"}
    server = run(tmp_path, "attacked", attacks)
    reasons = {r["round"]: r.get("clients_failed_reasons", {}) for r in rows(server)}
    assert list(reasons[1]) == list(reasons[2]) == list(reasons[3]) == [str(ATTACKER)]
    assert "x |w_sent|" in reasons[1]["3"] and "median" in reasons[2]["3"] and "median" in reasons[3]["3"]
    honest = run(tmp_path, "honest", attacks, drop_attacker=True)
    assert_close(server.state["weights"], honest.state["weights"])
    assert rows(server)[-1]["ood_acc"] == pytest.approx(rows(honest)[-1]["ood_acc"], abs=1.0)
    ckpt = load_checkpoint(server.run_dir)
    assert non_finite(ckpt["server_state"]) is None and np.abs(ckpt["server_state"]["weights"]["w/fc.weight"]).max() < 10


def test_a_huge_num_examples_claim_does_not_take_over(tmp_path, caplog):
    attacks = {"2:3": "claim", "3:3": "claim"}
    server = run(tmp_path, "claim", attacks)
    assert [r.get("num_examples_capped") for r in rows(server)] == [None, {"3": 10**9}, {"3": 10**9}]
    assert sum("claimed num_examples=1000000000" in m for m in caplog.messages) == 1  # warned once
    assert all("clients_failed" not in r for r in rows(server))  # capped, not refused: no honest client dropped
    honest = run(tmp_path, "honest", attacks, drop_attacker=True)  # the honest clients alone in rounds 2 and 3
    attacked, clean = server.state["weights"], honest.state["weights"]
    # capped at its share n_3 / Σ n of a round (uncapped: ~1), its +1 on the biases moves the mean by that share
    # in each of the two rounds (10⁹ examples would move it by ~2: the attacker's biases)
    sizes = [len(c.train_idx) for c in server.fed.clients]
    share = sizes[ATTACKER] / sum(sizes)
    np.testing.assert_allclose(attacked["w/classifier.bias"] - clean["w/classifier.bias"], 2 * share, atol=0.1)
    np.testing.assert_allclose(attacked["w/conv.weight"], clean["w/conv.weight"], atol=0.2)


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "krum", "multi_krum"])
def test_robust_rules_keep_an_attacker_out_without_the_norm_bound(tmp_path, rule):
    attacks = {"2:3": "x1000", "3:3": "x1000"}
    server = run(tmp_path, rule, attacks, "federation.update_norm_factor=null", f"federation.aggregation={rule}",
                 "federation.trim_fraction=0.25")
    weights = server.state["weights"]
    assert max(float(np.abs(v).max()) for k, v in weights.items() if v.dtype.kind == "f") < 20
    honest = run(tmp_path, "honest", {})
    assert rows(server)[-1]["ood_acc"] > rows(honest)[-1]["ood_acc"] - 15
    if rule.endswith("krum"):
        assert "3" in rows(server)[-1]["clients_left_out"]


@pytest.mark.parametrize(("over", "why"), [
    (["federation.aggregation=multi_krum", "federation.krum_keep=4"], "federation.krum_keep=4 with krum_malicious=1 "
     "keeps all 4 replies a round samples: the plain mean, no defence; keep fewer (0: replies - krum_malicious)"),
    (["federation.aggregation=multi_krum", "federation.krum_malicious=0"], "federation.krum_keep=0 with "
     "krum_malicious=0 keeps all 4 replies a round samples: the plain mean, no defence; keep fewer (0: replies - "
     "krum_malicious)"),
    (["federation.aggregation=trimmed_mean"], "federation.trim_fraction=0.2 cuts nothing among the 4 replies a round "
     "samples (int(0.2 x 4) = 0): the plain mean, no defence; set it to at least 1/4"),
    (["federation.aggregation=krum", "federation.krum_malicious=2"], "federation.krum_malicious=2 attackers among the "
     "4 replies a round samples leave no honest majority for federation.aggregation=krum"),
    (["federation.aggregation=multi_krum", "federation.krum_malicious=1", "federation.client_fraction=0.5"],
     "federation.krum_malicious=1 attackers among the 2 replies a round samples leave no honest majority for "
     "federation.aggregation=multi_krum"),
])
def test_robust_settings_that_defend_nothing_stop_the_run_before_round_one_trains(tmp_path, over, why):
    # multi_krum keeping every reply, or trimmed_mean at 0.2 with 4 replies, was the plain mean bit for bit, under the
    # name of a robust rule
    with pytest.raises(RunStopped) as err:
        run(tmp_path, "krum", {}, *over)
    assert str(err.value) == why


@pytest.mark.parametrize(("over", "why"), [
    (["method.name=local", "federation.aggregation=median"], "federation.aggregation: median is for flat federations of "
     "methods that average weights, not local, which does not average weights"),
    (["hierarchy={stations: 2}", "federation.aggregation=median"], "federation.aggregation: median is for flat "
     "federations of methods that average weights, not a station topology (hierarchy)"),
    (["method.name=hfedf", "federation.reject_outliers=3"], "federation.reject_outliers: hfedf does not average "
     "weights, so a reply's update norm is not defined"),
    (["partition.holdout=0", "federation.rollback_loss_factor=2"], "federation.rollback_loss_factor needs the "
     "clients' holdouts (partition.holdout > 0)"),
    # it froze the global model: a poisoned station round went unmeasured and every later merge was rolled back
    (["hierarchy={stations: 2}", "federation.rollback_loss_factor=1.5"], "federation.rollback_loss_factor is for flat "
     "federations: under a hierarchy the global model changes only at a merge, so a station round's loss is not "
     "measured"),
])
def test_defences_are_refused_where_they_are_not_defined_when_the_config_loads(over, why):
    # at load, so a sweep refuses the cell before any run and feddg run before making its run directory
    with pytest.raises(ConfigError) as err:
        build_config(BASE, over)
    assert str(err.value) == why


def test_a_non_finite_aggregate_is_rolled_back_never_checkpointed_and_resume_goes_on(tmp_path):
    attacks = {"2:3": "poison"}
    server = run(tmp_path, "poisoned", attacks)
    row = rows(server)[1]
    assert row["rolled_back"] is True and row["rollback_reason"] == "NaN or Inf in state/weights/w/conv.weight"
    assert non_finite(server.state) is None
    # killed after the rolled-back round: its checkpoint holds the round-1 model; resuming ends as the whole run
    cfg = build_config({**BASE, "method": {"name": "malicious", "params": {"faults": attacks}}}, [])
    killed = Server(toy_federation_of(cfg), tmp_path / "killed")

    after_1: dict = {}

    def stop_after_2(row: dict) -> None:
        if row["round"] == 1:
            after_1.update(killed.state["weights"])
        if row["round"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_inprocess(killed, stop_after_2)
    ckpt = load_checkpoint(killed.run_dir)
    assert ckpt["round"] == 2 and non_finite(ckpt["server_state"]) is None
    for k, v in after_1.items():  # the round-1 model
        np.testing.assert_array_equal(ckpt["server_state"]["weights"][k], v, err_msg=k)
    resumed = Server(toy_federation_of(cfg), killed.run_dir, resume=True)
    run_inprocess(resumed)
    for k, v in server.state["weights"].items():
        np.testing.assert_array_equal(resumed.state["weights"][k], v, err_msg=k)


def test_a_rolled_back_round_keeps_the_previous_client_states(tmp_path: Path) -> None:
    server = Server(toy_federation_of(build_config({**BASE, "method": {"name": "malicious"}}, [])), tmp_path / "run")
    for round in (1, 2):  # every client echoes the weights sent; in round 2 the attacker poisons the aggregate
        sent = server.configure(round)
        fold = server.start_round(sent)
        for cid, msg in sent.items():
            reply = {**{k: v for k, v in msg.items() if k.startswith("w/")}, "num_examples": 10}
            if round == 2 and cid == ATTACKER:
                reply["poison"] = 1.0
            server.receive(fold, Reply(cid, reply), {"round": np.array(round)})
        row = server.finish_round(round, fold, {})
    assert row["rolled_back"] is True
    assert {c: int(server.client_states[c]["round"]) for c in server.client_states} == {0: 1, 1: 1, 2: 1, 3: 1}
    assert server.commits == {0: 1, 1: 1, 2: 1, 3: 1}  # what a Flower node is told to keep: round 1's states
    resumed = Server(server.fed, server.run_dir, resume=True)  # the last checkpoint (round 1) carries them
    assert resumed.commits == resumed.saved_commits == {0: 1, 1: 1, 2: 1, 3: 1} and resumed.run_key == server.run_key


def round_of_bias_steps(server: Server, steps: tuple[float, ...]) -> dict:
    """Round 1 where client k echoes the weights sent with its first classifier bias moved by ``steps[k]`` (its update
    norm), each reply with 10 examples and a new client state ``{"client": k}``; the round's metrics row."""
    sent = server.configure(1)
    fold = server.start_round(sent)
    for cid, step in zip(sent, steps, strict=True):
        reply = {k: v for k, v in sent[cid].items() if k.startswith("w/")}
        reply["w/classifier.bias"] = reply["w/classifier.bias"] + np.eye(1, reply["w/classifier.bias"].size,
                                                                         dtype=np.float32)[0] * step
        server.receive(fold, Reply(cid, {**reply, "num_examples": 10}), {"client": np.array(cid)})
    return server.finish_round(1, fold, {})


def test_the_norm_reference_is_the_median_of_the_accepted_replies_and_survives_a_resume(tmp_path: Path) -> None:
    cfg = build_config({**BASE, "method": {"name": "malicious"}},
                       ["federation.reject_outliers=3", "federation.update_norm_factor=1000000"])
    server = Server(toy_federation_of(cfg), tmp_path / "run")
    row = round_of_bias_steps(server, (1.0, 2.0, 3.0, 100.0))  # update norms 1, 2, 3 and an outlier 100 > 3 x 2.5
    assert list(row["clients_failed_reasons"]) == ["3"]
    assert sorted(server.client_states) == [0, 1, 2]  # the rejected outlier's new client state is not kept
    assert server.norm_bound is not None and server.norm_bound.reference == pytest.approx(2.0, rel=1e-5)  # not 2.5
    resumed = Server(toy_federation_of(cfg), server.run_dir, resume=True)  # the checkpoint carries the reference
    assert resumed.norm_bound is not None and resumed.norm_bound.reference == pytest.approx(2.0, rel=1e-5)


def test_a_reply_within_the_norm_bound_that_explodes_the_loss_is_rolled_back(tmp_path):
    attacks = {"3:3": "flip"}
    unguarded = run(tmp_path, "unguarded", attacks)  # passes the update-norm bound: folded in, loss up
    assert all("clients_failed" not in r and "rolled_back" not in r for r in rows(unguarded))
    server = run(tmp_path, "guarded", attacks, "federation.rollback_loss_factor=2")
    got = rows(server)
    best = min(got[0]["holdout_loss"], got[1]["holdout_loss"])
    assert got[2]["rolled_back"] is True and got[2]["holdout_loss"] > 2 * best
    assert got[2]["rollback_reason"] == (f"evaluated loss {got[2]['holdout_loss']:.4g} > 2 x best {best:.4g} "
                                         "(federation.rollback_loss_factor)")
    assert "rolled_back" not in got[0] and "rolled_back" not in got[1]
    # the honest path is unchanged: the guarded run's rounds 1-2 are the unguarded run's, bit for bit; after the
    # rolled-back round 3 the model (and the checkpoint) is round 2's
    two = run(tmp_path, "two-rounds", attacks, "federation.rounds=2")
    ckpt = load_checkpoint(server.run_dir)
    assert ckpt["round"] == 3 and ckpt["loss_reference"] == best
    for k, v in two.state["weights"].items():
        np.testing.assert_array_equal(server.state["weights"][k], v, err_msg=k)
        np.testing.assert_array_equal(ckpt["server_state"]["weights"][k], v, err_msg=k)
    assert [r["ood_acc"] for r in got[:2]] == [r["ood_acc"] for r in rows(unguarded)[:2]]


def test_a_round_with_too_few_usable_replies_names_three_reasons_and_counts_the_rest(tmp_path: Path) -> None:
    server = Server(toy_federation_of(build_config(BASE, [])), tmp_path / "run")
    fold = server.start_round(server.configure(1))
    for cid in fold.sent:
        server.fail(fold, cid, f"why {cid}")
    with pytest.raises(RunStopped) as err:
        server.finish_round(1, fold, {})
    assert str(err.value) == (f"round 1: 0 of 4 clients replied usably, fewer than federation.min_clients=1 (client 0: "
                              f"why 0; client 1: why 1; client 2: why 2; 1 more in the log); stopped, nothing was "
                              f"checkpointed yet: feddg run --resume {server.run_dir} continues from it")
    assert server.metrics == [] and not (server.run_dir / "checkpoint.pt").exists()  # nothing of the round recorded


def test_reject_outliers_alone_measures_the_update_norms_it_compares(tmp_path: Path) -> None:
    # with federation.update_norm_factor off: the norms of the held replies are still measured, so the outlier goes
    server = Server(toy_federation_of(build_config({**BASE, "method": {"name": "malicious"}},
                                                   ["federation.reject_outliers=3", "federation.update_norm_factor=null"])),
                    tmp_path / "run")
    row = round_of_bias_steps(server, (1.0, 2.0, 3.0, 100.0))  # update norms 1, 2, 3 and 100 > 3 x median 2.5
    assert row["clients_failed_reasons"] == {"3": "update norm 100 > 3 x median 2.5"} and row["clients"] == 3
