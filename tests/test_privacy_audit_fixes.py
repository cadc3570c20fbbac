"""Fixes to the privacy accounting and audit (docs/privacy.md): DP-FedAvg's ε under PLD is the mechanism's as run,
the setup exchange's payloads count as outside dp_weights, the audit refuses tasks its attacks do not fit, and its
count of FedFA's and FPL's releases is the methods' own."""

import json
import logging
import math
from types import SimpleNamespace

import pytest
from support.dp_reference import analytic_gaussian_epsilon
from toy import toy_federation
from typer.testing import CliRunner

from feddg.aggregation.accounting import dp_fedavg_epsilon
from feddg.audit.privacy import _releases
from feddg.cli import app
from feddg.config import ConfigError, build_config, dump_config
from feddg.engines.inprocess import run_inprocess
from feddg.federation.server import Server

DP_WEIGHTS = ("dp_weights.noise_multiplier=0.5", "dp_weights.clip=0.3", "federation.rounds=1")
TEXT = {"data": {"dataset": "synthetic-sentiment", "max_length": 32, "max_per_domain": 40},
        "split": {"target": "kitchen"}, "partition": {"kind": "by_domain", "num_clients": 3},
        "model": {"name": "tiny-roberta"}, "optim": {"name": "adamw", "lr": 0.001}, "device": "cpu"}
SEG = {"data": {"dataset": "synthetic-mri", "max_per_domain": 24}, "split": {"target": "BIDMC"},
       "partition": {"kind": "by_domain", "num_clients": 5, "holdout": 0.25},
       "model": {"name": "unet", "params": {"width": 8}}, "optim": {"name": "adam", "lr": 0.003}, "device": "cpu"}
MISFIT = "the privacy audit is for image classification: the "


# --- bug 1: PLD accounted DP-FedAvg at z/4 ----------------------------------------------------------------------


@pytest.mark.parametrize(("z", "rounds"), [(1.0, 1), (1.0, 4), (2.0, 3)])
def test_pld_epsilon_of_dp_fedavg_is_the_exact_gaussian_of_multiplier_half_z(z, rounds):
    """Every client every round: ``rounds`` Gaussian releases of σ/Δ = z/2 (Δ = 2·C·max p, replace-one) compose to
    one of σ/Δ = z / (2 √rounds); PLD (pessimistic, tight) gives its exact ε, RDP an upper bound."""
    exact = analytic_gaussian_epsilon(z / 2 / math.sqrt(rounds), 1e-5)
    pld = dp_fedavg_epsilon(z, 3, 3, rounds, 1e-5, "pld")
    assert pld == pytest.approx(exact, rel=1e-3) and pld >= exact * (1 - 1e-6)
    assert pld <= dp_fedavg_epsilon(z, 3, 3, rounds, 1e-5, "rdp")


def test_the_auditors_case_pld_is_10_not_24():
    assert analytic_gaussian_epsilon(0.5, 1e-5) == pytest.approx(9.997, abs=1e-3)
    assert dp_fedavg_epsilon(1.0, 3, 3, 1, 1e-5, "pld") == pytest.approx(9.997, abs=0.01)


# --- bug 2: the setup exchange's payloads and dp_weights --------------------------------------------------------


@pytest.mark.parametrize(("over", "clear"), [
    (("method.name=fedmix",), ["mix"]),  # the clients' mean images and labels
    (("method.name=ccst",), ["style"]),  # the style bank
    (("method.name=ccst", "method.params.dp.noise_multiplier=1.0"), []),  # CCST noises its styles itself
])
def test_setup_payloads_are_not_covered_unless_the_method_noises_them(tmp_path, caplog, over, clear):
    with caplog.at_level(logging.WARNING, logger="feddg.federation.weight_privacy"):
        run_inprocess(Server(toy_federation(*over, *DP_WEIGHTS), tmp_path))
    rec = json.loads((tmp_path / "results.json").read_text())["weights_privacy"]
    assert rec["not_covered"] == clear
    warned = [r.getMessage() for r in caplog.records if "setup replies also carry" in r.getMessage()]
    assert warned == ([f"dp_weights covers the w/ arrays only: setup replies also carry {clear[0]} in the clear"]
                      if clear else [])


# --- bug 3: the audit on tasks its attacks do not fit -----------------------------------------------------------


@pytest.mark.parametrize(("raw", "audit", "why"), [
    (TEXT, {}, "classification task of synthetic-sentiment provides class_labels, tokens; update-dlg needs images "
               "(attacks that fit: none)"),
    (SEG, {}, "segmentation task of synthetic-mri provides dense_masks, images; update-dlg needs class_labels"),
    (SEG, {"attacks": ["fpl-prototypes", "gram"]}, "; fpl-prototypes needs class_labels; gram needs class_labels "
                                                    "(attacks that fit: sample-style, client-style, fedfa-moments)"),
])
def test_an_audit_section_that_does_not_fit_the_task_is_refused_at_load_in_one_line(raw, audit, why):
    with pytest.raises(ConfigError, match=f"^audit: {MISFIT}") as err:
        build_config({**raw, "audit": audit})
    assert why in str(err.value) and "\n" not in str(err.value)


def test_an_audit_section_whose_attacks_fit_the_task_is_accepted():
    assert build_config({**SEG, "audit": {"attacks": ["fedfa-moments"]}}).audit is not None


@pytest.mark.parametrize(("raw", "options"), [(TEXT, []), (SEG, []), (SEG, ["--attack", "gram"])])
def test_the_audit_command_refuses_a_task_its_attacks_do_not_fit_in_one_line(tmp_path, raw, options):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(build_config(raw)))
    res = CliRunner().invoke(app, ["audit", "privacy", str(run), *options])
    not_a_run = CliRunner().invoke(app, ["audit", "privacy", str(tmp_path)])  # another user error: no config.yaml
    assert res.exit_code == not_a_run.exit_code == 2
    assert res.output.startswith(f"error: {MISFIT}") and res.output.count("\n") == 1
    assert not (run / "audit").exists() and not (run / "audit.partial").exists()


# --- bug 4: the audit's count of FedFA's and FPL's releases ------------------------------------------------------

FEDFA = ("method.name=fedfa", "method.params.stages=[conv, bn]")  # ToyNet has no conv-stage map
STATIONS = "hierarchy={stations: 2, station_rounds: 2, merge: avg}"


@pytest.mark.parametrize(("attack", "over", "releases"), [
    ("fedfa-moments", FEDFA, 6),  # lambda_h 0.1 (default): stat/ and hist/ in each of 3 rounds
    ("fedfa-moments", (*FEDFA, "method.params.lambda_h=0"), 3),  # FedFA^l: stat/ only
    ("fedfa-moments", (*FEDFA, STATIONS), 12),  # 3 server rounds x 2 station rounds x 2 groups
    ("fpl-prototypes", ("method.name=fpl", STATIONS), 6),
    ("fedfa-moments", (STATIONS,), 12),  # a FedAvg run: FedFA's statistics as FedFA (defaults) would release them
])
def test_the_audits_count_of_releases_is_the_methods_own(tmp_path, attack, over, releases):
    fed = toy_federation(*over)
    audited = _releases(SimpleNamespace(cfg=fed.cfg, fed=fed), attack)
    as_method = FEDFA if attack == "fedfa-moments" and "method.name=fedfa" not in over else ()
    # the same run as the method's, under its own dp: (results.json's privacy counts the releases)
    server = Server(toy_federation(*over, *as_method, "method.params.dp.noise_multiplier=1.0"), tmp_path)
    server.round = server.rounds
    assert audited == server.write_results()["privacy"]["releases"] == releases
