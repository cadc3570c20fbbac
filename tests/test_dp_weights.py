"""DP-FedAvg on the weight replies (docs/privacy.md, "DP on the weights"): clipping, the aggregate's noise, the
adaptive clip, the run's ε, and that noise 0 with a huge clip is FedAvg bit for bit on both engines."""

import json
import math

import numpy as np
import pytest
from dp_accounting import GaussianDpEvent, NeighboringRelation, SampledWithoutReplacementDpEvent
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from support.dp_reference import accounted_gaussian
from test_flower import LoopbackGrid, server_config_text, toy_config, toy_federation_of
from toy import toy_federation

from feddg.aggregation.accounting import dp_fedavg_epsilon
from feddg.aggregation.dp_weights import (
    adaptive_noise,
    clip_update,
    gaussian_noise,
    next_clip,
    noise_std,
    update_norm,
)
from feddg.aggregation.mean import WeightedSum, weighted_mean
from feddg.algorithms.base import Accumulator, Reply
from feddg.config import ConfigError, WeightDPConfig, build_config
from feddg.engines.flower.client import make_client_app
from feddg.engines.flower.server import run_on_grid
from feddg.engines.inprocess import run_inprocess, run_round
from feddg.federation.server import Server
from feddg.federation.weight_privacy import NOISE_STREAM, WeightPrivacy
from feddg.messages import weights_of
from feddg.seeds import derived_seed

SENT = {"w/a": np.zeros(2, np.float32), "w/b": np.ones(1, np.float32), "w/n": np.array(5, np.int64)}
REPLY = {"w/a": np.array([3.0, 0.0], np.float32), "w/b": np.array([5.0], np.float32), "w/n": np.array(9, np.int64),
         "num_examples": 10, "train_loss": 0.5}  # Δ = (3, 0, 4): norm 5; the int counter is neither clipped nor noised


def _untimed(rows, drop=()):
    return [{k: v for k, v in r.items() if not k.startswith("time_") and not k.startswith(drop or "\0")} for r in rows]


# --- formulas --------------------------------------------------------------------------------------
def test_an_update_is_clipped_to_the_norm_as_one_vector():
    assert update_norm(REPLY, SENT) == 5.0
    out, norm = clip_update(REPLY, SENT, 1.0)
    assert norm == 5.0
    np.testing.assert_allclose(out["w/a"], [0.6, 0.0], rtol=1e-6)  # 3/5
    np.testing.assert_allclose(out["w/b"], [1.8], rtol=1e-6)  # 1 + 4/5
    assert out["w/n"] == 9 and out["num_examples"] == 10 and out["w/a"].dtype == np.float32
    kept, _ = clip_update(REPLY, SENT, 5.0)  # within the bound: the same arrays, the same bits
    assert all(kept[k] is REPLY[k] for k in REPLY)


def test_only_float_weight_arrays_are_measured_and_clipped():
    sent, reply = {**SENT, "stat/s": np.zeros(1, np.float32)}, {**REPLY, "stat/s": np.array([12.0], np.float32)}
    assert update_norm(reply, sent) == 5.0  # the statistic's 12 is not part of the update
    out, _ = clip_update(reply, sent, 1.0)
    assert out["stat/s"] is reply["stat/s"]


@pytest.mark.parametrize("clip", [0.0, -1.0])
def test_a_clip_that_is_not_positive_is_refused(clip):
    with pytest.raises(ValueError, match="the clipping norm must be positive"):
        clip_update(REPLY, SENT, clip)


def test_clipping_matches_flowers_compute_clip_model_update():
    dp = pytest.importorskip("flwr.supercore.differential_privacy")
    params = [np.asarray(REPLY[k], np.float64) for k in ("w/a", "w/b")]
    dp.compute_clip_model_update(params, [np.asarray(SENT[k], np.float64) for k in ("w/a", "w/b")], 2.0)
    out, _ = clip_update(REPLY, SENT, 2.0)
    np.testing.assert_allclose(np.concatenate(params), np.concatenate([out["w/a"], out["w/b"]]), rtol=1e-6)


def test_noise_std_is_z_c_over_m_for_equal_weights_and_the_largest_share_otherwise():
    assert noise_std(2.0, 0.5, [3, 3, 3, 3]) == 2.0 * 0.5 / 4
    assert noise_std(2.0, 0.5, [1, 3]) == 2.0 * 0.5 * 0.75
    flwr_dp = pytest.importorskip("flwr.supercore.differential_privacy")
    assert noise_std(1.3, 0.7, [5] * 10) == pytest.approx(flwr_dp.compute_stdv(1.3, 0.7, 10), rel=1e-15)


@pytest.mark.parametrize("weights", [[], [-1, 3], [0, 0]])
def test_noise_std_refuses_weights_without_a_positive_sum_or_with_a_negative_one(weights):
    with pytest.raises(ValueError, match="need non-negative weights with a positive sum"):
        noise_std(1.0, 1.0, weights)


def _noised_round(weights: list[int], expected: int, n: int = 200_000):
    """A round of zero updates from clients of ``weights`` examples (``expected`` announced) through the server's
    noise: the mean's entries are pure noise."""
    priv = WeightPrivacy(WeightDPConfig(noise_multiplier=2.0, clip=0.5), num_clients=4, fraction=1.0, seed=3)
    acc = Accumulator(WeightedSum("w/", expected))
    for w in weights:
        acc.weights.add({"w/x": np.zeros(n, np.float32), "w/n": np.array(1, np.int64)}, w)
    metrics = priv.add_noise(acc, round=1, examples=weights, sampled=4)
    return acc.weights.mean(), metrics


def test_the_aggregate_noise_has_std_z_c_over_m():
    mean, metrics = _noised_round([3, 3, 3, 3], 12)
    sigma = 2.0 * 0.5 / 4
    assert metrics["dp_weights/noise_std"] == sigma
    # sample std of n normals: within 5 standard errors σ/√(2n) of σ; the mean within 5 σ/√n of 0
    assert abs(mean["w/x"].std() - sigma) < 5 * sigma / math.sqrt(2 * mean["w/x"].size)
    assert abs(mean["w/x"].mean()) < 5 * sigma / math.sqrt(mean["w/x"].size)
    assert mean["w/n"] == 1  # integer arrays are not noised
    expected = np.random.default_rng(derived_seed(3, 1, NOISE_STREAM)).normal(0.0, sigma, mean["w/x"].shape)
    np.testing.assert_array_equal(mean["w/x"], expected.astype(np.float32))  # exactly the round's stream


def test_a_missing_reply_leaves_the_noise_of_the_mean_exact():
    mean, metrics = _noised_round([2, 6], 12)  # 4 examples never arrived: the mean is rescaled by 12/8
    sigma = 2.0 * 0.5 * 6 / 8
    assert metrics["dp_weights/noise_std"] == sigma
    expected = np.random.default_rng(derived_seed(3, 1, NOISE_STREAM)).normal(0.0, sigma, mean["w/x"].shape)
    np.testing.assert_allclose(mean["w/x"], expected, rtol=1e-6, atol=1e-7)


def test_gaussian_noise_keeps_shapes_and_draws_in_key_order():
    noise = gaussian_noise({"a": np.zeros((2, 3)), "b": np.zeros(4)}, 1.0, np.random.default_rng(0))
    flat = np.random.default_rng(0).normal(0.0, 1.0, 10)
    assert noise["a"].shape == (2, 3)
    np.testing.assert_array_equal(np.concatenate([noise["a"].ravel(), noise["b"]]), flat)


def test_adaptive_clip_moves_geometrically_toward_the_quantile():
    assert next_clip(2.0, 1, 2, 0.9, 0.2) == pytest.approx(2.0 * math.exp(0.08), rel=1e-15)  # too few unclipped: grow
    assert next_clip(1.0, 4, 4, 0.5, 0.2) == pytest.approx(math.exp(-0.1), rel=1e-15)  # all unclipped: shrink
    std, z = adaptive_noise(1.0, 100, None)  # Andrew et al.: σ_b = m/20, z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2)
    assert std == 5.0 and z == pytest.approx((1.0 - 1.0 / 100) ** -0.5, rel=1e-15)
    flwr_dp = pytest.importorskip("flwr.supercore.differential_privacy")
    assert (std, z) == pytest.approx(flwr_dp.compute_adaptive_noise_params(1.0, 100, None), rel=1e-15)
    with pytest.raises(ValueError, match="count_std: 0.2 is too small"):
        adaptive_noise(1.0, 4, None)


def test_the_count_noise_must_exceed_half_z_and_noise_zero_adds_none_to_the_weights():
    with pytest.raises(ValueError, match="count_std: 0.5 is too small"):
        adaptive_noise(1.0, 10, None)  # σ_b = 10/20 = z/2: (z⁻² − (2σ_b)⁻²) = 0, no finite z_Δ
    assert adaptive_noise(1.0, 10, 0.6) == (0.6, pytest.approx((1.0 - 1.2**-2) ** -0.5, rel=1e-15))
    assert adaptive_noise(0.0, 10, None) == (0.0, 0.0)  # z = 0: nothing noised, the count neither
    assert adaptive_noise(0.0, 10, 1.5) == (1.5, 0.0)  # an explicit count noise is kept


def test_the_server_moves_the_clip_by_the_unclipped_count():
    cfg = WeightDPConfig(noise_multiplier=0.0, clip=2.0, adaptive={"target_quantile": 0.9, "clip_lr": 0.2})
    priv = WeightPrivacy(cfg, num_clients=2, fraction=1.0, seed=0)
    priv.begin()
    acc = Accumulator(WeightedSum("w/", 20))
    for cid, step in enumerate((1.0, 3.0)):  # update norms 1 (kept) and 3 (clipped to 2)
        reply = priv.clip_reply(Reply(cid, {"w/x": np.array([step], np.float32), "num_examples": 10}),
                                {"w/x": np.zeros(1, np.float32)})
        acc.weights.add(reply.message, 10)
    metrics = priv.add_noise(acc, 1, [10, 10], 2)
    assert acc.weights.mean()["w/x"][0] == 1.5  # (1 + 2) / 2
    assert metrics["dp_weights/unclipped_noised"] == 0.5 and priv.clip == 2.0
    priv.commit()
    assert priv.clip == pytest.approx(2.0 * math.exp(-0.2 * (0.5 - 0.9)), rel=1e-15)
    record = priv.record(1)  # results.json: the configured clip and the one the run ended with
    assert record["clip"] == 2.0 and record["clip_final"] == pytest.approx(2.0 * math.exp(0.08), rel=1e-15)


def test_an_update_of_norm_exactly_the_clip_counts_as_unclipped() -> None:
    cfg = WeightDPConfig(noise_multiplier=0.0, clip=2.0, adaptive={"target_quantile": 0.5, "clip_lr": 0.2})
    priv = WeightPrivacy(cfg, num_clients=1, fraction=1.0, seed=0)
    priv.begin()
    priv.clip_reply(Reply(0, {"w/x": np.array([2.0], np.float32)}), {"w/x": np.zeros(1, np.float32)})
    assert priv.unclipped == 1  # Andrew et al.: b = 1[‖Δ‖ ≤ C]


def test_the_adaptive_clips_count_of_unclipped_updates_is_released_with_gaussian_noise_of_count_std():
    cfg = WeightDPConfig(noise_multiplier=0.5, clip=2.0, adaptive={"count_std": 1.5})
    priv = WeightPrivacy(cfg, num_clients=2, fraction=1.0, seed=0)
    errors = []
    for rnd in range(1, 801):
        priv.begin()
        acc = Accumulator(WeightedSum("w/", 20))
        for cid in range(2):  # both updates within the clip: the true count is 2
            acc.weights.add(priv.clip_reply(Reply(cid, {"w/x": np.array([1.0], np.float32), "num_examples": 10}),
                                            {"w/x": np.zeros(1, np.float32)}).message, 10)
        errors.append(priv.add_noise(acc, rnd, [10, 10], 2)["dp_weights/unclipped_noised"] * 2 - 2)
    assert abs(np.mean(errors)) < 0.2 and np.std(errors) == pytest.approx(1.5, rel=0.08)  # 800 draws: se 2.5 %


# --- runs ------------------------------------------------------------------------------------------
def test_noise_zero_and_a_huge_clip_is_fedavg_bit_for_bit(tmp_path):
    ref = Server(toy_federation(), tmp_path / "ref")
    run_inprocess(ref)
    dp = Server(toy_federation("dp_weights.noise_multiplier=0", "dp_weights.clip=1e9"), tmp_path / "dp")
    run_inprocess(dp)
    assert all(np.array_equal(ref.state["weights"][k], dp.state["weights"][k]) for k in ref.state["weights"])
    assert _untimed(dp.metrics, "dp_weights/") == _untimed(ref.metrics)
    assert json.loads((tmp_path / "dp" / "results.json").read_text())["weights_privacy"]["epsilon"] is None


def test_a_round_moves_the_global_model_by_at_most_the_clip(tmp_path):
    moved = []
    for name, dp in (("plain", ()), ("dp", ("dp_weights.noise_multiplier=0", "dp_weights.clip=0.01"))):
        fed = toy_federation("federation.rounds=1", *dp)
        start = {k: np.array(v) for k, v in weights_of(fed.model).items()}
        server = Server(fed, tmp_path / name)
        run_inprocess(server)
        moved.append(update_norm(server.state["weights"], start))
    assert moved[0] > 0.5 and moved[1] <= 0.01 + 1e-6  # a mean of updates clipped to C is within C


def test_replacing_one_client_moves_the_mean_by_twice_its_clipped_share_so_epsilon_takes_half_of_z():
    # two clients of 1 and 3 examples; the larger one's update, clipped to C, replaced by its opposite
    clip, weights, other = 0.5, [1.0, 3.0], np.array([0.1, -0.2])
    up, down = np.array([clip, 0.0]), np.array([-clip, 0.0])
    moved = np.linalg.norm(weighted_mean([other, up], weights) - weighted_mean([other, down], weights))
    assert moved == pytest.approx(2 * clip * 3 / 4)  # 2 · C · max p
    assert noise_std(1.0, clip, weights) / moved == pytest.approx(0.5)  # the mechanism's multiplier: z / 2
    # every client every round: 8 Gaussian releases of multiplier z / 2, by dp-accounting's own RDP accountant
    assert dp_fedavg_epsilon(1.0, 6, 6, 8, 1e-5) == pytest.approx(accounted_gaussian(RdpAccountant, 0.5, 8, 1e-5))


def test_pld_epsilon_of_full_participation_is_the_add_or_remove_gaussian_of_half_z():
    # replace-one moves the weighted mean by 2 C max p against noise z C max p: one Gaussian of multiplier z / 2
    direct = accounted_gaussian(PLDAccountant, 2.0, 2, 1e-5)
    assert dp_fedavg_epsilon(4.0, 5, 5, 2, 1e-5, "pld") == pytest.approx(direct, rel=1e-3)


@pytest.mark.parametrize(("clients", "sampled"), [(4, 0), (4, 5)])
def test_dp_fedavg_epsilon_refuses_a_sample_outside_the_federation(clients, sampled):
    with pytest.raises(ValueError, match=f"need 0 < sampled <= clients; got {sampled} of {clients}"):
        dp_fedavg_epsilon(1.0, clients, sampled, 3, 1e-5)


def test_pld_refuses_client_sampling_with_a_value_error():
    with pytest.raises(ValueError, match="the pld accountant of dp-accounting cannot compose SampledWithoutReplacement"):
        dp_fedavg_epsilon(1.0, 6, 3, 4, 1e-5, "pld")


def test_epsilon_is_the_accountants_for_replace_one_sampling_without_replacement(tmp_path):
    server = Server(toy_federation("dp_weights.noise_multiplier=1.5", "dp_weights.clip=0.5",
                                   "federation.client_fraction=0.5"), tmp_path)
    run_inprocess(server)
    rec = json.loads((tmp_path / "results.json").read_text())["weights_privacy"]
    clients = len(server.fed.clients)
    assert (rec["clients"], rec["sampled"], rec["releases"], rec["noise_multiplier_accounted"]) == (clients, 2, 3, 0.75)
    assert rec["sampling_rate"] == 2 / clients
    expected = RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)  # Wang et al. 2019, Thm. 27
    expected.compose(SampledWithoutReplacementDpEvent(clients, 2, GaussianDpEvent(0.75)), 3)
    assert rec["epsilon"] == expected.get_epsilon(1e-5)
    assert rec["epsilon"] < accounted_gaussian(RdpAccountant, 0.75, 3, 1e-5)  # sampling amplifies privacy
    with pytest.raises(ConfigError, match="^dp_weights.accountant: pld cannot compose client sampling without "):
        build_config({}, ["dp_weights={noise_multiplier: 1, clip: 1, accountant: pld}", "federation.client_fraction=0.5"])


@pytest.mark.parametrize("overrides, why", [
    (["method.name=local"], "local does not average weights by num_examples"),
    (["method.name=feddg_ga"], "feddg_ga does not average weights by num_examples"),
    (["hierarchy.stations=2"], "not a station topology"),
    (["federation.aggregation=median"], "not federation.aggregation=median"),
    (["federation.reject_outliers=3"], "not federation.reject_outliers"),
])
def test_dp_on_weights_is_refused_in_one_line_where_it_is_not_dp_fedavg(overrides, why):
    with pytest.raises(ConfigError, match=why) as err:
        build_config({}, ["dp_weights.noise_multiplier=1", "dp_weights.clip=1", *overrides])
    assert "\n" not in str(err.value)


def test_flower_engine_gives_the_same_noised_adaptive_run(tmp_path, task_identity):
    cfg = toy_config("federation.rounds=2", "dp_weights.noise_multiplier=0.5", "dp_weights.clip=0.3",
                     "dp_weights.adaptive.count_std=1.0", "federation.client_fraction=0.5",
                     "dp_noise=seeded")  # the same noise on both engines (a secret key is drawn per federation)
    ref = Server(toy_federation_of(cfg), tmp_path / "ref")
    run_inprocess(ref)
    server = Server(toy_federation_of(cfg), tmp_path / "flower")
    run_on_grid(server, LoopbackGrid(make_client_app(server_config_text(server), factory=toy_federation_of), 4))
    assert all(np.array_equal(ref.state["weights"][k], server.state["weights"][k]) for k in ref.state["weights"])
    assert _untimed(server.metrics) == _untimed(ref.metrics)
    assert server.metrics[1]["dp_weights/clip"] != 0.3  # the clip moved after round 1, the same on both engines


@pytest.mark.parametrize("dp_noise", ["seeded", "secret"])
def test_only_seeded_noise_can_be_redrawn_from_the_config(tmp_path, dp_noise):
    # the noise was drawn from derived_seed(config.yaml's seed, round, ...): whoever held the config and the published
    # noise std subtracted it exactly (an audit recovered the clean mean to 3e-8); secret noise is keyed per run
    over = ("federation.rounds=1", "dp_weights.noise_multiplier=1.0", "dp_weights.clip=0.3", f"dp_noise={dp_noise}")
    runs = [Server(toy_federation(*over), tmp_path / f"run{i}") for i in range(2)]
    for server in runs:
        run_inprocess(server)
    clean = Server(toy_federation("federation.rounds=1", "dp_weights.noise_multiplier=0", "dp_weights.clip=0.3"),
                   tmp_path / "clean")  # the same clipped mean without noise
    run_inprocess(clean)
    key = "w/classifier.weight"
    noise = [server.state["weights"][key].astype(np.float64) - clean.state["weights"][key] for server in runs]
    assert min(float(np.std(n)) for n in noise) > 0.01  # both noised
    assert np.array_equal(noise[0], noise[1]) == (dp_noise == "seeded")
    assert (runs[0].fed.noise_key == runs[0].fed.cfg.seed) == (dp_noise == "seeded")


def test_a_resumed_run_keeps_the_adaptive_clip(tmp_path):
    overrides = ("dp_weights.noise_multiplier=0.5", "dp_weights.clip=0.3", "dp_weights.adaptive.count_std=1.0",
                 "dp_noise=seeded")  # a secret noise key is drawn afresh on resume (the guarantee allows it)
    whole = Server(toy_federation(*overrides), tmp_path / "whole")
    run_inprocess(whole)
    part = Server(toy_federation(*overrides), tmp_path / "part")
    part.mark_setup_done()
    for r in (1, 2):
        run_round(part, r)
    resumed = Server(toy_federation(*overrides), tmp_path / "part", resume=True)
    run_inprocess(resumed)
    assert _untimed(resumed.metrics) == _untimed(whole.metrics)


def test_a_resumed_run_reports_what_every_round_sent_in_the_clear(tmp_path):
    """FedIIR's gradient sums are outside the guarantee: a run resumed after its last round still says so."""
    overrides = ("method.name=fediir", "dp_weights.noise_multiplier=0.5", "dp_weights.clip=0.3")
    part = Server(toy_federation(*overrides, "federation.rounds=2"), tmp_path / "part")
    part.mark_setup_done()
    for r in (1, 2):
        run_round(part, r)
    resumed = Server(toy_federation(*overrides, "federation.rounds=2"), tmp_path / "part", resume=True)
    assert resumed.write_results()["weights_privacy"]["not_covered"] == ["grad", "grad_batches"]


def test_batchnorm_running_statistics_are_warned_about_and_cnn_gn_has_none(tmp_path, caplog, cache_dir, monkeypatch):
    from feddg.federation.setup import build_federation
    from feddg.models import create_model

    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))

    bn, gn = (create_model(name, num_classes=10) for name in ("cnn", "cnn_gn"))
    assert not list(gn.buffers()) and any(n.endswith("running_var") for n, _ in bn.named_buffers())
    assert sum(p.numel() for p in gn.parameters()) == sum(p.numel() for p in bn.parameters())  # GN affine = BN affine
    dp = ("dp_weights.noise_multiplier=0.1", "dp_weights.clip=1")
    for name in ("cnn", "cnn_gn"):
        caplog.clear()
        cfg = build_config({"data": {"dataset": "digits-dg", "max_per_domain": 30}, "split": {"target": "uci"},
                            "partition": {"kind": "by_domain", "num_clients": 3}, "device": "cpu"},
                           [f"model.name={name}", *dp])
        Server(build_federation(cfg), tmp_path / name)
        assert ("BatchNorm running statistics" in caplog.text) == (name == "cnn"), name


def test_the_unclipped_count_starts_afresh_each_round(tmp_path):
    # noise 0, a clip no update reaches, a count with next to no noise: every round releases 4 of 4 sampled (1.0),
    # not the run's total so far (2.0, 3.0)
    server = Server(toy_federation("dp_weights.noise_multiplier=0", "dp_weights.clip=1000",
                                   "dp_weights.adaptive.count_std=1e-6"), tmp_path / "run")
    run_inprocess(server)
    assert [row["dp_weights/unclipped_noised"] for row in server.metrics] == pytest.approx([1.0] * 3, abs=1e-4)
