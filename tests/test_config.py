from pathlib import Path

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


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).parent.parent / "configs").glob("**/*.yaml")), ids=lambda p: str(p.parent.name + "/" + p.name)
)
def test_every_shipped_config_and_sweep_variant_validates(path):
    """A typo in a shipped config fails here, not an hour into a sweep."""
    from feddg.sweep import _cells, _override, load_sweep

    spec, raw = load_sweep(path)
    base = build_config(raw)
    if base.data.dataset != "digits-dg":  # folder datasets: the cells need the user's data root
        return
    for extra in spec.variants.values():
        for _, split in _cells(spec, base):
            build_config(raw, [_override(k, v) for k, v in extra.items()] + split)
