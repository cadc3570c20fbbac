"""PARDON: client and global styles (eqs. 1-5), triplet loss (eq. 7), loss weights, messages, engine."""

import json
import math
from collections.abc import Callable
from pathlib import Path

import finch
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from toy import toy_federation

from feddg.algorithms import Reply, create_method, pardon
from feddg.algorithms.components.style import channel_moments, channel_stats
from feddg.algorithms.pardon import (
    PardonParams,
    client_style,
    interpolation_style,
    representation_reg,
    sample_negatives,
    triplet_loss,
)
from feddg.config import build_config
from feddg.engines.inprocess import run_inprocess, run_round, run_setup
from feddg.federation.client import client_context
from feddg.federation.server import Server
from feddg.messages import weights_of
from feddg.sweep import _cells, load_sweep

CONFIGS = sorted((Path(__file__).parent.parent / "configs" / "pardon").glob("*.yaml"))


# --------------------------------------------------------------------------- styles


def test_global_style_is_the_elementwise_median_of_the_cluster_styles():
    # three clusters of client styles (2, 3 and 2 clients), far apart in cosine distance
    means = np.array([[10, 0], [10, 1], [0, 10], [1, 10], [2, 10], [-10, -10], [-10, -12]], float)
    stds = np.array([[1, 2], [1, 2], [2, 1], [2, 1], [2, 1], [3, 3], [3, 5]], float)
    order = np.random.default_rng(0).permutation(7)
    mean, std, clusters = interpolation_style(means[order], stds[order], "finch-median")
    # cluster styles (eq. 4): μ (10, .5), (1, 10), (-10, -11); σ (1, 2), (2, 1), (3, 4); median (eq. 5)
    assert clusters == 3
    assert np.allclose(mean, [1.0, 0.5]) and np.allclose(std, [2.0, 2.0])
    # v2 (global average) is the plain mean of the client styles, which differs here
    avg_mean, avg_std, _ = interpolation_style(means, stds, "average")
    assert np.allclose(avg_mean, means.mean(0)) and np.allclose(avg_std, stds.mean(0))
    assert not np.allclose(avg_mean, mean)
    # the other reading of eq. 3: FINCH's coarsest partition (40 random clients: two FINCH levels)
    rng = np.random.default_rng(0)
    means, stds = rng.normal(size=(40, 2)), rng.random((40, 2)) + 0.5
    c, num, _ = finch.FINCH(np.concatenate([means, stds], 1), distance="cosine", ensure_early_exit=False)
    assert num[0] > num[-1] > 1
    for level, col in (("finest", 0), ("coarsest", -1)):
        cluster_means = [means[c[:, col] == k].mean(0) for k in np.unique(c[:, col])]
        got, _, n_clusters = interpolation_style(means, stds, "finch-median", level)
        assert n_clusters == num[col] and np.allclose(got, np.median(cluster_means, axis=0))


def test_server_setup_takes_every_replys_style_through_eqs_3_to_5() -> None:
    """40 random client styles with two FINCH levels: ``S_g`` is the median of the finest-partition cluster means
    of μ and of σ (rebuilt from ``finch.FINCH``); v2 (``global_style=average``) is the plain mean of the replies."""
    rng = np.random.default_rng(1)
    means, stds = rng.normal(size=(40, 2)), rng.random((40, 2)) + 0.5
    replies = [Reply(k, {"style/mean": means[k].astype(np.float32), "style/std": stds[k].astype(np.float32)})
               for k in range(40)]
    c, num, _ = finch.FINCH(np.concatenate([means, stds], 1).astype(np.float32), distance="cosine",
                            ensure_early_exit=False)
    assert num[0] > num[-1]
    finest = c[:, 0]

    def median_of_cluster_means(v: np.ndarray) -> np.ndarray:
        return np.median([v[finest == k].mean(0) for k in np.unique(finest)], axis=0)

    state = create_method("pardon").server_setup({"weights": {}}, replies)  # the defaults: finch-median, finest
    assert state["style_clusters"] == num[0]
    np.testing.assert_allclose(state["style"][0], median_of_cluster_means(means), rtol=1e-5)
    np.testing.assert_allclose(state["style"][1], median_of_cluster_means(stds), rtol=1e-5)
    v2 = create_method("pardon", {"global_style": "average"}).server_setup({"weights": {}}, replies)
    np.testing.assert_allclose(v2["style"][0], means.mean(0), rtol=1e-5)
    np.testing.assert_allclose(v2["style"][1], stds.mean(0), rtol=1e-5)


def test_defaults_are_the_authors_values() -> None:
    # docs/methods/pardon.md: α = 0.5, λ_t = 0.75, m = 0.3, λ_r = 0.2, FINCH coarsest (eq. 1) / finest (eq. 3), v5
    p = PardonParams()
    assert (p.alpha, p.triplet_weight, p.margin, p.reg_weight) == (0.5, 0.75, 0.3, 0.2)
    assert (p.local_style, p.global_style, p.global_partition, p.objective) == (
        "finch", "finch-median", "finest", "triplet")


def test_client_style_averages_cluster_styles():
    g = torch.Generator().manual_seed(0)
    feats = torch.cat([torch.randn(3, 2, 4, 4, generator=g) + 5, 3 * torch.randn(2, 2, 4, 4, generator=g)])
    labels = np.array([0, 0, 0, 1, 1])
    mean, second = channel_moments(feats)

    def eq2(x):  # style of a cluster by hand: all samples and pixels of each channel
        flat = x.permute(1, 0, 2, 3).reshape(2, -1)
        return flat.mean(1), (flat.var(1, unbiased=False) + 1e-5).sqrt()

    (m0, s0), (m1, s1) = eq2(feats[:3]), eq2(feats[3:])
    mu, sigma = client_style(mean, second, labels, "styles")
    assert torch.allclose(mu, (m0 + m1) / 2, atol=1e-5) and torch.allclose(sigma, (s0 + s1) / 2, atol=1e-4)
    # the authors' code averages moments instead: σ² = mean(E_c[F²]) − mean(μ_c)²
    mu2, sigma2 = client_style(mean, second, labels, "moments")
    sq = ((s0**2 + m0**2) + (s1**2 + m1**2)) / 2
    assert torch.allclose(mu2, mu) and torch.allclose(sigma2, (sq - mu**2 + 1e-5).sqrt(), atol=1e-3)
    assert not torch.allclose(sigma2, sigma, atol=1e-2)
    # v1: one cluster = the pooled style of all samples
    v1 = client_style(mean, second, np.zeros(5, int))
    assert torch.allclose(v1[0], eq2(feats)[0], atol=1e-5) and torch.allclose(v1[1], eq2(feats)[1], atol=1e-4)


def test_client_setup_uploads_the_mean_of_its_finch_cluster_styles_only():
    fed = toy_federation("method.name=pardon", "method.params.style_path=pixel")
    method = fed.method
    ctx = client_context(fed, 0, 0)
    reply, state = method.client_setup(fed.model, method.setup_request(method.server_init(fed.model, None)), {}, ctx)
    assert set(reply) == {"style/mean", "style/std"} and reply["style/mean"].shape == (1,)
    # by hand: per-image styles of the client's data, FINCH (coarsest), eq. 2 per cluster, mean
    x = fed.dataset.x[torch.as_tensor(fed.clients[0].train_idx)]
    mean, std = channel_stats(x)
    c, _, _ = finch.FINCH(np.concatenate([mean, std], 1), distance="cosine", ensure_early_exit=False)
    labels = c[:, -1]
    assert len(np.unique(labels)) > 1
    styles = [channel_stats(x[labels == k].permute(1, 0, 2, 3).reshape(1, 1, -1, 1)) for k in np.unique(labels)]
    expected_mean = np.mean([s[0].item() for s in styles])
    expected_std = np.mean([s[1].item() for s in styles])
    assert math.isclose(float(reply["style/mean"][0]), expected_mean, rel_tol=1e-4)
    assert math.isclose(float(reply["style/std"][0]), expected_std, rel_tol=1e-4)
    assert state == {}  # the pixel path keeps nothing


# --------------------------------------------------------------------------- losses


def test_triplet_negatives_are_always_of_another_class():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        labels = torch.randint(0, 3, (int(torch.randint(1, 12, (), generator=g)),), generator=g)
        anchors, neg = sample_negatives(labels, g)
        assert (labels[anchors] != labels[neg]).all()
        has_other = torch.tensor([(labels != y).any() for y in labels])
        assert torch.equal(anchors, torch.nonzero(has_other).flatten())


def test_triplet_loss_hand_value():
    f = torch.tensor([[5.0, 0.0], [0.0, 2.0]])  # normalised: (1, 0), (0, 1)
    f_tilde = torch.tensor([[0.6, 0.8], [0.8, 0.6]])
    y = torch.tensor([0, 1])
    # anchor 0: positive f̃_0, negative f̃_1; anchor 1: positive f̃_1, negative f̃_0
    expected = math.sqrt(0.8) - math.sqrt(0.4) + 0.3
    assert math.isclose(triplet_loss(f, f_tilde, y, 0.3).item(), expected, rel_tol=1e-5)
    assert triplet_loss(f, f_tilde, torch.tensor([1, 1]), 0.3).item() == 0.0  # no negative: skipped


def test_representation_regulariser_is_the_mean_of_squares():
    f, ft = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 0.0]])
    assert representation_reg(f, ft).item() == pytest.approx((1 + 9 + 4 + 0) / 2)


def test_loss_weights_come_from_the_config(monkeypatch):
    """With lr = 0 the weights never change, so the difference of two mean losses is exactly
    λ_t·T + λ_r·R for constant T and R."""
    monkeypatch.setattr(pardon, "triplet_loss", lambda f, ft, y, m, g: 0 * f.sum() + 1.0)
    monkeypatch.setattr(pardon, "representation_reg", lambda f, ft: 0 * f.sum() + 10.0)

    def mean_loss(*over):
        fed = toy_federation("method.name=pardon", "method.params.style_path=pixel", *over)
        m = fed.method
        state = m.server_init(fed.model, None)
        state["style"] = (np.zeros(1, np.float32), np.ones(1, np.float32))
        msg = {**m.client_config(state, 0, 1), "lr": 0.0, "round": 1}
        return m.client_update(fed.model, msg, {}, client_context(fed, 0, 1))[0]["train_loss"]

    base = mean_loss("method.params.triplet_weight=0", "method.params.reg_weight=0")
    assert mean_loss() - base == pytest.approx(0.75 * 1 + 0.2 * 10, abs=1e-5)  # the defaults
    assert mean_loss("method.params.triplet_weight=0.5", "method.params.reg_weight=0.01") - base == pytest.approx(
        0.5 + 0.1, abs=1e-5)
    assert build_config({}, ["method.name=pardon", "method.params.margin=0.7"]).method.params == {"margin": 0.7}


def test_client_loss_is_eq9_on_the_stylised_batch_value_and_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss that client training minimises against eq. 9 rebuilt from torch primitives: ``x̃ = α·AdaIN(x, S_g)
    + (1 − α)·x`` per sample and channel, ``CE(h(f)) + λ_t·mean_i(‖a_i − p_i‖ − ‖a_i − n_i‖ + m) + λ_r·mean(f² + f̃²)``
    with ``a = f``, ``p = f̃``, ``n = f̃_j``. Batch ``(x₀, x₀, x₁)`` of classes ``(0, 0, 1)``: every anchor's negative
    is determined (2, 2, and 0 or its copy 1); a margin above √2 keeps every hinge open. The gradient flows through
    both ``f`` and ``f̃``."""
    captured: dict[str, Callable[..., torch.Tensor]] = {}

    def capture(model: torch.nn.Module, ctx: object, lr: float, loss_fn: Callable[..., torch.Tensor]) -> float:
        captured["loss_fn"] = loss_fn
        return 0.0

    monkeypatch.setattr(pardon, "train_local", capture)
    lam_t, lam_r, margin, alpha, s_mean, s_std = 2.0, 0.3, 1.5, 0.75, 0.7, 3.0
    fed = toy_federation("method.name=pardon", "method.params.style_path=pixel", f"method.params.alpha={alpha}",
                         f"method.params.triplet_weight={lam_t}", f"method.params.reg_weight={lam_r}",
                         f"method.params.margin={margin}")
    msg = {**weights_of(fed.model), "style/mean": np.array([s_mean], np.float32),
           "style/std": np.array([s_std], np.float32), "lr": 0.1, "round": 1}
    fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 1))
    model = fed.model.eval()
    torch.manual_seed(0)
    x, y = torch.randn(2, 1, 6, 6)[[0, 0, 1]], torch.tensor([0, 0, 1])
    loss = captured["loss_fn"](model, x, y)
    mu = x.mean(dim=(2, 3), keepdim=True)
    sd = (x.var(dim=(2, 3), unbiased=False, keepdim=True) + 1e-5).sqrt()
    x_tilde = alpha * ((x - mu) / sd * s_std + s_mean) + (1 - alpha) * x
    f, f_tilde = model.features(x), model.features(x_tilde)
    a, p = F.normalize(f, dim=1), F.normalize(f_tilde, dim=1)
    triplet = ((a - p).norm(dim=1) - (a - p[[2, 2, 0]]).norm(dim=1) + margin).mean()
    expected = F.cross_entropy(model.classifier(f), y) + lam_t * triplet + lam_r * (f.pow(2) + f_tilde.pow(2)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    params = list(model.parameters())
    for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(expected, params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- engine


def _capture(fed):
    setup, rounds = [], []
    m = fed.method
    cs, cu = m.client_setup, m.client_update

    def client_setup(*a):
        out = cs(*a)
        setup.append(out[0])
        return out

    def client_update(*a):
        out = cu(*a)
        rounds.append(out[0])
        return out

    m.client_setup, m.client_update = client_setup, client_update
    return setup, rounds


@pytest.mark.parametrize("path", ["pixel", "feature"])
def test_messages_carry_one_style_vector_and_weights_only(tmp_path, path):
    over = ["method.params.style_path=pixel"] if path == "pixel" else [
        "method.params.style_path=feature", "method.params.style_layer=conv"]
    fed = toy_federation("method.name=pardon", *over, "federation.client_fraction=0.5", "federation.rounds=2")
    setup, rounds = _capture(fed)
    server = Server(fed, tmp_path)
    run_inprocess(server)
    assert len(setup) == 4  # every client, not only the sampled ones
    dim = 1 if path == "pixel" else 4
    for reply in setup:
        assert set(reply) == {"style/mean", "style/std"}
        assert reply["style/mean"].shape == reply["style/std"].shape == (dim,)
    weights = {f"w/{k}" for k in fed.model.state_dict()}
    assert len(rounds) == 4 and all(set(r) == weights | {"num_examples", "train_loss"} for r in rounds)
    # the global style travels in every round's message
    sent = server.configure(1)
    assert all(np.array_equal(m["style/mean"], server.state["style"][0]) for m in sent.values())
    assert server.metrics[0]["style_dim"] == dim and server.metrics[0]["time_style_setup_s"] > 0
    assert json.loads((tmp_path / "results.json").read_text())["method_params"]["style_path"] == path
    for row in server.metrics:  # the one-time setup is reported, not added to every round's time
        engine = sum(row.get(k, 0.0) for k in ("time_train_s", "time_aggregate_s", "time_eval_s"))
        assert row["time_round_s"] == pytest.approx(engine)


def test_feature_path_keeps_the_initial_encoder_in_the_client_state(tmp_path):
    fed = toy_federation("method.name=pardon", "method.params.style_path=feature", "method.params.style_layer=conv")
    initial = fed.model.conv.weight.detach().clone()
    server = Server(fed, tmp_path)
    run_setup(server)
    assert all(set(s) == {"enc/conv.weight", "enc/conv.bias"} for s in server.client_states.values())
    run_round(server, 1)
    assert not torch.allclose(fed.model.conv.weight, initial)  # the model trained ...
    assert np.array_equal(server.client_states[0]["enc/conv.weight"], initial.numpy())  # ... the encoder did not


def test_resume_after_setup_gives_the_uninterrupted_result(tmp_path):
    over = ("method.name=pardon", "method.params.style_path=feature", "method.params.style_layer=conv",
            "federation.rounds=3")
    full = Server(toy_federation(*over), tmp_path / "full")
    run_inprocess(full)
    crashed = Server(toy_federation(*over), tmp_path / "crash")
    run_setup(crashed)
    run_round(crashed, 1)
    resumed = Server(toy_federation(*over), tmp_path / "crash", resume=True)
    setup, _ = _capture(resumed.fed)
    run_inprocess(resumed)
    assert setup == []  # the setup exchange is in the checkpoint
    def strip(rows):
        return [{k: v for k, v in r.items() if "time" not in k and "setup_s" not in k} for r in rows]

    assert strip(resumed.metrics) == strip(full.metrics)


def test_ablations_switch_the_components(tmp_path):
    v4 = create_method("pardon", {"objective": "augment-triplet"})
    assert v4.setup_request({"weights": {}}) is None  # no style at all

    def v3_loss(alpha):  # v3 at lr 0: CE(x) + CE(x̃); α = 0 makes the pixel transfer the identity
        fed = toy_federation("method.name=pardon", "method.params.style_path=pixel", "method.params.reg_weight=0",
                             "method.params.objective=stylised-ce", f"method.params.alpha={alpha}")
        server = Server(fed, tmp_path / str(alpha))
        run_setup(server)
        msg = {**fed.method.client_config(server.state, 0, 1), "lr": 0.0, "round": 1}
        v3 = fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 1))[0]["train_loss"]
        avg = create_method("fedavg").client_update(fed.model, msg, {}, client_context(fed, 0, 1))[0]["train_loss"]
        return v3, avg

    v3, avg = v3_loss(0.0)
    assert v3 == pytest.approx(2 * avg, rel=1e-5)
    v3, avg = v3_loss(1.0)
    assert v3 != pytest.approx(2 * avg, rel=1e-3)  # the stylised copy is a different batch


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_sweeps_validate(path):
    spec, raw = load_sweep(path)
    base = build_config(raw)
    # PARDON §IV-A: 20 % of the clients a round on the digit/PACS protocols, 10 % of IWildCam's 243 (Table III)
    fraction = 0.1 if base.data.dataset == "iwildcam" else 0.2
    assert base.partition.params == {"lam": 0.1} and base.federation.client_fraction == fraction
    for extra in spec.variants.values():
        for _, split in _cells(spec, base):
            build_config(raw, [f"{k}={v}" for k, v in extra.items()] + split)


def test_report_draws_the_style_grid_for_style_methods_only(tmp_path, cache_dir):
    from feddg.config import dump_config
    from feddg.experiment import run_experiment
    from feddg.reports.run import report
    from feddg.reports.style_grid import style_grid

    over = ["data.max_per_domain=40", "partition.num_clients=6", "federation.rounds=1", f"data.cache_dir={cache_dir}",
            "model.name=cnn", "device=cpu"]
    cfg = build_config({"name": "grid"}, over + ["method.name=pardon", "method.params.style_path=feature"])
    run_experiment(cfg, tmp_path / "pardon", progress=False)
    assert tmp_path / "pardon" / "styles.png" in report(tmp_path / "pardon")
    assert (tmp_path / "pardon" / "styles.png").is_file()
    (tmp_path / "avg").mkdir()
    (tmp_path / "avg" / "config.yaml").write_text(dump_config(build_config({}, over)))
    assert style_grid(tmp_path / "avg") is None
