import pytest

from feddg.config import ConfigError, build_config, dump_config, load_config


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
