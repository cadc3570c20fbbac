"""M1: the wall time of HFedATM's station → server merge (FOT + RegMean) of ResNet-18 stations.

:func:`resnet18_stations` builds a realistic merge input: one random ResNet-18 (ImageNet stem)
perturbed independently per station and then permuted by random channel permutations (so FOT has
every filter to move back), with each station's Gram of ``fc``'s inputs (eq. 9 averaged over its
clients, eq. 10 shrunk) permuted like its features. :func:`time_merges` times merge callables interleaved
with a fixed number of torch threads; ``benchmarks/bench_merge.py`` compares implementations.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType

import numpy as np
import torch

from feddg.aggregation.fot import CPU_CROSS_PRODUCTS, CrossProduct
from feddg.aggregation.regmean import shrink, station_gram
from feddg.messages import WEIGHT_PREFIX, Message
from feddg.models import create_model
from feddg.models.permutation import (
    PermutationSpec,
    apply_permutations,
    permutation_spec,
    permute_grams,
    random_permutations,
)


@dataclass
class MergeCase:
    """The arguments of ``merge_stations`` (minus its params) for one merge."""

    weights: list[Message]
    grams: list[dict[str, np.ndarray]]
    gammas: list[float]
    spec: PermutationSpec


def _fc_grams(rng: np.random.Generator, dim: int, clients: int, samples: int, alpha: float) -> np.ndarray:
    """A station's shrunk Gram (eqs. 8–10) of non-negative, correlated features (post-ReLU, pooled)."""
    mix = rng.normal(size=(dim, dim)) / np.sqrt(dim)
    client_grams = []
    for _ in range(clients):
        x = np.maximum(rng.normal(size=(samples, dim)) @ mix + 0.5, 0.0).astype(np.float32)
        client_grams.append(x.T @ x)
    return shrink(station_gram(client_grams), alpha)


def _perturb(v: torch.Tensor, noise: float, g: torch.Generator) -> torch.Tensor:
    if not v.is_floating_point() or v.numel() < 2:
        return v
    return v + noise * v.std() * torch.randn(v.shape, generator=g)


def resnet18_stations(
    stations: int = 10,
    noise: float = 0.3,
    seed: int = 0,
    num_classes: int = 10,
    clients: int = 3,
    samples: int = 64,
    alpha: float = 0.75,
) -> MergeCase:
    """``stations`` ResNet-18 models: a common random init plus Gaussian noise (``noise`` × each
    tensor's std) per station, every station but the first also randomly channel-permuted."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = create_model("resnet18", num_classes=num_classes, image_size=224)
    spec = permutation_spec(model)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights: list[Message] = []
    grams: list[dict[str, np.ndarray]] = []
    for e in range(stations):
        g = torch.Generator().manual_seed(seed * 1000 + e)
        state = {k: _perturb(v, noise, g) for k, v in base.items()}
        gram = {"fc": torch.from_numpy(_fc_grams(rng, model.feature_dim, clients, samples, alpha))}
        if e > 0:
            perms = random_permutations(spec, rng)
            state = apply_permutations(state, spec, perms)
            gram = permute_grams(gram, spec, perms)
        weights.append({WEIGHT_PREFIX + k: v.numpy() for k, v in state.items()})
        grams.append({k: v.numpy() for k, v in gram.items()})
    return MergeCase(weights, grams, [float(clients)] * stations, spec)


def time_merges(
    merges: Mapping[str, Callable[[], object]], repeats: int = 5, threads: int = 2
) -> dict[str, list[float]]:
    """Wall-clock seconds of ``repeats`` calls of each merge, interleaved (A B A B ...) so that load
    changes hit every implementation alike, with ``threads`` torch threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    times: dict[str, list[float]] = {name: [] for name in merges}
    try:
        for _ in range(repeats):
            for name, merge in merges.items():
                t0 = time.perf_counter()
                merge()
                times[name].append(time.perf_counter() - t0)
        return times
    finally:
        torch.set_num_threads(previous)


def summary(times: list[float]) -> tuple[float, float]:
    """(min, median) seconds."""
    return min(times), statistics.median(times)


def _linear_flop(input_shape: Sequence[int], weight_shape: Sequence[int], *_: object, **__: object) -> int:
    """FLOPs of ``input [..., k] · weight [n, k]ᵀ`` (oneDNN's linear, which ``FlopCounterMode`` does not know)."""
    return 2 * math.prod(input_shape) * weight_shape[0]


def merge_gflop(merge: Callable[[], object]) -> float:
    """GFLOP of the matrix products in one call of ``merge``, counted by torch's ``FlopCounterMode`` (FOT's cost
    GEMMs, on MKL or oneDNN: the exact-cost part of a merge; the assignment solves and the means add no GEMM
    FLOPs)."""
    from torch.utils.flop_counter import FlopCounterMode

    custom = {torch.ops.mkldnn._linear_pointwise: _linear_flop} if "oneDNN" in CPU_CROSS_PRODUCTS else {}
    with FlopCounterMode(display=False, custom_mapping=custom) as counter:
        merge()
    return counter.get_total_flops() / 1e9


def gemm_gflops(threads: int, shape: tuple[int, int, int] = (512, 4608, 512), repeats: int = 20,
                kernel: str = "MKL") -> float:
    """This machine's float32 GEMM rate now (GFLOP/s, best of ``repeats``) at ``shape`` ``(m, k, n)`` (default:
    the merge's largest cost GEMM, ResNet-18's 512 filters of 512 × 3 × 3), on ``threads`` torch threads, with
    ``kernel`` (a key of :data:`~feddg.aggregation.fot.CPU_CROSS_PRODUCTS`: the float32 GEMMs eq. 3's products may
    run on here, called as the merge calls them; on an AMD EPYC, Zen 5, oneDNN's runs 2.2× MKL's)."""
    m, k, n = shape
    a, b, out = torch.randn(m, k), torch.randn(n, k), torch.empty(m, n)
    gemm = CPU_CROSS_PRODUCTS[kernel]
    best = float("inf")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for i in range(repeats + 3):  # 3 warm-up products
            t0 = time.perf_counter()
            gemm(a, b, out)
            if i >= 3:
                best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)
    return 2 * m * k * n / best / 1e9


def fastest_gemm(threads: int) -> tuple[str, float]:
    """The fastest kernel of :data:`~feddg.aggregation.fot.CPU_CROSS_PRODUCTS` here and its rate: the exact-cost
    bound is the merge's FLOPs at the best float32 GEMM rate this machine offers, whichever kernel the merge calls."""
    rates = {name: gemm_gflops(threads, kernel=name) for name in CPU_CROSS_PRODUCTS}
    name = max(rates, key=lambda k: rates[k])
    return name, rates[name]


@dataclass
class GemmClock:
    """Wall seconds a merge spends inside eq. 3's products: within ``with clock:`` every CPU kernel of
    :data:`~feddg.aggregation.fot.CPU_CROSS_PRODUCTS` (where the merge looks its kernel up) runs under a timer, and
    each block's total is appended to :attr:`laps`. With the float64 mean's floor (:func:`mean_pass`) it gives the
    least time in which the exact merge could run here: its own products, then one mean pass."""

    laps: list[float] = field(default_factory=list)
    _kernels: dict[str, CrossProduct] = field(default_factory=dict)

    def __enter__(self) -> GemmClock:
        self._kernels = dict(CPU_CROSS_PRODUCTS)
        self.laps.append(0.0)
        CPU_CROSS_PRODUCTS.update({name: self._timed(kernel) for name, kernel in self._kernels.items()})
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        CPU_CROSS_PRODUCTS.update(self._kernels)

    def shortest(self) -> float:
        """The shortest lap; refused where a block's products did not run through the clock (a kernel outside the
        table): no floor, rather than half one."""
        if not self.laps or min(self.laps) <= 0:
            raise RuntimeError("M1: the merge's cost products did not run through the GEMM clock; no exact floor")
        return min(self.laps)

    def _timed(self, kernel: CrossProduct) -> CrossProduct:
        def timed(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
            t0 = time.perf_counter()
            kernel(a, b, out)
            self.laps[-1] += time.perf_counter() - t0

        return timed


def mean_pass(case: MergeCase) -> Callable[[], object]:
    """One pass of the γ-weighted float64 mean (eq. 7) over every station tensor, unpermuted: the floor of the
    merge's non-GEMM work (each station's weights read once, the float64 operations the merge's mean does)."""
    from feddg.aggregation.mean import weighted_mean

    keys = list(case.weights[0])

    def run() -> object:
        return {k: weighted_mean([np.asarray(w[k]) for w in case.weights], case.gammas) for k in keys}

    return run
