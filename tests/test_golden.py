"""Every method and every station merge reproduces, bit for bit, the recorded metrics and final weights: a
refactor changes the house, not the numbers.

The cases run in a process of their own with ``reproducibility: portable``'s kernels (support/golden.py), whose
bits are the same on any x86-64 CPU with AVX2 — the figures were recorded on an AVX-512 Intel Xeon and match under
emulated AMD EPYC and Intel Haswell CPUs (benchmarks/golden_cpus.sh). They were first recorded with a 2-core AMD
EPYC's own kernels before the architecture step; the code of that record reproduces it exactly under an emulated
EPYC, and its portable-kernel figures are the ones recorded here."""

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
