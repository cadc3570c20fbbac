"""Settings models never read a boolean as a number (YAML's yes/on/true), nor take an infinite or NaN float (YAML's
.inf/.nan), wherever they sit in a config."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field

import feddg
from feddg.config import ConfigError, build_config
from feddg.settings import Settings, booleans_for_numbers
from feddg.sweep import load_sweep


@pytest.mark.parametrize(("annotation", "value", "found"), [
    (int, True, [((), True)]),
    (float, False, [((), False)]),
    (int | None, True, [((), True)]),
    (int | Literal["auto"], True, [((), True)]),
    (Annotated[int, Field(ge=0)], True, [((), True)]),
    (list[int], [0, True, 2, False], [((1,), True), ((3,), False)]),
    (list[Annotated[int, Field(ge=0)]] | None, [True], [((0,), True)]),
    (bool, True, []),
    (int | bool, True, []),
    (Any, True, []),
    (float | Any, True, []),  # a union with Any takes a boolean as it is
    (list[int | Any], [True], []),
    (Literal[True, "x"], True, []),
    (str, True, []),  # pydantic refuses it itself
    (list[str], [True], []),
    (int, 1, []),
    (float, 0.5, []),
])
def test_booleans_for_numbers_finds_exactly_the_booleans_a_number_field_would_coerce(annotation, value, found):
    assert booleans_for_numbers(annotation, value) == found


@pytest.mark.parametrize(("override", "where"), [
    ("federation.rounds=yes", "federation.rounds"),
    ("federation.rounds=true", "federation.rounds"),
    ("optim.lr=on", "optim.lr"),
    ("data.max_per_domain=true", "data.max_per_domain"),
    ("federation.workers=true", "federation.workers"),  # int | "auto"
    ("hierarchy.params.lambda_ot=true", "hierarchy.params.lambda_ot"),  # a merge's parameters
    ("optim.augment=[{name: mixup, alpha: true}]", "optim.augment.0.mixup.alpha"),  # a discriminated union's member
])
def test_a_boolean_for_a_number_is_refused_at_its_key(override, where):
    with pytest.raises(ConfigError) as err:
        build_config({}, [override])
    assert str(err.value) == f"{where}: expected a number, got a boolean"


@pytest.mark.parametrize(("override", "where"), [
    ("optim.lr=.inf", "optim.lr"),  # passes gt=0: it trained to NaN weights
    ("optim.weight_decay=.inf", "optim.weight_decay"),  # passes ge=0
    ("optim.grad_clip=.inf", "optim.grad_clip"),  # float | None
    ("federation.client_timeout_s=.inf", "federation.client_timeout_s"),  # None is "no timeout"
    ("optim.lr=.nan", "optim.lr"),  # pydantic's own "greater than 0" before; one message for both now
    ("method.params={mu: .inf}", "method.params.mu"),  # a method's parameters
    ("hierarchy.params.lambda_ot=-.inf", "hierarchy.params.lambda_ot"),  # a merge's parameters
    ("optim.lr=1.0e+300", None),  # large but finite
])
def test_an_infinite_or_nan_float_is_refused_at_its_key(override, where):
    extra = ["method.name=fedprox"] if "method.params" in override else []
    if where is None:
        build_config({}, [*extra, override])
        return
    with pytest.raises(ConfigError) as err:
        build_config({}, [*extra, override])
    assert str(err.value) == f"{where}: Input should be a finite number"


def test_method_parameters_and_booleans_where_they_belong():
    with pytest.raises(ConfigError, match=r"^method.params.mu: expected a number, got a boolean$"):
        build_config({}, ["method.name=fedprox", "method.params.mu=yes"])
    cfg = build_config({}, ["eval.per_domain=false", "model.channels_last=true", "federation.rounds=3"])
    assert (cfg.eval.per_domain, cfg.model.channels_last, cfg.federation.rounds) == (False, True, 3)


def test_every_settings_model_of_feddg_derives_from_settings():
    # Imported, not grepped: `pydantic.BaseModel`, an alias or a second base would slip past a pattern.
    for module in pkgutil.walk_packages(feddg.__path__, "feddg."):
        if not module.name.endswith("__main__"):  # __main__ runs the CLI
            importlib.import_module(module.name)
    ours = [c for c in subclasses(BaseModel) if c.__module__.startswith("feddg.")]
    assert len(ours) > 20  # the walk reached the config, methods and merges
    assert [f"{c.__module__}.{c.__qualname__}" for c in ours if not issubclass(c, Settings)] == []


def subclasses(cls: type) -> list[type]:
    return [s for direct in cls.__subclasses__() for s in [direct, *subclasses(direct)]]


def test_a_model_of_its_own_gets_the_check_and_keeps_unknown_keys_refused():
    class Own(Settings):
        steps: int = 1
        ratio: float | None = None

    with pytest.raises(ValueError, match=r"steps\n  expected a number, got a boolean"):
        Own.model_validate({"steps": True})
    with pytest.raises(ValueError, match="Extra inputs are not permitted"):
        Own.model_validate({"stpes": 2})
    assert Own.model_validate({"steps": 2, "ratio": 1}).ratio == 1.0


def test_a_sweep_seed_given_as_a_boolean_is_refused(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nsweep:\n  seeds: [0, true]\n")
    with pytest.raises(ValueError, match=r"^sweep.seeds.1: expected a number, got a boolean$"):
        load_sweep(path, [])
