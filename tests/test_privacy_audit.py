"""What leaves a client: every registered method replies with exactly its declared keys and never a per-sample
array; under DP every shared statistic is exactly its clipped value plus the documented noise; results.json
carries the run's ε (docs/privacy.md)."""

import json

import numpy as np
import pytest
import torch
from support.dp_reference import analytic_gaussian_epsilon
from torch import nn
from toy import ToyNet, toy_federation
from toy_pixels import needs_masks, pixel_config, pixel_federation, registered

from feddg.aggregation.accounting import gaussian_epsilon, statistic_privacy
from feddg.aggregation.dp import gram_sensitivity
from feddg.algorithms.base import Reply, ServerContext
from feddg.algorithms.hfedatm import GRAM_FLAG, HFedATMParams
from feddg.algorithms.registry import list_methods
from feddg.cli import privacy_line
from feddg.engines.inprocess import run_inprocess
from feddg.federation.client import client_context
from feddg.federation.server import Server
from feddg.federation.topology import StationTopology, station_summary
from feddg.messages import entries, weights_of
from feddg.models.permutation import register_spec, sequential_spec

register_spec(ToyNet, sequential_spec)  # as tests/test_hierarchy.py: conv -> bn -> flatten -> fc
FEDFA = ("method.name=fedfa", "method.params.stages=[conv, bn]")  # ToyNet has no conv-stage map
OVERRIDES = {
    "fedfa": FEDFA[1:],
    "central": ("partition.kind=iid", "partition.num_clients=1"),
    "scaffold": ("optim.momentum=0",),
    "mtgc": ("optim.momentum=0", "hierarchy.stations=2"),
    "fedrc": ("hierarchy.stations=2",),
}
#: what a setup exchange releases, per method (one statistic per client, never per sample)
SETUP_KEYS = {"fedrc": {"fedrc/n", "fedrc/n_eff", "fedrc/mean", "fedrc/var"}, "harmofl": {"amp/mean"},
              "elcfs": {"amp/bank"}, "fedmix": {"mix/x", "mix/y"}}


def _declared(method: str, model: nn.Module) -> set[str]:
    """The keys a method's round reply is documented to carry (docs/methods/<method>.md), for ToyNet."""
    w = set(weights_of(model))
    params = {n for n, _ in model.named_parameters()}
    bn = {f"w/{n}.{k}" for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d) for k in m.state_dict()}
    plain = w | {"num_examples", "train_loss"}
    declared = {
        "fedavg": plain, "fedprox": plain, "local": plain, "central": plain, "pardon": plain, "ccst": plain,
        "fedsr": plain | {"l2r", "cmi"},
        "fediir": plain | {"grad_batches"} | {f"grad/{n}" for n, _ in model.classifier.named_parameters()},
        "feddg_ga": plain | {"ga_gap", "ga_has_gap", "ga_weight"},  # gap_at: aggregated (the default)
        "fedgma": plain | {f"sign/{n}" for n in params},
        "scaffold": plain | {f"dc/{n}" for n in params},
        "mtgc": plain | {"mtgc/h_gamma"},
        "fedrc": plain | {"fedrc/weight"},
        "fpl": plain | {"proto/mean", "proto/present"},
        "fedfa": plain | {f"stat/{k}/{s}" for k in (1, 2) for s in ("mu_bar", "sigma_bar")} | {"hist/pi"},
        "harmofl": plain, "elcfs": plain,  # their spectra leave once, in the setup exchange
        "fedavgm": plain, "fedsam": plain, "fedrobust": plain,  # FedRobust's (Λ, δ) stay in the client's state
        "fedmix": plain,  # its group means leave once, in the setup exchange
        "fedbn": (plain - bn) | {f"bn/{k}" for k in bn},
        "hfedf": (plain - {f"w/{n}" for n in params}) | {f"delta/{n}" for n in params},
        "pfedhn": (plain - {f"w/{n}" for n in params}) | {f"delta/{n}" for n in params},
    }
    if method not in declared:
        raise KeyError(f"{method}: declare what its reply carries in tests/test_privacy_audit.py")
    return declared[method]


def _setup(fed, state):
    """The one-time setup exchange with every client, if the method has one: replies and client states."""
    m = fed.method
    request = m.setup_request(state)
    if request is None:
        return state, [], {}
    replies, states = [], {}
    for cid in range(len(fed.clients)):
        reply, states[cid] = m.client_setup(fed.model, dict(request), {}, client_context(fed, cid, 0))
        replies.append(reply)
    return m.server_setup(state, [Reply(c, r) for c, r in enumerate(replies)]), replies, states


def _no_per_sample_array(msg, n: int) -> bool:
    return all(not isinstance(v, np.ndarray) or v.ndim == 0 or v.shape[0] != n for v in msg.values())


@pytest.mark.parametrize("method", list_methods())
def test_every_method_replies_only_its_declared_keys_and_no_per_sample_array(method):
    if needs_masks(method):
        with registered():
            _declared_keys_and_no_per_sample_array(method, pixel_federation(pixel_config(f"method.name={method}")))
    else:
        _declared_keys_and_no_per_sample_array(method, toy_federation(f"method.name={method}",
                                                                      *OVERRIDES.get(method, ())))


def _declared_keys_and_no_per_sample_array(method, fed):
    m = fed.method
    state = m.server_init(fed.model, ServerContext(len(fed.clients), 3, 0))
    state, setup_replies, states = _setup(fed, state)
    n = fed.clients[0].train_idx.size
    for reply in setup_replies:  # PARDON: one (μ, σ); CCST: its style rows; FedRC: one Gaussian; never per sample
        assert set(reply) == SETUP_KEYS.get(method, {"style/mean", "style/std"}) and _no_per_sample_array(reply, n)
    msg = {**m.client_config(state, 0, 1), "lr": 0.1, "round": 1}
    reply, client_state = m.client_update(fed.model, msg, states.get(0, {}), client_context(fed, 0, 1))
    assert set(reply) == _declared(method, fed.model)
    assert _no_per_sample_array(reply, n)
    assert reply["num_examples"] == n


# --- under DP: what leaves is exactly clip(statistic) + N(0, σ²) -----------------------------------------


def _clip_plus_noise(arrays, clip, sigma, generator):
    """Independently of ``privatize``: the arrays as one vector, scaled to norm ≤ clip, plus σ·randn."""
    flat = np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays.values()])
    flat = flat * min(1.0, clip / np.linalg.norm(flat))
    flat = flat + sigma * torch.randn(flat.size, generator=generator, dtype=torch.float64).numpy()
    sizes = np.cumsum([np.size(a) for a in arrays.values()])[:-1]
    return {k: p.reshape(np.shape(a)) for (k, a), p in zip(arrays.items(), np.split(flat, sizes), strict=True)}


def _twin_without_dp(method):
    return type(method)(method.params.model_copy(update={"dp": None}))


def _both(fed, call):
    """``call(method, ctx)`` with the DP-free twin, then with DP, from the same client stream; the twin's
    context (its noise stream is where the DP run draws its noise) and both replies."""
    clean_ctx = client_context(fed, 0, 1)
    clean, _ = call(_twin_without_dp(fed.method), clean_ctx)
    noisy, _ = call(fed.method, client_context(fed, 0, 1))
    return clean_ctx, clean, noisy


def _round_call(fed):
    m = fed.method
    state = m.server_init(fed.model, ServerContext(len(fed.clients), 3, 0))
    msg = {**m.client_config(state, 0, 1), "lr": 0.1, "round": 1}
    return lambda method, ctx: method.client_update(fed.model, dict(msg), {}, ctx)


def test_fedfa_statistics_and_histogram_are_clipped_and_noised_one_group_each():
    fed = toy_federation(*FEDFA, "method.params.dp.noise_multiplier=0.3", "method.params.dp.clip=2.0")
    ctx, clean, noisy = _both(fed, _round_call(fed))
    sigma = 0.3 * 4.0
    assert all(np.array_equal(clean[k], noisy[k]) for k in weights_of(fed.model))  # the same training
    stats = _clip_plus_noise(entries(clean, "stat/"), 2.0, sigma, ctx.noise)  # drawn first, then hist/
    hist = _clip_plus_noise(entries(clean, "hist/"), 2.0, sigma, ctx.noise)
    assert set(stats) == {"stat/1/mu_bar", "stat/1/sigma_bar", "stat/2/mu_bar", "stat/2/sigma_bar"}
    for key, want in {**stats, **hist}.items():
        np.testing.assert_allclose(noisy[key], want, atol=1e-5)
    assert not np.allclose(noisy["hist/pi"], clean["hist/pi"], atol=0.1)


@pytest.mark.parametrize("method", ["pardon", "ccst"])
def test_style_upload_is_clipped_and_noised_once_with_std_floored_at_zero(method):
    fed = toy_federation(f"method.name={method}", "method.params.dp.epsilon=3.0", "method.params.dp.clip=0.5")
    request = fed.method.setup_request(fed.method.server_init(fed.model, ServerContext(4, 3, 0)))
    ctx, clean, noisy = _both(fed, lambda m, c: m.client_setup(fed.model, dict(request), {}, c))
    sigma = fed.method.params.dp.sigma()
    assert analytic_gaussian_epsilon(sigma / (2 * 0.5), 1e-5) == pytest.approx(3.0, rel=1e-6)  # Δ = 2C, ε = 3
    want = _clip_plus_noise(clean, 0.5, sigma, ctx.noise)
    np.testing.assert_allclose(noisy["style/mean"], want["style/mean"], atol=1e-6)
    np.testing.assert_allclose(noisy["style/std"], np.maximum(want["style/std"], 0.0), atol=1e-6)
    assert set(noisy) == {"style/mean", "style/std"}


@pytest.mark.parametrize("dp_noise", ["seeded", "secret"])
def test_a_clients_noise_repeats_from_the_config_only_when_seeded(dp_noise):
    # the clients drew their noise from their training stream (the run's seed): the server, which holds the config,
    # could redraw it; under secret each federation (run, Flower node) keys its own
    over = ("method.name=ccst", "method.params.dp.epsilon=3.0", "method.params.dp.clip=0.5", f"dp_noise={dp_noise}")
    styles = []
    for _ in range(2):
        fed = toy_federation(*over)
        request = fed.method.setup_request(fed.method.server_init(fed.model, ServerContext(4, 3, 0)))
        styles.append(fed.method.client_setup(fed.model, dict(request), {}, client_context(fed, 0, 0))[0]["style/mean"])
    assert np.array_equal(*styles) == (dp_noise == "seeded")
    ctx = client_context(fed, 0, 0)
    assert (ctx.noise is ctx.generator) == (dp_noise == "seeded")


def test_fpl_prototypes_are_clipped_and_noised_and_every_class_is_reported():
    fed = toy_federation("method.name=fpl", "method.params.dp.noise_multiplier=1.0", "method.params.dp.clip=3.0")
    update = _round_call(fed)

    def without_class_3(method, ctx):
        ctx.train_idx = ctx.train_idx[fed.dataset.labels[ctx.train_idx] != 3]
        return update(method, ctx)

    ctx, clean, noisy = _both(fed, without_class_3)
    want = _clip_plus_noise({"proto/mean": clean["proto/mean"]}, 3.0, 6.0, ctx.noise)
    np.testing.assert_allclose(noisy["proto/mean"], want["proto/mean"], atol=1e-5)
    assert clean["proto/present"].tolist() == [1, 1, 1, 0] and noisy["proto/present"].tolist() == [1, 1, 1, 1]
    assert not clean["proto/mean"][3].any() and noisy["proto/mean"][3].std() > 1.0  # the absent class: pure noise


def test_hfedatm_grams_are_the_clipped_grams_plus_the_symmetric_noise_drawn_next():
    """By hand: each linear layer's inputs of one eval pass after training (``gram_pass: after``), every sample's
    row scaled to norm ≤ C, ``XᵀX``, plus an upper triangle of ``N(0, σ²)`` mirrored, drawn layer by layer from the
    client's noise stream, with σ the analytic Gaussian mechanism's for (ε, δ) = (1, 1e-5) at Δ = C²."""
    clip = 2.0
    fed = toy_federation("hierarchy.stations=2", "hierarchy.station_rounds=2", "federation.rounds=2",
                         "hierarchy.merge=hfedatm", "hierarchy.params.dp_epsilon=1.0", f"hierarchy.params.dp_clip={clip}",
                         "hierarchy.params.gram_pass=after")
    topo = fed.topology
    msg = {**topo.client_config(fed.method, topo.init(fed.method, fed.model, None), 0, 2), "lr": 0.1, "round": 2}
    assert msg[GRAM_FLAG] == 1
    noisy, _ = topo.client_update(fed.method, fed.model, dict(msg), {}, client_context(fed, 0, 2))
    ctx = client_context(fed, 0, 2)
    fed.method.client_update(fed.model, {k: v for k, v in msg.items() if k != GRAM_FLAG}, {}, ctx)  # the same training
    inputs: dict[str, list[torch.Tensor]] = {"fc": [], "classifier": []}
    hooks = [getattr(fed.model, n).register_forward_pre_hook(lambda m, a, n=n: inputs[n].append(a[0].double()))
             for n in inputs]
    fed.model.eval()
    with torch.no_grad():
        for x, _ in ctx.batches(shuffle=False, train=False):
            fed.model(x)
    for h in hooks:
        h.remove()
    sigma = topo.dp_sigma
    assert analytic_gaussian_epsilon(sigma / clip**2, 1e-5) == pytest.approx(1.0, rel=1e-6)
    clipped_any = False
    for name in ("fc", "classifier"):  # the reply's layer order: the noise is drawn in it
        x = torch.cat(inputs[name])
        norms = x.norm(dim=1, keepdim=True)
        clipped_any |= bool((norms > clip).any())
        rows = x * torch.minimum(torch.ones_like(norms), clip / norms)
        z = torch.randn(x.shape[1], x.shape[1], generator=ctx.noise, dtype=torch.float64) * sigma
        want = rows.T @ rows + torch.triu(z) + torch.triu(z, diagonal=1).T
        np.testing.assert_allclose(noisy[f"gram/{name}"], want.numpy(), rtol=1e-5, atol=1e-3)
    assert {k for k in noisy if k.startswith("gram/")} == {"gram/fc", "gram/classifier"}
    assert clipped_any  # the clip acted here, so a recorder that skipped it would fail


# --- results.json ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("over", "rounds", "releases"), [
    ((*FEDFA, "method.params.dp.noise_multiplier=1.0"), 3, 6),  # stat/ and hist/ every round
    (("method.name=fedfa", "method.params.stages=[conv, bn]", "method.params.lambda_h=0",
      "method.params.dp.noise_multiplier=1.0"), 3, 3),  # FedFA^l: stat/ only
    (("method.name=fpl", "method.params.dp.epsilon=2.0", "method.params.dp.accountant=pld"), 5, 5),
    (("method.name=pardon", "method.params.dp.epsilon=2.0"), 5, 1),  # the style, once
    (("method.name=ccst", "method.params.dp.epsilon=2.0", "method.params.dp.clip=4"), 5, 1),
])
def test_results_carry_the_runs_epsilon(tmp_path, over, rounds, releases):
    fed = toy_federation(*over)
    server = Server(fed, tmp_path)
    server.round = rounds
    res = server.write_results()["privacy"]
    dp = fed.method.params.dp
    assert res == statistic_privacy(dp, releases) and res["releases"] == releases
    z = dp.sigma() / (2 * dp.clip)  # σ/Δ with Δ = 2C (replace-one), against an independent ε(σ) where ε is given
    assert z == dp.noise_multiplier if dp.epsilon is None else (
        analytic_gaussian_epsilon(z, dp.delta) == pytest.approx(dp.epsilon, rel=1e-6))
    assert res["epsilon"] == pytest.approx(gaussian_epsilon(z, releases, dp.delta, dp.accountant))
    assert json.loads((tmp_path / "results.json").read_text())["privacy"]["epsilon"] == res["epsilon"]


def test_a_run_without_dp_has_no_privacy_entry(tmp_path):
    server = Server(toy_federation("method.name=fpl"), tmp_path)
    assert "privacy" not in server.write_results()


def test_a_dp_run_writes_epsilon_and_feddg_prints_it(tmp_path):
    over = ("method.name=fpl", "method.params.dp.noise_multiplier=2.0", "federation.rounds=1")
    res = run_inprocess(Server(toy_federation(*over), tmp_path))
    rec = json.loads((tmp_path / "results.json").read_text())["privacy"]
    assert rec == res["privacy"] and rec["releases"] == 1
    assert rec["epsilon"] == pytest.approx(gaussian_epsilon(2.0, 1, 1e-5))
    line = privacy_line("shared statistics", rec)
    assert line.startswith(f"privacy of the shared statistics: ε = {rec['epsilon']:.4g} at δ = 1e-05 over 1 release")


def test_hierarchy_keeps_basic_composition_and_adds_the_accountants_epsilon():
    topo = StationTopology(np.array([0, 0, 1, 1]), 2, 1.0, "hfedatm", HFedATMParams(dp_epsilon=1.0, dp_clip=2.0,
                           gram_pass="after"), None)
    cond = {"regmean/fc/cond": 1.0, "regmean/classifier/cond": 1.0}
    rows = [{"round": 1}, {"round": 2, **cond}, {"round": 3}, {"round": 4, **cond}]  # 2 server rounds × 2 layers
    h = station_summary(topo, rows)
    assert h["dp_gram_releases"] == 4 and h["dp_epsilon_total_basic"] == 4.0
    p = h["privacy"]
    z = topo.dp_sigma / gram_sensitivity(2.0)
    assert p["releases"] == 4 and p["unit"] == "sample" and p["noise_multiplier"] == pytest.approx(z)
    assert p["epsilon"] == pytest.approx(gaussian_epsilon(z, 4, 1e-5, "rdp")) and p["epsilon"] < 4.0
