"""Filter-wise optimal transport alignment (FOT), HFedATM §3.3, eqs. 2–6.

For every channel group of a permutation spec (``feddg.models.permutation``): flatten and
L2-normalise each filter (eq. 2), build the squared-Euclidean cost between the reference
station's filters and another station's (eq. 3), solve the OT problem over the Birkhoff polytope
with entropic Sinkhorn (eq. 4; or an exact assignment), round the plan to a permutation and apply
it graph-consistently to the station's model (eq. 5). Filters of another spatial size are resized
bilinearly to the reference's (eq. 6).

Cost matrices are float32 torch matmuls batched over stations (they dominate the time); the
c × c OT problems are solved in float64 by POT / SciPy.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import ot
import torch
import torch.nn.functional as F
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from feddg.models.permutation import PermGroup, Permutations, PermutationSpec, apply_permutations

Solver = Literal["sinkhorn", "hungarian"]

#: coordinate-descent passes for specs with cycles (residual streams); acyclic specs need one
MAX_PASSES = 5
#: largest cost/reg for which plain Sinkhorn's kernel exp(−C/reg) is used (exp(−500) ≈ 7e-218 > float64 min)
MAX_EXPONENT = 500.0


def resize_filters(w: Tensor, size: tuple[int, int]) -> Tensor:
    """Eq. 6: bilinear resize of filters ``[c_out, c_in, k, k]`` to spatial ``size``."""
    if tuple(w.shape[-2:]) == tuple(size):
        return w
    return F.interpolate(w.float(), size=size, mode="bilinear", align_corners=False).to(w.dtype)


def normalise_filters(w: Tensor) -> Tensor:
    """Eq. 2: each filter ``[c_in, k, k]`` flattened and divided by its L2 norm, as float32.

    ``[c, c_in, k, k] -> [c, d]``, or stacked over stations ``[E, c, c_in, k, k] -> [E, c, d]``.
    An all-zero filter stays zero.
    """
    flat = w.float().flatten(start_dim=-3) if w.dim() >= 4 else w.float()
    return flat / flat.norm(dim=-1, keepdim=True).clamp_min(1e-12)


def cost_matrix(ref: Tensor, other: Tensor) -> Tensor:
    """Eq. 3: ``C_ij = ‖ŵ_ref,i − ŵ_other,j‖²`` for unit rows ``ref [c, d]`` and ``other [..., c, d]``.

    Computed as ``‖a‖² + ‖b‖² − 2 a·b`` with one (batched) matmul; clamped at 0 against rounding.
    """
    cross = other @ ref.T  # [..., c_other, c_ref]
    sq = ref.pow(2).sum(-1)[None, :] + other.pow(2).sum(-1)[..., :, None] - 2 * cross
    return sq.transpose(-1, -2).clamp_min(0.0)  # rows: reference filters


def sinkhorn_plan(cost: np.ndarray, reg: float, iters: int) -> np.ndarray:
    """Eq. 4: entropic OT plan between uniform marginals ``1/c`` (Cuturi 2013), ``iters`` iterations.

    Cuturi's scaling iterations (POT ``sinkhorn``) while the kernel ``exp(−C/reg)`` stays far from
    float64 underflow (``max C / reg ≤`` :data:`MAX_EXPONENT`; unit filters give ``C ≤ 4``, so the
    paper's ``reg = 0.05`` qualifies), else the log-domain variant, which is stable but ~10–70× slower.
    """
    c = cost.shape[0]
    a = np.full(c, 1.0 / c)
    method = "sinkhorn" if cost.max() / reg <= MAX_EXPONENT else "sinkhorn_log"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # POT warns when it stops at numItermax, which is the point
        return ot.sinkhorn(a, a, cost.astype(np.float64), reg, method=method, numItermax=iters, stopThr=0.0)


def plan_to_permutation(plan: np.ndarray) -> np.ndarray:
    """The permutation carrying the most mass of ``plan``: ``perm[i] = j`` maximising ``Σ_i plan[i, perm[i]]``."""
    rows, cols = linear_sum_assignment(plan, maximize=True)
    return cols[np.argsort(rows)]


def match(cost: np.ndarray, solver: Solver = "sinkhorn", reg: float = 0.05, iters: int = 25) -> np.ndarray:
    """Permutation aligning another station's filters to the reference: new filter ``i`` := old ``perm[i]``.

    ``sinkhorn``: the paper's entropic plan rounded to a permutation; ``hungarian``: the exact
    assignment minimising ``Σ_i C[i, perm[i]]`` (the unregularised eq. 4, whose optimum is a vertex).
    """
    if solver == "hungarian":
        rows, cols = linear_sum_assignment(cost)
        return cols[np.argsort(rows)]
    if solver == "sinkhorn":
        return plan_to_permutation(sinkhorn_plan(cost, reg, iters))
    raise ValueError(f"unknown FOT solver {solver!r}; expected 'sinkhorn' or 'hungarian'")


def group_costs(ref: Mapping[str, Tensor], others: Sequence[Mapping[str, Tensor]], group: PermGroup) -> Tensor:
    """``[E, c, c]`` cost of each station against the reference for one group: eq. 3 averaged over the
    group's producers (one producer per plain conv layer; several for a residual stream)."""
    total = None
    for key in group.producers:
        r = ref[key]
        stack = torch.stack([resize_filters(o[key], tuple(r.shape[-2:])) if r.dim() == 4 else o[key] for o in others])
        c = cost_matrix(normalise_filters(r), normalise_filters(stack))
        total = c if total is None else total + c
    assert total is not None, f"group {group.name} has no producers"
    return total / len(group.producers)


@dataclass
class Alignment:
    """Aligned station states, the permutation applied to each, and per-group diagnostics (means over
    stations): the fraction of filters moved, and the transport cost per filter ``Σ_i C[i, π(i)] / c``
    of the identity matching before alignment and of the found permutation after it (both with the
    layer's input channels aligned by the groups before it)."""

    states: list[dict[str, Tensor]]
    perms: list[Permutations]
    moved: dict[str, float] = field(default_factory=dict)
    cost_before: dict[str, float] = field(default_factory=dict)
    cost_after: dict[str, float] = field(default_factory=dict)
    passes: int = 0


def align_to_reference(
    ref: Mapping[str, Tensor],
    others: Sequence[Mapping[str, Tensor]],
    spec: PermutationSpec,
    solver: Solver = "sinkhorn",
    reg: float = 0.05,
    iters: int = 25,
) -> Alignment:
    """Eqs. 2–5 for every group of ``spec``: permute each state in ``others`` towards ``ref``.

    Groups are matched in spec order, each after the permutations found so far have been applied
    (so a layer's filters are compared with aligned input channels, Singh & Jaggi 2020). Specs with
    cycles (residual streams) repeat the sweep until no permutation changes (at most
    :data:`MAX_PASSES`); ``cost_before`` is from the first sweep, ``cost_after`` from the last.
    """
    states = [dict(o) for o in others]
    total = [{g.name: np.arange(g.size) for g in spec.groups} for _ in states]
    before: dict[str, float] = {}
    after: dict[str, float] = {}
    passes = 0
    while states and passes < (1 if spec.acyclic else MAX_PASSES):
        passes += 1
        changed = False
        for g in spec.groups:
            costs = group_costs(ref, states, g).double().numpy()
            before.setdefault(g.name, float(np.mean([np.diag(c).mean() for c in costs])))
            found = []
            for e, cost in enumerate(costs):
                perm = match(cost, solver, reg, iters)
                found.append(cost[np.arange(g.size), perm].mean())
                if (perm != np.arange(g.size)).any():
                    changed = True
                    states[e] = apply_permutations(states[e], PermutationSpec((g,)), {g.name: perm})
                    total[e][g.name] = total[e][g.name][perm]
            after[g.name] = float(np.mean(found))
        if not changed:
            break
    moved = {g.name: float(np.mean([(t[g.name] != np.arange(g.size)).mean() for t in total])) for g in spec.groups} if total else {}
    return Alignment(states, total, moved, before, after, passes)
