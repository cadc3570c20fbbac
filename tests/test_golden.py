"""Every method (but FedDG-ELCFS, a segmentation method: these runs classify) and every station merge reproduces,
bit for bit, the recorded metrics and final weights: a refactor changes the house, not the numbers.

The cases run in a process of their own with ``reproducibility: portable``'s kernels (support/golden.py), whose
bits are meant to be the same on any x86-64 CPU with AVX2: the figures match on a real AMD EPYC (Zen 5) and under
emulated Intel and AMD CPUs (benchmarks/golden_cpus.sh), and those of the cases without a square root or Adam also
on the Intel Xeon (AVX-512) that recorded them first. The cases with one were re-recorded when feddg stopped
taking MKL's vendor-dependent square root (feddg/numerics.py; docs/reliability.md)."""

import json
import subprocess
import sys

import pytest
from support.golden import FIXTURES, TESTS

from feddg.reproducibility import portable_env

TOY = json.loads((FIXTURES / "golden_toy.json").read_text())
DIGITS = json.loads((FIXTURES / "golden_digits.json").read_text())


@pytest.fixture(scope="module")
def computed(cache_dir):
    """Every case, computed once in a pinned process."""
    res = subprocess.run([sys.executable, str(TESTS / "support" / "golden.py"), "--cache", str(cache_dir)],
                         env=portable_env(), capture_output=True, text=True, timeout=900, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


@pytest.mark.parametrize("name", sorted(TOY))
def test_toy_runs_match_the_recorded_figures(name, computed):
    got = computed["toy"][name]
    assert got["metrics"] == TOY[name]["metrics"]
    assert got["weights"] == TOY[name]["weights"]


@pytest.mark.parametrize("name", sorted(DIGITS["cases"]))
def test_digits_runs_match_the_recorded_figures(name, computed):
    got = computed["digits"][name]
    assert got["metrics"] == DIGITS["cases"][name]["metrics"]
    assert got["weights"] == DIGITS["cases"][name]["weights"]


def test_every_method_of_the_registry_has_a_golden_run():
    from feddg.algorithms.registry import METHODS

    named = {o.split("=", 1)[1] for case in [*TOY.values(), *DIGITS["cases"].values()] for o in case["overrides"]
             if o.startswith("method.name=")}
    registered = {name for name, cls in METHODS.items()  # feddg's own, not a test's (a lazy entry becomes its class)
                  if (cls if isinstance(cls, str) else cls.__module__).startswith("feddg.algorithms.")}
    assert registered - named - {"fedavg"} == {"elcfs"}  # fedavg: the default; ELCFS segments, these runs classify
