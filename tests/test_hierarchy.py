"""The station topology (HFedATM): round schedule, sampling, Grams, merges, privacy audit, accounting."""

import json

import numpy as np
import pytest
import torch
from support.augmentation import shift_training_batches
from torch import nn
from toy import ToyNet, toy_federation

from feddg.aggregation.dp import gaussian_sigma
from feddg.aggregation.merges import merge_stations
from feddg.algorithms.base import ClientContext, OptimSettings, Reply
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.feddg_ga import WEIGHT as GA_WEIGHT
from feddg.algorithms.feddg_ga import FedDGGA
from feddg.algorithms.hfedatm import GRAM_FLAG, GramRecorder, HFedATMParams, station_grams, update_with_grams
from feddg.config import ConfigError, build_config
from feddg.data.partition import make_partition
from feddg.engines.inprocess import run_inprocess, run_round
from feddg.federation.client import client_context
from feddg.federation.server import Server
from feddg.federation.setup import Federation
from feddg.federation.topology import StationTopology, assign_stations
from feddg.messages import WEIGHT_PREFIX, message_nbytes, weights_of
from feddg.models.permutation import (
    apply_permutations,
    permutation_spec,
    permute_grams,
    random_permutations,
    register_spec,
    sequential_spec,
)
from feddg.reports.overhead import overhead_table

register_spec(ToyNet, sequential_spec)  # conv -> bn -> flatten -> fc: a plain chain


def hier_federation(*overrides: str) -> Federation:
    """The toy federation (4 clients, 2 per source domain) under a hierarchy: 2 stations, N=2, R=2."""
    return toy_federation("hierarchy.stations=2", "hierarchy.station_rounds=2", "federation.rounds=2", *overrides)


def stations(station_of, station_rounds=1, station_fraction=1.0, merge="avg", **params) -> StationTopology:
    return StationTopology(np.asarray(station_of), station_rounds, station_fraction, merge, HFedATMParams(**params), None)


def fold(topo, method, state, replies, round=1):
    """One station round of ``replies`` through the topology's fold."""
    acc = topo.start(method, {r.client_id: r.num_examples for r in replies})
    for r in replies:
        acc = topo.accumulate(method, acc, r)
    return topo.finish(method, state, acc, round)


def _run(tmp_path, *overrides, name="run"):
    server = Server(hier_federation(*overrides), tmp_path / name)
    return server, run_inprocess(server)


# --- topology -----------------------------------------------------------------------------


def test_engine_rounds_map_to_server_and_station_rounds():
    topo = stations([0, 0, 1, 1], station_rounds=3)
    assert [(topo.server_round(t), topo.station_round(t)) for t in range(1, 8)] == [
        (1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3), (3, 1)
    ]


def test_station_assignments():
    doms = [(2,), (0,), (1,), (0,), (2,), (1,)]
    assert assign_stations("contiguous", 3, doms).tolist() == [0, 0, 1, 1, 2, 2]
    assert assign_stations("round_robin", 3, doms).tolist() == [0, 1, 2, 0, 1, 2]
    assert assign_stations("domain", 3, doms).tolist() == [2, 0, 1, 0, 2, 1]
    with pytest.raises(ValueError, match="at least as many clients"):
        assign_stations("contiguous", 7, doms)


def test_station_and_client_sampling():
    topo = stations(np.repeat(np.arange(4), 3), station_rounds=2, station_fraction=0.5)
    for t in (1, 3, 5):
        a, b = topo.sample(t, 1.0, 0), topo.sample(t + 1, 1.0, 0)
        assert a == b  # the same stations for the whole server round
        assert len({topo.station_of(c) for c in a}) == 2 and len(a) == 6
    picked = topo.sample(1, 0.34, seed=0)  # one client of each of the two sampled stations
    assert len(picked) == 2 and len({topo.station_of(c) for c in picked}) == 2
    assert stations(np.repeat(np.arange(4), 3), 2).sample(1, 1.0, 0) == list(range(12))


def test_two_level_dirichlet_partition():
    domain_ids = np.repeat(np.arange(3), 200)
    rng = np.random.default_rng(0)
    labels = np.zeros(600, dtype=np.int64)

    def two_level_dirichlet(idx, doms, clients, groups, a_group, a_client, rng, **kw):
        return make_partition("two_level_dirichlet", idx, doms, labels, clients, rng, groups=groups,
                              alpha_group=a_group, alpha_client=a_client, **kw)

    part = two_level_dirichlet(np.arange(600), domain_ids, 6, 3, 1.0, 1.0, rng)
    assert np.array_equal(np.sort(np.concatenate(part.client_indices)), np.arange(600))
    concentrated = two_level_dirichlet(np.arange(600), domain_ids, 6, 3, 1e-3, 1e3, rng, max_tries=1000)
    stations = [np.concatenate(concentrated.client_indices[2 * e : 2 * e + 2]) for e in range(3)]
    for d in range(3):  # tiny α_station: each domain lives (almost) entirely at one station
        share = [np.isin(np.flatnonzero(domain_ids == d), s).mean() for s in stations]
        assert max(share) > 0.95
    sizes = [len(c) for c in concentrated.client_indices]  # huge α_client: a station's clients are equal
    assert all(abs(sizes[2 * e] - sizes[2 * e + 1]) <= 0.1 * (sizes[2 * e] + sizes[2 * e + 1]) for e in range(3))
    with pytest.raises(ValueError, match="multiple of groups"):
        two_level_dirichlet(np.arange(600), domain_ids, 5, 3, 1.0, 1.0, rng)


def test_hierarchy_config_is_validated():
    with pytest.raises(ConfigError, match="hierarchy.params.alhpa"):
        build_config({"hierarchy": {"params": {"alhpa": 0.5}}})
    with pytest.raises(ConfigError, match="hierarchy.merge"):
        build_config({"hierarchy": {"merge": "hfedavg"}})
    with pytest.raises(ConfigError, match="partition.params.groups"):
        build_config({"partition": {"num_clients": 6, "kind": "two_level_dirichlet", "params": {"groups": 3}},
                      "hierarchy": {"stations": 2}})
    with pytest.raises(ConfigError, match="it needs hierarchy.assignment=contiguous, not round_robin$"):  # groups fit
        build_config({"partition": {"num_clients": 6, "kind": "two_level_dirichlet", "params": {"groups": 3}},
                      "hierarchy": {"stations": 3, "assignment": "round_robin"}})


# --- the engine under a hierarchy ----------------------------------------------------------


def test_rounds_evaluation_only_at_server_round_ends(tmp_path):
    server, res = _run(tmp_path, "federation.rounds=3", "eval.every=2")
    rows = server.metrics
    assert server.rounds == 6 and [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [("ood_acc" in r) for r in rows] == [False, False, False, True, False, True]  # server rounds 2, 3
    assert [r["hfl/station_round"] for r in rows] == [1, 2, 1, 2, 1, 2]
    assert res["hierarchy"]["server_rounds"] == 3 and res["final"]["id_acc"] > 50


def test_one_station_with_avg_is_exactly_flat_fedavg(tmp_path):
    flat = Server(toy_federation(), tmp_path / "flat")
    run_inprocess(flat)
    hier, _ = _run(tmp_path, "hierarchy.stations=1", "hierarchy.station_rounds=1", "federation.rounds=3", name="h")
    assert all(np.array_equal(flat.state["weights"][k], hier.state["weights"][k]) for k in flat.state["weights"])


def test_client_pull_global_restarts_every_station_round_from_the_global_model():
    fed = hier_federation("hierarchy.params.client_pull=global")
    topo = fed.topology
    state = topo.init(fed.method, fed.model, None)
    state["stations"][0] = {**state["stations"][0], "weights": {k: v + 1 for k, v in state["weights"].items()}}
    assert all(np.array_equal(v, state["weights"][k]) for k, v in topo.client_config(fed.method, state, 0, 1).items())
    topo.params.__dict__["client_pull"] = "station"  # frozen model; only for this check
    assert not np.array_equal(topo.client_config(fed.method, state, 0, 1)["w/fc.weight"], state["weights"]["w/fc.weight"])


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "fedsr", "fediir"])
@pytest.mark.parametrize("merge", ["avg", "hfedatm", "hfedatm-no-fot", "hfedatm-no-regmean"])
def test_every_client_method_runs_under_every_merge(tmp_path, method, merge):
    over = (f"method.name={method}", f"hierarchy.merge={merge}", "federation.rounds=1", "hierarchy.station_rounds=1")
    server, res = _run(tmp_path, *over)
    assert res["hierarchy"]["client_method"] == method and res["hierarchy"]["merge"] == merge
    keys = set(server.metrics[-1])
    assert ("fot/moved" in keys) == (merge in ("hfedatm", "hfedatm-no-regmean"))
    assert ("regmean/fallbacks" in keys) == (merge in ("hfedatm", "hfedatm-no-fot"))
    assert np.isfinite(res["final"]["ood_acc"])


def test_resume_is_bit_identical(tmp_path):
    over = ("hierarchy.merge=hfedatm", "federation.rounds=2")
    full, _ = _run(tmp_path, *over, name="full")
    crashed = Server(hier_federation(*over), tmp_path / "crash")
    crashed.mark_setup_done()
    for t in (1, 2, 3):
        run_round(crashed, t)
    resumed = Server(hier_federation(*over), tmp_path / "crash", resume=True)
    run_inprocess(resumed)
    assert all(np.array_equal(full.state["weights"][k], resumed.state["weights"][k]) for k in full.state["weights"])


# --- Grams on the client -------------------------------------------------------------------


class _NoBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(36, 5), nn.Linear(5, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _ctx(epochs=2):
    fed = toy_federation()
    c = client_context(fed, 0, 1)
    return ClientContext(0, 1, fed.dataset, c.train_idx, 16, epochs, OptimSettings(), torch.Generator().manual_seed(0),
                         fed.task)


@pytest.mark.parametrize("gram_pass", ["last_epoch", "after"])
def test_client_grams_are_the_inputs_gram_of_one_pass_over_its_data(gram_pass):
    torch.manual_seed(0)
    model, ctx = _NoBN(), _ctx(epochs=2)
    msg = {**weights_of(model), "lr": 0.0, "round": 1, GRAM_FLAG: 1}  # lr 0: inputs are the same every epoch
    reply, _ = update_with_grams(FedAvg(), model, msg, {}, ctx, HFedATMParams(gram_pass=gram_pass))
    x = ctx.dataset.x[torch.from_numpy(ctx.train_idx)].flatten(1).double()
    h = torch.relu(model.fc1(x.float())).double()
    np.testing.assert_allclose(reply["gram/fc1"], (x.T @ x).numpy(), rtol=1e-5)  # one epoch, not two
    np.testing.assert_allclose(reply["gram/fc2"], (h.T @ h).detach().numpy(), rtol=1e-4, atol=1e-4)


def test_an_after_pass_grams_the_data_as_stored_not_augmented(monkeypatch):
    torch.manual_seed(0)
    model, ctx = _NoBN(), _ctx(epochs=1)
    shift_training_batches(monkeypatch, ctx.dataset)  # training batches +100: the after pass must not see them
    msg = {**weights_of(model), "lr": 0.0, "round": 1, GRAM_FLAG: 1}
    reply, _ = update_with_grams(FedAvg(), model, msg, {}, ctx, HFedATMParams(gram_pass="after"))
    x = ctx.dataset.x[torch.from_numpy(ctx.train_idx)].flatten(1).double()
    np.testing.assert_allclose(reply["gram/fc1"], (x.T @ x).numpy(), rtol=1e-5)


def test_last_epoch_grams_are_of_the_last_training_epoch_and_eval_passes_around_it_are_not_counted():
    """lr > 0, so fc2's inputs change between epochs; FedDG-GA evaluates (eval mode) before and after training."""
    torch.manual_seed(0)
    model, ctx = _NoBN(), _ctx(epochs=2)
    seen: list[tuple[bool, torch.Tensor]] = []  # (training?, fc2's input), forward by forward
    model.fc2.register_forward_pre_hook(lambda m, a: seen.append((m.training, a[0].detach().double())))
    msg = {**weights_of(model), "lr": 0.5, "round": 1, GA_WEIGHT: 0.5, GRAM_FLAG: 1}
    reply, _ = update_with_grams(FedDGGA(), model, msg, {}, ctx, HFedATMParams(gram_pass="last_epoch"))
    trained = [h for training, h in seen if training]
    assert len(trained) % 2 == 0 and len(trained) < len(seen)  # two equal epochs, and eval passes
    last = torch.cat(trained[len(trained) // 2 :])
    first = torch.cat(trained[: len(trained) // 2])
    np.testing.assert_allclose(reply["gram/fc2"], (last.T @ last).numpy(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(reply["gram/fc2"], (first.T @ first).numpy(), rtol=1e-3)  # the epochs differ


def test_a_second_forward_of_the_same_batch_is_not_counted_twice():
    model = _NoBN()
    rec = GramRecorder(model)
    x = torch.randn(3, 36)
    with rec:
        rec.new_pass()
        rec.new_batch()
        model(x)
        model(x)
    torch.testing.assert_close(rec.grams()["fc1"], x.double().T @ x.double())


def test_dp_grams_are_of_each_samples_input_clipped_to_the_clip_norm() -> None:
    """At ε = 1000 the noise is σ ≈ 0.006: the Gram is Σ_i x̂_i x̂_iᵀ with x̂_i = x_i · min(1, C/‖x_i‖), by hand."""
    torch.manual_seed(0)
    model, ctx = _NoBN(), _ctx(epochs=1)
    params = HFedATMParams(dp_epsilon=1000.0, gram_pass="after", dp_clip=0.5)
    msg = {**weights_of(model), "lr": 0.0, "round": 1, GRAM_FLAG: 1}  # lr 0: the sent weights are the initial ones
    reply, _ = update_with_grams(FedAvg(), model, msg, {}, ctx, params)
    x = ctx.dataset.x[torch.from_numpy(ctx.train_idx)].flatten(1).double()
    clipped = x * (0.5 / x.norm(dim=1, keepdim=True)).clamp(max=1.0)
    assert (x.norm(dim=1) > 0.5).all()  # every sample is clipped: without it the Gram would be far larger
    sigma = params.dp_sigma()
    assert sigma is not None
    np.testing.assert_allclose(reply["gram/fc1"], (clipped.T @ clipped).numpy(), atol=8 * sigma)


# --- station: eqs. 9–10 ---------------------------------------------------------------------


def test_station_grams_are_the_clients_mean_shrunk_by_alpha_for_the_layers_every_client_sent() -> None:
    a, b = np.array([[2.0, 1.0], [1.0, 4.0]]), np.array([[4.0, 3.0], [3.0, 2.0]])
    out = station_grams([{"fc": a, "head": np.eye(2)}, {"fc": b}], HFedATMParams(alpha=0.5))
    assert set(out) == {"fc"}  # "head" is missing at one client
    # eq. 9: mean [[3, 2], [2, 3]]; eq. 10 with α = 0.5: off-diagonal halved
    np.testing.assert_allclose(out["fc"], [[3.0, 1.0], [1.0, 3.0]])


def test_station_grams_under_dp_are_projected_onto_the_psd_cone_before_shrinking() -> None:
    q0, q1 = np.array([0.6, 0.8]), np.array([-0.8, 0.6])  # orthonormal eigenvectors
    noisy = 2.0 * np.outer(q0, q0) - np.outer(q1, q1)  # eigenvalues 2, −1: indefinite, as noise can make it
    params = HFedATMParams(alpha=0.5, dp_epsilon=1.0, gram_pass="after")
    out = station_grams([{"fc": noisy}, {"fc": noisy}], params)
    # projected: 2 q0 q0ᵀ = [[0.72, 0.96], [0.96, 1.28]]; then eq. 10 with α = 0.5
    np.testing.assert_allclose(out["fc"], [[0.72, 0.48], [0.48, 1.28]], atol=1e-12)


# --- privacy audit: what leaves a client ----------------------------------------------------

DECLARED = {"fedavg": set(), "fedprox": set(), "fedsr": {"l2r", "cmi"}, "fediir": {"grad_batches"}}


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "fedsr", "fediir"])
def test_no_raw_activation_or_sample_leaves_a_client(method):
    fed = hier_federation(f"method.name={method}", "hierarchy.merge=hfedatm")
    topo = fed.topology
    state = topo.init(fed.method, fed.model, None)
    msg = {**topo.client_config(fed.method, state, 0, 2), "lr": 0.1, "round": 2}  # station round N: Grams requested
    assert msg[GRAM_FLAG] == 1
    reply, client_state = topo.client_update(fed.method, fed.model, msg, {}, client_context(fed, 0, 2))
    linears = {n: m for n, m in fed.model.named_modules() if isinstance(m, nn.Linear)}
    weights = set(weights_of(fed.model))
    grams = {k for k in reply if k.startswith("gram/")}
    classifier_grads = {k for k in reply if k.startswith("grad/")}
    assert set(reply) == weights | grams | classifier_grads | {"num_examples", "train_loss"} | DECLARED[method]
    assert grams == {f"gram/{n}" for n in linears}
    for name, layer in linears.items():  # m × m second moments, never n × m activations
        g = reply[f"gram/{name}"]
        assert g.shape == (layer.in_features, layer.in_features) and np.allclose(g, g.T, rtol=1e-5, atol=1e-4)
    params = dict(fed.model.classifier.named_parameters())
    assert all(reply[k].shape == params[k[5:]].shape for k in classifier_grads)
    assert all(not isinstance(v, np.ndarray) or v.ndim == 0 or v.shape[0] != fed.clients[0].train_idx.size
               for v in reply.values())
    assert not set(client_state) & set(reply)  # FedSR's reference stays on the client


def test_dp_grams_come_from_the_sent_weights():
    with pytest.raises(ValueError, match="dp_epsilon needs gram_pass: after"):
        HFedATMParams(dp_epsilon=1.0)  # last_epoch: the passes of training, through weights never sent
    assert HFedATMParams(dp_epsilon=1.0, gram_pass="after").dp_sigma() is not None


def test_dp_noises_the_grams_and_the_results_record_epsilon(tmp_path):
    over = ("hierarchy.merge=hfedatm", "hierarchy.params.dp_epsilon=1.0", "hierarchy.params.dp_clip=2.0",
            "hierarchy.params.gram_pass=after", "federation.rounds=1")
    fed = hier_federation(*over)
    topo = fed.topology
    state = topo.init(fed.method, fed.model, None)
    msg = {**topo.client_config(fed.method, state, 0, 2), "lr": 0.1, "round": 2}
    noisy, _ = topo.client_update(fed.method, fed.model, dict(msg), {}, client_context(fed, 0, 2))
    recorder_clip = GramRecorder(fed.model, clip=2.0)  # the clipped, noiseless Gram of the same pass
    fed.method.client_update(fed.model, {k: v for k, v in msg.items() if k != GRAM_FLAG}, {}, client_context(fed, 0, 2))
    recorder_clip.extra_pass(fed.model, client_context(fed, 0, 2))
    clean = recorder_clip.grams()["fc"].numpy()
    sigma = gaussian_sigma(1.0, 1e-5, 4.0)
    diff = noisy["gram/fc"] - clean
    assert np.allclose(diff, diff.T, atol=1e-3) and diff[np.triu_indices(len(diff), 1)].std() == pytest.approx(sigma, rel=0.1)
    server, res = _run(tmp_path, *over)
    h = res["hierarchy"]
    assert h["dp_epsilon"] == 1.0 and h["dp_sigma"] == pytest.approx(sigma) and h["dp_clip"] == 2.0
    assert h["dp_gram_releases"] == 2 and h["dp_epsilon_total_basic"] == 2.0  # 1 server round × 2 linear layers
    assert json.loads((tmp_path / "run" / "results.json").read_text())["hierarchy"]["dp_epsilon"] == 1.0


# --- merge, diagnostics, accounting ---------------------------------------------------------


def test_hfedatm_merge_of_a_permuted_station_recovers_the_station_model():
    torch.manual_seed(0)
    model = ToyNet().eval()
    spec = permutation_spec(model)
    s1 = model.state_dict()
    perms = random_permutations(spec, np.random.default_rng(0))
    s2 = apply_permutations(s1, spec, perms)
    x = torch.randn(300, 4 * 36, dtype=torch.float64)
    g1 = (x.T @ x).numpy()
    # the permuted station saw the same data through permuted channels: its Gram is permuted too
    g2 = permute_grams({"fc": torch.from_numpy(g1)}, spec, perms)["fc"].numpy()
    gc = np.eye(16) * 3.0
    msgs = [{WEIGHT_PREFIX + k: v.numpy() for k, v in s.items()} for s in (s1, s2)]
    grams = [{"fc": g1, "classifier": gc}, {"fc": g2, "classifier": gc}]
    merged, metrics = merge_stations(msgs, grams, [2, 1], spec)
    assert all(np.allclose(merged[WEIGHT_PREFIX + k], v.numpy(), atol=1e-5) for k, v in s1.items())
    assert metrics["fot/conv/moved"] == 1.0 - (perms["conv"] == np.arange(4)).mean()
    assert metrics["fot/conv/cost_after"] < 1e-6 < metrics["fot/conv/cost_before"]
    assert metrics["regmean/fc/fallback"] == 0.0 and metrics["regmean/fc/cond"] >= 1.0
    unaligned, _ = merge_stations(msgs, grams, [2, 1], None)  # hfedatm-no-fot
    assert not np.allclose(unaligned["w/conv.weight"], s1["conv.weight"].numpy())


def test_hfedatm_merge_solves_eq12_with_each_stations_gram_moved_by_its_alignment():
    """Two stations whose ``fc`` differ: its RegMean solution depends on the Grams, so the permuted station's Gram
    must be aligned together with its weights."""
    torch.manual_seed(0)
    model = ToyNet().eval()
    spec = permutation_spec(model)
    s1 = model.state_dict()
    other = {**s1, "fc.weight": torch.randn(16, 4 * 36)}  # the second station's model, before its permutation
    perms = random_permutations(spec, np.random.default_rng(0))
    assert (perms["conv"] != np.arange(4)).any()
    s2 = apply_permutations(other, spec, perms)
    x1, x2 = torch.randn(300, 4 * 36, dtype=torch.float64), torch.randn(300, 4 * 36, dtype=torch.float64) + 0.5
    g1, g2 = x1.T @ x1, x2.T @ x2  # distinct, full Grams, each in its own station's channel order
    gc = np.eye(16) * 3.0
    grams = [{"fc": g1.numpy(), "classifier": gc},
             {"fc": permute_grams({"fc": g2}, spec, perms)["fc"].numpy(), "classifier": gc}]
    msgs = [{WEIGHT_PREFIX + k: v.numpy() for k, v in s.items()} for s in (s1, s2)]
    merged, _ = merge_stations(msgs, grams, [2, 1], spec)
    w1, w2 = s1["fc.weight"].double().numpy(), other["fc.weight"].double().numpy()
    expected = np.linalg.solve((g1 + g2).numpy(), g1.numpy() @ w1.T + g2.numpy() @ w2.T).T  # eq. 12
    np.testing.assert_allclose(merged[WEIGHT_PREFIX + "fc.weight"], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(merged[WEIGHT_PREFIX + "classifier.weight"], s1["classifier.weight"].numpy(), atol=1e-5)


def test_station_aggregation_then_merge_with_gamma_weights():
    topo = stations([0, 0, 0, 1])
    w = lambda v: {"w/p": np.array([v], np.float32)}  # noqa: E731
    state = {"weights": w(0.0), "stations": [{"weights": w(0.0)}, {"weights": w(0.0)}], "round": 0}
    replies = [Reply(0, {**w(1.0), "num_examples": 10}), Reply(1, {**w(4.0), "num_examples": 30}),
               Reply(3, {**w(9.0), "num_examples": 5})]
    new, metrics = fold(topo, FedAvg(), state, replies)
    # station 0: FedAvg by examples (1·10 + 4·30) / 40 = 3.25, γ=2; station 1: 9, γ=1
    assert new["weights"]["w/p"][0] == pytest.approx((2 * 3.25 + 9.0) / 3)
    assert all(s["weights"]["w/p"][0] == new["weights"]["w/p"][0] for s in new["stations"])
    assert metrics["hfl/bytes_station_up"] == 2 * message_nbytes(w(0.0))
    assert metrics["hfl/bytes_station_down"] == 2 * message_nbytes(w(0.0))


def test_a_station_without_grams_has_its_linear_layers_averaged_with_a_warning(caplog):
    # a reply may omit its Grams (optional slots): a station left without any crashed the server's merge (TypeError)
    topo = stations([0, 0, 1, 1], merge="hfedatm-no-fot")
    rng = np.random.default_rng(0)
    w = [{"w/fc.weight": rng.normal(size=(2, 3)).astype(np.float32), "w/fc.bias": rng.normal(size=2).astype(np.float32)}
         for _ in range(2)]
    state = {"weights": w[0], "stations": [{"weights": w[0]}, {"weights": w[1]}], "round": 0}
    gram = (lambda x: x.T @ x)(rng.normal(size=(5, 3))).astype(np.float32)
    replies = [Reply(0, {**w[0], "gram/fc": gram, "num_examples": 4}), Reply(2, {**w[1], "num_examples": 4})]
    with caplog.at_level("WARNING", logger="feddg.aggregation.merges"):
        new, metrics = fold(topo, FedAvg(), state, replies)
    assert metrics["regmean/layers_without_grams"] == 1 and "fc" in caplog.text
    np.testing.assert_allclose(new["weights"]["w/fc.weight"], (w[0]["w/fc.weight"] + w[1]["w/fc.weight"]) / 2, rtol=1e-6)


def test_diagnostics_and_accounting_are_in_the_metrics_and_results(tmp_path):
    server, res = _run(tmp_path, "hierarchy.merge=hfedatm")
    merge_row, station_row = server.metrics[1], server.metrics[0]
    for key in ("fot/conv/moved", "fot/conv/cost_before", "fot/conv/cost_after", "regmean/fc/cond",
                "regmean/classifier/fallback", "hfl/time_fot_s", "hfl/time_regmean_s", "hfl/bytes_station_up"):
        assert key in merge_row and key not in station_row, key
    grams_up = merge_row["hfl/bytes_client_gram_up"]
    assert grams_up == pytest.approx(4 * (4 * (144 * 144 + 16 * 16) + len("gram/fc") + len("gram/classifier")))
    assert station_row["hfl/bytes_client_gram_up"] == 0
    per = res["hierarchy"]["per_server_round"]
    assert per["time_s"] >= per["time_local_training_s"] > 0 and per["time_fot_s"] > 0
    assert per["bytes_client_gram_up"] == grams_up
    table = overhead_table([res, {**res, "hierarchy": {**res["hierarchy"], "merge": "avg",
                                                        "per_server_round": {"time_s": per["time_s"] / 2}}}])
    assert "| fedavg |" in table and "| 100.0 |" in table


class _CountingFedAvg(FedAvg):
    """FedAvg that reports how many replies its (station) fold saw."""

    def keep(self, reply):
        return {}

    def finish(self, state, acc):
        state, _ = super().finish(state, acc)
        return state, {"inner/seen": float(len(acc.kept))}


def test_the_client_methods_own_metrics_are_passed_through_as_a_mean_over_stations():
    fed = hier_federation()  # 4 clients, 2 stations of 2 (contiguous)
    method = _CountingFedAvg()
    state = fed.topology.init(method, fed.model, None)
    reply = {**weights_of(fed.model), "num_examples": 10}
    _, metrics = fold(fed.topology, method, state, [Reply(c, reply) for c in (0, 1, 2)])  # station 0: 2, station 1: 1
    assert metrics["inner/seen"] == pytest.approx(1.5)
