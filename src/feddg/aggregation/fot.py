"""Filter-wise optimal transport alignment (FOT), HFedATM §3.3, eqs. 2–6.

For every channel group of a permutation spec (``feddg.models.permutation``): flatten and
L2-normalise each filter (eq. 2), build the squared-Euclidean cost between the reference
station's filters and another station's (eq. 3), solve the OT problem over the Birkhoff polytope
with entropic Sinkhorn (eq. 4; or an exact assignment), round the plan to a permutation and apply
it graph-consistently to the station's model (eq. 5). Filters of another spatial size are resized
bilinearly to the reference's (eq. 6).

The inner products of eq. 3 (float32 GEMMs, one per producer and station, on the device the states are on; on a
CPU oneDNN's unless the kernels are pinned, :func:`cross_product`) dominate the time, so
:func:`align_to_reference` computes each once per merge and again only for the stations whose
input channels a later group moved (reading the station's filters in place: the reference's take the inverse
permutation); permutations are composed as index arrays and applied to the
weights once at the end (:attr:`Alignment.states`; the station merge instead gathers them inside its mean,
``aggregation/merges.py``). The c × c OT problems are solved in float64 (Sinkhorn as POT computes it, a large
group's problems on threads; SciPy's assignment only when the row-wise optima do not already form the optimal
permutation).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from feddg.aggregation.threads import map_on_threads
from feddg.models.permutation import Axis, PermGroup, Permutations, PermutationSpec, apply_permutations
from feddg.reproducibility import is_pinned

Solver = Literal["sinkhorn", "hungarian"]

#: at most this many sweeps over the groups (specs with cycles, i.e. residual streams, need more than one)
MAX_PASSES = 5
#: largest cost/reg for which plain Sinkhorn's kernel exp(−C/reg) is used (exp(−500) ≈ 7e-218 > float64 min)
MAX_EXPONENT = 500.0
#: from this c up, a group's c × c Sinkhorn problems are solved on threads (measured on 2 cores, 9 problems: 1.6×
#: faster at c = 512, whose two float64 matrices outgrow one core's cache; 1.1–1.3× at 256; slower at 64–192,
#: where the GIL between numpy's short calls dominates)
THREADED_SOLVES_FROM = 256


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


def _cost_from_cross(cross: Tensor, ref_sq: Tensor, other_sq: Tensor, scale: Tensor | None = None) -> Tensor:
    """``‖a‖² + ‖b‖² − 2 a·b`` from the inner products ``cross [..., c_other, c_ref]`` (overwritten; its
    rows first multiplied by ``scale``, the other side's ``1/‖w‖``), clamped at 0 against rounding;
    rows of the result are the reference's filters."""
    cross.mul_(-2.0 if scale is None else scale[..., :, None] * -2.0)
    return cross.add_(other_sq[..., :, None]).add_(ref_sq).clamp_min_(0.0).transpose(-1, -2)


def cost_matrix(ref: Tensor, other: Tensor) -> Tensor:
    """Eq. 3: ``C_ij = ‖ŵ_ref,i − ŵ_other,j‖²`` for unit rows ``ref [c, d]`` and ``other [..., c, d]``."""
    return _cost_from_cross(other @ ref.T, ref.pow(2).sum(-1), other.pow(2).sum(-1))


#: ``cross(filters [c_o, d], ref_rows [c_r, d], out [c_o, c_r])``: ``out = filters · ref_rowsᵀ`` in float32
CrossProduct = Callable[[Tensor, Tensor, Tensor], None]


def mkl_cross(filters: Tensor, ref_rows: Tensor, out: Tensor) -> None:
    """Eq. 3's inner products by ``torch.mm`` (MKL on a CPU, cuBLAS on a GPU)."""
    torch.mm(filters, ref_rows.T, out=out)


def onednn_cross(filters: Tensor, ref_rows: Tensor, out: Tensor) -> None:
    """Eq. 3's inner products by oneDNN's float32 matmul (PyTorch's mkldnn linear; CPU only)."""
    out.copy_(torch.ops.mkldnn._linear_pointwise(filters, ref_rows, None, "none", [], ""))


#: the CPU kernels of eq. 3's GEMM in this PyTorch build, by name: MKL's and, where PyTorch has it, oneDNN's
CPU_CROSS_PRODUCTS: dict[str, CrossProduct] = {"MKL": mkl_cross}
if torch.backends.mkldnn.is_available():
    CPU_CROSS_PRODUCTS["oneDNN"] = onednn_cross


def cross_product(device: torch.device) -> CrossProduct:
    """The GEMM of eq. 3 on ``device``: on a CPU oneDNN's where PyTorch has it (on a 2-core AMD EPYC, Zen 5, 470
    against MKL's 210 GFLOP/s: MKL takes its AVX2 path on AMD), except under ``reproducibility: portable``'s
    pinned kernels, whose MKL products give the same bits on every CPU (oneDNN's blocking follows the CPU's
    caches); elsewhere ``torch.mm``. Either is float32 (the two differ in the last bits, which the assignment
    screen and the float64 solves tolerate: the permutations are the plain float64 algorithm's, tests/test_fot.py).
    A CPU kernel is looked up in :data:`CPU_CROSS_PRODUCTS` at each call (M1's benchmark times the products there)."""
    if device.type != "cpu":
        return mkl_cross
    return CPU_CROSS_PRODUCTS["oneDNN" if "oneDNN" in CPU_CROSS_PRODUCTS and not is_pinned() else "MKL"]


def sinkhorn_plan(cost: np.ndarray, reg: float, iters: int) -> np.ndarray:
    """Eq. 4: entropic OT plan between uniform marginals ``1/c`` (Cuturi 2013), ``iters`` iterations.

    Cuturi's scaling iterations while the kernel ``exp(−C/reg)`` stays far from float64 underflow
    (``max C / reg ≤`` :data:`MAX_EXPONENT`; unit filters give ``C ≤ 4``, so the paper's ``reg = 0.05``
    qualifies), else POT's log-domain ``sinkhorn_log``, which is stable but ~10–70× slower.
    """
    cost = np.asarray(cost, dtype=np.float64)
    if cost.max() / reg <= MAX_EXPONENT:
        return _sinkhorn_knopp(cost, reg, iters)
    import ot  # POT: slow to import, and only the log-domain case needs it

    a = np.full(cost.shape[0], 1.0 / cost.shape[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # POT warns when it stops at numItermax, which is the point
        return ot.sinkhorn(a, a, cost, reg, method="sinkhorn_log", numItermax=iters, stopThr=0.0)


def _sinkhorn_knopp(cost: np.ndarray, reg: float, iters: int) -> np.ndarray:
    """POT's ``sinkhorn_knopp`` with ``stopThr=0`` and uniform marginals, operation for operation (so
    the same plan to the bit), without its per-iteration bookkeeping: ``v = a / Kᵀu``, ``u = 1 / (K/a) v``;
    a numerical failure (a zero or non-finite scaling) stops at the previous iterate, as POT does."""
    c = cost.shape[0]
    a = np.full(c, 1.0 / c)
    u, v = np.ones(c) / c, np.ones(c) / c
    kernel = np.exp(cost / (-reg))
    scaled = (1 / a).reshape(-1, 1) * kernel
    for _ in range(iters):
        kt_u = np.dot(kernel.T, u)
        v_next = a / kt_u
        u_next = 1.0 / np.dot(scaled, v_next)
        if not (kt_u.all() and np.isfinite(u_next).all() and np.isfinite(v_next).all()):
            break
        u, v = u_next, v_next
    return u.reshape((-1, 1)) * kernel * v.reshape((1, -1))


def outright_optima(scores: np.ndarray, maximize: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """For each matrix of ``scores [n, c, c]``: every row's best column, and whether those columns are the optimal
    permutation outright — each row's best entry unique and no two rows sharing its column (no permutation can
    then do better in any row)."""
    best = scores.argmax(-1) if maximize else scores.argmin(-1)
    values = np.take_along_axis(scores, best[..., None], -1)
    unique = ((scores == values).sum(-1) == 1).all(-1)
    distinct = (np.diff(np.sort(best, -1), axis=-1) != 0).all(-1)
    return best, unique & distinct


def _solve(scores: np.ndarray, maximize: bool) -> np.ndarray:
    """SciPy's exact assignment (Crouse 2016) as ``perm[i]``."""
    from scipy.optimize import linear_sum_assignment  # slow to import; not needed by every merge

    rows, cols = linear_sum_assignment(scores, maximize=maximize)
    return cols[np.argsort(rows)]


def assignment(scores: np.ndarray, maximize: bool = False) -> np.ndarray:
    """``perm`` optimising ``Σ_i scores[i, perm[i]]`` over permutations: the row optima where they are the optimum
    outright (:func:`outright_optima`), otherwise SciPy's exact assignment."""
    columns, outright = outright_optima(np.asarray(scores)[None], maximize)
    return columns[0] if outright[0] else _solve(scores, maximize)


def plan_to_permutation(plan: np.ndarray) -> np.ndarray:
    """The permutation carrying the most mass of ``plan``: ``perm[i] = j`` maximising ``Σ_i plan[i, perm[i]]``."""
    return assignment(plan, maximize=True)


def match(cost: np.ndarray, solver: Solver = "sinkhorn", reg: float = 0.05, iters: int = 25) -> np.ndarray:
    """Permutation aligning another station's filters to the reference: new filter ``i`` := old ``perm[i]``.

    ``sinkhorn``: the paper's entropic plan rounded to a permutation; ``hungarian``: the exact
    assignment minimising ``Σ_i C[i, perm[i]]`` (the unregularised eq. 4, whose optimum is a vertex).
    """
    if solver == "hungarian":
        return assignment(cost)
    if solver == "sinkhorn":
        return plan_to_permutation(sinkhorn_plan(cost, reg, iters))
    raise ValueError(f"unknown FOT solver {solver!r}; expected 'sinkhorn' or 'hungarian'")


def match_all(costs: Tensor, solver: Solver = "sinkhorn", reg: float = 0.05, iters: int = 25) -> list[np.ndarray]:
    """:func:`match` for each matrix of ``costs [n, c, c]`` (float32, as eq. 3's GEMMs give them).

    ``hungarian`` screens every matrix at once in float32 (:func:`outright_optima`; the cast to float64 is exact,
    so the comparisons are :func:`assignment`'s); only the matrices without an outright optimum are cast to
    float64 and solved one by one.
    """
    costs = costs.cpu()
    if solver != "hungarian":
        def solve(cost: Tensor) -> np.ndarray:
            return match(cost.double().numpy(), solver, reg, iters)

        if costs.shape[-1] < THREADED_SOLVES_FROM:
            return [solve(c) for c in costs]
        return map_on_threads(solve, list(costs), "feddg-sinkhorn")
    columns, outright = outright_optima(costs.numpy())
    return [columns[i] if outright[i] else _solve(costs[i].double().numpy(), False) for i in range(len(costs))]


class _Producer:
    """One conv weight whose filters FOT matches: the reference's unit filters (eq. 2) and every
    station's filters (views of its weights) with their norms, computed once per merge, plus the
    inner products ``cross[e] = w_e · ŵ_refᵀ`` of the raw filters (rows in the station's original
    filter order, its input channels permuted as they were at step ``at[e]``); eq. 2's ``1/‖w‖``
    enters with the cost. A station's filters are never copied: where its input channels moved, the
    reference's filters take the inverse permutation instead (the same sum, its terms in another order),
    gathered from :attr:`ref_t` in contiguous rows of ``r · c`` floats rather than ``r``-float runs, and read by
    the GEMM transposed (2-core Zen 5, 512 × 512 × 9 with oneDNN: gather and product 5.7 ms against 7.7 ms for
    ``r``-float runs, the product alone 5.1 ms); :func:`cross_product` picks the GEMM."""

    def __init__(
        self,
        key: str,
        ref: Mapping[str, Tensor],
        others: Sequence[Mapping[str, Tensor]],
        inputs: list[tuple[str, Axis]],
        block: int = 1,
    ) -> None:
        r = ref[key]
        self.key, self.inputs = key, inputs
        # a channel of ``block`` rows (an attention head's): its rows' entries are one filter [c_in, block]
        self.ref = normalise_filters(r) if block == 1 else normalise_filters(_blocks(r.float(), block).flatten(1))
        self.ref_sq = self.ref.pow(2).sum(-1)
        self.others = []
        for o in others:
            w = resize_filters(o[key], (r.shape[-2], r.shape[-1])) if r.dim() == 4 else o[key]
            # [c, c_in, k·k], a view if float32
            self.others.append(w.float().reshape(w.shape[0], w.shape[1], -1) if block == 1 else _blocks(w.float(), block))
        norms = torch.stack([torch.linalg.vector_norm(w.flatten(1), dim=1) for w in self.others])
        self.inv_norm = 1.0 / norms.clamp_min(1e-12)  # [E, c]
        self.other_sq = (norms * self.inv_norm).pow_(2)  # 1, or 0 for an all-zero filter
        self.cross = torch.empty(len(others), self.others[0].shape[0], self.ref.shape[0], device=r.device)
        self.at = np.full(len(others), -1)
        self.product = cross_product(r.device)

    @cached_property
    def ref_t(self) -> Tensor:
        """The reference's unit filters as ``[c_in, r, c]`` (an input channel is a contiguous row), on first need."""
        return self.ref.reshape(self.ref.shape[0], self.others[0].shape[1], -1).permute(1, 2, 0).contiguous()

    @cached_property
    def gathered(self) -> Tensor:
        """The buffer of every gather of :attr:`ref_t` (no fresh pages per GEMM)."""
        return torch.empty_like(self.ref_t)

    def _filters(self, e: int) -> Tensor:
        """Station ``e``'s filters ``[c, d]`` as stored (a view of its weights)."""
        return self.others[e].reshape(self.others[e].shape[0], -1)

    def _moved_reference(self, e: int, total: Mapping[str, np.ndarray]) -> Tensor | None:
        """``[c, d]``: the reference's unit filters with the inverse of the permutation that the groups' current
        permutations apply to station ``e``'s input channels, so that ``filters · thisᵀ`` is the inner product of the
        permuted filters with the reference; ``None`` where nothing moves them (the transpose of a view of
        :attr:`gathered`, valid until the next call)."""
        index = None
        for group, axis in self.inputs:
            perm = total[group][e]
            if (perm != np.arange(len(perm))).any():
                index = np.arange(len(self.ref_t)) if index is None else index
                pos = axis.positions(len(perm))
                index[pos.ravel()] = pos[perm].ravel()  # permuted input channel j is station channel index[j]
        if index is None:
            return None
        inverse = np.empty_like(index)
        inverse[index] = np.arange(len(index))
        torch.index_select(self.ref_t, 0, torch.from_numpy(inverse).to(self.ref_t.device), out=self.gathered)
        return self.gathered.view(-1, self.ref_t.shape[-1]).T

    def stale(self, changed: Mapping[str, np.ndarray], since: np.ndarray) -> np.ndarray:
        """Stations whose input channels moved after step ``since``."""
        out = since < 0
        for group, _ in self.inputs:
            out |= changed[group] > since
        return out

    def refresh(
        self, stations: np.ndarray, total: Mapping[str, np.ndarray], changed: Mapping[str, np.ndarray], step: int
    ) -> None:
        """Eq. 3's GEMM for the given stations whose inner products are missing or out of date."""
        for e in stations[self.stale(changed, self.at)[stations]]:
            moved = self._moved_reference(e, total)
            self.product(self._filters(e), self.ref if moved is None else moved, self.cross[e])
            self.at[e] = step

    def cost(self, stations: np.ndarray, rows: Tensor) -> Tensor:
        """Eq. 3 ``[n, c_ref, c]`` for the stations' filters in their current order ``rows [n, c]``."""
        index = torch.from_numpy(stations)[:, None].to(self.cross.device)
        rows = rows.to(self.cross.device)
        scale = self.inv_norm[index, rows]
        return _cost_from_cross(self.cross[index, rows], self.ref_sq, self.other_sq[index, rows], scale)

    def diagonal(self, e: int, total: Mapping[str, np.ndarray]) -> Tensor:
        """``C_ii`` of eq. 3 for station ``e``'s filters in their original order (the cost of not
        moving them), without the GEMM."""
        moved = self._moved_reference(e, total)
        dot = torch.linalg.vecdot(self._filters(e), self.ref if moved is None else moved) * self.inv_norm[e]
        return (self.ref_sq + self.other_sq[e] - 2.0 * dot).clamp_min_(0.0)


def _blocks(w: Tensor, block: int) -> Tensor:
    """``[c·block, c_in, ...] -> [c, c_in, block·...]``: channel ``i``'s rows ``i·block + j`` as one filter."""
    c = w.shape[0] // block
    return w.reshape(c, block, w.shape[1], -1).transpose(1, 2).reshape(c, w.shape[1], -1)


def _producer_blocks(spec: PermutationSpec) -> dict[str, int]:
    """Producer key -> rows per channel (``Axis.block`` of its output axis; 1 for a conv's filters)."""
    return {a.key: a.block for g in spec.groups for a in g.members if a.dim == 0 and a.key in g.producers}


def _producer_inputs(spec: PermutationSpec) -> dict[str, list[tuple[str, Axis]]]:
    """Producer key -> the groups (and their axes) indexing its input channels (dim 1)."""
    producers = {p for g in spec.groups for p in g.producers}
    inputs: dict[str, list[tuple[str, Axis]]] = {p: [] for p in producers}
    for g in spec.groups:
        for a in g.members:
            if a.dim == 1 and a.key in inputs:
                inputs[a.key].append((g.name, a))
    return inputs


def group_costs(ref: Mapping[str, Tensor], others: Sequence[Mapping[str, Tensor]], group: PermGroup) -> Tensor:
    """``[E, c, c]`` cost of each station against the reference for one group: eq. 3 averaged over the
    group's producers (one producer per plain conv layer; several for a residual stream)."""
    if not group.producers:
        raise ValueError(f"group {group.name} has no producers")
    stations = np.arange(len(others))
    rows = torch.arange(group.size).expand(len(others), -1)
    total = None
    blocks = {a.key: a.block for a in group.members if a.dim == 0}
    for key in group.producers:
        p = _Producer(key, ref, others, [], blocks.get(key, 1))
        p.refresh(stations, {}, {}, 0)
        c = p.cost(stations, rows)
        total = c if total is None else total + c
    assert total is not None
    return total / len(group.producers)


@dataclass
class Alignment:
    """The permutation found for each station (every group, identities included), per-group diagnostics
    (means over stations): the fraction of filters moved, and the transport cost per filter ``Σ_i C[i, π(i)] / c``
    of the identity matching before alignment and of the found permutation after it (both with the
    layer's input channels aligned by the groups before it), and the number of sweeps that matched
    at least one group; :attr:`states` applies the permutations (on first use: a merge that only needs
    the mean can fuse them into it instead)."""

    others: Sequence[Mapping[str, Tensor]]
    spec: PermutationSpec
    perms: list[Permutations]
    moved: dict[str, float] = field(default_factory=dict)
    cost_before: dict[str, float] = field(default_factory=dict)
    cost_after: dict[str, float] = field(default_factory=dict)
    passes: int = 0

    @cached_property
    def states(self) -> list[dict[str, Tensor]]:
        """The aligned station states (eq. 5): each station's permutations applied to its tensors."""
        return [
            apply_permutations(o, self.spec, {g: p for g, p in pe.items() if (p != np.arange(len(p))).any()})
            for o, pe in zip(self.others, self.perms, strict=True)
        ]


def align_to_reference(
    ref: Mapping[str, Tensor],
    others: Sequence[Mapping[str, Tensor]],
    spec: PermutationSpec,
    solver: Solver = "sinkhorn",
    reg: float = 0.05,
    iters: int = 25,
) -> Alignment:
    """Eqs. 2–5 for every group of ``spec``: permute each state in ``others`` towards ``ref``.

    Coordinate descent over the groups in spec order: each group is matched after the permutations
    found so far, so a layer's filters are compared with aligned input channels (Singh & Jaggi
    2020). In the first sweep a group leaves out the producers whose inputs no group has matched yet
    (the unaligned inner product is noise) unless that leaves none; such a group, and any group one
    of whose producers' input channels moved after it was matched, is matched again in the next
    sweep (for the stations concerned), until nothing is left to match (at most :data:`MAX_PASSES`
    sweeps). Acyclic specs therefore take one sweep; residual streams two or more. ``cost_before``
    is every group's identity matching at its first match (all producers), ``cost_after`` its last
    matching.
    """
    n = len(others)
    if not n:
        return Alignment(others, spec, [])
    inputs = _producer_inputs(spec)
    blocks = _producer_blocks(spec)
    producers = {k: _Producer(k, ref, others, inputs[k], blocks.get(k, 1)) for g in spec.groups for k in g.producers}
    total = {g.name: np.tile(np.arange(g.size), (n, 1)) for g in spec.groups}
    changed = {g.name: np.full(n, -1) for g in spec.groups}  # step at which a station's permutation last moved
    matched = {g.name: np.full(n, -1) for g in spec.groups}  # step at which a station was last matched
    found = {g.name: np.zeros(n) for g in spec.groups}
    partial: set[str] = set()
    before: dict[str, float] = {}
    everyone = np.arange(n)
    step = passes = 0
    while passes < MAX_PASSES:
        swept = False
        for g in spec.groups:
            prods = [producers[k] for k in g.producers]
            if not prods:
                raise ValueError(f"group {g.name} has no producers")
            first = matched[g.name][0] < 0
            if first or g.name in partial:
                stations = everyone
            else:
                stations = np.flatnonzero(np.any([p.stale(changed, matched[g.name]) for p in prods], axis=0))
            if not len(stations):
                continue
            swept, step = True, step + 1
            aligned = [p for p in prods if all(matched[h][0] >= 0 for h, _ in p.inputs)]
            used = aligned if first and aligned else prods
            partial.discard(g.name)
            if len(used) < len(prods):
                partial.add(g.name)
            for p in used:
                p.refresh(stations, total, changed, step)
            rows = torch.from_numpy(total[g.name][stations])
            cost = used[0].cost(stations, rows)
            for p in used[1:]:
                cost = cost + p.cost(stations, rows)
            costs = (cost / len(used)).cpu()  # float32; the diagnostics below sum its entries in float64
            if first:
                diag = torch.diagonal(costs, dim1=1, dim2=2).double().numpy() * len(used)
                for p in prods:
                    if p not in used:
                        diag = diag + np.stack([p.diagonal(int(e), total).double().cpu().numpy() for e in stations])
                before[g.name] = float((diag / len(prods)).mean())
            identity = np.arange(g.size)
            for i, (e, perm) in enumerate(zip(stations, match_all(costs, solver, reg, iters), strict=True)):
                found[g.name][e] = costs[i][identity, perm].double().numpy().mean()
                matched[g.name][e] = step
                if (perm != identity).any():
                    total[g.name][e] = total[g.name][e][perm]
                    changed[g.name][e] = step
        if not swept:
            break
        passes += 1
    perms = [{g: t[e] for g, t in total.items()} for e in range(n)]
    moved = {g.name: float((total[g.name] != np.arange(g.size)).mean()) for g in spec.groups}
    after = {g: float(f.mean()) for g, f in found.items()}
    return Alignment(others, spec, perms, moved, before, after, passes)
