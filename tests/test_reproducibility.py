"""``reproducibility: portable``: the CLI re-executes itself with the CPU kernels pinned and records them; a library
run that asks for portable bits without them is refused. (That the pinned kernels give the same bits across CPUs
is what tests/test_golden.py checks, and benchmarks/golden_cpus.sh under emulated CPUs.)"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from toy import toy_federation

from feddg.federation.server import Server
from feddg.reproducibility import PORTABLE_DEFAULTS, PORTABLE_ENV, is_pinned, portable_env, shell_exports


def unpinned() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in PORTABLE_ENV and k not in PORTABLE_DEFAULTS}


def test_portable_env_pins_every_kernel_and_keeps_a_machines_own_openblas_core():
    env = portable_env({"PATH": "/bin", "OMP_NUM_THREADS": "8"})
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_CBWR"] == "COMPATIBLE" and env["OMP_NUM_THREADS"] == "1"
    assert env["OPENBLAS_CORETYPE"] == "Haswell" and env["PATH"] == "/bin"
    assert portable_env({"OPENBLAS_CORETYPE": "Zen"})["OPENBLAS_CORETYPE"] == "Zen"
    assert is_pinned(env) and not is_pinned({"PATH": "/bin"})
    assert not is_pinned({**env, "MKL_CBWR": "AUTO"})


def test_shell_exports_give_a_pinned_environment():
    parsed = {}
    for line in shell_exports({}).splitlines():
        word, assignment = shlex.split(line)
        assert word == "export"
        key, _, value = assignment.partition("=")
        parsed[key] = value
    assert is_pinned(parsed)


def test_a_library_run_without_pinned_kernels_is_refused_in_one_line(tmp_path):
    if is_pinned():
        pytest.skip("this test process already runs with the portable kernels")
    with pytest.raises(RuntimeError, match=r"feddg env portable") as err:
        Server(toy_federation("reproducibility=portable", "federation.rounds=1"), tmp_path / "run")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_cli_reexecutes_with_pinned_kernels_and_records_them(tmp_path, cache_dir):
    env = {**unpinned(), "FEDDG_CACHE": str(cache_dir)}
    args = ["run", "configs/demo.yaml", "-o", "data.max_per_domain=60", "-o", "partition.num_clients=3",
            "-o", "federation.rounds=1", "-o", "model.name=lenet", "-o", "split.target=uci", "--quiet"]
    for mode in ("portable", "native"):
        res = subprocess.run([sys.executable, "-m", "feddg", *args, "-o", f"reproducibility={mode}",
                              "--run-dir", str(tmp_path / mode)], env=env, capture_output=True, text=True,
                             timeout=300, check=False)
        assert res.returncode == 0, res.stderr[-2000:]
    portable = json.loads((tmp_path / "portable" / "provenance.json").read_text())["reproducibility"]
    native = json.loads((tmp_path / "native" / "provenance.json").read_text())["reproducibility"]
    assert portable["mode"] == "portable" and portable["torch_cpu_capability"] == "AVX2"
    assert portable["torch_threads"] == 1 and is_pinned(portable["env"])
    assert native["mode"] == "native" and not is_pinned(native["env"])
