"""FedFA's server side (eqs. 6–7), the message contract, the variants, byte accounting and protocols."""

import copy
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from toy import toy_federation

from feddg.aggregation.fedfa_stats import (
    add_noise,
    client_sharing_variance,
    t_modulation,
)
from feddg.algorithms import Reply, ServerContext, create_method
from feddg.algorithms.components.soft_histogram import soft_histogram, symmetric_kl
from feddg.cli import communication_table
from feddg.config import ConfigError, build_config
from feddg.engines.inprocess import run_inprocess
from feddg.evaluation.tally import tally_by_domain
from feddg.federation.client import client_context, run_client
from feddg.federation.server import Server
from feddg.messages import load_weights, weights_of
from feddg.models import create_model
from feddg.sweep import load_sweep

TOY = ("method.name=fedfa", "method.params.stages=[conv, bn]")  # ToyNet has no conv-stage map


def _fed(*over):
    return toy_federation(*TOY, *over)


# --- eqs. 6-7 -------------------------------------------------------------------------------
def test_eq6_eq7_on_hand_made_client_statistics():
    stats = np.array([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 2.0, 3.0]])  # M=3 clients, C=3 channels
    var = client_sharing_variance(stats)
    np.testing.assert_allclose(var, [0.0, 2 / 3, 2.0])  # per channel, 1/M
    gamma = t_modulation(var)
    q = np.array([0.0, (2 / 3) / (1 + 2 / 3), 2 / 3])  # (1 + 1/Σ²)^-1
    np.testing.assert_allclose(gamma, 3 * q / q.sum())  # = [0, 1.125, 1.875]
    np.testing.assert_allclose(gamma, [0.0, 1.125, 1.875])
    assert gamma.sum() == pytest.approx(3.0) and gamma.argmin() == 0


def test_eq7_sums_to_c_is_monotone_and_handles_all_zero_variance():
    var = np.random.default_rng(0).exponential(size=64)
    gamma = t_modulation(var)
    assert gamma.sum() == pytest.approx(64.0)
    assert (np.diff(gamma[np.argsort(var)]) >= 0).all()
    np.testing.assert_array_equal(t_modulation(np.zeros(5)), np.ones(5))  # limit of equal variances
    np.testing.assert_array_equal(client_sharing_variance(np.ones((1, 4))), np.zeros(4))  # one client


def test_stat_noise():
    rng = np.random.default_rng(0)
    x = np.zeros(20000, dtype=np.float32)
    assert add_noise(x, 0.0, rng) is x
    noisy = add_noise(x, 0.2, rng)
    assert noisy.dtype == np.float32 and noisy.std() == pytest.approx(0.2, rel=0.03)


# --- the server half on hand-made replies ----------------------------------------------------
def _reply(mu, sigma, hist=None, n=10):
    msg = {"w/x": np.zeros(2, np.float32), "num_examples": n, "train_loss": 0.0,
           "stat/1/mu_bar": np.array(mu, np.float32), "stat/1/sigma_bar": np.array(sigma, np.float32)}
    if hist is not None:
        msg["hist/pi"] = np.array(hist, np.float32)
    return msg


def _state():
    return {"weights": {"w/x": np.zeros(2, np.float32)}, "stats": {}, "hists": {}, "broadcast": {}, "metrics": {}}


def test_server_sends_per_layer_gamma_over_every_client_seen():
    m = create_method("fedfa", {"lambda_h": 0.0})
    s, _ = m.aggregate(_state(), [Reply(0, _reply([1, 0, 0], [1, 1, 1])), Reply(1, _reply([1, 1, 0], [1, 2, 1]))])
    np.testing.assert_allclose(s["broadcast"]["ffa/1/gamma_mu"], t_modulation(np.array([0, 0.25, 0])), rtol=1e-6)
    # round 2: only client 2 reports; clients 0 and 1 keep their latest statistics
    s, _ = m.aggregate(s, [Reply(2, _reply([1, 2, 3], [1, 1, 1]))])
    expected = t_modulation(client_sharing_variance([[1, 0, 0], [1, 1, 0], [1, 2, 3]]))
    np.testing.assert_allclose(s["broadcast"]["ffa/1/gamma_mu"], expected, rtol=1e-6)
    np.testing.assert_allclose(s["broadcast"]["ffa/1/gamma_sigma"], t_modulation(np.array([0, 2 / 9, 0])), rtol=1e-5)
    assert sorted(s["broadcast"]) == ["ffa/1/gamma_mu", "ffa/1/gamma_sigma"]
    assert m.client_config(s, 0, 3)["ffa/1/gamma_mu"] is s["broadcast"]["ffa/1/gamma_mu"]


def test_direct_fusion_sends_the_raw_variance():
    m = create_method("fedfa", {"variant": "direct", "lambda_h": 0.0})
    s, _ = m.aggregate(_state(), [Reply(0, _reply([0, 0], [1, 1])), Reply(1, _reply([0, 3], [2, 1]))])
    np.testing.assert_allclose(s["broadcast"]["ffa/1/var_mu"], [0.0, 2.25])  # ((0 − 1.5)² + (3 − 1.5)²) / 2
    np.testing.assert_allclose(s["broadcast"]["ffa/1/var_sigma"], [0.25, 0.0])
    assert "ffa/1/gamma_mu" not in s["broadcast"]


@pytest.mark.parametrize("weighting, expected", [("uniform", [0.5, 0.5]), ("num_examples", [0.25, 0.75])])
def test_global_histogram_is_the_average_of_the_client_histograms(weighting, expected):
    m = create_method("fedfa", {"hist_weighting": weighting})
    replies = [Reply(0, _reply([0], [1], [[1.0, 0.0]], n=10)), Reply(1, _reply([0], [1], [[0.0, 1.0]], n=30))]
    s, _ = m.aggregate(_state(), replies)
    np.testing.assert_allclose(s["broadcast"]["hist/pi"], [expected], rtol=1e-6)


def test_global_histogram_averages_the_latest_histogram_of_every_client_seen() -> None:
    # docs/methods/fedfa.md item 14: round 2 hears clients 0 (new π) and 2; client 1 keeps its round-1 π
    m = create_method("fedfa")
    s, _ = m.aggregate(_state(), [Reply(0, _reply([0], [1], [[1.0, 0.0]])), Reply(1, _reply([0], [1], [[0.0, 1.0]]))])
    s, _ = m.aggregate(s, [Reply(0, _reply([0], [1], [[0.0, 1.0]])), Reply(2, _reply([0], [1], [[1.0, 0.0]]))])
    np.testing.assert_allclose(s["broadcast"]["hist/pi"], [[1 / 3, 2 / 3]], rtol=1e-6)


def test_defaults_are_the_papers_values() -> None:
    # FedFA §3.2 and Algorithm 2: p = 0.5, α = 0.99; §3.3 / §5: λ = 0.1, τ = 0.01, L = 8
    p = create_method("fedfa").params
    assert (p.variant, p.p, p.momentum, p.lambda_h, p.tau, p.bins) == ("full", 0.5, 0.99, 0.1, 0.01, 8)


# --- the client half and the message contract ------------------------------------------------
def _round_replies(fed, rounds=2):
    """Run ``rounds`` rounds (no evaluation, no run directory); the last round's messages and replies."""
    method = fed.method
    state = method.server_init(fed.model, ServerContext(len(fed.clients), rounds, 0))
    states: dict[int, dict] = {}
    for r in range(1, rounds + 1):
        sent = {cid: {**method.client_config(state, cid, r), "lr": 0.1, "round": r} for cid in range(len(fed.clients))}
        replies = {}
        for cid, msg in sent.items():
            replies[cid] = run_client(fed, cid, r, msg, states.get(cid, {}))
            states[cid] = replies[cid][1]
        if r < rounds:
            state, _ = method.aggregate(state, [Reply(cid, rep) for cid, (rep, _) in replies.items()])
    return state, sent, replies


W_KEYS = {"num_examples", "train_loss"}


@pytest.mark.parametrize(
    "over, extra",
    [
        ((), {"stat/1/mu_bar", "stat/1/sigma_bar", "stat/2/mu_bar", "stat/2/sigma_bar", "hist/pi", "align_loss"}),
        (("method.params.lambda_h=0",), {"stat/1/mu_bar", "stat/1/sigma_bar", "stat/2/mu_bar", "stat/2/sigma_bar"}),
        (("method.params.layers=[2]", "method.params.lambda_h=0"), {"stat/2/mu_bar", "stat/2/sigma_bar"}),
        (("method.params.variant=client", "method.params.lambda_h=0"), set()),
        (("method.params.variant=random", "method.params.lambda_h=0"), set()),
        (("method.params.variant=direct", "method.params.lambda_h=0"), {"stat/1/mu_bar", "stat/1/sigma_bar",
                                                                         "stat/2/mu_bar", "stat/2/sigma_bar"}),
    ],
)
def test_reply_keys_are_exactly_what_the_algorithm_uploads(over, extra):
    fed = _fed(*over)
    server, sent, replies = _round_replies(fed)
    w_keys = {"w/" + k for k in fed.model.state_dict()}
    for reply, state in replies.values():
        assert set(reply) == w_keys | W_KEYS | extra
        assert set(state) == {k.replace("stat/", "ffa/") for k in extra if k.startswith("stat/")}
    down = set(next(iter(sent.values()))) - w_keys - {"lr", "round"}
    expected_down = {k.replace("stat/", "ffa/").replace("_bar", "") for k in extra if k.startswith("stat/")}
    tag = "var_" if "variant=direct" in " ".join(over) else "gamma_"
    expected_down = {k.replace("/mu", f"/{tag}mu").replace("/sigma", f"/{tag}sigma") for k in expected_down}
    assert down == expected_down | ({"hist/pi"} if "hist/pi" in extra else set())


def test_ffa_statistics_never_enter_the_weights():
    fed = _fed()
    base = toy_federation()  # the same ToyNet without FFA
    assert list(fed.model.state_dict()) == list(base.model.state_dict())


def test_fedfa_without_augmentation_and_alignment_is_fedavg(tmp_path):
    avg = Server(toy_federation("federation.rounds=2"), tmp_path / "avg")
    fa = Server(_fed("federation.rounds=2", "method.params.p=0.0", "method.params.lambda_h=0"), tmp_path / "fa")
    run_inprocess(avg), run_inprocess(fa)
    w_avg, w_fa = avg.state["weights"], fa.state["weights"]
    assert all(np.array_equal(w_avg[k], w_fa[k]) for k in w_avg)
    aug = Server(_fed("federation.rounds=2", "method.params.lambda_h=0"), tmp_path / "aug")
    run_inprocess(aug)
    assert max(float(np.abs(w_avg[k] - aug.state["weights"][k]).max()) for k in w_avg) > 1e-4


def test_two_rounds_statistics_persist_and_alignment_starts_in_round_two(tmp_path):
    fed = _fed("federation.rounds=2")
    server = Server(fed, tmp_path / "run")
    run_inprocess(server)
    assert "fedfa/align_loss" not in server.metrics[0] and server.metrics[1]["fedfa/align_loss"] > 0
    for k, c in ((1, 4), (2, 4)):
        gamma = server.state["broadcast"][f"ffa/{k}/gamma_mu"]
        assert gamma.shape == (c,) and gamma.sum() == pytest.approx(c, rel=1e-5)
    assert server.state["broadcast"]["hist/pi"].shape == (4, 8)
    # μ̄ is kept across rounds (unlike Algorithm 1 line 3's reading, reset_stats=True)
    reset = Server(_fed("federation.rounds=2", "method.params.reset_stats=true"), tmp_path / "reset")
    run_inprocess(reset)
    kept, fresh = server.client_states[0]["ffa/1/mu_bar"], reset.client_states[0]["ffa/1/mu_bar"]
    assert np.abs(kept).sum() > np.abs(fresh).sum() > 0  # two rounds of momentum vs one
    assert sorted(server.state["stats"]) == [0, 1, 2, 3]
    # the run reports the extra bytes next to the weights' (results.json, and `feddg run` prints them)
    per_round = json.loads((tmp_path / "run" / "results.json").read_text())["bytes_per_round"]
    up = [m["fedfa/bytes_stats_up"] for m in server.metrics]
    assert per_round["fedfa/bytes_stats_up"] == pytest.approx(np.mean(up)) and up[0] > 0
    assert per_round["bytes_up"] == pytest.approx(np.mean([m["bytes_up"] for m in server.metrics]))
    console = Console(record=True, width=120)
    console.print(communication_table({"bytes_per_round": per_round}))
    text = console.export_text()
    assert "fedfa/bytes_hist_up" in text and "fedfa/bytes_weights_up" in text


def test_alignment_changes_training_and_is_off_at_lambda_zero(tmp_path):
    a = Server(_fed("federation.rounds=2", "method.params.lambda_h=0.0"), tmp_path / "a")
    b = Server(_fed("federation.rounds=2", "method.params.lambda_h=1.0"), tmp_path / "b")
    run_inprocess(a), run_inprocess(b)
    assert a.metrics[0]["train_loss"] == b.metrics[0]["train_loss"]  # no π in round 1: identical
    assert a.metrics[1]["train_loss"] != b.metrics[1]["train_loss"]


def test_noise_is_added_to_the_uploaded_statistics_only():
    _, _, replies = _round_replies(_fed("method.params.stat_noise=0.3", "method.params.lambda_h=0"))
    diff = np.concatenate([reply[k] - state["ffa/" + k.removeprefix("stat/")] for reply, state in replies.values()
                           for k in reply if k.startswith("stat/")])  # every statistic of every client
    assert len(diff) == 64 and np.sqrt(np.mean(diff**2)) == pytest.approx(0.3, rel=0.3)  # N(0, 0.3²): se 9 %
    _, _, clean = _round_replies(_fed("method.params.lambda_h=0"))
    np.testing.assert_array_equal(clean[0][0]["stat/1/mu_bar"], clean[0][1]["ffa/1/mu_bar"])


@pytest.mark.parametrize("samples, n", [("pooled", 1), ("spatial", 36)])
def test_local_histogram_eq11(samples, n):
    fed = _fed(f"method.params.hist_samples={samples}")
    method, model = fed.method, fed.model
    feats = torch.randn(5, 4, 6, 6)
    assert method._samples(feats).shape == (5 * n, 4)
    from feddg.federation.client import client_context

    hist = method.local_histogram(model, client_context(fed, 0, 1))
    assert hist.shape == (4, 8) and np.allclose(hist.sum(1), 1.0, atol=1e-5)


def _bn_pooled(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's output and its ``bn`` stage (the alignment tap of TOY) pooled over H×W, ``[N, C]``."""
    seen: list[torch.Tensor] = []
    handle = model.get_submodule("bn").register_forward_hook(lambda m, i, out: seen.append(out))
    try:
        out = model(x)
    finally:
        handle.remove()
    return out, seen[0].mean(dim=(2, 3))


def test_uploaded_histogram_is_eq11_over_all_of_the_clients_batches() -> None:
    """π_m rebuilt with ``soft_histogram`` over the pooled ``bn`` features of all 54 samples (4 batches of 16,
    eval mode) of the trained model: one min-max range and one mean over them all, not the last batch's."""
    fed = _fed()
    ctx = client_context(fed, 0, 1)
    assert ctx.num_examples > 2 * ctx.batch_size
    msg = {**fed.method.client_config(fed.method.server_init(fed.model, ServerContext(4, 2, 0)), 0, 1),
           "lr": 0.1, "round": 1}
    reply, _ = fed.method.client_update(fed.model, msg, {}, ctx)
    model = fed.model.eval()
    with torch.no_grad():
        _, feats = _bn_pooled(model, fed.dataset.x[ctx.train_idx])
    expected = soft_histogram(feats, num_bins=8, tau=0.01, kind="paper").numpy()
    np.testing.assert_allclose(reply["hist/pi"], expected, rtol=1e-4, atol=1e-6)


def test_eq15_adds_lambda_times_the_alignment_loss_to_the_task_loss() -> None:
    """One plain SGD step on the client's data in one batch, FFA off (p=0): the reply's weights are
    ``w − η ∇(CE + λ·symKL(π_b, π))`` with π_b rebuilt by ``soft_histogram`` on the pooled ``bn`` features."""
    lam, lr = 0.5, 0.1
    fed = _fed("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=1000", "method.params.p=0",
               f"method.params.lambda_h={lam}")
    torch.manual_seed(0)
    pi = torch.softmax(torch.randn(4, 8), dim=1)
    ref = copy.deepcopy(fed.model).train()
    ctx = client_context(fed, 0, 2)
    msg = {**weights_of(fed.model), "hist/pi": pi.numpy(), "lr": lr, "round": 2}
    reply, _ = fed.method.client_update(fed.model, msg, {}, ctx)
    x, y = fed.dataset.x[ctx.train_idx], torch.as_tensor(fed.dataset.labels[ctx.train_idx])
    out, feats = _bn_pooled(ref, x)
    ce = F.cross_entropy(out, y)
    align = symmetric_kl(soft_histogram(feats, num_bins=8, tau=0.01, kind="paper"), pi)
    params = dict(ref.named_parameters())
    g_ce = torch.autograd.grad(ce, list(params.values()), retain_graph=True)
    g_align = torch.autograd.grad(align, list(params.values()), materialize_grads=True)  # 0 past bn
    assert reply["align_loss"] == pytest.approx(float(align.detach()), rel=1e-4)
    assert max(float((lr * lam * g).abs().max()) for g in g_align) > 1e-3  # the alignment term moves the weights
    for (name, p), gc, ga in zip(params.items(), g_ce, g_align, strict=True):
        np.testing.assert_allclose(reply["w/" + name], (p - lr * (gc + lam * ga)).detach().numpy(),
                                   rtol=1e-4, atol=2e-5)


def test_prepare_model_gives_every_ffa_layer_the_configured_hyperparameters() -> None:
    att = _fed("method.params.p=0.3", "method.params.momentum=0.7", "method.params.random_std=0.2",
               "method.params.variant=random").model.fedfa
    assert [(k, layer.variant, layer.p, layer.momentum, layer.random_std) for k, layer in att.items()] == [
        (1, "random", 0.3, 0.7, 0.2), (2, "random", 0.3, 0.7, 0.2)]


def test_client_update_continues_eq5_from_its_state_with_the_configured_momentum() -> None:
    """lr 0, p 1, one batch of all 54 samples, one FFA layer after ``conv``: each statistic is
    ``α·s̄₀ + (1 − α)·E_B[s]`` with ``s̄₀`` the client state and ``(μ, σ)`` of ``conv(x)`` by hand (eq. 2, σ² + 1e-6)."""
    alpha = 0.7
    fed = _fed("method.params.layers=[1]", "method.params.lambda_h=0", "method.params.p=1",
               f"method.params.momentum={alpha}", "federation.batch_size=1000")
    ctx = client_context(fed, 0, 1)
    state = {"ffa/1/mu_bar": np.array([1.0, -2.0, 0.5, 3.0], np.float32),
             "ffa/1/sigma_bar": np.array([2.0, 0.5, 4.0, 1.5], np.float32)}
    msg = {**weights_of(fed.model), "lr": 0.0, "round": 2}
    conv = fed.model.conv
    with torch.no_grad():  # the functional conv: calling the module would run its FFA hook
        h = F.conv2d(fed.dataset.x[ctx.train_idx], conv.weight, conv.bias, padding=1)
    mu, sigma = h.mean(dim=(2, 3)), (h.var(dim=(2, 3), unbiased=False) + 1e-6).sqrt()
    reply, new_state = fed.method.client_update(fed.model, msg, state, ctx)
    for key, batch in (("mu_bar", mu), ("sigma_bar", sigma)):
        expected = alpha * state[f"ffa/1/{key}"] + (1 - alpha) * batch.mean(0).numpy()
        np.testing.assert_allclose(new_state[f"ffa/1/{key}"], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(reply[f"stat/1/{key}"], new_state[f"ffa/1/{key}"])


@pytest.mark.parametrize("variant, tag", [("full", "gamma"), ("direct", "var")])
def test_client_update_loads_the_servers_modulation_of_its_variant_and_forgets_it_after(variant: str, tag: str) -> None:
    fed = _fed(f"method.params.variant={variant}", "method.params.lambda_h=0", "method.params.layers=[1]")
    sent = {f"ffa/1/{tag}_mu": np.array([0.5, 1.0, 1.5, 1.0], np.float32),
            f"ffa/1/{tag}_sigma": np.array([2.0, 1.0, 0.5, 0.5], np.float32)}
    msg = {**weights_of(fed.model), **sent, "lr": 0.1, "round": 2}
    fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 2))
    (_, layer), = fed.model.fedfa.items()
    np.testing.assert_array_equal(layer.modulation_mu.numpy(), sent[f"ffa/1/{tag}_mu"])
    np.testing.assert_array_equal(layer.modulation_sigma.numpy(), sent[f"ffa/1/{tag}_sigma"])
    # the model is shared by all clients: the next client without a modulation starts from none
    fed.method.client_update(fed.model, {**weights_of(fed.model), "lr": 0.1, "round": 1}, {}, client_context(fed, 1, 1))
    assert layer.modulation_mu is None and layer.modulation_sigma is None


def test_bad_configs_fail_early():
    with pytest.raises(ConfigError, match="variant"):
        toy_federation("method.name=fedfa", "method.params.variant=bogus")
    with pytest.raises(ValueError, match="out of range"):
        _fed("method.params.layers=[3]")


# --- communication cost (§6.1) ----------------------------------------------------------------
def test_alexnet_extra_bytes_match_the_papers_arithmetic():
    method = create_method("fedfa", {"lambda_h": 0.1})
    torch.manual_seed(0)
    model = method.prepare_model(create_model("alexnet", num_classes=10, in_channels=3, image_size=32)).train()
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))  # creates μ̄, σ̄ of the five FFA layers
    assert model.fedfa.channels() == {1: 64, 2: 192, 3: 384, 4: 256, 5: 256}
    stats = {k.replace("ffa/", "stat/"): v for k, v in method._ffa_state(model.fedfa).items()}
    reply = {**weights_of(model), "num_examples": 2, "train_loss": 0.0, **stats,
             "hist/pi": np.full((256, 8), 1 / 8, np.float32)}
    state = method.server_init(model, ServerContext(1, 2, 0))
    state, _ = method.aggregate(state, [Reply(0, reply)])  # round 1: nothing extra was sent down
    state, m = method.aggregate(state, [Reply(0, reply)])  # round 2: γ and π were sent down
    kb = 1024
    # 4 × (64+192+384+256+256) × 4 B = 18 KB; 2 × 8 × 256 × 4 B = 16 KB (plus the key names)
    assert 18 * kb < m["fedfa/bytes_stats_up"] + m["fedfa/bytes_stats_down"] < 18 * kb + 400  # 20 key names
    assert 16 * kb < m["fedfa/bytes_hist_up"] + m["fedfa/bytes_hist_down"] < 16 * kb + 20
    assert m["fedfa/bytes_stats_up"] == pytest.approx(m["fedfa/bytes_stats_down"], abs=40)
    assert m["fedfa/bytes_extra"] < 1e-3 * m["fedfa/bytes_weights_up"]



def test_unet_has_ffa_after_each_encoder_stage_aligns_at_the_bottleneck_and_costs_the_papers_bytes():
    method = create_method("fedfa", {"lambda_h": 0.1})
    torch.manual_seed(0)
    model = method.prepare_model(create_model("unet", num_classes=2, in_channels=3, image_size=32)).train()
    model.fedfa.tap.recording = True
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    assert model.fedfa.channels() == {1: 32, 2: 64, 3: 128, 4: 256, 5: 512}  # FedFA §6.1's U-Net widths
    features = model.fedfa.tap.features
    assert model.fedfa.stage_names[model.fedfa.tap_stage - 1] == "bottleneck" and features.shape == (2, 512, 2, 2)
    pi = method._histogram(method._samples(features)).numpy()
    stats = {k.replace("ffa/", "stat/"): v for k, v in method._ffa_state(model.fedfa).items()}
    reply = {**weights_of(model), "num_examples": 2, "train_loss": 0.0, **stats, "hist/pi": pi}
    state = method.server_init(model, ServerContext(1, 2, 0))
    state, _ = method.aggregate(state, [Reply(0, reply)])
    state, m = method.aggregate(state, [Reply(0, reply)])
    kb = 1024
    # 4 × (32+64+128+256+512) × 4 B = 15.5 KB; 2 × 8 × 512 × 4 B = 32 KB (plus the key names)
    assert 15.5 * kb < m["fedfa/bytes_stats_up"] + m["fedfa/bytes_stats_down"] < 15.5 * kb + 400
    assert 32 * kb < m["fedfa/bytes_hist_up"] + m["fedfa/bytes_hist_down"] < 32 * kb + 20

# --- evaluation protocols ------------------------------------------------------------------------
def test_one_client_per_source_domain_makes_id_acc_the_per_client_test_accuracy(tmp_path):
    # by_domain with one client per source domain: LODO = leave-one-client-out, and id_acc/<d> is
    # the global model on client d's own held-out test set (the feature-shift FL protocol)
    fed = _fed("partition.num_clients=2", "federation.rounds=1")
    assert sorted(c.domains for c in fed.clients) == [(0,), (1,)]
    server = Server(fed, tmp_path / "run")
    res = run_inprocess(server)
    load_weights(fed.model, server.state["weights"])
    for client in fed.clients:
        (d,) = client.domains
        row = tally_by_domain(fed.model, fed.dataset, client.holdout_idx, fed.task, batch_size=64,
                              device=torch.device("cpu"))[d]
        correct, total = int(row[0]), int(row[1])
        assert res["final"][f"id_acc/{fed.dataset.domains[d]}"] == pytest.approx(100.0 * correct / total)


# --- the sweep configs --------------------------------------------------------------------------
SWEEPS = sorted(Path(__file__).parent.parent.glob("configs/fedfa/digits-lo*.yaml"))  # the ablation sweeps


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_sweep_configs_validate_every_variant(path):
    spec, raw = load_sweep(path)
    assert set(spec.variants) == {"FedAvg", "FedFA-R", "FedFA-C", "FedFA^l", "FedFA+"} and spec.seeds == [0, 1, 2]
    for over in spec.variants.values():
        cfg = build_config(raw, [f"{k}={v}" for k, v in over.items()])
        if cfg.method.name == "fedfa":
            params = create_method("fedfa", cfg.method.params).params
            assert (params.lambda_h > 0) == (over.get("method.params.lambda_h") == 0.1)


# --- composition with the hierarchy (HFedATM): FedFA as the client method inside stations ----------
def test_fedfa_runs_inside_stations(tmp_path):
    fed = _fed("hierarchy.stations=2", "hierarchy.station_rounds=2", "federation.rounds=1")
    server = Server(fed, tmp_path / "run")
    run_inprocess(server)
    stations = server.state["stations"]
    # each station computes eqs. 6-7 over its own clients' statistics and averages its own π
    assert [sorted(s["stats"]) for s in stations] == [[0, 1], [2, 3]]
    for s in stations:
        assert s["broadcast"]["ffa/1/gamma_mu"].sum() == pytest.approx(4.0, rel=1e-5)
        assert s["broadcast"]["hist/pi"].shape == (4, 8)
    assert not np.allclose(stations[0]["broadcast"]["ffa/1/gamma_mu"], stations[1]["broadcast"]["ffa/1/gamma_mu"])


# --- the last FFA stage ----------------------------------------------------------------------------

def test_global_average_pool_of_the_last_ffa_layer_is_mean_plus_noise():
    from feddg.algorithms.components.ffa import channel_stats, ffa_transform

    x = torch.tensor([[[[1.0, 3.0], [5.0, 7.0]]]])  # one sample, one channel: μ = 4, σ = √5
    mu, sigma = channel_stats(x)
    eps_mu, eps_sigma = torch.tensor([[0.5]]), torch.tensor([[-2.0]])
    out = ffa_transform(x, mu, sigma, 2.0, 3.0, eps_mu, eps_sigma)
    # pooled: μ̂ = μ + ε_μ Σ̂_μ = 4 + 0.5 · 2 = 5, whatever σ̂ is
    assert out.mean(dim=(2, 3)).item() == pytest.approx(5.0, abs=1e-5)


def test_last_stage_false_drops_only_the_last_ffa_layer():
    assert [k for k, _ in create_method("fedfa").prepare_model(create_model("cnn", 10)).fedfa.items()] == [1, 2, 3, 4]
    att = create_method("fedfa", {"last_stage": False}).prepare_model(create_model("cnn", 10)).fedfa
    assert [k for k, _ in att.items()] == [1, 2, 3] and att.tap_stage == 4
    chosen = create_method("fedfa", {"last_stage": False, "layers": [1, 4]}).prepare_model(create_model("cnn", 10))
    assert [k for k, _ in chosen.fedfa.items()] == [1]


# --- the first round's statistics ------------------------------------------------------------------


def test_the_server_measures_each_stages_channels_with_one_eval_forward():
    model = create_method("fedfa").prepare_model(create_model("resnet18", 10, image_size=32))
    model.train()
    example = torch.randn(1, 3, 32, 32)
    assert model.fedfa.stage_channels(model, example) == {1: 64, 2: 64, 3: 128, 4: 256, 5: 512}
    assert model.training  # the mode it had
    assert all(layer.mu_bar is None for _, layer in model.fedfa.items())  # the eval forward left no statistics


@pytest.mark.parametrize(("key", "shape"), [("stat/1/mu_bar", (1,)), ("stat/2/sigma_bar", (4, 1)),
                                            ("hist/pi", (4, 3))])
def test_a_first_round_reply_of_other_shapes_is_dropped_and_the_round_goes_on(tmp_path, monkeypatch, key, shape):
    """Before any modulation was sent nothing fixed the statistics' shapes: one client's ``stat/1/mu_bar`` of
    shape (1,) crashed eq. 6's stack (a traceback that stopped the run), a (4, 1) array or another histogram would
    be broadcast into the others'."""
    from feddg.algorithms.fedfa import FedFA

    trained = FedFA.client_update

    def misshaped(self, model, msg, client_state, ctx):
        reply, state = trained(self, model, msg, client_state, ctx)
        if ctx.round == 1 and ctx.client_id == 1:
            reply = {**reply, key: np.zeros(shape, np.float32)}
        return reply, state

    monkeypatch.setattr(FedFA, "client_update", misshaped)
    server = Server(_fed("federation.rounds=2"), tmp_path / "run")
    run_inprocess(server)
    first = server.metrics[0]
    assert first["clients_failed"] == 1 and first["clients_failed_reasons"]["1"].startswith(f"{key} has shape {shape}")
    assert "clients_failed" not in server.metrics[1]
    assert {k: v.shape for k, v in server.state["broadcast"].items()} == {
        "ffa/1/gamma_mu": (4,), "ffa/1/gamma_sigma": (4,), "ffa/2/gamma_mu": (4,), "ffa/2/gamma_sigma": (4,),
        "hist/pi": (4, 8)}


@pytest.mark.parametrize(
    "call, arg",
    [(client_sharing_variance, np.zeros((0, 3))), (client_sharing_variance, np.zeros(3)),
     (t_modulation, np.array([0.5, -0.1])), (t_modulation, np.ones((2, 2)))],
    ids=["no-clients", "1d-stats", "negative-variance", "2d-variance"],
)
def test_eq6_eq7_refuse_inputs_outside_their_domain(call: Callable[[np.ndarray], np.ndarray], arg: np.ndarray) -> None:
    with pytest.raises(ValueError, match=r"^need client statistics of shape \[M, C\] with M ≥ 1|^variance must be a "
                                         r"non-negative vector \[C\]$"):
        call(arg)
