"""The same bits on any x86-64 CPU with AVX2 (``reproducibility: portable``).

PyTorch, oneDNN, MKL, numpy and OpenBLAS pick their float kernels from the CPU they run on (AVX2 on one machine,
AVX-512 on the next, a vendor-specific MKL path on AMD), and a kernel's summation order is part of its result:
the same code gives other float bits elsewhere. ``portable`` pins every one of them to a kernel that exists on
every x86-64 CPU with AVX2 and is meant to compute the same everywhere (docs/reliability.md says what is
verified), and runs each process with one thread (threaded
reductions split their sums by the thread count). No setting pins MKL's vector math, which PyTorch's x86 build
uses for ``torch.sqrt`` (and Adam's default step) and which gives other bits on an AMD than on an Intel processor:
feddg takes those from :mod:`feddg.numerics` instead. The libraries read these settings once, when they load, so
they must be in the environment before torch or numpy is imported: the CLI re-executes itself with them
(:func:`exec_pinned`); a program that drives feddg as a library starts with them set
(``eval "$(feddg env portable)"``) and :func:`check_pinned` refuses a run that asks for portable bits without
them. Checked with the golden cases on real and emulated CPUs (``benchmarks/golden_cpus.sh``; docs/reliability.md
says which cases on which CPUs); the cost is in docs/benchmarks.md.

This module imports neither torch nor numpy at its top, so the CLI can read a config and re-execute first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, Literal

Mode = Literal["native", "portable"]

#: set (overriding) in a portable run's environment
PORTABLE_ENV: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",  # PyTorch's vectorised kernels: the AVX2 build, not AVX-512
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN's JIT convolutions: no AVX-512 or AMX code
    "MKL_CBWR": "COMPATIBLE",  # MKL's reproducible branch; the only one (with AUTO) MKL honours on non-Intel CPUs
    # numpy's own SIMD loops (exp, log, sums) at most AVX2; old and new names of its AVX-512 targets
    "NPY_DISABLE_CPU_FEATURES": "AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL "
                                "AVX512_ICL AVX512_SPR X86_V4",
    "OMP_NUM_THREADS": "1",  # torch's intra-op threads (read when torch loads)
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",  # numpy's and scipy's BLAS
}
#: set only where the environment has no value: some machines set OpenBLAS's core type for correctness
PORTABLE_DEFAULTS: dict[str, str] = {"OPENBLAS_CORETYPE": "Haswell"}


def portable_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with the portable kernels pinned."""
    env = dict(os.environ if base is None else base)
    env.update(PORTABLE_ENV)
    for key, value in PORTABLE_DEFAULTS.items():
        env.setdefault(key, value)
    return env


def is_pinned(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``env`` (default: this process's) holds every portable setting."""
    env = os.environ if env is None else env
    return all(env.get(k) == v for k, v in PORTABLE_ENV.items()) and all(k in env for k in PORTABLE_DEFAULTS)


def exec_pinned(mode: Mode) -> None:
    """For ``portable``: re-execute this command with the kernels pinned, unless they already are (then return).
    Call it before anything has run a float kernel; the command starts again from its first line."""
    if mode != "portable" or is_pinned():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], portable_env())


def check_pinned(mode: Mode) -> None:
    """Refuse a ``portable`` run in a process whose kernels were not pinned before torch loaded."""
    if mode != "portable":
        return
    import torch

    if not is_pinned() or torch.backends.cpu.get_cpu_capability() != "AVX2":
        raise RuntimeError('reproducibility: portable needs its kernels pinned before torch loads: run it with the '
                           'feddg command, or start this program after eval "$(feddg env portable)"')


def kernel_record(mode: Mode) -> dict[str, Any]:
    """provenance.json's ``reproducibility``: the mode and the kernels this process actually runs."""
    import torch

    keys = (*PORTABLE_ENV, *PORTABLE_DEFAULTS)
    return {
        "mode": mode,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "env": {k: os.environ[k] for k in keys if k in os.environ},
    }


def shell_exports(env: Mapping[str, str] | None = None) -> str:
    """``export KEY='value'`` lines of the portable settings (``feddg env portable``)."""
    pinned = portable_env(env)
    return "\n".join(f"export {k}='{pinned[k]}'" for k in (*PORTABLE_ENV, *PORTABLE_DEFAULTS))
