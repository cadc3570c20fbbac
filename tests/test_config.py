import warnings
from pathlib import Path

import pytest

from feddg.config import ConfigError, build_config, config_tree, dump_config, load_config
from feddg.sweep import load_sweep


def test_defaults_and_overrides_are_typed():
    cfg = build_config({}, ["federation.rounds=3", "method.name=fedprox", "method.params.mu=0.5", "split.target=uci"])
    assert cfg.federation.rounds == 3 and cfg.method.params == {"mu": 0.5} and cfg.split.target == "uci"


@pytest.mark.parametrize(
    "raw, overrides, key",
    [
        ({"federaton": {}}, [], "federaton: unknown key"),
        ({}, ["federation.rounds=many"], "federation.rounds"),
        ({}, ["optim.schedule=warmup"], "optim.schedule"),
        ({}, ["method.name=fedprox", "method.params.nu=1"], "method.params.nu: unknown key"),
        ({}, ["method.name=fedprox", "method.params.mu=-1"], "method.params.mu"),
        ({}, ["method.name=nope"], "unknown method 'nope'"),
    ],
)
def test_errors_name_the_key(raw, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build_config(raw, overrides)


@pytest.mark.parametrize("overrides, message", [
    (["model.name=unet"], r"^model\.name: model unet \(images → dense_masks\) does not fit the classification task "
                          r"of digits-dg \(images → class_labels\); models that do: alexnet, cnn, .*vgg11_bn$"),
    (["data.dataset=synthetic-mri", "model.name=cnn"], r"^model\.name: model cnn \(images → class_labels\) does not "
                                                       r"fit the segmentation task .*; models that do: unet$"),
    (["data.dataset=synthetic-sentiment", "model.name=mlp"], r"\(features → class_labels\) does not fit .*"
                                                             r"\(tokens → class_labels\); .*tiny-roberta, transformer$"),
    (["model.name=tiny-roberta"], r"^model\.name: model tiny-roberta \(tokens → class_labels\) does not fit"),
    (["model.params.widht=8"], r"^model\.params\.widht: model cnn has no such option; it takes block_widths$"),
    (["model.name=resnet18", "model.params.width=8"], r"^model\.params\.width: .*takes normalization, small_input$"),
    (["model.params.image_size=32"], r"^model\.params\.image_size: given by the data or the run"),
    (["data.dataset=synthetic-sentiment", "model.name=tiny-roberta", "model.params.hiden_size=8"],
     r"^model\.params\.hiden_size: model tiny-roberta has no such option; it takes RobertaConfig's fields$"),
])
def test_a_model_that_does_not_fit_the_data_or_an_unknown_option_is_refused_before_any_data_loads(overrides, message):
    """Model and task are checked at config time (a sweep refuses before its first run), in one line naming the key;
    the model options' keys too (a typo was a TypeError, or silently ignored by a Hugging Face config)."""
    with pytest.raises(ConfigError, match=message) as err:
        build_config({}, overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("raw, overrides, message", [
    ({}, ["engine=flower"], "engine: unknown key; did you mean federation.engine?"),
    ({}, ["federation.roundz=2"], "federation.roundz: unknown key; did you mean federation.rounds?"),
    ({}, ["secaggplus.num_shares=3"], "secaggplus: unknown key; did you mean flower.secaggplus?"),
    ({}, ["method.name=fedprox", "method.params.mux=1"], "method.params.mux: unknown key; did you mean method.params.mu?"),
    ({"hierarchy": {"params": {"alpah": 1}}}, [], "hierarchy.params.alpah: unknown key; did you mean "
                                                 "hierarchy.params.alpha?"),
    ({}, ["method.name=fedprox", "method.params.nu=1"], "method.params.nu: unknown key"),  # nothing close: no guess
    ({}, ["name2=x"], "name2: unknown key; did you mean name?"),
    ({}, ["federation.seed=3"], "federation.seed: unknown key; did you mean seed or data.seed or audit.seed?"),
    ({}, ["data.sed=3"], "data.sed: unknown key; did you mean data.seed?"),
    ({}, ["eval.extra=[{name: x, dataset: digits-dg, seed: 1}]"], "eval.extra.0.seed: unknown key"),  # a list item
])
def test_an_unknown_key_names_the_key_it_may_have_meant(raw, overrides, message):
    with pytest.raises(ConfigError) as err:
        build_config(raw, overrides)
    assert str(err.value) == message


def test_a_sweep_key_names_the_key_it_may_have_meant(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text("sweep: {targts: all}\n")
    with pytest.raises(ConfigError, match=r"^sweep\.targts: unknown key; did you mean sweep\.targets\?$"):
        load_sweep(path)


def test_model_options_that_fit_pass():
    cfg = build_config({}, ["data.dataset=synthetic-sentiment", "model.name=tiny-roberta", "model.params.hidden_size=32"])
    assert cfg.model.params == {"hidden_size": 32}
    assert build_config({}, ["data.dataset=synthetic-mri", "model.name=unet", "model.params.width=8"]).model.name == "unet"


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key.sub=value"):
        build_config({}, ["rounds"])


def test_yaml_round_trip(tmp_path):
    cfg = build_config({"name": "x"}, ["partition.num_clients=6"])
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).parent.parent / "configs").glob("**/*.yaml")), ids=lambda p: str(p.parent.name + "/" + p.name)
)
def test_every_shipped_config_and_sweep_variant_validates(path):
    """A typo in a shipped config fails here, not an hour into a sweep."""
    from feddg.sweep import _cells, _override, load_sweep

    spec, raw = load_sweep(path)
    base = build_config(raw)
    # Digits-DG: every cell's split; another dataset's cells need the user's data root: each variant on the base's split
    splits = [split for _, split in _cells(spec, base)] if base.data.dataset == "digits-dg" else [[]]
    for extra in spec.variants.values():
        for split in splits:
            build_config(raw, [_override(k, v) for k, v in extra.items()] + split)


def test_yaml_syntax_errors_are_one_line_with_file_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("federation:\n  rounds: 3\n  batch_size: [1,\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}:4:1: ") and "\n" not in str(err.value)
    path.write_text("federation:\n  rounds: 3\nfederation:\n  batch_size: 8\n")  # last-one-wins would drop rounds
    with pytest.raises(ConfigError, match=r":3:1: duplicate key 'federation'"):
        load_config(path)
    path.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)


def test_a_folder_given_as_the_config_is_named_a_folder_and_a_run_directory_gets_the_resume_command(tmp_path):
    with pytest.raises(ConfigError, match=rf"^{tmp_path} is a folder, not a config file$"):
        load_config(tmp_path)  # it said "config file not found" of a folder that is there
    (tmp_path / "config.yaml").write_text("name: r\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert str(err.value) == f"{tmp_path} is a folder, not a config file (a run directory: feddg run --resume {tmp_path})"


def test_bad_override_values_and_keys_are_one_line():
    with pytest.raises(ConfigError, match=r"override 'federation.rounds=\[1,': invalid YAML value"):
        build_config({}, ["federation.rounds=[1,"])
    with pytest.raises(ConfigError, match="empty part"):
        build_config({}, ["federation..rounds=1"])
    with pytest.raises(ConfigError, match=r"^override key federation\. has an empty part$"):
        build_config({}, ["federation.=1"])
    with pytest.raises(ConfigError, match=r"^name\.first: 'name' is not a section$"):
        build_config({"name": "x"}, ["name.first=1"])


def test_device_is_checked_at_load(monkeypatch):
    import torch

    assert build_config({}).device == "auto" and build_config({}, ["device=cpu"]).device == "cpu"
    with pytest.raises(ConfigError, match="device: 'gpu' is not a device; use auto, cpu, cuda or cuda:k"):
        build_config({}, ["device=gpu"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="device: cuda requested but torch has no CUDA"):
        build_config({}, ["device=cuda"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert build_config({}, ["device=cuda:0"]).device == "cuda:0"
    with pytest.raises(ConfigError, match="cuda:1 requested but torch sees 1 CUDA device"):
        build_config({}, ["device=cuda:1"])


def test_a_domain_named_by_a_whole_number_is_taken_by_its_name(tmp_path):
    # rotated-mnist's domains are "0", "15", ...: YAML reads `-o split.target=15` as the integer 15
    cfg = build_config({}, ["data.dataset=rotated-mnist", "split.target=15", "data.domains=[0, 15, 30]",
                            "eval.extra=[{name: r, dataset: rotated-mnist, domains: [45]}]"])
    assert (cfg.split.target, cfg.data.domains, cfg.eval.extra[0].domains) == ("15", ["0", "15", "30"], ["45"])
    assert build_config({}, ["split.protocol=ltdo", "split.target=[15, 30]", "split.val_domain=0",
                             "data.dataset=rotated-mnist"]).split.val_domain == "0"
    with pytest.raises(ConfigError, match=r"^split.target: expected a domain name or a list of names, got True$"):
        build_config({}, ["split.target=yes"])  # a boolean is not a name
    path = tmp_path / "s.yaml"
    path.write_text("data: {dataset: rotated-mnist}\nsweep:\n  targets: [15, 30]\n  pairs: [[0, 15]]\n")
    spec, _ = load_sweep(path)
    assert spec.targets == ["15", "30"] and spec.pairs == [("0", "15")]


@pytest.mark.parametrize(("over", "why"), [
    ("partition.kind=nosuch", "partition: unknown partition kind 'nosuch'"),
    ("partition.params.lam=0.5", "partition: partition 'by_domain' takes no parameter 'lam'"),
    ("federation.workers=0", "federation.workers: expected a whole number >= 1 or auto, got 0"),
    ("federation.workers=-2", "federation.workers: expected a whole number >= 1 or auto, got -2"),
    # a union's refusal is one phrase, not pydantic's error for each of its branches
    ("federation.workers=many", "federation.workers: expected a whole number >= 1 or auto, got 'many'"),
    ("split.target={a: 1}", "split.target: expected a domain name or a list of names, got {'a': 1}"),
])
def test_partitions_and_worker_counts_are_checked_when_the_config_loads(over, why):
    # before: an unknown kind loaded and failed when the data did (a sweep's later cell after the earlier ones ran);
    # workers 0 or -2 ran sequentially as 1
    with pytest.raises(ConfigError) as err:
        build_config({}, [over])
    assert str(err.value).startswith(why)


def test_a_hierarchy_takes_a_natural_partition_and_refuses_a_method_that_averages_no_weights():
    # a natural partition's clients are its groups (num_clients left unset, the default 4 < 10 stations was refused)
    cfg = build_config({"data": {"dataset": "writers"}, "split": {"target_fraction": 0.1},
                        "partition": {"kind": "natural"}, "hierarchy": {"stations": 10}})
    assert cfg.hierarchy is not None and cfg.hierarchy.stations == 10
    with pytest.raises(ConfigError, match="^hierarchy: pfedhn does not average weights, so its stations have no model"):
        build_config({"method": {"name": "pfedhn"}, "hierarchy": {"stations": 2}})  # it failed after a server round


def test_an_override_splits_at_its_first_equals_sign() -> None:
    # the value keeps every later '=' (a name, a path)
    assert build_config({}, ["name=lr=0.1"]).name == "lr=0.1"


def test_a_mapping_override_merges_into_its_section_and_an_empty_one_empties_it() -> None:
    raw = {"federation": {"rounds": 3, "batch_size": 8}}
    cfg = build_config(raw, ["federation={local_epochs: 2, batch_size: 16}"])
    assert (cfg.federation.rounds, cfg.federation.local_epochs, cfg.federation.batch_size) == (3, 2, 16)
    assert build_config(raw, ["federation={}"]).federation.rounds == 10  # the default
    assert raw == {"federation": {"rounds": 3, "batch_size": 8}}  # the overrides did not leak into raw


def test_a_key_overridden_twice_warns_and_the_last_value_wins() -> None:
    with pytest.warns(UserWarning, match=r"^federation\.rounds is overridden twice: the last value wins \(3 is replaced\)$"):
        cfg = build_config({}, ["federation.rounds=3", "federation.rounds=5"])
    assert cfg.federation.rounds == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_config({}, ["federation.rounds=3", "federation.batch_size=5"])  # distinct keys: no warning


def test_replacing_a_components_params_warns_of_the_dropped_keys_unless_it_is_renamed() -> None:
    raw = {"method": {"name": "fedprox", "params": {"mu": 0.5}}}
    with pytest.warns(UserWarning, match=r"^method\.params is replaced whole: mu go back to their defaults"):
        assert build_config(raw, ["method.params={}"]).method.params == {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build_config(raw, ["method.name=fedavg", "method.params={}"]).method.name == "fedavg"
        two_level = {"hierarchy": {"stations": 2},
                     "partition": {"kind": "two_level_dirichlet", "num_clients": 4, "params": {"groups": 2}}}
        cfg = build_config(two_level, ["partition.kind=iid", "partition.params={}", "hierarchy=null"])
        assert cfg.partition.kind == "iid"  # a partition is switched by its kind


@pytest.mark.parametrize(("overrides", "why"), [
    (["federation.client_timeout_s=5", "federation.workers=1"], "federation: client_timeout_s needs workers >= 2"),
    (["federation.client_timeout_s=5", "federation.engine=flower"], "federation: client_timeout_s is for the in-process"),
    (["hierarchy.stations=5"], "hierarchy.stations: 5 stations need partition.num_clients >= 5"),
    (["dp_weights={noise_multiplier: 1, clip: 1, accountant: pld}", "federation.client_fraction=0.5"],
     "dp_weights.accountant: pld cannot compose client sampling"),
    (["federation.rollback_loss_factor=2", "partition.holdout=0"], "federation.rollback_loss_factor needs the clients' holdouts"),
    (["federation.trim_fraction=0.5"], "federation.trim_fraction: Input should be less than 0.5"),
    (["split.target_fraction=1"], "split.target_fraction: Input should be less than 1"),
])
def test_cross_field_checks_refuse_just_past_their_bound(overrides: list[str], why: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config({}, overrides)
    assert str(err.value).startswith(why)


@pytest.mark.parametrize("overrides", [
    ["federation.client_timeout_s=5", "federation.workers=2"],
    ["hierarchy.stations=4"],  # == partition.num_clients (4, the default)
    ["dp_weights={noise_multiplier: 1, clip: 1, accountant: pld}"],  # every client every round
    ["federation.rollback_loss_factor=2", "partition.holdout=0.1"],
])
def test_cross_field_checks_accept_their_bound(overrides: list[str]) -> None:
    build_config({}, overrides)


def test_defaults_are_the_documented_ones() -> None:
    # docs/architecture.md (10 % holdout, client_state_budget_mb 1024), docs/reliability.md (update_norm_factor 10,
    # num_clients 4)
    cfg = build_config({})
    assert (cfg.partition.holdout, cfg.federation.client_state_budget_mb, cfg.federation.update_norm_factor,
            cfg.partition.num_clients) == (0.1, 1024.0, 10.0, 4)
    assert (cfg.split.protocol, cfg.method.name, cfg.federation.aggregation, cfg.federation.client_fraction) == (
        "lodo", "fedavg", "mean", 1.0)


def test_an_override_key_is_read_without_surrounding_spaces() -> None:
    assert build_config({}, [" federation.rounds =3"]).federation.rounds == 3


def test_a_natural_partition_left_to_the_data_dumps_no_client_count() -> None:
    natural = {"data": {"dataset": "writers"}, "split": {"target_fraction": 0.1}, "partition": {"kind": "natural"}}
    assert "num_clients" not in config_tree(build_config(natural))["partition"]
    assert config_tree(build_config(natural, ["partition.num_clients=7"]))["partition"]["num_clients"] == 7
    assert config_tree(build_config({}))["partition"]["num_clients"] == 4  # by_domain: always written


def test_a_two_level_dirichlet_partition_needs_one_group_per_station() -> None:
    raw = {"partition": {"kind": "two_level_dirichlet", "num_clients": 4, "params": {"groups": 2}},
           "hierarchy": {"stations": 2}}
    assert build_config(raw).partition.params == {"groups": 2}
    with pytest.raises(ConfigError, match=r"^partition.kind=two_level_dirichlet: partition.params.groups \(2\) must "
                                          r"equal hierarchy.stations \(4\)$"):
        build_config(raw, ["hierarchy.stations=4"])
