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
import torch
from toy import toy_federation

from feddg import reproducibility
from feddg.federation.server import Server
from feddg.reproducibility import (
    PORTABLE_DEFAULTS,
    PORTABLE_ENV,
    check_pinned,
    exec_pinned,
    is_pinned,
    kernel_record,
    portable_env,
    shell_exports,
)


def unpinned() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in PORTABLE_ENV and k not in PORTABLE_DEFAULTS}


def test_portable_env_pins_every_kernel_and_keeps_a_machines_own_openblas_core():
    env = portable_env({"PATH": "/bin", "OMP_NUM_THREADS": "8"})
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_CBWR"] == "COMPATIBLE" and env["OMP_NUM_THREADS"] == "1"
    assert env["OPENBLAS_CORETYPE"] == "Haswell" and env["PATH"] == "/bin"
    assert portable_env({"OPENBLAS_CORETYPE": "Zen"})["OPENBLAS_CORETYPE"] == "Zen"
    assert is_pinned(env) and not is_pinned({"PATH": "/bin"})
    assert not is_pinned({**env, "MKL_CBWR": "AUTO"})
    assert not is_pinned(dict(PORTABLE_ENV))  # OPENBLAS_CORETYPE must be set too, whatever its value


def test_shell_exports_give_a_pinned_environment():
    parsed = {}
    for line in shell_exports({}).splitlines():
        word, assignment = shlex.split(line)
        assert word == "export"
        key, _, value = assignment.partition("=")
        parsed[key] = value
    assert is_pinned(parsed)
    assert "export OPENBLAS_CORETYPE='Zen'" in shell_exports({"OPENBLAS_CORETYPE": "Zen"}).splitlines()


def set_environ(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """This process's environment without any portable setting, then ``env``."""
    for key in (*PORTABLE_ENV, *PORTABLE_DEFAULTS):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_exec_pinned_reexecutes_this_command_with_the_pinned_env_only_when_portable_and_unpinned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(reproducibility.os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    set_environ(monkeypatch, {})
    exec_pinned("native")
    assert calls == []
    exec_pinned("portable")
    assert [(path, argv) for path, argv, _ in calls] == [(sys.executable, [sys.executable, *sys.orig_argv[1:]])]
    assert is_pinned(calls[0][2]) and calls[0][2]["PATH"] == os.environ["PATH"]
    set_environ(monkeypatch, {**PORTABLE_ENV, "OPENBLAS_CORETYPE": "Zen"})
    exec_pinned("portable")  # already pinned: runs on, no loop
    assert len(calls) == 1


@pytest.mark.parametrize(("pinned", "capability", "refused"),
                         [(True, "AVX2", False), (True, "AVX512", True), (False, "AVX2", True)])
def test_check_pinned_needs_the_pinned_env_and_torchs_avx2_kernels(
    monkeypatch: pytest.MonkeyPatch, pinned: bool, capability: str, refused: bool
) -> None:
    set_environ(monkeypatch, portable_env({}) if pinned else {})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    check_pinned("native")  # never refused
    if refused:
        with pytest.raises(RuntimeError, match="feddg env portable"):
            check_pinned("portable")
    else:
        check_pinned("portable")


def test_kernel_record_holds_every_portable_setting_of_the_environment_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_environ(monkeypatch, {**PORTABLE_ENV, "OPENBLAS_CORETYPE": "Zen", "FEDDG_UNRELATED": "1"})
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # the threads torch runs on now, not the pinned setting
    try:
        record = kernel_record("portable")
    finally:
        torch.set_num_threads(threads)
    assert record["env"] == {**PORTABLE_ENV, "OPENBLAS_CORETYPE": "Zen"}
    assert record["mode"] == "portable" and record["torch_threads"] == threads + 1


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
