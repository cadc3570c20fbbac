"""The privacy audit (docs/privacy.md, "Auditing what leaves a client"): metrics on hand-computed cases, the
generator's inversion in a planted case and on pure noise, DLG, the Gram's rotation ambiguity, DP
degrading each attack as ε falls, and ``feddg audit privacy`` on a tiny run."""

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml
from scipy import linalg
from typer.testing import CliRunner

from feddg.aggregation.accounting import gaussian_epsilon
from feddg.audit.gradient import TinyNet, dlg, dp_update, one_step_update
from feddg.audit.gram import gram_audit, gram_root
from feddg.audit.inversion import Victims, noised, vector_inversion
from feddg.audit.metrics import (
    FID_NAME,
    PSNR_CAP,
    denormalise,
    fid_effnet,
    frechet_distance,
    psnr,
    reidentification,
    ssim,
    to_unit,
)
from feddg.audit.privacy import Replay, replay
from feddg.cli import app
from feddg.config import AuditConfig, ConfigError, audit_attacks, build_config, dump_config
from feddg.experiment import resume_experiment, run_experiment
from feddg.reports.run import report

RNG = np.random.default_rng(0)


def blocky(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` random 3×16×16 images of 2×2 blocks in [0.2, 0.8]."""
    return (0.2 + 0.6 * rng.random((n, 3, 8, 8))).repeat(2, 2).repeat(2, 3)


def pixel_styles(x: np.ndarray) -> np.ndarray:
    """Per-image ``[μ ‖ σ]`` of the channels: CCST's sample-level pixel style."""
    return np.concatenate([x.mean((2, 3)), x.std((2, 3))], axis=1)


PLANTED = blocky(16, np.random.default_rng(1))
OWNERS = np.repeat(np.arange(4), 4)


# --------------------------------------------------------------------------- metrics


def test_identical_images_score_the_psnr_cap_ssim_one_and_fid_zero():
    x = PLANTED[:6]
    assert psnr(x[0], x[0]) == PSNR_CAP
    assert ssim(x[0], x[0]) == pytest.approx(1.0)
    assert fid_effnet(x, x) == pytest.approx(0.0, abs=1e-6)


def test_a_shift_of_a_tenth_is_20_db_and_moves_ssim_and_fid():
    x = PLANTED[:6]
    assert psnr(x[0], x[0] + 0.1) == pytest.approx(10 * math.log10(1 / 0.01))  # MSE 0.01 on range 1
    assert psnr(x[0], x[0] + 0.05) == pytest.approx(10 * math.log10(1 / 0.0025))
    assert ssim(x[0], x[0] + 0.1) < 1.0
    assert fid_effnet(x, x + 0.1) > 1.0


def test_frechet_distance_matches_scipy_sqrtm_and_the_closed_form_of_a_shift():
    f1, f2 = RNG.standard_normal((12, 20)), RNG.standard_normal((15, 20)) + 0.5
    s1, s2 = np.cov(f1, rowvar=False), np.cov(f2, rowvar=False)
    ref = ((f1.mean(0) - f2.mean(0)) ** 2).sum() + np.trace(s1 + s2 - 2 * np.real(linalg.sqrtm(s1 @ s2)))
    assert frechet_distance(f1, f2) == pytest.approx(ref, rel=1e-6)
    assert frechet_distance(f1, f1 + 2.0) == pytest.approx(20 * 4.0)  # same covariance: ‖Δμ‖² = 20 · 2²
    with pytest.raises(ValueError, match="at least 2"):
        frechet_distance(f1[:1], f2)


def test_reidentification_counts_reconstructions_nearest_to_their_victims_images():
    pool = np.stack([np.full((1, 2, 2), v) for v in (0.0, 0.3, 0.7, 1.0)])
    owners = np.array([0, 0, 1, 1])
    recon = np.stack([np.full((1, 2, 2), v) for v in (0.1, 0.9, 0.6)])  # nearest: 0.0 (c0), 1.0 (c1), 0.7 (c1)
    assert reidentification(recon, np.array([0, 0, 1]), pool, owners) == pytest.approx(2 / 3)
    assert to_unit(np.array([-1.0, 0.0, 3.0]), -1, 1).tolist() == [0.0, 0.5, 1.0]


def test_images_are_scored_in_0_1_with_the_datasets_own_normalisation_undone():
    # ImageNet statistics per channel: one min/max over all channels would shift each channel (by up to 0.08 here)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    pixels = np.random.default_rng(0).uniform(size=(2, 3, 4, 4))
    pixels[0, :, 0, 0], pixels[1, :, 0, 1] = 0.0, 1.0  # every channel spans [0, 1]
    normalised = (pixels - np.reshape(mean, (1, 3, 1, 1))) / np.reshape(std, (1, 3, 1, 1))
    np.testing.assert_allclose(denormalise(normalised, mean, std), pixels, atol=1e-12)
    replay = SimpleNamespace(fed=SimpleNamespace(dataset=SimpleNamespace(mean=mean, std=std)),
                             lo=float(normalised.min()), hi=float(normalised.max()))
    np.testing.assert_allclose(Replay.unit(replay, normalised), pixels, atol=1e-12)
    replay.fed.dataset = SimpleNamespace(mean=None, std=None)  # no statistics known: the value range, as before
    assert np.array_equal(Replay.unit(replay, normalised), to_unit(normalised, replay.lo, replay.hi))


def test_replay_takes_distinct_training_images_of_every_client_and_the_initial_weights_without_a_checkpoint(
        tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    (tmp_path / "config.yaml").write_text(dump_config(build_config(TINY)))
    rp = replay(tmp_path, AuditConfig(per_client=10_000, attacker_size=5), seed=0)
    assert rp.weights == "initial (no checkpoint)" and len(rp.attacker_x) == 5
    for client, x in zip(rp.fed.clients, rp.x, strict=True):  # more asked than held: each image once, in index order
        np.testing.assert_array_equal(x.numpy(), rp.fed.dataset.get_batch(np.sort(client.train_idx), train=False)[0])


# --------------------------------------------------------------------------- generator inversion


@pytest.fixture(scope="module")
def planted_rows() -> list[dict]:
    """The planted case at z = 0, 0.01, 0.1, 1: every victim's sample style names one of the attacker's images."""
    v = pixel_styles(PLANTED)
    rows, _ = vector_inversion(PLANTED, v, Victims(v, OWNERS, PLANTED, OWNERS, source=np.arange(16)),
                               noise_multipliers=(0.0, 0.01, 0.1, 1.0), fid=False)
    return rows


def test_generator_recovers_images_from_sample_styles_when_each_style_names_one_image(planted_rows):
    assert planted_rows[0]["psnr"] > 25 and planted_rows[0]["ssim"] > 0.9  # each against its own image
    assert planted_rows[0]["reid"] == 1.0 and planted_rows[0]["reid_chance"] == 0.25
    # chance: a random draw of the attacker's images (here the victims' own, 3 of 16 in place: 23 dB) scored the same way
    assert planted_rows[0]["psnr"] > planted_rows[0]["psnr_chance"] + 10 and planted_rows[0]["ssim_chance"] < 0.5


def test_generator_does_not_beat_chance_on_styles_of_pure_noise():
    rng = np.random.default_rng(2)
    attacker = blocky(16, rng)
    victims = Victims(rng.standard_normal((16, 6)), OWNERS, PLANTED, OWNERS)
    rows, _ = vector_inversion(attacker, rng.standard_normal((16, 6)), victims, fid=False)
    assert rows[0]["reid"] <= rows[0]["reid_chance"] + 0.1
    assert rows[0]["psnr"] < 15


def test_dp_noise_is_the_clipped_statistic_plus_one_draw_scaled_by_z():
    v = pixel_styles(PLANTED)
    clip = 0.5
    clipped = noised(v, OWNERS, 1e-12, clip, seed=3)
    one, two = noised(v, OWNERS, 1.0, clip, 3) - clipped, noised(v, OWNERS, 2.0, clip, 3) - clipped
    np.testing.assert_allclose(two, 2 * one, atol=1e-5)
    assert np.linalg.norm(clipped[OWNERS == 0]) == pytest.approx(clip, rel=1e-4)  # all the owner's rows: one vector
    assert one.std() == pytest.approx(2 * clip, rel=0.25)  # σ = z · Δ, Δ = 2C


def test_dp_degrades_the_style_inversion_monotonically_as_epsilon_falls(planted_rows):
    psnrs = [r["psnr"] for r in planted_rows]
    assert all(a > b for a, b in zip(psnrs, psnrs[1:], strict=False)), psnrs
    zs = [r["noise_multiplier"] for r in planted_rows]
    assert [r["epsilon"] for r in planted_rows] == [None, *(gaussian_epsilon(z, 1, 1e-5) for z in zs[1:])]


# --------------------------------------------------------------------------- DLG


def _dlg_psnr(z: float) -> tuple[float, int]:
    torch.manual_seed(0)
    net = TinyNet(3, 16, 16, 10)
    x = torch.as_tensor(PLANTED[:1] * 2 - 1, dtype=torch.float32)
    update = dp_update(one_step_update(net, x, torch.tensor([7]), 0.1), z, clip=1.0, seed=0)
    x_hat, label = dlg(net, update, 0.1, (3, 16, 16), iterations=15)
    return psnr(PLANTED[0], to_unit(x_hat[0].numpy(), -1, 1)), label


def test_dlg_recovers_a_single_image_and_its_label_from_a_one_step_update():
    p, label = _dlg_psnr(0.0)
    assert p > 30 and label == 7


def test_dp_degrades_dlg_monotonically():
    psnrs = [_dlg_psnr(z)[0] for z in (0.0, 0.001, 0.1)]
    assert psnrs[0] > psnrs[1] + 10 and psnrs[1] >= psnrs[2] - 0.5, psnrs


# --------------------------------------------------------------------------- Gram


def test_gram_gives_features_up_to_rotation_but_not_individual_activations():
    a = RNG.standard_normal((200, 8))
    r = gram_root(a.T @ a)
    np.testing.assert_allclose(r.T @ r, a.T @ a, atol=1e-9)
    out = gram_audit(a)
    assert out["procrustes_rel_err"] < 1e-10  # recoverable up to a rotation
    assert out["rotated_gram_rel_err"] < 1e-12 and out["rotated_rows_rel_err"] > 1.0  # same Gram, other rows
    single = gram_audit(a[:1])  # one sample: rank one, the activation up to its sign
    assert single["row_cosine"] == pytest.approx(1.0)


def test_dp_degrades_gram_recovery_monotonically():
    a = RNG.standard_normal((100, 8))
    clip = 3.0
    errs = []
    for z in (0.0, 0.1, 1.0, 10.0):
        ac = a * np.minimum(1, clip / np.linalg.norm(a, axis=1, keepdims=True))
        noise = np.triu(np.random.default_rng(0).standard_normal((8, 8)))
        g = ac.T @ ac + z * clip**2 * (noise + np.triu(noise, 1).T)
        errs.append(gram_audit(ac, g)["procrustes_rel_err"])
    assert all(a < b for a, b in zip(errs, errs[1:], strict=False)), errs


# --------------------------------------------------------------------------- the command

TINY = {"data": {"dataset": "digits-dg", "max_per_domain": 30}, "partition": {"kind": "by_domain", "num_clients": 3},
        "model": {"name": "lenet"}, "method": {"name": "ccst", "params": {"style_type": "single"}},
        "federation": {"rounds": 1, "batch_size": 32}, "split": {"target": "uci"}, "device": "cpu"}


def test_cli_writes_privacy_json_and_grids_on_a_tiny_run(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    assert audit_attacks(build_config(TINY)) == ("sample-style", "update-dlg")  # CCST's styles; every reply's update
    sampled = {**TINY, "federation": {**TINY["federation"], "client_fraction": 0.67}}  # 2 of 3 clients a round
    run_experiment(build_config(sampled), tmp_path / "r", progress=False)
    res = CliRunner().invoke(app, ["audit", "privacy", str(tmp_path / "r"), "--noise", "0", "--noise", "1",
                                   "--per-client", "6", "--steps", "30", "--attack", "sample-style", "--attack",
                                   "fpl-prototypes", "--attack", "gram", "--attack", "update-dlg"])
    assert res.exit_code == 0, res.output
    record = json.loads((tmp_path / "r" / "audit" / "privacy.json").read_text())
    assert record["method"] == "ccst" and record["weights"] == "checkpoint" and record["fid_name"] == FID_NAME
    assert record["settings"]["seed"] is None and record["seed"] == 0  # the run's seed
    rows = record["rows"]
    assert [(r["attack"], r["attacker"], r["noise_multiplier"]) for r in rows] == [
        ("sample-style", "third-party", 0.0), ("sample-style", "third-party", 1.0),
        ("sample-style", "inter-client", 0.0), ("sample-style", "inter-client", 1.0),
        ("fpl-prototypes", "third-party", 0.0), ("fpl-prototypes", "third-party", 1.0),
        ("fpl-prototypes", "inter-client", 0.0), ("fpl-prototypes", "inter-client", 1.0),
        ("gram", "station", 0.0), ("gram", "station", 1.0), ("update-dlg", "server", 0.0), ("update-dlg", "server", 1.0)]
    assert rows[0]["n"] == 18 and rows[2]["n"] == 12  # 6 styles of each of 3 clients; client 0 attacks 1 and 2
    assert rows[1]["epsilon"] == pytest.approx(gaussian_epsilon(1.0, 1, 1e-5))
    assert {r["scored_against"] for r in rows[:4]} == {"own image"} and all(0 < r["psnr_chance"] < 100 for r in rows[:4])
    assert {r["scored_against"] for r in rows[4:8]} == {"nearest of victim's"}  # a class mean stands for many images
    assert rows[4]["n"] <= 18 and rows[5]["n"] == 30  # without DP the classes held; under dp all 10 rows of 3 clients
    assert rows[9]["epsilon"] == pytest.approx(gaussian_epsilon(1.0, 3, 1e-5))  # 1 round × LeNet's 3 linear layers
    assert rows[10]["scored_against"] == "own image" and rows[11]["dp"] == "local"
    assert rows[11]["epsilon"] == pytest.approx(gaussian_epsilon(0.5, 1, 1e-5))  # local DP at z/2: no sampling
    assert (tmp_path / "r" / "audit" / "sample-style-third-party.png").is_file()
    lines = res.output.splitlines()  # the terminal shows the table too: one line per scored row, its own figures
    for r in rows:
        if r["attack"] != "gram":
            cells = [r["attack"], r["attacker"], f"{r['psnr']:.1f} ({r['psnr_chance']:.1f})", f"{r[FID_NAME]:.1f}"]
            assert any(all(c in line for c in cells) for line in lines), cells
    page = report(tmp_path / "r")[0].read_text()  # feddg report shows the audit: the table and the grids
    assert "Privacy audit" in page and FID_NAME in page and "sample-style-third-party.png" in page
    assert f"{rows[0]['psnr']:.1f} ({rows[0]['psnr_chance']:.1f})" in page  # each score beside its chance level
    bad = CliRunner().invoke(app, ["audit", "privacy", str(tmp_path / "r"), "--attack", "nope"])
    assert bad.exit_code == 2 and "unknown attack" in bad.output
    with pytest.raises(ValueError, match="noise multipliers must be >= 0"):
        AuditConfig(noise_multipliers=[-1.0])


AUDIT = {"attacks": ["sample-style"], "per_client": 4, "noise_multipliers": [0.0, 1.0], "generator_steps": 20,
         "fid": False}


def test_a_sweep_with_an_audit_section_audits_each_cell_and_tables_the_seeds(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    config = tmp_path / "sweep.yaml"
    sweep = {"targets": ["uci"], "seeds": [0, 1], "variants": {"CCST": {}}}
    config.write_text(yaml.safe_dump({**TINY, "audit": AUDIT, "sweep": sweep}))
    res = CliRunner().invoke(app, ["sweep", str(config), "--out-dir", str(tmp_path / "s"), "--quiet"])
    assert res.exit_code == 0, res.output
    cells = [tmp_path / "s" / "CCST" / "uci" / f"seed{k}" for k in (0, 1)]
    records = [json.loads((c / "audit" / "privacy.json").read_text()) for c in cells]
    assert [r["seed"] for r in records] == [0, 1]  # each cell audits with its run's seed (audit.seed unset)
    with (tmp_path / "s" / "audit.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [(r["attacker"], float(r["z"]), int(r["seeds"])) for r in table] == [
        ("third-party", 0.0, 2), ("third-party", 1.0, 2), ("inter-client", 0.0, 2), ("inter-client", 1.0, 2)]
    for i, row in enumerate(table):  # mean and sample std of the two cells' rows
        psnr = [rec["rows"][i]["psnr"] for rec in records]
        assert float(row["psnr_mean"]) == pytest.approx(np.mean(psnr))
        assert float(row["psnr_std"]) == pytest.approx(np.std(psnr, ddof=1))
        assert row[f"{FID_NAME}_mean"] == ""  # fid: false
    assert "sample-style" in (tmp_path / "s" / "audit.md").read_text()
    page = report(tmp_path / "s")[0].read_text()  # feddg report on the sweep: the table and PSNR against z
    assert "Privacy audit" in page and "attack quality against the noise" in page and "sample-style" in page
    stamps = [(c / "results.json").stat().st_mtime_ns for c in cells]
    audits = [(c / "audit" / "privacy.json").stat().st_mtime_ns for c in cells]
    again = CliRunner().invoke(app, ["sweep", str(config), "--out-dir", str(tmp_path / "s"), "--quiet"])
    assert again.exit_code == 0, again.output
    assert [(c / "audit" / "privacy.json").stat().st_mtime_ns for c in cells] == audits  # current: reused
    more = CliRunner().invoke(app, ["sweep", str(config), "--out-dir", str(tmp_path / "s"), "--quiet",
                                    "-o", "audit.noise_multipliers=[0.0, 0.1]"])
    assert more.exit_code == 0, more.output
    assert [(c / "results.json").stat().st_mtime_ns for c in cells] == stamps  # audit settings never retrain
    assert [json.loads((c / "audit" / "privacy.json").read_text())["settings"]["noise_multipliers"]
            for c in cells] == [[0.0, 0.1]] * 2


def test_the_runs_audit_section_is_the_commands_default_and_its_options_override_it(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**TINY, "audit": {**AUDIT, "seed": 3}}))
    ran = CliRunner().invoke(app, ["run", str(config), "--run-dir", str(tmp_path / "r"), "--quiet"])
    assert ran.exit_code == 0 and "privacy audit: wrote" in ran.output, ran.output  # feddg run audits after training
    first = json.loads((tmp_path / "r" / "audit" / "privacy.json").read_text())
    assert first["settings"] == AuditConfig(**{**AUDIT, "seed": 3}).model_dump(mode="json") and first["seed"] == 3
    res = CliRunner().invoke(app, ["audit", "privacy", str(tmp_path / "r"), "--noise", "0.5"])
    assert res.exit_code == 0, res.output
    record = json.loads((tmp_path / "r" / "audit" / "privacy.json").read_text())
    assert record["settings"] == AuditConfig(**{**AUDIT, "seed": 3, "noise_multipliers": [0.5]}).model_dump(mode="json")
    assert [r["noise_multiplier"] for r in record["rows"]] == [0.5, 0.5]
    kept = json.loads((tmp_path / "r" / "audit-1" / "privacy.json").read_text())  # the first audit is not lost
    assert kept == first and not (tmp_path / "r" / "audit.partial").exists()
    with pytest.raises(ConfigError, match="audit.attacks"):
        build_config({**TINY, "audit": {**AUDIT, "attacks": ["nope"]}})


def test_a_resumed_or_overwritten_run_drops_the_audit_of_its_old_model(tmp_path, cache_dir, monkeypatch):
    """A sweep reuses an audit whose settings match: it must never find one of a model the run no longer has."""
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    run = tmp_path / "r"
    run_experiment(build_config(TINY), run, progress=False)
    audits = ("audit", "audit-1", "audit-12", "audit.partial")
    for name in audits:
        (run / name).mkdir()
        (run / name / "privacy.json").write_text("{}")
    (run / "audit-notes").mkdir()  # a user's folder
    resume_experiment(run, ["federation.rounds=2"], progress=False)  # a grown run: another model
    assert not any((run / name).exists() for name in audits) and (run / "audit-notes").is_dir()
    for name in audits:
        (run / name).mkdir()
    run_experiment(build_config(TINY), run, overwrite=True, progress=False)
    assert not any((run / name).exists() for name in audits) and (run / "audit-notes").is_dir()
