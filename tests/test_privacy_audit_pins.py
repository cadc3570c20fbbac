"""Pins of the privacy audit (docs/privacy.md, "Auditing what leaves a client") that its other tests leave open:
where the replay draws its attackers' images and weights, what each attack is handed from the settings, the
shares' statistics in closed form on the pixel path, the noise and clip of a release, the chance levels, the
orchestration of ``audit_privacy`` (seed, attacks, staging, numbering of earlier audits), the sweep's tables and the
report's section. The heavy parts (training, the generator, DLG) are stubbed or run at a step or two."""

from __future__ import annotations

import copy
import csv
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, cast

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from toy import toy_federation, toy_federation_of

from feddg.aggregation.accounting import gaussian_epsilon
from feddg.algorithms.components.style import EPS, finch_labels, std_from_moments, style_vectors
from feddg.algorithms.pardon import client_style
from feddg.audit import inversion, privacy, sweep
from feddg.audit.metrics import FID_NAME
from feddg.audit.privacy import Replay, replay
from feddg.config import AuditConfig, build_config, dump_config
from feddg.federation.setup import Federation
from feddg.messages import weights_of
from feddg.models.base import FedModel
from feddg.models.lenet import LeNet
from feddg.reports import audit as reports_audit


def toy_run(run_dir: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str,
            checkpoint: dict[str, Any] | None = None) -> Federation:
    """A run directory of the toy federation (config.yaml; the federation rebuilt from it by the toy's own builder)
    whose checkpoint is ``checkpoint``; returns the federation as the replay rebuilds it."""
    fed = toy_federation(*overrides)
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(fed.cfg))
    monkeypatch.setattr(privacy, "build_federation", toy_federation_of)
    monkeypatch.setattr(privacy, "open_checkpoint", lambda _: checkpoint)
    return fed


# --------------------------------------------------------------------------- replay


def test_the_third_party_draws_the_target_domains_images_not_the_ood_validation_domains(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LTDO holds out a validation domain (b) and a test domain (c): the public data is the target's (test_idx); more
    asked than held gives each target image once, in index order."""
    fed = toy_run(tmp_path, monkeypatch, "split.protocol=ltdo", "split.val_domain=b")
    assert len(fed.split.val_idx) and len(fed.split.test_idx) == 120
    rp = replay(tmp_path, AuditConfig(per_client=3, attacker_size=500), seed=0)
    np.testing.assert_array_equal(rp.attacker_x.numpy(), fed.dataset.x[np.sort(fed.split.test_idx)].numpy())


def test_a_run_without_held_out_data_is_refused_for_the_third_party(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    toy_run(tmp_path, monkeypatch, "split.protocol=federated", "split.target=null", "partition.num_clients=3")
    with pytest.raises(ValueError, match="the third-party attacker needs held-out public data"):
        replay(tmp_path, AuditConfig(per_client=2), seed=0)


def test_the_value_range_spans_the_victims_and_the_attackers_images(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Without dataset statistics ``unit`` maps ``[lo, hi]`` onto ``[0, 1]``: over the victims' and the public images
    together (the target domain c, contrast 1.3, reaches further than the 4 victims per client here)."""
    toy_run(tmp_path, monkeypatch)
    rp = replay(tmp_path, AuditConfig(per_client=4, attacker_size=64), seed=1)
    both = torch.cat([*rp.x, rp.attacker_x])
    assert (rp.lo, rp.hi) == (float(both.min()), float(both.max()))
    victims = torch.cat(rp.x)
    assert (rp.lo, rp.hi) != (float(victims.min()), float(victims.max()))  # the public images count
    assert rp.unit(both).min() == 0.0 and rp.unit(both).max() == 1.0


def test_the_replay_loads_the_checkpoints_weights_into_its_model_and_says_so(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    trained = toy_federation().model
    with torch.no_grad():
        for p in trained.parameters():
            p.fill_(0.25)
    fed = toy_run(tmp_path, monkeypatch, checkpoint={"server_state": {"weights": weights_of(trained)}})
    rp = replay(tmp_path, AuditConfig(per_client=2, attacker_size=2), seed=0)
    assert rp.weights == "checkpoint"
    assert all(bool((p == 0.25).all()) for p in rp.model.parameters())
    assert not all(bool((p == 0.25).all()) for p in fed.model.parameters())  # an initial model is not: the load shows


# --------------------------------------------------------------------------- what each attack is handed


def pixel_moments(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per image and channel: the mean and the population std with the style code's ``ε`` (eq. 2's ``σ``)."""
    m = x.double().mean((2, 3))
    return m.numpy(), torch.sqrt((x.double() ** 2).mean((2, 3)) - m**2 + EPS).numpy()


def share_replay(*overrides: str, trained: torch.nn.Module | None = None) -> Replay:
    """A replay of the toy federation: 6 training images (and labels) per client; ``trained`` as its final model."""
    fed = toy_federation(*overrides)
    xs = [fed.dataset.x[torch.as_tensor(c.train_idx[:6])] for c in fed.clients]
    ys = [fed.dataset.labels[c.train_idx[:6]] for c in fed.clients]
    model = cast(FedModel, trained if trained is not None else fed.model).eval()
    return Replay(fed.cfg, fed, model, "checkpoint", xs, ys, xs[0], -3.0, 3.0)


def test_sample_styles_use_the_runs_style_path_on_the_initial_model_and_the_audits_style_path_overrides_it() -> None:
    """A CCST run on the feature path (``style_layer: bn``): each image's ``[μ ‖ σ]`` of the frozen *initial* model's
    ``bn`` output (4 channels: 8-d), not the trained one's; ``audit.style_path: pixel`` gives the images' own (2-d)."""
    trained = copy.deepcopy(toy_federation().model)
    with torch.no_grad():
        trained.conv.weight.mul_(3.0)
    rp = share_replay("method.name=ccst", "method.params.style_path=feature", "method.params.style_layer=bn",
                      trained=trained)
    x = rp.x[1]
    initial = copy.deepcopy(rp.fed.model).eval()
    with torch.no_grad():
        mu, sigma = pixel_moments(initial.bn(initial.conv(x)))
    per_sample, release = privacy._share(rp, "sample-style", AuditConfig())
    np.testing.assert_allclose(per_sample(x), np.concatenate([mu, sigma], 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(release(x, rp.y[1]), per_sample(x))  # CCST sends each image's style
    per_sample, _ = privacy._share(rp, "sample-style", AuditConfig(style_path="pixel"))
    np.testing.assert_allclose(per_sample(x), np.concatenate(pixel_moments(x), 1), rtol=1e-5, atol=1e-6)


def paired_styles() -> torch.Tensor:
    """8 one-channel 6×6 images of styles ``(μ, σ) = r (cos θ, sin θ)`` exactly (a ±1 checkerboard scaled by σ, plus
    μ), in pairs at θ = 10°/11°, 20°/21°, 80°/81°, 88°/89°: FINCH (cosine) pairs them first (finest: 4 clusters)
    and merges the pairs next (coarsest: 2)."""
    theta = torch.tensor([10.0, 11.0, 20.0, 21.0, 80.0, 81.0, 88.0, 89.0]) * torch.pi / 180
    r = 1 + 0.1 * torch.arange(8.0)
    board = ((torch.arange(6).view(6, 1) + torch.arange(6).view(1, 6)) % 2) * 2.0 - 1.0
    return (r * torch.cos(theta)).view(8, 1, 1, 1) + (r * torch.sin(theta)).view(8, 1, 1, 1) * board


@pytest.mark.parametrize("average", ["styles", "moments"])
def test_the_client_style_is_pardons_one_row_with_the_runs_client_average(average: Literal["styles", "moments"]) -> None:
    """PARDON's reply (eq. 1–2): FINCH (coarsest) on the images' styles, then ``client_style`` with the run's
    ``client_average``: one ``[μ ‖ σ]`` row."""
    rp = share_replay("method.name=pardon", f"method.params.client_average={average}")
    x = paired_styles()
    m = x.mean((2, 3))
    second = (x**2).mean((2, 3))
    styles = style_vectors(m.numpy(), std_from_moments(m, second).numpy())
    labels = finch_labels(styles, "coarsest")
    assert labels.tolist() == [0, 0, 0, 0, 1, 1, 1, 1] and len(set(finch_labels(styles, "finest").tolist())) == 4
    mu, sigma = client_style(m, second, labels, average)
    other = client_style(m, second, labels, "styles" if average == "moments" else "moments")
    assert not torch.allclose(sigma, other[1], rtol=1e-3)  # the two averages differ on these images
    _, release = privacy._share(rp, "client-style", AuditConfig())
    np.testing.assert_allclose(release(x, np.zeros(8, int)), np.concatenate([mu, sigma])[None], rtol=1e-5)


def lenet(seed: int) -> FedModel:
    torch.manual_seed(seed)
    return LeNet(4, in_channels=1, image_size=28).eval()


def test_fedfa_moments_are_the_trained_models_first_conv_stage_statistics_per_image_and_pooled() -> None:
    """FedFA's stage 1 of LeNet is ``conv.2`` (conv → ReLU → pool, 6 channels): per image its channel ``[μ ‖ σ]``,
    released as the client's pooled one (mean of the moments, then ``σ``), of the *trained* model."""
    trained, initial = lenet(0), lenet(1)
    rp = SimpleNamespace(cfg=build_config({"method": {"name": "fedfa"}}), model=trained,
                         fed=SimpleNamespace(model=initial, dataset=SimpleNamespace(num_classes=4)))
    x = torch.rand((5, 1, 28, 28), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        f = trained.conv[:3](x).double()
    per_sample, release = privacy._share(cast(Replay, rp), "fedfa-moments", AuditConfig())
    np.testing.assert_allclose(per_sample(x), np.concatenate(pixel_moments(f), 1), rtol=1e-4, atol=1e-6)
    mu = f.mean((0, 2, 3))
    sigma = torch.sqrt((f**2).mean((0, 2, 3)) - mu**2 + EPS)
    np.testing.assert_allclose(release(x, np.zeros(5, int)), torch.cat([mu, sigma])[None].numpy(), rtol=1e-4,
                               atol=1e-6)


def test_fpl_prototypes_are_the_trained_models_features() -> None:
    trained, initial = lenet(0), lenet(1)
    rp = SimpleNamespace(cfg=build_config({"method": {"name": "fpl"}}), model=trained,
                         fed=SimpleNamespace(model=initial, dataset=SimpleNamespace(num_classes=4)))
    x = torch.rand((3, 1, 28, 28), generator=torch.Generator().manual_seed(2))
    per_sample, release = privacy._share(cast(Replay, rp), "fpl-prototypes", AuditConfig())
    with torch.no_grad():
        f = trained.features(x).double().numpy()
    np.testing.assert_allclose(per_sample(x), f, rtol=1e-6)
    np.testing.assert_allclose(release(x, np.array([3, 1, 3])), [np.zeros(84), f[1], np.zeros(84), f[[0, 2]].mean(0)],
                               rtol=1e-6)


def pixel_replay(monkeypatch: pytest.MonkeyPatch, *overrides: str) -> Replay:
    """A replay of the toy federation with 6 random 1×7×7 images per client (SSIM's window fits), public images
    alike, and every share the images' pixel ``[μ ‖ σ]``: per image, per client (one row), or per class as a
    ``[4, 2]`` matrix of class means (zero for a class not held)."""
    def style(x: torch.Tensor) -> np.ndarray:
        return np.concatenate(pixel_moments(x), 1)

    def release(attack: str) -> Callable[[torch.Tensor, np.ndarray], np.ndarray]:
        if attack == "sample-style":
            return lambda x, y: style(x)
        if attack == "fpl-prototypes":
            return lambda x, y: np.stack([style(x)[y == k].mean(0) if (y == k).any() else np.zeros(2) for k in range(4)])
        return lambda x, y: style(x).mean(0, keepdims=True)

    monkeypatch.setattr(privacy, "_share", lambda rp, attack, s: (style, release(attack)))
    fed = toy_federation(*overrides)
    g = torch.Generator().manual_seed(0)
    xs = [torch.rand((6, 1, 7, 7), generator=g) for _ in fed.clients]
    ys = [np.zeros(6, int) for _ in fed.clients]
    return Replay(fed.cfg, fed, cast(FedModel, fed.model), "initial", xs, ys, torch.rand((5, 1, 7, 7), generator=g),
                  0.0, 1.0)


@pytest.fixture
def inversions(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every ``vector_inversion`` the attacks start: its arguments; it then runs for real at one generator step
    without FID (fast), and its reconstructions are kept under ``recons``."""
    calls: list[dict[str, Any]] = []
    real = privacy.vector_inversion

    def spy(attacker_images: np.ndarray, attacker_vectors: np.ndarray, victims: inversion.Victims,
            **kw: Any) -> tuple[list[dict[str, Any]], dict[float, np.ndarray]]:
        rows, recons = real(attacker_images, attacker_vectors, victims, **{**kw, "steps": 1, "fid": False})
        calls.append({"victims": victims, "recons": recons, **kw})
        return rows, recons

    monkeypatch.setattr(privacy, "vector_inversion", spy)
    return calls


def test_a_vector_attack_hands_the_inversion_the_audits_settings_and_the_methods_release_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, inversions: list[dict[str, Any]]) -> None:
    """FPL on a 3-round run: δ, generator steps, FID, the noise sweep and the seed as set; its prototypes released
    every engine round (3); each victim's present rows are the classes *it* holds; rows stand for many images."""
    grids: list[tuple[list[tuple[str, np.ndarray]], str]] = []
    draw = privacy.draw_grid
    monkeypatch.setattr(privacy, "draw_grid", lambda grid, title, path: grids.append((grid, title)) or draw(grid, title, path))
    rp = pixel_replay(monkeypatch, "method.name=fpl")
    rp.y = [np.array([c % 4] * 3 + [(c + 1) % 4] * 3) for c in range(4)]
    s = AuditConfig(noise_multipliers=[0.5, 0.0], delta=1e-3, generator_steps=7, fid=False)
    rows = privacy.vector_attack(rp, "fpl-prototypes", "third-party", s, 11, tmp_path)
    (call,) = inversions
    assert (call["noise_multipliers"], call["delta"], call["steps"], call["fid"], call["seed"], call["releases"]) == (
        (0.5, 0.0), 1e-3, 7, False, 11, 3)
    assert call["sigma_from"] is None  # prototypes have no σ half
    victims = call["victims"]
    assert victims.source is None and victims.row_owner.tolist() == np.repeat(range(4), 4).tolist()
    held = [np.isin(range(4), [c % 4, (c + 1) % 4]) for c in range(4)]
    np.testing.assert_array_equal(victims.present, np.concatenate(held))
    assert [(r["attack"], r["attacker"], r["grid"], r["n"], r["delta"]) for r in rows] == [
        ("fpl-prototypes", "third-party", "fpl-prototypes-third-party.png", 16, 1e-3),
        ("fpl-prototypes", "third-party", "fpl-prototypes-third-party.png", 8, 1e-3)]
    # the grid: the rows sent without DP (8 held classes) at every z, in increasing z, under their true images: the
    # nearest of each victim's to the reconstruction at the smallest z
    ((grid, title),) = grids
    assert title == "fpl-prototypes, third-party attacker" and (tmp_path / "fpl-prototypes-third-party.png").is_file()
    assert [(label, len(x)) for label, x in grid] == [("true (nearest)", 8), ("z = 0", 8), ("z = 0.5", 8)]
    recons = call["recons"]
    np.testing.assert_array_equal(grid[1][1], recons[0.0])
    np.testing.assert_array_equal(grid[2][1], recons[0.5][victims.present])
    np.testing.assert_array_equal(grid[0][1], inversion.reference(recons[0.0], victims.rows(victims.present)))


def test_only_sample_styles_are_paired_with_their_own_images(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            inversions: list[dict[str, Any]]) -> None:
    """A sample style is scored against its own image; PARDON's client style (one row per client) stands for many,
    scored against the nearest of the victim's."""
    rp = pixel_replay(monkeypatch, "method.name=pardon")
    s = AuditConfig(noise_multipliers=[0.0], generator_steps=1, fid=False)
    for attack in ("sample-style", "client-style"):
        privacy.vector_attack(rp, attack, "inter-client", s, 0, tmp_path)
    paired, pooled = (c["victims"] for c in inversions)
    np.testing.assert_array_equal(paired.source, np.arange(18))  # clients 1..3's 6 images, the pool without client 0
    assert pooled.source is None and pooled.row_owner.tolist() == [1, 2, 3]


# --------------------------------------------------------------------------- audit_privacy: the orchestration


@pytest.fixture
def stubbed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[tuple[Any, ...]]]:
    """A run directory (an FPL run of seed 5 with an ``audit:`` section) whose replay and attacks are stubs: each
    call is recorded (the replay's seed, each attack with its attacker and seed) and every attack returns one row."""
    cfg = build_config({"method": {"name": "fpl"}, "seed": 5, "audit": {"per_client": 3, "noise_multipliers": [0.5]}})
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(cfg))
    calls: list[tuple[Any, ...]] = []

    def fake_replay(run_dir: Path, s: AuditConfig, seed: int) -> SimpleNamespace:
        calls.append(("replay", seed, s.per_client))
        return SimpleNamespace(cfg=cfg, x=[0, 1, 2], weights="initial (no checkpoint)")

    def vector(rp: Any, attack: str, attacker: str, s: AuditConfig, seed: int, out: Path) -> list[dict[str, Any]]:
        calls.append((attack, attacker, seed))
        return [{"attack": attack, "attacker": attacker}]

    def other(name: str) -> Callable[..., list[dict[str, Any]]]:
        def attack(rp: Any, s: AuditConfig, seed: int, *out: Path) -> list[dict[str, Any]]:
            calls.append((name, seed))
            return [{"attack": name}]
        return attack

    monkeypatch.setattr(privacy, "replay", fake_replay)
    monkeypatch.setattr(privacy, "vector_attack", vector)
    monkeypatch.setattr(privacy, "update_attack", other("update-dlg"))
    monkeypatch.setattr(privacy, "gram_attack", other("gram"))
    return run, calls


def test_the_default_audit_is_the_runs_section_its_attacks_and_its_seed(stubbed: tuple[Path, list[Any]]) -> None:
    """No settings: the run's ``audit:`` section; no attacks named: FPL's prototypes (both attackers) and the update;
    no audit seed: the run's (5), recorded in privacy.json with the rest of the record."""
    run, calls = stubbed
    steps: list[str] = []
    path = privacy.audit_privacy(run, progress=steps.append)
    assert path == run / "audit" / "privacy.json"
    assert calls == [("replay", 5, 3), ("fpl-prototypes", "third-party", 5), ("fpl-prototypes", "inter-client", 5),
                     ("update-dlg", 5)]
    assert steps == ["rebuilding the run", "fpl-prototypes (third-party)", "fpl-prototypes (inter-client)", "update-dlg"]
    record = json.loads(path.read_text())
    assert {k: record[k] for k in ("run", "method", "weights", "clients", "seed", "attacks")} == {
        "run": "run", "method": "fpl", "weights": "initial (no checkpoint)", "clients": 3, "seed": 5,
        "attacks": ["fpl-prototypes", "update-dlg"]}
    assert record["settings"] == AuditConfig(per_client=3, noise_multipliers=[0.5]).model_dump(mode="json")
    assert record["rows"] == [{"attack": "fpl-prototypes", "attacker": "third-party"},
                              {"attack": "fpl-prototypes", "attacker": "inter-client"}, {"attack": "update-dlg"}]


def test_named_attacks_run_in_their_order_with_the_audits_own_seed(stubbed: tuple[Path, list[Any]]) -> None:
    run, calls = stubbed
    privacy.audit_privacy(run, AuditConfig(attacks=["gram", "client-style"], seed=9))
    assert calls == [("replay", 9, 32), ("gram", 9), ("client-style", "third-party", 9),
                     ("client-style", "inter-client", 9)]
    record = json.loads((run / "audit" / "privacy.json").read_text())
    assert (record["seed"], record["attacks"]) == (9, ["gram", "client-style"])


def test_a_crashed_audits_leftovers_do_not_block_or_leak_into_the_next(stubbed: tuple[Path, list[Any]]) -> None:
    run, _ = stubbed
    (run / "audit.partial").mkdir()
    (run / "audit.partial" / "stale.png").write_bytes(b"old")
    privacy.audit_privacy(run, AuditConfig(attacks=["gram"]))
    assert sorted(p.name for p in (run / "audit").iterdir()) == ["privacy.json"]
    assert not (run / "audit.partial").exists()


def test_earlier_audits_are_kept_under_the_next_free_number_and_other_folders_are_left_alone(
        stubbed: tuple[Path, list[Any]]) -> None:
    """``audit`` (the latest) moves to ``audit-N`` with N one past the highest number kept (not the count);
    a user's ``audit-notes`` is neither a number nor touched."""
    run, _ = stubbed
    for name in ("audit", "audit-2", "audit-notes"):
        (run / name).mkdir()
        (run / name / "mark").write_text(name)
    privacy.audit_privacy(run, AuditConfig(attacks=["gram"]))
    assert (run / "audit-3" / "mark").read_text() == "audit" and (run / "audit-2" / "mark").read_text() == "audit-2"
    assert (run / "audit-notes" / "mark").read_text() == "audit-notes" and not (run / "audit-1").exists()
    assert (run / "audit" / "privacy.json").is_file()
    privacy.audit_privacy(run, AuditConfig(attacks=["gram"]))
    assert (run / "audit-4" / "privacy.json").is_file()


# --------------------------------------------------------------------------- inversion: release, clip, chance


def const(*values: float) -> np.ndarray:
    """Constant 1×7×7 images (SSIM's window fits)."""
    return np.stack([np.full((1, 7, 7), v) for v in values])


def test_the_reidentification_chance_is_each_rows_victims_share_of_the_pool() -> None:
    """Rows of clients 0, 0, 1 against a pool of 3 images of client 0 and 1 of client 1: (3/4 + 3/4 + 1/4) / 3."""
    pool_owner = np.array([0, 0, 0, 1])
    victims = inversion.Victims(np.zeros((3, 1)), np.array([0, 0, 1]), const(0.1, 0.2, 0.3, 0.9), pool_owner)
    out = inversion.scores(const(0.1, 0.3, 0.9), victims, const(0.5, 0.5, 0.5), fid=False)
    assert out["reid_chance"] == pytest.approx(7 / 12)
    assert out["reid"] == 1.0 and out["n"] == 3 and out[FID_NAME] is None


def planted(n_attacker: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """The attacker's constant images and their 2-d vectors ``[v, 1 − v]``."""
    values = np.linspace(0.1, 0.9, n_attacker)
    return const(*values), np.stack([values, 1 - values], 1)


def test_the_default_clip_is_the_median_norm_of_each_victims_whole_statistic() -> None:
    """Owner 0 sends rows (3, 0) and (0, 4): one statistic of norm 5 (not its rows' 3 and 4); owners 1 and 2 one
    row each, norms 1 and 6: the median of (5, 1, 6) is 5, each row of the audit says so, and at z > 0 every
    owner's release is clipped to it (owner 2's norm 6 is not: its noise-free part shrinks by 5/6)."""
    images, vectors = planted()
    rows = np.array([[3.0, 0.0], [0.0, 4.0], [1.0, 0.0], [0.0, 6.0]])
    victims = inversion.Victims(rows, np.array([0, 0, 1, 2]), const(0.2, 0.3, 0.5, 0.8), np.array([0, 0, 1, 2]))
    out, _ = inversion.vector_inversion(images, vectors, victims, noise_multipliers=(0.0, 1e-9), steps=1, fid=False)
    assert [r["clip"] for r in out] == [5.0, 5.0]
    sent = inversion.noised(rows, victims.row_owner, 1e-9, 5.0, seed=0)
    np.testing.assert_allclose(sent, [[3, 0], [0, 4], [1, 0], [0, 5]], atol=1e-6)


def test_epsilon_composes_the_given_releases_at_the_given_delta() -> None:
    images, vectors = planted()
    victims = inversion.Victims(vectors[:2], np.array([0, 1]), images[:2], np.array([0, 1]))
    out, _ = inversion.vector_inversion(images, vectors, victims, noise_multipliers=(0.0, 2.0), releases=7,
                                        delta=1e-3, steps=1, fid=False)
    assert out[0]["epsilon"] is None and out[0]["delta"] == out[1]["delta"] == 1e-3
    assert out[1]["epsilon"] == pytest.approx(gaussian_epsilon(2.0, 7, 1e-3))
    assert out[1]["epsilon"] > gaussian_epsilon(2.0, 1, 1e-3)


def test_the_chance_draw_takes_distinct_attacker_images_when_it_has_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    """6 rows, 6 attacker images: the decoys are the 6 images, each once (a draw without replacement); at z = 0 the
    decoys of the rows released (FPL: the classes held) only."""
    seen: list[np.ndarray] = []
    real = inversion.scores

    def spy(recon: np.ndarray, victims: inversion.Victims, decoys: np.ndarray, **kw: Any) -> dict[str, Any]:
        seen.append(decoys)
        return real(recon, victims, decoys, **kw)

    monkeypatch.setattr(inversion, "scores", spy)
    images, vectors = planted()
    present = np.array([True, False, True, True, False, True])
    victims = inversion.Victims(vectors, np.repeat([0, 1], 3), images, np.repeat([0, 1], 3), present=present)
    inversion.vector_inversion(images, vectors, victims, noise_multipliers=(1.0, 0.0), steps=1, fid=False, seed=4)
    noisy, clean = seen
    assert sorted(noisy[:, 0, 0, 0].tolist()) == pytest.approx(np.linspace(0.1, 0.9, 6).tolist())
    np.testing.assert_array_equal(clean, noisy[present])


def test_the_generator_gets_the_style_sigma_clamped_at_zero_and_is_trained_with_the_audits_seed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the generator inverts under DP is what CCST and PARDON send: ``noised(..., sigma_from)``, σ ≥ 0."""
    given: list[np.ndarray] = []
    seeds: list[int] = []
    real_invert, real_train = inversion.invert, inversion.train_generator

    def invert(gen: Any, vectors: np.ndarray) -> np.ndarray:
        given.append(vectors)
        return real_invert(gen, vectors)

    def train(images: np.ndarray, vectors: np.ndarray, **kw: Any) -> Any:
        seeds.append(kw["seed"])
        return real_train(images, vectors, **kw)

    monkeypatch.setattr(inversion, "invert", invert)
    monkeypatch.setattr(inversion, "train_generator", train)
    images, vectors = planted()
    small = 0.01 * vectors  # noise of z = 1 at the median clip swamps them: some σ entries come out negative
    victims = inversion.Victims(small, np.repeat([0, 1, 2], 2), images, np.repeat([0, 1, 2], 2))
    inversion.vector_inversion(images, vectors, victims, noise_multipliers=(1.0,), steps=1, fid=False, seed=3,
                               sigma_from=1)
    clip = float(np.median([np.linalg.norm(small[2 * o:2 * o + 2]) for o in range(3)]))
    raw = inversion.noised(small, victims.row_owner, 1.0, clip, 3)
    assert (raw[:, 1] < 0).any()
    np.testing.assert_allclose(given[0], inversion.noised(small, victims.row_owner, 1.0, clip, 3, sigma_from=1))
    assert seeds == [3]


def test_fid_is_scored_at_every_noise_level_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inversion, "effnet_features", lambda x: x.reshape(len(x), -1))
    images, vectors = planted()
    victims = inversion.Victims(vectors[:3], np.zeros(3, int), images, np.repeat([0, 1], 3))
    out, _ = inversion.vector_inversion(images, vectors, victims, noise_multipliers=(0.0, 1.0), steps=1, fid=True)
    assert all(isinstance(r[FID_NAME], float) and r[FID_NAME] >= 0 for r in out)


# --------------------------------------------------------------------------- update-dlg


def test_dlg_scores_each_victims_label_against_its_first_image_and_runs_the_audits_iterations_and_delta(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each client's attacked image is its first, so iDLG's label counts against ``y[c][0]`` (here the second
    image's label differs); DLG runs ``dlg_iterations``; ε at ``z/2`` over the 3 engine rounds at the audit's δ."""
    seen: list[int] = []
    found = iter([3, 1, 2])  # DLG's labels for clients 0, 1, 2: right, right, wrong

    def spy(net: torch.nn.Module, update: list[torch.Tensor], lr: float, shape: tuple[int, ...], *,
            iterations: int, seed: int) -> tuple[torch.Tensor, int]:
        seen.append(iterations)
        return torch.zeros((1, *shape)), next(found)

    monkeypatch.setattr(privacy, "dlg", spy)
    fed = toy_federation()
    xs = [torch.full((2, 1, 8, 8), v) for v in (0.1, 0.5, 0.9)]
    ys = [np.array([3, 0]), np.array([1, 2]), np.array([0, 2])]
    rp = Replay(fed.cfg, fed, cast(FedModel, fed.model), "initial", xs, ys, xs[0], 0.0, 1.0)
    s = AuditConfig(noise_multipliers=[1.0], dlg_victims=5, dlg_iterations=3, delta=1e-3, fid=False)
    (row,) = privacy.update_attack(rp, s, 0, tmp_path)
    assert seen == [3, 3, 3]  # every client (5 asked, 3 held)
    assert row["label_acc"] == pytest.approx(2 / 3) and row["n"] == 3
    assert row["delta"] == 1e-3 and row["epsilon"] == pytest.approx(gaussian_epsilon(0.5, 3, 1e-3))
    assert row["grid"] == "update-dlg.png" and (tmp_path / "update-dlg.png").is_file()


# --------------------------------------------------------------------------- the sweep's tables


def write_audit(run_dir: Path, settings: AuditConfig | None, rows: list[dict[str, Any]] | None = None,
                text: str | None = None) -> None:
    (run_dir / "audit").mkdir(parents=True, exist_ok=True)
    body = text if text is not None else json.dumps({"settings": settings.model_dump(mode="json") if settings else None,
                                                     "rows": rows or []})
    (run_dir / "audit" / "privacy.json").write_text(body)


def test_an_audit_is_current_only_with_exactly_the_same_settings_and_a_readable_record(tmp_path: Path) -> None:
    s = AuditConfig(per_client=3)
    assert not sweep.audit_is_current(tmp_path, s)  # none
    write_audit(tmp_path, s)
    assert sweep.audit_is_current(tmp_path, s)
    assert not sweep.audit_is_current(tmp_path, AuditConfig(per_client=4))
    write_audit(tmp_path, None, text="{not json")  # a torn write: audited again, not a crash
    assert not sweep.audit_is_current(tmp_path, s)


def test_audit_cells_skip_cells_without_a_section_reuse_current_audits_and_redo_stale_ones(tmp_path: Path) -> None:
    s = AuditConfig(noise_multipliers=[0.0, 1.0])
    row = {"attack": "gram", "attacker": "station", "noise_multiplier": 1.0, "epsilon": 4.5, "procrustes_rel_err": 0.3}
    fresh, stale, none = tmp_path / "fresh", tmp_path / "stale", tmp_path / "none"
    write_audit(fresh, s, [row])
    write_audit(stale, AuditConfig(), [])
    audited: list[Path] = []

    def audit(run_dir: Path, settings: AuditConfig) -> Path:
        audited.append(run_dir)
        write_audit(run_dir, settings, [{**row, "epsilon": None, "noise_multiplier": 0.0}])
        return run_dir / "audit" / "privacy.json"

    cells = [{"run_dir": str(d), "variant": v, "target": "t", "seed": k}
             for d, v, k in ((fresh, "A", 0), (stale, "B", 1), (none, "C", 2))]
    out = sweep.audit_cells(cells, [s, s, None], audit)
    assert audited == [stale]
    assert [(c["variant"], c["seed"], c["z"], c["epsilon"], c["procrustes_rel_err"], c["psnr"]) for c in out] == [
        ("A", 0, 1.0, 4.5, 0.3, None), ("B", 1, 0.0, None, 0.3, None)]


def test_the_sweeps_markdown_right_aligns_the_numbers_and_gives_chance_psnr_one_decimal() -> None:
    cells = [{"variant": "V", "target": "t", "seed": k, "attack": "sample-style", "attacker": "third-party", "z": 0.1,
              "epsilon": 123.456, **dict.fromkeys(key for _, key in sweep.METRICS), "psnr": p, "psnr_chance": c,
              "ssim": 0.5} for k, p, c in ((0, 10.0, 7.04), (1, 12.0, 7.16))]
    summary = sweep.summarise(cells)
    assert summary[0]["psnr_chance"] == pytest.approx((7.1, 0.0848528137423857))
    lines = sweep.markdown(summary).splitlines()
    assert lines[0] == "| variant | target | attack | attacker | z | ε | seeds | PSNR dB | PSNR chance | SSIM |"
    assert lines[1] == "|---|---|---|---|---|---:|---:|---:|---:|---:|"
    assert lines[2] == "| V | t | sample-style | third-party | 0.1 | 123 | 2 | 11.0 ± 1.4 | 7.1 ± 0.1 | 0.50 ± 0.00 |"


# --------------------------------------------------------------------------- the report's sections


def test_the_runs_audit_table_formats_each_score_and_sorts_the_grids(tmp_path: Path) -> None:
    """An inversion row: PSNR (chance) to 0.1 dB, SSIM without a chance level as it stands, FID to 0.1, re-id with
    its chance to 0.01, z as ``g``; the grids in name order."""
    (tmp_path / "audit").mkdir()
    for name in ("b.png", "a.png"):
        (tmp_path / "audit" / name).write_bytes(name.encode())
    rows = [{"attack": "fpl-prototypes", "attacker": "inter-client", "noise_multiplier": 0.1234, "epsilon": 1234.5,
             "psnr": 9.96, "psnr_chance": 9.04, "ssim": 0.234, FID_NAME: 1000.04, "reid": 0.0651, "reid_chance": 0.05,
             "grid": "b.png"},
            {"attack": "update-dlg", "attacker": "server", "noise_multiplier": 1.0, "epsilon": None, "psnr": 45.54,
             "psnr_chance": None, "ssim": 0.99, "ssim_chance": 0.071, FID_NAME: None, "reid": 1.0, "reid_chance": 0.5,
             "grid": "a.png"}]
    (tmp_path / "audit" / "privacy.json").write_text(json.dumps({"rows": rows, "weights": "checkpoint"}))
    section = reports_audit.audit_section(tmp_path)
    assert section is not None
    assert section["rows"] == [
        ("fpl-prototypes", "inter-client", "0.1234", "1.23e+03", "10.0 (9.0)", "0.23", "1000.0", "0.07 (0.05)"),
        ("update-dlg", "server", "1", "—", "45.5", "0.99 (0.07)", "—", "1.00 (0.50)")]
    assert [g["title"] for g in section["grids"]] == ["a.png", "b.png"]


def test_a_sweep_without_an_audit_has_no_audit_section_and_each_line_is_a_variant_attack_and_attacker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert reports_audit.sweep_audit_section(tmp_path) is None
    with (tmp_path / "audit.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerows([["variant", "attack", "attacker", "z", "psnr_mean", "psnr_std"],
                     ["v", "sample-style", "third-party", "0", "8", "1"],
                     ["v", "sample-style", "inter-client", "0", "10", "1"]])
    (tmp_path / "audit.md").write_text("| t |")
    figures: list[Any] = []
    monkeypatch.setattr(reports_audit, "png_uri", lambda fig: figures.append(fig) or "uri")
    reports_audit.sweep_audit_section(tmp_path)
    (ax,) = figures[0].axes
    assert [c.get_label() for c in ax.containers] == ["v: sample-style (third-party)", "v: sample-style (inter-client)"]
    plt.close(figures[0])


def test_the_gram_attack_reads_the_trained_models_classifier_inputs() -> None:
    """The Gram is of the final model's features (the classifier's inputs); its clip the median row norm (21 rows:
    the 11th)."""
    fed = toy_federation()
    trained = copy.deepcopy(fed.model).eval()
    with torch.no_grad():
        trained.fc.weight.mul_(2.0)
    xs = [fed.dataset.x[torch.as_tensor(c.train_idx[:n])] for c, n in zip(fed.clients, (5, 5, 5, 6), strict=True)]
    rp = Replay(fed.cfg, fed, cast(FedModel, trained), "checkpoint", xs, [], xs[0], -3.0, 3.0)
    (row,) = privacy.gram_attack(rp, AuditConfig(noise_multipliers=[0.0]), seed=0)
    with torch.no_grad():
        norms = np.sort(trained.features(torch.cat(xs)).double().norm(dim=1).numpy())
    assert row["clip"] == pytest.approx(norms[10], rel=1e-7)


def test_the_gram_clip_of_an_even_number_of_rows_is_the_mean_of_the_two_middle_norms() -> None:
    """The median as the other attacks take it (numpy's): of 20 rows, the mean of the 10th and 11th norms (torch's
    median gave the 10th)."""
    fed = toy_federation()
    xs = [fed.dataset.x[torch.as_tensor(c.train_idx[:5])] for c in fed.clients]
    rp = Replay(fed.cfg, fed, cast(FedModel, fed.model).eval(), "initial", xs, [], xs[0], -3.0, 3.0)
    (row,) = privacy.gram_attack(rp, AuditConfig(noise_multipliers=[0.0]), seed=0)
    with torch.no_grad():
        norms = np.sort(rp.model.features(torch.cat(xs)).double().norm(dim=1).numpy())
    assert norms[9] < norms[10] and row["clip"] == pytest.approx((norms[9] + norms[10]) / 2, rel=1e-9)


def test_the_client_style_of_a_pardon_run_with_one_pooled_style_is_that_pooled_style() -> None:
    """PARDON ``local_style: average`` (v1): the client's one style is eq. 2 over all its images (``local_labels``:
    every image in one cluster); the audit recomputes "what its clients share" (privacy.py). It inverted FINCH's
    clusters' style, which a v1 run never sends."""
    rp = share_replay("method.name=pardon", "method.params.local_style=average")
    x = paired_styles()
    m, second = x.mean((2, 3)), (x**2).mean((2, 3))
    mu, sigma = m.mean(0), torch.sqrt(second.mean(0) - m.mean(0) ** 2 + EPS)
    _, release = privacy._share(rp, "client-style", AuditConfig())
    np.testing.assert_allclose(release(x, np.zeros(8, int)), torch.cat([mu, sigma])[None].numpy(), rtol=1e-5)


def test_the_client_style_of_a_pardon_run_clustering_on_features_is_that_of_finchs_clusters_of_the_flat_maps() -> None:
    """PARDON ``cluster_on: features``: eq. 1's FINCH runs on each image's flat encoder map (the pixel path: the image
    itself), not on its style. Flipping every other image's checkerboard keeps the styles and splits the pairs."""
    rp = share_replay("method.name=pardon", "method.params.cluster_on=features")
    x = paired_styles()
    m = x.mean((2, 3), keepdim=True)
    x = m + (x - m) * torch.tensor([1.0, -1.0] * 4).view(8, 1, 1, 1)
    m, second = x.mean((2, 3)), (x**2).mean((2, 3))
    labels = finch_labels(x.flatten(1).numpy(), "coarsest")
    styles = style_vectors(m.numpy(), std_from_moments(m, second).numpy())
    assert labels.tolist() == [0, 1, 0, 1, 2, 3, 2, 3] and finch_labels(styles, "coarsest").tolist() == [0] * 4 + [1] * 4
    mu, sigma = client_style(m, second, labels, "styles")
    _, release = privacy._share(rp, "client-style", AuditConfig())
    np.testing.assert_allclose(release(x, np.zeros(8, int)), np.concatenate([mu, sigma])[None], rtol=1e-5)


def test_the_audit_itself_refuses_a_task_its_attacks_do_not_fit_before_rebuilding_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only the command: ``audit_privacy`` (as ``feddg run`` and ``feddg sweep`` call it) refuses a text run in one
    line, before any replay or staging."""
    raw = {"data": {"dataset": "synthetic-sentiment", "max_length": 32}, "split": {"target": "kitchen"},
           "partition": {"kind": "by_domain", "num_clients": 3}, "model": {"name": "tiny-roberta"},
           "optim": {"name": "adamw", "lr": 0.001}}
    (tmp_path / "config.yaml").write_text(dump_config(build_config(raw)))
    monkeypatch.setattr(privacy, "replay", lambda *a: pytest.fail("the run was rebuilt"))
    with pytest.raises(ValueError, match="^the privacy audit is for image classification: ") as err:
        privacy.audit_privacy(tmp_path, AuditConfig())
    assert "\n" not in str(err.value) and not (tmp_path / "audit.partial").exists()


def test_no_noise_is_no_release_mechanism_at_all_and_a_subset_of_rows_keeps_its_own_images() -> None:
    """``noised`` at z = 0 is the identity (no clipping, even far above the clip); ``Victims.rows`` keeps each kept
    row's owner and source image."""
    v = np.array([[30.0, -4.0], [0.5, 2.0], [-7.0, 1.0]])
    np.testing.assert_array_equal(inversion.noised(v, np.array([0, 0, 1]), 0.0, 0.01, seed=0, sigma_from=1), v)
    victims = inversion.Victims(v, np.array([0, 0, 1]), const(0.1, 0.2, 0.3), np.array([0, 0, 1]),
                                source=np.array([2, 0, 1]), present=np.array([True, False, True]))
    kept = victims.rows(np.array([False, True, True]))
    assert kept.source is not None and kept.source.tolist() == [0, 1] and kept.row_owner.tolist() == [0, 1]
    np.testing.assert_array_equal(kept.vectors, v[1:])
    assert kept.present is None  # what was kept is sent
