"""The experiment config's defaults, bounds and cross-field refusals that no other test pinned (found by mutation
testing src/feddg/config.py): each default as the docs or the field's own description state it, each bound
accepted at its edge and refused just past it with its one-line message, and the audit, hierarchy, evaluation and
override checks that had no refusal tested."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import yaml

from feddg.config import ConfigError, audit_attacks, build_config, dump_config, load_config, one_line


def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


# --- defaults ---------------------------------------------------------------------------------------------------
# the values of docs/flower.md's settings table, docs/privacy.md's audit: and dp_weights: examples, and the fields'
# descriptions; a changed default silently changes every run that leaves the key out (and its config hash)
DEFAULTS = {
    "name": "experiment", "seed": 0, "device": "auto", "dp_noise": "secret", "reproducibility": "native",
    "output_dir": "runs",
    "data.dataset": "digits-dg", "data.max_length": 128, "data.vocab_size": 4000, "data.loader_workers": 0,
    "data.writers": None, "data.max_per_domain": None,
    "split.protocol": "lodo", "split.target": None, "split.few_shot_k": 0,
    "partition.kind": "by_domain", "partition.train_fraction": 1.0, "partition.train_min": 0,
    "model.name": "cnn", "model.channels_last": False,
    "optim.name": "sgd", "optim.lr": 0.01, "optim.momentum": 0.9, "optim.weight_decay": 5e-4,
    "optim.schedule": "constant", "optim.loss": "task", "optim.warmup_rounds": 0, "optim.grad_clip": None,
    "optim.step_size": 10, "optim.gamma": 0.1, "optim.amp": "off", "optim.augment": [],
    "federation.engine": "inprocess", "federation.rounds": 10, "federation.client_fraction": 1.0,
    "federation.local_epochs": 1, "federation.batch_size": 32, "federation.workers": "auto",
    "federation.threads": "auto", "federation.checkpoint_every": 1, "federation.min_clients": 1,
    "federation.client_timeout_s": None, "federation.reject_outliers": None, "federation.rollback_loss_factor": None,
    "federation.max_reply_mb": None, "federation.trim_fraction": 0.2, "federation.krum_malicious": 1,
    "federation.krum_keep": 0,
    "hierarchy": None, "dp_weights": None, "audit": None,
    "eval.every": 1, "eval.batch_size": 256, "eval.per_domain": True, "eval.metrics": [], "eval.extra": [],
    "flower.client_num_cpus": 1.0, "flower.client_num_gpus": 0.0, "flower.ray_num_cpus": None,
    "flower.round_timeout_s": 3600.0, "flower.node_wait_s": 120.0, "flower.roster": None,
    "flower.secure_aggregation": "none", "flower.secaggplus.num_shares": 1.0,
    "flower.secaggplus.reconstruction_threshold": 0.7, "flower.secaggplus.clipping_range": 8.0,
    "flower.secaggplus.quantization_range": 2**22, "flower.secaggplus.modulus_range": 2**32,
    "flower.secaggplus.max_weight": None,
    "logging.tensorboard": False, "logging.mlflow": None,
}


def test_every_default_is_the_documented_one():
    cfg = build_config({})
    assert {key: _get(cfg, key) for key in DEFAULTS} == DEFAULTS


def test_an_empty_hierarchy_section_takes_the_documented_defaults():
    h = build_config({}, ["hierarchy={}"]).hierarchy
    assert (h.stations, h.station_rounds, h.merge, h.assignment, h.station_fraction, h.params) == (
        2, 1, "avg", "contiguous", 1.0, {})


def test_an_audit_section_takes_the_defaults_of_docs_privacy_md():
    a = build_config({}, ["audit={}"]).audit
    assert (a.attacks, a.per_client, a.attacker_size, a.noise_multipliers, a.delta, a.generator_steps,
            a.dlg_victims, a.dlg_iterations, a.fid, a.seed, a.style_path) == (
        None, 32, 256, [0.0, 0.01, 0.1, 1.0], 1e-5, 300, 4, 20, True, None, None)


def test_dp_weights_adaptive_clipping_takes_the_defaults_of_docs_privacy_md():
    dp = build_config({}, ["dp_weights={noise_multiplier: 1, clip: 1, adaptive: {}}"]).dp_weights
    assert (dp.delta, dp.accountant) == (1e-5, "rdp")
    assert (dp.adaptive.target_quantile, dp.adaptive.clip_lr, dp.adaptive.count_std) == (0.5, 0.2, None)


def test_an_augmentation_is_stored_with_its_defaults_filled_in():
    # Mixup's alpha defaults to 0.2 (augment.py); the stored list is the validated specs, not the raw mappings
    assert build_config({}, ["optim.augment=[{name: mixup}]"]).optim.augment == [{"name": "mixup", "alpha": 0.2}]


# --- bounds: each accepted at its edge, refused just past it ---------------------------------------------------
@pytest.mark.parametrize("override", [
    "data.max_per_domain=1", "data.max_length=8", "data.vocab_size=261", "data.writers=1", "data.loader_workers=0",
    "split.target_fraction=0.001", "partition.train_fraction=1", "partition.train_fraction=0.001",
    "optim.lr=1e-12", "optim.momentum=0", "federation.client_fraction=1", "federation.client_fraction=0.001",
    "federation.threads=1", "federation.checkpoint_every=1", "federation.reject_outliers=1.001",
    "federation.update_norm_factor=1.001", "federation.rollback_loss_factor=1.001", "federation.max_reply_mb=1e-6",
    "federation.client_state_budget_mb=0", "federation.trim_fraction=0",
    "dp_weights={noise_multiplier: 0, clip: 1, adaptive: {target_quantile: 1}}",
    "dp_weights={noise_multiplier: 0, clip: 1, adaptive: {target_quantile: 0}}",
    "audit.noise_multipliers=[0]", "hierarchy.station_fraction=0.001",
])
def test_a_value_at_its_bound_is_accepted(override):
    build_config({}, [override])


@pytest.mark.parametrize(("override", "message"), [
    ("data.max_per_domain=0", "data.max_per_domain: Input should be greater than or equal to 1"),
    ("data.max_length=7", "data.max_length: Input should be greater than or equal to 8"),
    ("data.vocab_size=260", "data.vocab_size: Input should be greater than or equal to 261"),
    ("data.writers=0", "data.writers: Input should be greater than or equal to 1"),
    ("data.loader_workers=-1", "data.loader_workers: Input should be greater than or equal to 0"),
    ("split.target_fraction=0", "split.target_fraction: Input should be greater than 0"),
    ("partition.train_fraction=0", "partition.train_fraction: Input should be greater than 0"),
    ("partition.train_fraction=1.001", "partition.train_fraction: Input should be less than or equal to 1"),
    ("partition.holdout=1", "partition.holdout: Input should be less than 1"),
    ("optim.lr=0", "optim.lr: Input should be greater than 0"),
    ("optim.momentum=1", "optim.momentum: Input should be less than 1"),
    ("federation.client_fraction=0", "federation.client_fraction: Input should be greater than 0"),
    ("federation.threads=0", "federation.threads: expected a whole number >= 1 or auto, got 0"),
    ("federation.checkpoint_every=0", "federation.checkpoint_every: Input should be greater than or equal to 1"),
    ("federation.reject_outliers=1", "federation.reject_outliers: Input should be greater than 1"),
    ("federation.update_norm_factor=1", "federation.update_norm_factor: Input should be greater than 1"),
    ("federation.rollback_loss_factor=1", "federation.rollback_loss_factor: Input should be greater than 1"),
    ("federation.max_reply_mb=0", "federation.max_reply_mb: Input should be greater than 0"),
    ("federation.client_state_budget_mb=-1",
     "federation.client_state_budget_mb: Input should be greater than or equal to 0"),
    ("dp_weights={noise_multiplier: 0, clip: 1, adaptive: {target_quantile: 1.001}}",
     "dp_weights.adaptive.target_quantile: Input should be less than or equal to 1"),
    ("audit.noise_multipliers=[]", "audit.noise_multipliers: List should have at least 1 item after validation"),
    ("hierarchy.station_fraction=0", "hierarchy.station_fraction: Input should be greater than 0"),
])
def test_a_value_just_past_its_bound_is_refused_at_its_key(override, message):
    with pytest.raises(ConfigError) as err:
        build_config({}, [override])
    assert str(err.value).startswith(message), str(err.value)


# --- the audit: section ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "attacks"), [
    ([], ("update-dlg",)),
    (["method.name=pardon"], ("client-style", "update-dlg")),
    (["method.name=fedfa"], ("fedfa-moments", "update-dlg")),
    (["method.name=fpl"], ("fpl-prototypes", "update-dlg")),
    (["hierarchy={}"], ("gram", "update-dlg")),  # the stations' Grams leave the clients
    (["hierarchy={}", "method.name=fedfa"], ("fedfa-moments", "gram", "update-dlg")),
])
def test_the_default_audit_attacks_what_the_method_and_topology_share(overrides, attacks):
    assert audit_attacks(build_config({}, overrides)) == attacks


SEGMENTATION = {"data": {"dataset": "synthetic-mri"}, "model": {"name": "unet"}}
AUDIT_MISFIT = ("audit: the privacy audit is for image classification: the segmentation task of synthetic-mri "
                "provides dense_masks, images; {attack} needs class_labels (attacks that fit: sample-style, "
                "client-style, fedfa-moments)")


@pytest.mark.parametrize(("override", "attack"), [
    ("audit={}", "update-dlg"),  # the default attacks: DLG inverts a classifier's cross-entropy
    ("audit.attacks=[gram]", "gram"),  # a classifier's [N, d] inputs
    ("audit.attacks=[sample-style, fpl-prototypes]", "fpl-prototypes"),
])
def test_an_audit_attack_that_needs_class_labels_is_refused_on_a_segmentation_task(override, attack):
    with pytest.raises(ConfigError) as err:
        build_config(SEGMENTATION, [override])
    assert str(err.value) == AUDIT_MISFIT.format(attack=attack)


def test_an_audit_of_image_attacks_only_is_accepted_on_a_segmentation_task():
    # the listed attacks replace the defaults (update-dlg among them, which the task could not take)
    cfg = build_config(SEGMENTATION, ["audit.attacks=[sample-style, client-style, fedfa-moments]"])
    assert cfg.audit.attacks == ["sample-style", "client-style", "fedfa-moments"]


def test_an_audit_of_a_text_task_fits_no_attack():
    with pytest.raises(ConfigError, match=r"^audit: .* the classification task of synthetic-sentiment provides "
                                          r"class_labels, tokens; update-dlg needs images \(attacks that fit: none\)$"):
        build_config({"data": {"dataset": "synthetic-sentiment"}, "model": {"name": "transformer"}}, ["audit={}"])


# --- hierarchy and evaluation sections -------------------------------------------------------------------------
def test_an_unknown_station_merge_is_refused_with_the_registered_ones():
    with pytest.raises(ConfigError) as err:
        build_config({}, ["hierarchy.merge=nosuch"])
    assert str(err.value) == ("hierarchy.merge: unknown station merge 'nosuch'; available: avg, hfedatm, "
                              "hfedatm-no-fot, hfedatm-no-regmean")


def test_extra_evaluation_targets_need_distinct_names_made_of_safe_characters():
    two = "eval.extra=[{name: r, dataset: digits-dg}, {name: r, dataset: digits-dg}]"
    with pytest.raises(ConfigError) as err:
        build_config({}, [two])
    assert str(err.value) == "eval.extra: every extra target needs its own name; got ['r', 'r']"
    # the name becomes a metric key extra/<name>_acc/<domain>: a '/' would split it
    with pytest.raises(ConfigError, match=r"^eval\.extra\.0\.name: String should match pattern"):
        build_config({}, ["eval.extra=[{name: a/b, dataset: digits-dg}]"])
    cfg = build_config({}, ["eval.extra=[{name: A.b-c_1, dataset: digits-dg}, {name: r, dataset: digits-dg}]"])
    assert [e.name for e in cfg.eval.extra] == ["A.b-c_1", "r"]


# --- cross-field refusals ----------------------------------------------------------------------------------------
def test_dp_weights_refuses_a_method_that_sums_weights_without_dividing_by_the_examples():
    # FedDG-GA with gap_at: received folds plain sums (a WeightedSum with no expected total): not DP-FedAvg's mean
    with pytest.raises(ConfigError) as err:
        build_config({}, ["method.name=feddg_ga", "method.params.gap_at=received",
                          "dp_weights={noise_multiplier: 1, clip: 1}"])
    assert str(err.value) == ("dp_weights: DP-FedAvg is for flat federations whose method averages the weights by "
                              "num_examples (federation.aggregation=mean), not feddg_ga does not average weights by "
                              "num_examples")


# --- error messages ------------------------------------------------------------------------------------------------
def test_a_model_level_error_of_a_parameter_set_is_named_by_the_section_alone():
    # HFedATMParams' own cross-field check has no field location: the key is the section, not "hierarchy.params."
    with pytest.raises(ConfigError) as err:
        build_config({}, ["hierarchy.params={dp_epsilon: 5}"])
    assert str(err.value).startswith("hierarchy.params: dp_epsilon needs gram_pass: after ")


def test_several_errors_are_joined_by_semicolons_on_one_line():
    with pytest.raises(ConfigError) as err:
        build_config({"federation": {"rounds": 0, "batch_size": 0}})
    assert str(err.value) == ("federation.rounds: Input should be greater than or equal to 1; "
                              "federation.batch_size: Input should be greater than or equal to 1")


def test_an_unknown_key_with_a_line_break_is_shown_as_its_repr():
    with pytest.raises(ConfigError) as err:
        build_config({"feder\nation": {}})
    assert str(err.value) == "'feder\\nation': unknown key; did you mean federation?"


def test_one_line_folds_every_run_of_white_space():
    assert one_line(" a\n  b\tc\r\nd  ") == "a b c d"


# --- overrides ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("item", ["=3", " =3"])
def test_an_override_without_a_key_is_refused_as_malformed(item):
    with pytest.raises(ConfigError) as err:
        build_config({}, [item])
    assert str(err.value) == f"override {item!r} is not of the form key.sub=value"


def test_a_components_params_given_twice_warn_as_one_key():
    # params are replaced whole, so the repeated key is method.params itself, with its earlier mapping
    with pytest.warns(UserWarning) as record:
        cfg = build_config({}, ["method.name=fedfa", "method.params={p: 0.5}", "method.params={p: 0.4}"])
    assert [str(w.message) for w in record] == [
        "method.params is overridden twice: the last value wins ({'p': 0.5} is replaced)"]
    assert cfg.method.params == {"p": 0.4}


def test_a_key_set_by_a_section_mapping_then_again_warns_with_its_own_earlier_value():
    with pytest.warns(UserWarning) as record:
        build_config({}, ["federation={rounds: 3}", "federation.rounds=5"])
    assert [str(w.message) for w in record] == [
        "federation.rounds is overridden twice: the last value wins (3 is replaced)"]


def test_the_params_replaced_whole_warning_lists_the_dropped_keys_in_sorted_order():
    raw = {"method": {"name": "fedfa", "params": {"variant": "fedfa", "random_std": 1.0, "p": 0.5, "momentum": 0.9,
                                                  "lambda_h": 0.1}}}
    with pytest.warns(UserWarning) as record:
        build_config(raw, ["method.params={}"])
    assert [str(w.message) for w in record] == [
        "method.params is replaced whole: lambda_h, momentum, p, random_std, variant go back to their defaults "
        "(set method.params.<name>=... to change one)"]


# --- YAML files ----------------------------------------------------------------------------------------------------
def test_yaml_merge_keys_load_and_a_key_beside_one_is_not_a_duplicate(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("eval: &shared {batch_size: 64}\nfederation:\n  <<: *shared\n  rounds: 3\n")
    cfg = load_config(path)
    assert (cfg.federation.batch_size, cfg.federation.rounds, cfg.eval.batch_size) == (64, 3, 64)
    path.write_text("eval: &shared {batch_size: 64}\nfederation:\n  <<: *shared\n  batch_size: 16\n")
    assert load_config(path).federation.batch_size == 16  # the mapping's own key wins over the merged one


def test_a_yaml_error_with_a_context_names_both_places(tmp_path):
    path = tmp_path / "bad.yaml"
    text = "federation: {rounds: 3\nseed: 1\n"
    path.write_text(text)
    with pytest.raises(yaml.MarkedYAMLError) as ref:  # PyYAML's own reading of the same text
        yaml.safe_load(text)
    e = ref.value
    assert e.problem and e.context
    expected = (f"{path}:{e.problem_mark.line + 1}:{e.problem_mark.column + 1}: {e.problem} "
                f"({e.context} at {e.context_mark.line + 1}:{e.context_mark.column + 1})")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == one_line(expected)
    assert f"({e.context} at 1:13)" in str(err.value)  # the flow mapping opens at line 1, column 13


def test_an_empty_file_with_overrides_is_a_config(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path, ["federation.rounds=2"]).federation.rounds == 2
    with pytest.raises(ConfigError, match=r"empty\.yaml is empty: an experiment config names at least"):
        load_config(path)


def test_an_unreadable_file_is_refused_with_the_reason(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text("name: x\n")

    def refuse(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", refuse)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: cannot be read (Permission denied)"


def test_a_dumped_config_keeps_the_schemas_order():
    top = [line.split(":")[0] for line in dump_config(build_config({})).splitlines() if not line.startswith(" ")]
    assert top == ["name", "seed", "device", "dp_noise", "reproducibility", "output_dir", "data", "split",
                   "partition", "model", "method", "optim", "federation", "hierarchy", "dp_weights", "audit", "eval",
                   "flower", "logging"]


@pytest.mark.parametrize(("override", "why"), [
    ("hierarchy={}", "a station topology (hierarchy)"),
    ("federation.aggregation=median", "federation.aggregation=median"),
    ("federation.reject_outliers=2", "federation.reject_outliers"),
    ("dp_weights={noise_multiplier: 1, clip: 1}", "dp_weights (it clips each reply)"),
])
def test_secure_aggregation_refuses_what_needs_a_single_reply(override, why):
    # SecAgg+ hands the server only the weighted sum: nothing of the round may need one reply
    with pytest.raises(ConfigError) as err:
        build_config({}, ["flower.secure_aggregation=secaggplus", override])
    assert str(err.value) == ("flower.secure_aggregation: secaggplus is for Flower runs of methods whose replies are "
                              f"weights + num_examples, averaged by the mean, not {why}")
    build_config({}, ["flower.secure_aggregation=secaggplus"])  # plain FedAvg's mean: accepted


def test_an_unknown_transforms_preset_is_refused_when_the_config_loads():
    # only the segmentation slices' augment names (hflip, rot90_flip) are left to the loader
    with pytest.raises(ConfigError) as err:
        build_config({}, ["data.transforms=bogus"])
    assert str(err.value) == ("data: transforms: unknown transforms preset 'bogus'; expected one of none, digits, "
                              "domainbed")
    assert build_config({}, ["data.transforms=digits"]).data.transforms == "digits"
