"""The privacy audit's numbers mean what they say (docs/privacy.md, "Auditing what leaves a client"): a reconstruction
with a known source image is scored against it, FID against the victims' own images, PSNR/SSIM beside a measured
chance level; the Gram's ε counts training's releases; DLG's ε is local DP's; σ is clamped as CCST and PARDON send it;
FPL under DP releases all K rows. Constant 1×7×7 images make every score a closed form."""

import csv
import math
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from toy import ToyNet, toy_federation

from feddg.aggregation.accounting import gaussian_epsilon
from feddg.aggregation.dp import symmetric_noise
from feddg.audit import inversion, privacy
from feddg.audit.gradient import TinyNet
from feddg.audit.gram import gram_audit
from feddg.audit.inversion import Victims, noised, scores, vector_inversion
from feddg.audit.metrics import FID_NAME, PSNR_CAP
from feddg.audit.privacy import Replay, gram_attack, gram_releases, update_attack, vector_attack
from feddg.audit.shares import prototype_share
from feddg.audit.sweep import METRICS, markdown, summarise, write_tables
from feddg.config import AuditConfig
from feddg.devices import images
from feddg.engines.inprocess import run_inprocess
from feddg.federation.server import Server
from feddg.models.base import FedModel
from feddg.models.permutation import register_spec, sequential_spec

register_spec(ToyNet, sequential_spec)  # HFedATM aligns: conv -> bn -> flatten -> fc, a plain chain
C1 = 0.01**2  # SSIM's (K1·L)², L = 1: of constant images only the luminance term (2ab + C1)/(a² + b² + C1) is left


def const(*values: float) -> np.ndarray:
    return np.stack([np.full((1, 7, 7), v) for v in values])


def psnr_of(a: float, b: float) -> float:
    return PSNR_CAP if a == b else 10 * math.log10(1 / (a - b) ** 2)


def ssim_of(a: float, b: float) -> float:
    return (2 * a * b + C1) / (a * a + b * b + C1)


def flat(x: np.ndarray) -> np.ndarray:
    """Pixels as the Fréchet distance's features: 49 equal entries per image, so it has a closed form."""
    return x.reshape(len(x), -1)


POOL = const(0.2, 0.4, 0.6, 0.8)
OWNER = np.array([0, 0, 1, 1])


def test_copies_of_one_victim_image_score_against_each_rows_own_image_not_the_nearest(monkeypatch):
    monkeypatch.setattr(inversion, "effnet_features", flat)
    victims = Victims(np.zeros((4, 1)), OWNER, POOL, OWNER, source=np.arange(4))  # one row per victim image
    out = scores(const(0.2, 0.2, 0.2, 0.2), victims, const(0.5, 0.5, 0.5, 0.5))
    true = (0.2, 0.4, 0.6, 0.8)
    assert out["scored_against"] == "own image"
    assert out["psnr"] == pytest.approx(np.mean([psnr_of(t, 0.2) for t in true]))  # 30.6 dB, not the nearest's 100
    assert out["ssim"] == pytest.approx(np.mean([ssim_of(t, 0.2) for t in true]), rel=1e-6)
    assert out["psnr_chance"] == pytest.approx(np.mean([psnr_of(t, 0.5) for t in true]))
    assert out["ssim_chance"] == pytest.approx(np.mean([ssim_of(t, 0.5) for t in true]), rel=1e-6)
    # against the four victim images (mean 0.5, variance 0.2/3 per pixel): 49·((0.5 − 0.2)² + 0.2/3), not 0
    assert out[FID_NAME] == pytest.approx(49 * (0.3**2 + 0.2 / 3))


def test_a_row_standing_for_many_images_scores_against_the_nearest_of_its_victims_images(monkeypatch):
    monkeypatch.setattr(inversion, "effnet_features", flat)
    victims = Victims(np.zeros((2, 1)), np.array([0, 0]), POOL, OWNER)  # two rows of client 0 (e.g. prototypes)
    out = scores(const(0.45, 0.45), victims, const(0.2, 0.8))
    assert out["scored_against"] == "nearest of victim's"
    assert out["psnr"] == pytest.approx(psnr_of(0.4, 0.45))  # nearest of client 0's {0.2, 0.4}
    assert out["psnr_chance"] == pytest.approx((PSNR_CAP + psnr_of(0.4, 0.8)) / 2)  # the decoys' nearest: 0.2, 0.4
    assert out["ssim_chance"] == pytest.approx((1.0 + ssim_of(0.4, 0.8)) / 2, rel=1e-6)
    # FID's true set: client 0's images only (mean 0.3, variance 0.02), not client 1's
    assert out[FID_NAME] == pytest.approx(49 * (0.15**2 + 0.02))


def test_the_style_sigma_half_is_clamped_at_zero_as_ccst_and_pardon_send_it():
    v = 0.1 * np.abs(np.random.default_rng(0).standard_normal((8, 6)))  # rows [μ ‖ σ], 3 + 3
    owners = np.repeat([0, 1], 4)
    raw = noised(v, owners, 1.0, 0.5, seed=3)
    sent = noised(v, owners, 1.0, 0.5, seed=3, sigma_from=3)
    assert (raw[:, 3:] < 0).any()  # what the generator was given before: σ entries the server never receives
    np.testing.assert_array_equal(sent[:, :3], raw[:, :3])
    np.testing.assert_array_equal(sent[:, 3:], np.maximum(raw[:, 3:], 0.0))


def test_fpl_under_dp_releases_and_inverts_all_k_rows_and_without_dp_the_held_ones():
    torch.manual_seed(0)
    net = ToyNet().eval()
    x, y = torch.randn(6, 1, 6, 6), np.array([0, 0, 2, 2, 2, 0])
    per_sample, release = prototype_share(net, 4)
    f, rows = per_sample(x), release(x, y)
    assert rows.shape == (4, 16)  # fpl.py's [K, D] under dp: an absent class's row is zero (plus the noise)
    np.testing.assert_allclose(rows[[0, 2]], [f[[0, 1, 5]].mean(0), f[[2, 3, 4]].mean(0)])
    assert not rows[[1, 3]].any()
    rng = np.random.default_rng(0)
    pool = rng.uniform(size=(8, 1, 8, 8))
    victims = Victims(np.concatenate([rows, rows]), np.repeat([0, 1], 4), pool, np.repeat([0, 1], 4),
                      present=np.tile([True, False, True, False], 2))
    out, recons = vector_inversion(rng.uniform(size=(6, 1, 8, 8)), f, victims, noise_multipliers=(0.0, 1.0), steps=2,
                                   fid=False)
    assert [r["n"] for r in out] == [4, 8] and [len(recons[z]) for z in (0.0, 1.0)] == [4, 8]


def test_the_gram_epsilon_counts_a_release_per_gram_layer_and_server_round_as_training_does(tmp_path):
    over = ("hierarchy.stations=2", "hierarchy.station_rounds=2", "federation.rounds=2", "hierarchy.merge=hfedatm",
            "hierarchy.params.dp_epsilon=1.0", "hierarchy.params.gram_pass=after")
    trained = run_inprocess(Server(toy_federation(*over), tmp_path))["hierarchy"]["privacy"]["releases"]
    fed = toy_federation(*over)
    xs = [fed.dataset.x[torch.as_tensor(c.train_idx[:8])] for c in fed.clients]
    rp = Replay(fed.cfg, fed, fed.model.eval(), "initial", xs, [], xs[0], -3.0, 3.0)
    assert gram_releases(rp) == trained == 2 * 2  # 2 server rounds × ToyNet's 2 linear layers (fc, classifier)
    rows = gram_attack(rp, AuditConfig(noise_multipliers=[0.0, 1.0]), seed=0)
    assert rows[0]["epsilon"] is None and rows[1]["epsilon"] == pytest.approx(gaussian_epsilon(1.0, 4, 1e-5))


def test_dlg_is_labelled_local_dp_with_epsilon_at_half_z_over_every_engine_round_without_sampling(tmp_path):
    """The client's clipped update plus N(0, (zC)²): sensitivity 2C (replace-one), multiplier z/2; 3 rounds × 2 station
    rounds, 2 of 4 clients sampled (no amplification claimed). RDP of k Gaussians of multiplier m is one of m/√k."""
    fed = toy_federation("federation.client_fraction=0.5", "hierarchy.stations=2", "hierarchy.station_rounds=2")
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand((2, 1, 8, 8), generator=g) for _ in fed.clients]
    rp = Replay(fed.cfg, fed, fed.model, "initial", xs, [np.array([1, 2])] * len(xs), xs[0], 0.0, 1.0)
    s = AuditConfig(noise_multipliers=[0.0, 1.0], dlg_victims=2, dlg_iterations=1, fid=False)
    rows = update_attack(rp, s, 0, tmp_path)
    assert [r["dp"] for r in rows] == ["local", "local"] and rows[0]["epsilon"] is None
    assert rows[1]["epsilon"] == pytest.approx(gaussian_epsilon(0.5, 6, 1e-5))
    assert rows[1]["epsilon"] == pytest.approx(gaussian_epsilon(0.5 / math.sqrt(6), 1, 1e-5), rel=1e-6)
    assert rows[0]["scored_against"] == "own image" and 0.0 <= rows[0]["ssim_chance"] <= 1.0


def test_the_inter_client_pool_leaves_out_the_attacker_and_each_paired_row_points_at_its_own_image() -> None:
    fed = toy_federation()
    xs = [torch.full((n, 1, 7, 7), 0.1 * c) + 0.01 * torch.arange(n).view(-1, 1, 1, 1)
          for c, n in enumerate((2, 3, 1, 2))]  # every image distinct
    rp = Replay(fed.cfg, fed, cast(FedModel, fed.model), "initial", xs, [], xs[0], 0.0, 1.0)
    victims = rp.victims([np.zeros((3, 1)), np.zeros((2, 1))], [1, 3], attacker=0, paired=True)
    assert victims.pool_owner.tolist() == [1, 1, 1, 2, 3, 3]  # client 0 knows its own images
    np.testing.assert_allclose(victims.pool, torch.cat(xs[1:]).numpy())
    np.testing.assert_allclose(victims.pool[victims.source], torch.cat([xs[1], xs[3]]).numpy())
    assert victims.row_owner.tolist() == [1, 1, 1, 3, 3]


def test_dlg_clips_at_the_median_update_norm_labels_each_victim_and_draws_chance_from_other_clients(tmp_path: Path) -> None:
    fed = toy_federation()
    xs = [torch.full((2, 1, 8, 8), v) for v in (0.1, 0.4, 0.7, 1.0)]  # two copies of one image per client
    ys = [np.array([c, c]) for c in (3, 1, 0, 2)]
    rp = Replay(fed.cfg, fed, cast(FedModel, fed.model), "initial", xs, ys, xs[0], 0.0, 1.0)
    rows = update_attack(rp, AuditConfig(noise_multipliers=[0.0], dlg_victims=3, dlg_iterations=1, fid=False), 0, tmp_path)
    assert rows[0]["label_acc"] == 1.0  # iDLG: the one positive entry of a batch-1 update's bias
    torch.manual_seed(0)  # the attack's network: ‖η ∇CE‖ of each victim's first image, as one vector
    net = TinyNet(1, 8, 8, 4)
    norms = []
    for x, y in zip(xs[:3], ys[:3], strict=True):
        grads = torch.autograd.grad(F.cross_entropy(net(x[:1]), torch.as_tensor(y[:1])), list(net.parameters()))
        norms.append(0.1 * float(torch.cat([g.flatten() for g in grads]).norm()))
    assert rows[0]["clip"] == pytest.approx(sorted(norms)[1], rel=1e-5)
    assert rows[0]["psnr_chance"] < psnr_of(0.1, 0.4) + 1e-9  # another client's image: at least 0.3 away


def test_the_gram_attack_is_the_clipped_rows_gram_plus_symmetric_noise_of_std_z_c_squared_averaged_over_clients() -> None:
    fed = toy_federation()
    model = cast(FedModel, fed.model).eval()
    xs = [images(fed.dataset.get_batch(c.train_idx[:n], train=False)[0]) for c, n in zip(fed.clients, (8, 8, 8, 9), strict=True)]
    rp = Replay(fed.cfg, fed, model, "initial", xs, [], xs[0], -3.0, 3.0)
    rows = gram_attack(rp, AuditConfig(noise_multipliers=[0.0, 0.5]), seed=2)
    with torch.no_grad():
        feats = [model.features(x).double().numpy() for x in xs]
    clip = float(np.median(np.linalg.norm(np.concatenate(feats), axis=1)))  # 33 rows: the middle one
    assert rows[0]["clip"] == rows[1]["clip"] == pytest.approx(clip, rel=1e-12)
    for z, row in zip((0.0, 0.5), rows, strict=True):
        per_client = []
        for c, a in enumerate(feats):  # no DP at z = 0: the raw activations, not clipped
            ac = a * np.minimum(1.0, clip / np.linalg.norm(a, axis=1, keepdims=True)) if z > 0 else a
            noise = symmetric_noise(a.shape[1], z * clip**2, torch.Generator().manual_seed(2 + c)).numpy()
            per_client.append(gram_audit(ac, ac.T @ ac + noise, seed=2 + c))
        for key in ("procrustes_rel_err", "row_cosine", "row_cosine_top"):
            assert row[key] == pytest.approx(np.mean([p[key] for p in per_client]), rel=1e-6), (z, key)


def test_dlg_inverts_each_clients_exact_update_without_dp_and_its_own_noise_draw_under_dp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the server hands DLG: at z = 0 the reply's update itself (even one above the clip), at z > 0 the update
    clipped to C plus C·z·N(0, 1) from the client's own stream (seed + c); both at the run's learning rate."""
    seen: list[tuple[list[torch.Tensor], float]] = []

    def spy(net: torch.nn.Module, update: list[torch.Tensor], lr: float, shape: tuple[int, ...],
            **_: int) -> tuple[torch.Tensor, int]:
        seen.append(([u.clone() for u in update], lr))
        return torch.zeros((1, *shape)), 0

    monkeypatch.setattr(privacy, "dlg", spy)
    fed = toy_federation("optim.lr=0.05")
    xs = [torch.full((1, 1, 8, 8), v) for v in (0.1, 0.5, 0.9)]
    ys = [np.array([c]) for c in (3, 1, 0)]
    rp = Replay(fed.cfg, fed, cast(FedModel, fed.model), "initial", xs, ys, xs[0], 0.0, 1.0)
    update_attack(rp, AuditConfig(noise_multipliers=[0.0, 2.0], dlg_victims=3, fid=False), 5, tmp_path)
    torch.manual_seed(5)  # the attack's network, rebuilt: Δ = −η ∇CE of each victim's image
    net = TinyNet(1, 8, 8, 4)
    clean = [[-0.05 * g for g in torch.autograd.grad(F.cross_entropy(net(x), torch.as_tensor(y)), list(net.parameters()))]
             for x, y in zip(xs, ys, strict=True)]
    norms = [float(torch.cat([u.flatten() for u in up]).norm()) for up in clean]
    clip = sorted(norms)[1]
    assert max(norms) > clip  # one reply above the clip: clipping at z = 0 would show
    assert [lr for _, lr in seen] == [0.05] * 6
    for c, (up, (got, _)) in enumerate(zip(clean, seen[:3], strict=True)):  # z = 0: the reply as sent, unclipped
        for u, g in zip(up, got, strict=True):
            torch.testing.assert_close(g, u, rtol=1e-5, atol=1e-8, msg=f"client {c} at z = 0")
    for c, (up, (got, _)) in enumerate(zip(clean, seen[3:], strict=True)):  # z = 2: clipped, then its own noise
        gen = torch.Generator().manual_seed(5 + c)
        for u, g in zip(up, got, strict=True):
            want = u * min(1.0, clip / norms[c]) + 2.0 * clip * torch.randn(u.shape, generator=gen)
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=f"client {c} at z = 2")


def test_the_vector_attackers_train_on_their_own_images_and_only_style_sigma_halves_are_clamped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Third party: the held-out public images; inter-client: client 0's own, attacking clients 1.. with a pool
    that leaves client 0 out; the style shares ([μ ‖ σ]) clamp their σ half, FedFA's moments do not."""
    calls: list[dict[str, Any]] = []
    real = privacy.vector_inversion

    def spy(attacker_images: np.ndarray, attacker_vectors: np.ndarray, victims: Victims,
            **kw: Any) -> tuple[list[dict[str, Any]], dict[float, np.ndarray]]:
        calls.append({"images": attacker_images, "vectors": attacker_vectors, "victims": victims, **kw})
        return real(attacker_images, attacker_vectors, victims, **kw)

    def pixel_style(x: torch.Tensor) -> np.ndarray:  # per image [μ ‖ σ] of its one channel
        return torch.cat([x.mean((2, 3)), x.std((2, 3))], 1).numpy()

    monkeypatch.setattr(privacy, "vector_inversion", spy)
    monkeypatch.setattr(privacy, "_share", lambda *_: (pixel_style, lambda x, y: pixel_style(x)))
    fed = toy_federation()
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand((2, 1, 7, 7), generator=g) for _ in range(3)]
    public = torch.rand((3, 1, 7, 7), generator=g)
    rp = Replay(fed.cfg, fed, cast(FedModel, fed.model), "initial", xs, [np.zeros(2, int)] * 3, public, 0.0, 1.0)
    s = AuditConfig(noise_multipliers=[0.0, 1.0], generator_steps=1, fid=False)
    for attack in ("sample-style", "client-style", "fedfa-moments"):
        for attacker in ("third-party", "inter-client"):
            vector_attack(rp, attack, attacker, s, 0, tmp_path)
    for call, attack, attacker in zip(calls, np.repeat(["sample-style", "client-style", "fedfa-moments"], 2),
                                      ["third-party", "inter-client"] * 3, strict=True):
        own = public if attacker == "third-party" else xs[0]
        np.testing.assert_allclose(call["images"], own.numpy(), err_msg=f"{attack} {attacker}")
        np.testing.assert_allclose(call["vectors"], pixel_style(own), err_msg=f"{attack} {attacker}")
        victims = call["victims"]
        assert set(victims.row_owner) == set(victims.pool_owner) == ({0, 1, 2} if attacker == "third-party" else {1, 2})
        assert call["sigma_from"] == (None if attack == "fedfa-moments" else 1), (attack, attacker)  # d = 2: [μ ‖ σ]


def test_the_sweeps_audit_table_is_each_metrics_mean_and_sample_std_over_the_seeds_that_have_it(tmp_path: Path) -> None:
    def cell(seed: int, z: float, eps: float | None, **metrics: float) -> dict[str, Any]:
        return {"variant": "A", "target": "t", "seed": seed, "attack": "gram", "attacker": "station", "z": z,
                "epsilon": eps, **dict.fromkeys(key for _, key in METRICS), **metrics}

    cells = [cell(0, 1.0, 2.5, psnr=10.0, reid=0.2), cell(0, 0.0, None, psnr=20.0),
             cell(1, 1.0, 2.5, psnr=12.0, reid=0.4), cell(2, 1.0, 2.5, reid=0.9)]  # seed 2 has no PSNR, z = 0 no re-id
    noisy, clean = summarise(cells)  # first-seen order
    assert (noisy["z"], noisy["seeds"], noisy["epsilon"], clean["z"], clean["seeds"], clean["epsilon"]) == (
        1.0, 3, 2.5, 0.0, 1, None)
    # PSNR over seeds 0 and 1: mean 11, sample variance (1 + 1) / 1; re-id: deviations −.3, −.1, .4, variance .26 / 2
    assert noisy["psnr"] == pytest.approx((11.0, math.sqrt(2.0)))
    assert noisy["reid"] == pytest.approx((0.5, math.sqrt(0.13)))
    assert clean["psnr"] == (20.0, 0.0) and clean["reid"] is None  # one seed: no spread
    assert noisy[FID_NAME] is None and noisy["row_cosine"] is None
    table = markdown([noisy, clean])
    assert "| A | t | gram | station | 1 | 2.5 | 3 | 11.0 ± 1.4 | 0.50 ± 0.36 |" in table
    assert "| A | t | gram | station | 0 | — | 1 | 20.0 ± 0.0 | — |" in table and FID_NAME not in table
    write_tables(tmp_path, [noisy, clean], "t")
    with (tmp_path / "audit.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["epsilon"], r["seeds"], float(r["psnr_mean"]), float(r["psnr_std"])) for r in rows] == [
        ("2.5", "3", 11.0, pytest.approx(math.sqrt(2.0))), ("", "1", 20.0, 0.0)]
    assert rows[0][f"{FID_NAME}_mean"] == rows[0][f"{FID_NAME}_std"] == ""
