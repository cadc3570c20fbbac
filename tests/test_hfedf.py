"""hFedF (Algorithms 1–4) and pFedHN: formulas, signs, message schema, engine runs, few-shot mode."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from toy import toy_federation

from feddg.algorithms import Reply, ServerContext, create_method
from feddg.algorithms.components.hypernetwork import hypernetwork_vjp
from feddg.algorithms.hfedf import DELTA_PREFIX, EMB_KEY, buffer_names, ema_step, gradalign
from feddg.engines.inprocess import run_inprocess, run_round
from feddg.federation.client import client_context
from feddg.federation.server import Server
from feddg.messages import load_weights
from feddg.sweep import load_sweep

SGD = ["method.params.server_optimizer=sgd", "method.params.server_weight_decay=0.0"]


# ------------------------------------------------------------------ GradAlign (Algorithm 3)


def test_gradalign_weights_on_a_hand_made_example():
    g = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0])]
    # g_avg = (2/3, 2/3): cos = 1/√2, 1/√2, 1
    box, cos = gradalign(g, +1.0)
    assert np.allclose(cos.numpy(), [1 / math.sqrt(2), 1 / math.sqrt(2), 1.0])
    e1, e3 = math.exp(1 / math.sqrt(2)), math.e
    assert np.allclose(box.numpy(), np.array([e1, e1, e3]) / (2 * e1 + e3))  # ≈ 0.2994, 0.2994, 0.4013
    assert math.isclose(float(box.sum()), 1.0, rel_tol=1e-12)
    assert box[2] > box[0]  # the box's softmax(γ) favours the client aligned with the mean
    text, _ = gradalign(g, -1.0)
    m1, m3 = math.exp(-1 / math.sqrt(2)), math.exp(-1.0)
    assert np.allclose(text.numpy(), np.array([m1, m1, m3]) / (2 * m1 + m3))  # ≈ 0.3642, 0.3642, 0.2717
    assert math.isclose(float(text.sum()), 1.0, rel_tol=1e-12) and text[2] < text[0]


def test_gradalign_treats_a_zero_gradient_as_orthogonal_and_equal_gradients_uniformly():
    w, cos = gradalign([torch.tensor([2.0, 0.0]), torch.zeros(2)])
    assert cos.tolist() == [1.0, 0.0]
    assert np.allclose(w.numpy(), [math.e / (math.e + 1), 1 / (math.e + 1)])
    w, _ = gradalign([torch.tensor([1.0, 2.0])] * 4)
    assert np.allclose(w.numpy(), 0.25)


# ------------------------------------------------------------------------ EMA (Algorithm 4)


def test_ema_with_warm_up_matches_algorithm_4_step_by_step():
    alpha, w = 0.75, 2
    thetas = [torch.tensor([float(v)]) for v in (1, 2, 4, 8, 16)]  # θ after each optimiser step
    out, shadow = [], None
    for t, theta in enumerate(thetas):
        theta, shadow = ema_step(theta, shadow, t, w, alpha)
        out.append(float(theta))
        if t >= w:
            assert torch.equal(theta, shadow)  # Alg. 4, last line: θ ← θ_EMA
    # t=0,1: before warm-up, untouched; t=2: θ_EMA ← θ = 4 (untouched);
    # t=3: 0.75·8 + 0.25·4 = 7;  t=4: 0.75·16 + 0.25·7 = 13.75
    assert out == [1.0, 2.0, 4.0, 7.0, 13.75]
    with pytest.raises(ValueError):
        ema_step(torch.ones(1), None, 3, 2, 0.5)


def _state_and_replies(*over: str, clients: int = 2):
    kind = "by_domain" if clients == 2 else "iid"  # the toy has 2 source domains
    fed = toy_federation("method.name=hfedf", f"partition.num_clients={clients}", f"partition.kind={kind}", *over)
    state = fed.method.server_init(fed.model, ServerContext(clients, 3, 0))
    replies = []
    for cid in range(clients):
        msg = {**fed.method.client_config(state, cid, 1), "lr": 0.1, "round": 1}
        reply, _ = fed.method.client_update(fed.model, msg, {}, client_context(fed, cid, 1))
        replies.append(Reply(cid, reply))
    return fed, state, replies


def _theta(state) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in state["hnet"].theta()])


@pytest.mark.parametrize("t", [0, 1, 2, 3])
def test_aggregate_applies_ema_as_algorithm_4_after_the_warm_up(t):
    fed, state, replies = _state_and_replies("method.params.ema_alpha=0.8", "method.params.ema_warmup=1")
    state["t"] = t
    on, _ = fed.method.aggregate(copy.deepcopy(state), replies)
    off_method = create_method("hfedf", {"ema_alpha": 0.8, "ema_warmup": 1, "ema": False})
    off, _ = off_method.aggregate(copy.deepcopy(state), replies)
    before, nu_before = _theta(state), state["hnet"].embeddings.weight.detach()
    if t <= 1:  # up to and including the warm-up round the update is not smoothed
        assert torch.equal(_theta(on), _theta(off))
    else:  # θ^{t+1} = α θ_step + (1 − α) θ_EMA^t, and θ_EMA^t is the pre-step θ
        assert torch.allclose(_theta(on), 0.8 * _theta(off) + 0.2 * before, atol=1e-6)
        nu_on, nu_off = on["hnet"].embeddings.weight.detach(), off["hnet"].embeddings.weight.detach()
        assert torch.allclose(nu_on, 0.8 * nu_off + 0.2 * nu_before, atol=1e-6)  # Alg. 1 line 18: ν too


def test_ema_embeddings_false_smooths_theta_only():
    over = ("method.params.ema_alpha=0.8", "method.params.ema_warmup=1", "method.params.ema_embeddings=false")
    fed, state, replies = _state_and_replies(*over)
    state["t"] = 2
    on, _ = fed.method.aggregate(copy.deepcopy(state), replies)
    off, _ = create_method("hfedf", {"ema": False}).aggregate(copy.deepcopy(state), replies)
    assert torch.allclose(_theta(on), 0.8 * _theta(off) + 0.2 * _theta(state), atol=1e-6)  # Alg. 4 on θ
    assert torch.equal(on["hnet"].embeddings.weight, off["hnet"].embeddings.weight)  # ν as the optimiser left it
    assert not torch.equal(off["hnet"].embeddings.weight, state["hnet"].embeddings.weight)  # ν did move


def test_polyak_ema_trains_raw_theta_and_evaluates_the_smoothed_one():
    over = ("method.params.ema_mode=polyak", "method.params.ema_warmup=1", "method.params.ema_alpha=0.8",
            "method.params.server_lr=0.1")  # large steps: ν_EMA and ν differ visibly in the generated weights
    fed, state, replies = _state_and_replies(*over)
    raw = create_method("hfedf", {"ema": False, "server_lr": 0.1})
    s_poly, s_raw = copy.deepcopy(state), copy.deepcopy(state)
    raw_thetas = []  # θ after the steps of rounds t = 0, 1, 2
    for _ in range(3):
        s_poly, _ = fed.method.aggregate(s_poly, replies)
        s_raw, _ = raw.aggregate(s_raw, replies)
        raw_thetas.append(_theta(s_raw))
    assert torch.equal(_theta(s_poly), _theta(s_raw))  # the optimiser's θ is not overwritten
    shadow = s_poly["ema_shadow"]
    assert set(shadow) == {n for n, _ in s_poly["hnet"].named_parameters()}  # θ and ν, by name
    theta_ema = torch.cat([shadow[n].flatten() for n in s_poly["hnet"].theta_names()])
    assert not torch.allclose(theta_ema, _theta(s_raw))
    # Alg. 4 by hand: t = w = 1 sets θ_EMA ← θ^(1); t = 2: θ_EMA ← α θ^(2) + (1 − α) θ_EMA
    assert torch.allclose(theta_ema, 0.8 * raw_thetas[2] + 0.2 * raw_thetas[1], atol=1e-7)
    # evaluation generates from θ_EMA and ν_EMA: client 0 from ν_EMA[0], the global model from their mean
    nu_ema = shadow["embeddings.weight"]
    for cid, emb in ((0, nu_ema[0]), (None, nu_ema.mean(0))):
        with torch.no_grad():
            phi = torch.func.functional_call(s_poly["hnet"], shadow, (emb,))
        ev = fed.method.eval_weights(s_poly, cid)
        assert all(np.allclose(ev[f"w/{n}"], t.numpy(), rtol=0, atol=1e-7) for n, t in phi.items())
        assert not np.allclose(ev["w/fc.weight"], raw.eval_weights(s_raw, cid)["w/fc.weight"])


# --------------------------------------------------------- the round: VJP, sign, GradAlign


def test_client_reply_is_the_parameter_change_and_its_schema_is_exact():
    fed, state, replies = _state_and_replies()
    model = fed.model
    params = [n for n, _ in model.named_parameters()]
    bufs = buffer_names(model)
    assert bufs  # ToyNet has BatchNorm: running stats travel as w/, never generated
    msg = fed.method.client_config(state, 0, 1)
    assert set(msg) == {f"w/{k}" for k in model.state_dict()}  # only model weights go down
    reply = replies[0].message
    assert set(reply) == {f"{DELTA_PREFIX}{n}" for n in params} | {f"w/{b}" for b in bufs} | {
        "num_examples", "train_loss"}
    # Δφ = φ_final − φ_init (Algorithm 1, line 9)
    load_weights(model, msg)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    fed.method.client_update(model, {**msg, "lr": 0.1, "round": 1}, {}, client_context(fed, 0, 1))
    for n, p in model.named_parameters():
        assert np.allclose(reply[DELTA_PREFIX + n], (p.detach() - start[n]).numpy(), atol=1e-6)


def _client_loss(fed, method, state, cid: int) -> float:
    """Full-batch cross-entropy of h(θ, ν[cid]) on client cid's training data (BN on batch stats)."""
    model = fed.model
    load_weights(model, method.eval_weights(state, cid))
    x, y = fed.dataset.get_batch(fed.clients[cid].train_idx, train=False)
    model.train()
    with torch.no_grad():
        return float(F.cross_entropy(model(x), y))


def test_the_server_step_descends_and_the_literal_box_sign_would_ascend():
    """Δφ = φ_final − φ_init with θ − α ∇hᵀΔφ (Alg. 1 lines 9, 13, 17 literally) is an ascent step;
    the server uses −Δφ = φ_init − φ_final (pFedHN): the client's loss goes down."""
    over = [*SGD, "method.params.server_lr=0.02", "method.params.gradalign=false", "method.params.ema=false"]
    fed, state, replies = _state_and_replies(*over, clients=1)
    method = fed.method
    base = _client_loss(fed, method, state, 0)
    down, _ = method.aggregate(copy.deepcopy(state), replies)
    flipped = {k: (-v if k.startswith(DELTA_PREFIX) else v) for k, v in replies[0].message.items()}
    up, _ = method.aggregate(copy.deepcopy(state), [Reply(0, flipped)])
    assert _client_loss(fed, method, down, 0) < base - 0.01
    assert _client_loss(fed, method, up, 0) > base + 0.01


def _softmax_of_cosines_to_the_mean(grads: list[torch.Tensor], sign: float) -> torch.Tensor:
    """Algorithm 3 rebuilt from primitives: softmax(sign · cos(g_avg, g_i))."""
    mean = torch.stack(grads).mean(0)
    cos = torch.stack([F.cosine_similarity(g.double(), mean.double(), dim=0) for g in grads])
    return torch.softmax(sign * cos, 0)


@pytest.mark.parametrize(("align", "sign"), [(True, "box"), (True, "main_text"), (False, "box")])
def test_aggregate_is_one_step_along_the_gradalign_weighted_vjps(align: bool, sign: str) -> None:
    lr = 0.05
    fed, state, replies = _state_and_replies(*SGD, f"method.params.server_lr={lr}", f"method.params.gradalign={align}",
                                             "method.params.ema=false", f"method.params.gradalign_sign={sign}",
                                             clients=3)
    hnet = state["hnet"]
    vjps = [hypernetwork_vjp(hnet, r.client_id, {n: -torch.from_numpy(r.message[DELTA_PREFIX + n])
                                                   for n in hnet.names}) for r in replies]
    g_theta = [torch.cat([g.flatten() for g in v[0]]) for v in vjps]
    g_nu = [v[1].flatten() for v in vjps]
    if align:  # box: softmax(+cos) (Alg. 3); main_text: softmax(−cos) (§4.2)
        w_theta = _softmax_of_cosines_to_the_mean(g_theta, 1.0 if sign == "box" else -1.0)
        w_nu = _softmax_of_cosines_to_the_mean(g_nu, 1.0 if sign == "box" else -1.0)
        assert not np.allclose(w_theta.numpy(), 1 / 3)
    else:
        w_theta = w_nu = torch.full((3,), 1 / 3, dtype=torch.float64)
    expect_theta = _theta(state) - lr * sum(float(w) * g for w, g in zip(w_theta, g_theta, strict=True))
    nu0 = hnet.embeddings.weight.detach().flatten()
    expect_nu = nu0 - lr * sum(float(w) * g for w, g in zip(w_nu, g_nu, strict=True))
    new, metrics = fed.method.aggregate(copy.deepcopy(state), replies)
    assert torch.allclose(_theta(new), expect_theta, atol=1e-6)
    assert torch.allclose(new["hnet"].embeddings.weight.detach().flatten(), expect_nu, atol=1e-6)
    if align:
        assert np.allclose([metrics[f"gradalign_theta/{c}"] for c in range(3)], w_theta.numpy())


@pytest.mark.parametrize(("optimizer", "lr", "wd"), [("adam", 0.01, 1e-3), ("sgd", 0.1, 0.5)])
def test_the_server_step_adds_the_weight_decay_to_the_gradient(optimizer: str, lr: float, wd: float) -> None:
    """Table 10's weight decay reaches the server optimiser (coupled, L2): ĝ = g + λθ; Adam's first step is
    θ − lr·ĝ/(|ĝ| + ε), SGD's θ − lr·ĝ."""
    fed, state, replies = _state_and_replies("method.params.gradalign=false", "method.params.ema=false",
                                             f"method.params.server_optimizer={optimizer}",
                                             f"method.params.server_lr={lr}", f"method.params.server_weight_decay={wd}")
    hnet = state["hnet"]
    vjps = [hypernetwork_vjp(hnet, r.client_id, {n: -torch.from_numpy(r.message[DELTA_PREFIX + n])
                                                   for n in hnet.names})[0] for r in replies]
    g = sum(torch.cat([t.flatten() for t in v]) for v in vjps) / len(vjps)  # no GradAlign: the plain mean
    theta = _theta(state)
    g_hat = g + wd * theta
    new, _ = fed.method.aggregate(copy.deepcopy(state), replies)
    step = g_hat / (g_hat.abs() + 1e-8) if optimizer == "adam" else g_hat
    assert torch.allclose(_theta(new), theta - lr * step, atol=1e-6)


def test_pfedhn_is_the_same_hypernetwork_without_gradalign_and_ema():
    p = create_method("pfedhn").params
    assert (p.gradalign, p.ema, p.server_lr, p.server_weight_decay) == (False, False, 1e-2, 1e-3)
    h = create_method("hfedf").params
    assert (h.gradalign, h.ema, h.gradalign_sign, h.embeddings) == (True, True, "box", "learned")
    fed_p, state_p, replies = _state_and_replies("method.name=pfedhn")
    fed_h, state_h, _ = _state_and_replies("method.params.gradalign=false", "method.params.ema=false",
                                           "method.params.server_lr=0.01", "method.params.server_weight_decay=0.001")
    a, _ = fed_p.method.aggregate(state_p, replies)
    b, _ = fed_h.method.aggregate(state_h, replies)
    assert torch.equal(_theta(a), _theta(b))


def test_buffers_stay_per_client_and_the_global_model_uses_their_weighted_mean():
    fed, state, replies = _state_and_replies()
    replies = [Reply(r.client_id, {**r.message, "num_examples": n}) for r, n in zip(replies, (3, 11), strict=True)]
    new, _ = fed.method.aggregate(state, replies)
    key = "bn.running_mean"
    for r in replies:
        assert np.array_equal(fed.method.client_config(new, r.client_id, 2)[f"w/{key}"], r.message[f"w/{key}"])
    n = [r.num_examples for r in replies]
    expect = sum(k * r.message[f"w/{key}"] for k, r in zip(n, replies, strict=True)) / sum(n)
    assert np.allclose(fed.method.eval_weights(new, None)[f"w/{key}"], expect, atol=1e-6)
    # the global model is generated from the mean embedding
    hnet = new["hnet"]
    with torch.no_grad():
        phi = hnet(hnet.embeddings.weight.mean(0))
    assert np.allclose(fed.method.eval_weights(new, None)["w/fc.weight"], phi["fc.weight"].numpy())


# -------------------------------------------------------------------- embedding variants


def test_random_embeddings_are_redrawn_after_every_update_and_never_trained():
    fed, state, replies = _state_and_replies("method.params.embeddings=random")
    nu = state["hnet"].embeddings.weight
    assert not nu.requires_grad
    assert all(id(nu) != id(p) for g in state["opt"].param_groups for p in g["params"])
    s1, _ = fed.method.aggregate(copy.deepcopy(state), replies)
    s2, _ = fed.method.aggregate(copy.deepcopy(s1), replies)
    n0, n1, n2 = (s["hnet"].embeddings.weight.detach() for s in (state, s1, s2))
    assert not torch.equal(n0, n1) and not torch.equal(n1, n2)
    # same seed and round: the same draw (reproducible), whatever the gradients were
    again, _ = fed.method.aggregate(copy.deepcopy(state), [replies[0]])
    assert torch.equal(again["hnet"].embeddings.weight.detach(), n1)
    assert set(replies[0].message) == set(_state_and_replies()[2][0].message)  # same upload as learned


def test_autoencoder_embeddings_come_from_a_setup_upload_of_one_mean_latent(tmp_path):
    fed = toy_federation("method.name=hfedf", "method.params.embeddings=autoencoder", "method.params.ae_epochs=3",
                         "partition.num_clients=2", "federation.rounds=2")
    server = Server(fed, tmp_path / "ae")
    request = server.setup_request()
    assert set(request) == {"ae_seed", "latent_dim"}
    uploads = []
    original = fed.method.client_setup

    def spy(model, msg, cstate, ctx):
        reply, st = original(model, msg, cstate, ctx)
        uploads.append(reply)
        return reply, st

    fed.method.client_setup = spy
    run_inprocess(server)
    assert [set(u) for u in uploads] == [{EMB_KEY}, {EMB_KEY}]  # the only thing a client uploads in setup
    assert all(u[EMB_KEY].shape == (1,) for u in uploads)  # L = ⌊1 + 2/4⌋ = 1
    nu = server.state["hnet"].embeddings.weight.detach()
    assert np.allclose(nu.numpy(), np.stack([u[EMB_KEY] for u in uploads]))  # fixed: unchanged by 2 rounds
    assert not nu.requires_grad


# ------------------------------------------------------------------------ whole runs


def test_a_few_hfedf_rounds_reduce_the_clients_training_loss(tmp_path):
    fed = toy_federation("method.name=hfedf", "federation.rounds=5", "partition.num_clients=2")
    before = [_client_loss(fed, fed.method, fed.method.server_init(fed.model, ServerContext(2, 5, 0)), c)
              for c in range(2)]
    server = Server(toy_federation("method.name=hfedf", "federation.rounds=5", "partition.num_clients=2"),
                    tmp_path / "run")
    res = run_inprocess(server)
    after = [_client_loss(server.fed, server.fed.method, server.state, c) for c in range(2)]
    assert all(a < 0.8 * b for a, b in zip(after, before, strict=True))
    rows = server.metrics
    assert rows[-1]["train_loss"] < 0.8 * rows[0]["train_loss"]
    assert {"id_acc", "ood_acc", "global_ood_acc", "global_id_acc"} <= set(res["final"])
    assert "gradalign_theta/0" in rows[0] and "hn_grad_norm" in rows[0]
    # the hypernetwork never leaves the server: bytes down are one client model per client
    n_model = sum(v.numel() * v.element_size() for v in server.fed.model.state_dict().values())
    assert 2 * n_model < rows[0]["bytes_down"] < 2 * n_model + 2000


def test_hfedf_resumes_bit_identically(tmp_path):
    over = ("method.name=hfedf", "federation.rounds=4", "partition.num_clients=2", "method.params.ema_warmup=1")
    full = Server(toy_federation(*over), tmp_path / "full")
    run_inprocess(full)
    crashed = Server(toy_federation(*over), tmp_path / "crash")
    crashed.mark_setup_done()
    for r in (1, 2):
        run_round(crashed, r)
    resumed = Server(toy_federation(*over), tmp_path / "crash", resume=True)
    run_inprocess(resumed)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]  # noqa: E731
    assert strip(resumed.metrics) == strip(full.metrics)
    assert torch.equal(_theta(resumed.state), _theta(full.state))


# --------------------------------------------------------------------- few-shot, sweep


def test_few_shot_gives_each_client_k_distinct_target_samples_removed_from_the_test_set():
    base = toy_federation("partition.num_clients=2")
    fed = toy_federation("partition.num_clients=2", "split.few_shot_k=5")
    target = fed.dataset.domains.index("c")
    shots = []
    for c0, c in zip(base.clients, fed.clients, strict=True):
        extra = np.setdiff1d(c.train_idx, c0.train_idx)
        assert len(extra) == 5 and (fed.dataset.domain_ids[extra] == target).all()
        assert np.array_equal(c.holdout_idx, c0.holdout_idx)  # the id holdout stays source data
        shots.append(extra)
    all_shots = np.concatenate(shots)
    assert len(np.unique(all_shots)) == 10  # distinct per client
    assert np.array_equal(fed.split.test_idx, np.setdiff1d(base.split.test_idx, all_shots))
    with pytest.raises(ValueError, match="few_shot_k"):
        toy_federation("partition.num_clients=2", "split.few_shot_k=100")


def test_table2_sweep_config_validates_every_variant():
    spec, raw = load_sweep("configs/hfedf/digits-table2.yaml")
    from feddg.config import build_config

    methods = set()
    for name, extra in spec.variants.items():
        cfg = build_config(raw, [f"{k}={json.dumps(v)}" for k, v in extra.items()])
        methods.add(cfg.method.name)
        assert cfg.federation.local_epochs == 2 and cfg.federation.batch_size == 64
        if name.startswith("Central"):
            assert cfg.partition.num_clients == 1
        else:
            assert cfg.partition.kind == "d_allocation" and cfg.partition.num_clients == 3
    assert methods == {"local", "fedavg", "fedprox", "pfedhn", "hfedf"}
    assert len(spec.seeds) == 3
