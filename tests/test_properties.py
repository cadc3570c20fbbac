"""Property-based tests: config garbage is one ConfigError line, messages hold exactly arrays and
scalars, partitioners deal out every source sample exactly once."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from feddg.config import ConfigError, ExperimentConfig, build_config, load_config
from feddg.data.partition import PARTITIONERS, make_partition
from feddg.messages import validate_message

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _keys(model: Any = ExperimentConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config schema."""
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            out += _keys(sub, f"{prefix}{name}.")
    return out


REAL_KEYS = _keys()
text = st.one_of(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12),
                st.sampled_from(["", " ", "a\nb", "x\ty\r", "\x00", "[red]x", "é", "- a", "{a: 1}", "~"]))
dotted = st.one_of(st.sampled_from(REAL_KEYS), st.lists(st.one_of(st.sampled_from(REAL_KEYS), text), min_size=1,
                                                        max_size=3).map(".".join))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True), text)
trees = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                     st.dictionaries(st.one_of(st.sampled_from(REAL_KEYS), text), kids,
                                                                     max_size=3)), max_leaves=8)


def _one_line_config_error(make: Any) -> None:
    try:
        make()
    except ConfigError as err:
        assert "\n" not in str(err) and str(err).strip(), repr(str(err))


@FAST
@given(st.lists(st.tuples(dotted, st.one_of(text, scalars.map(lambda v: yaml.safe_dump(v).strip()))), max_size=3))
def test_random_overrides_load_or_fail_with_one_config_error_line(pairs):
    _one_line_config_error(lambda: build_config({}, [f"{k}={v}" for k, v in pairs]))


@FAST
@given(st.dictionaries(st.one_of(st.sampled_from([k.split(".")[0] for k in REAL_KEYS]), text), trees, max_size=4))
def test_random_trees_load_or_fail_with_one_config_error_line(tree):
    _one_line_config_error(lambda: build_config(tree))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=80))
def test_random_yaml_text_loads_or_fails_with_one_config_error_line(tmp_path, source):
    path = tmp_path / "c.yaml"
    path.write_text(source, encoding="utf-8")
    _one_line_config_error(lambda: load_config(path))


# --- messages -------------------------------------------------------------------------------
numeric = hnp.arrays(st.sampled_from([np.float32, np.float64, np.int64, np.uint8, np.bool_, np.complex64]),
                     hnp.array_shapes(min_dims=0, max_dims=3, max_side=3))
accepted = st.one_of(numeric, st.integers(), st.floats(), text, st.sampled_from([np.float32(1), np.int64(2)]))
rejected = st.one_of(st.booleans(), st.none(), st.lists(st.integers(), max_size=2), st.binary(max_size=3),
                     st.complex_numbers(), st.just(np.array([1, "a"], dtype=object)), st.just(torch.zeros(2)),
                     st.dictionaries(text, st.integers(), max_size=1), st.just(np.bool_(True)))


@FAST
@given(st.dictionaries(text, st.one_of(accepted.map(lambda v: (v, True)), rejected.map(lambda v: (v, False))),
                       max_size=4))
def test_validate_message_accepts_exactly_arrays_and_scalars(tagged):
    msg, ok = {k: v for k, (v, _) in tagged.items()}, all(good for _, good in tagged.values())
    if ok:
        validate_message(msg)
    else:
        with pytest.raises(TypeError):
            validate_message(msg)


# --- partitions -----------------------------------------------------------------------------
PARAMS = {
    "lam": st.floats(0.0, 1.0),
    "d": st.integers(1, 4),
    "alpha": st.floats(0.05, 10.0),
    "alpha_group": st.floats(0.05, 10.0),
    "alpha_client": st.floats(0.05, 10.0),
    "groups": st.integers(1, 4),
    "max_tries": st.integers(1, 50),
    "shuffle_clients": st.booleans(),
    "natural_groups": st.lists(st.integers(0, 6), min_size=140, max_size=140).map(np.array),
}


def _params(kind: str) -> st.SearchStrategy[dict[str, Any]]:
    keyword = [n for n, p in inspect.signature(PARTITIONERS[kind]).parameters.items() if p.kind is p.KEYWORD_ONLY]
    missing = [n for n in keyword if n not in PARAMS]
    assert not missing, f"give test_properties.PARAMS a strategy for {kind}'s {missing}"
    return st.fixed_dictionaries({n: PARAMS[n] for n in keyword})


@pytest.mark.parametrize("kind", sorted(PARTITIONERS))
def test_every_partitioner_loses_and_duplicates_no_sample(kind):
    @settings(max_examples=40, deadline=None)
    @given(data=st.data(), n=st.integers(1, 120), domains=st.integers(1, 5), classes=st.integers(1, 4),
           clients=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
    def check(data: st.DataObject, n: int, domains: int, classes: int, clients: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        total = n + rng.integers(0, 20)  # the source is a subset of a larger dataset
        domain_ids, labels = rng.integers(0, domains, total), rng.integers(0, classes, total)
        source = np.sort(rng.choice(total, size=n, replace=False))
        try:
            params = data.draw(_params(kind))
            part_groups = params.pop("natural_groups", None)  # the dataset's groups: never a config parameter
            part = make_partition(kind, source, domain_ids, labels, clients, rng, part_groups, **params)
        except ValueError:  # a documented refusal (too many clients for the data, ...), never a bad partition
            assume(False)
            return
        dealt = np.concatenate(part.client_indices)
        count = len(np.unique(part_groups[source])) if kind == "natural" else clients
        assert len(part.client_indices) == count and all(len(ix) for ix in part.client_indices)
        assert len(dealt) == n and np.array_equal(np.sort(dealt), source)

    check()
