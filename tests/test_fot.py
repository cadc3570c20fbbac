"""FOT alignment, HFedATM eqs. 2–6, against hand-computed and closed-form values."""

import itertools

import numpy as np
import pytest
import torch

from feddg.aggregation import fot
from feddg.aggregation.fot import (
    MAX_PASSES,
    Solver,
    align_to_reference,
    assignment,
    cost_matrix,
    group_costs,
    match,
    match_all,
    normalise_filters,
    plan_to_permutation,
    resize_filters,
    sinkhorn_plan,
)
from feddg.models import create_model
from feddg.models.permutation import (
    Axis,
    PermGroup,
    PermutationSpec,
    apply_permutations,
    permutation_spec,
    random_permutations,
)


def test_eq2_filters_are_flattened_to_unit_vectors_and_zero_stays_zero():
    w = torch.zeros(3, 2, 1, 2)
    w[0, 0, 0, 0], w[0, 1, 0, 1] = 3.0, 4.0  # norm 5
    w[1, 1, 0, 0] = -2.0
    out = normalise_filters(w)
    assert out.shape == (3, 4)
    torch.testing.assert_close(out[0], torch.tensor([0.6, 0.0, 0.0, 0.8]))
    torch.testing.assert_close(out[1], torch.tensor([0.0, 0.0, -1.0, 0.0]))
    torch.testing.assert_close(out[2], torch.zeros(4))
    assert normalise_filters(torch.randn(5, 3, 2, 4, 4)).shape == (5, 3, 32)  # stacked over stations


def test_eq3_cost_is_squared_euclidean_between_reference_rows_and_other_rows():
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    other = torch.tensor([[0.0, 1.0], [0.6, 0.8], [1.0, 0.0]])
    expected = torch.tensor(
        [[2.0, 0.8, 0.0], [0.0, 0.4, 2.0], [0.4, 0.0, 0.8]]  # C[i, j] = ‖ref_i − other_j‖²
    )
    torch.testing.assert_close(cost_matrix(ref, other), expected)
    batched = cost_matrix(ref, torch.stack([other, ref]))
    torch.testing.assert_close(batched[0], expected)
    torch.testing.assert_close(batched[1].diagonal(), torch.zeros(3))


@pytest.mark.parametrize("reg", [0.5, 0.2, 0.001])
def test_eq4_sinkhorn_plan_matches_the_2x2_closed_form(reg):
    # Uniform marginals: plan [[a, ½−a], [½−a, a]] with a² / (½−a)² = exp((C12 + C21 − C11 − C22) / reg).
    cost = np.array([[0.9, 1.0], [0.95, 0.8]])  # at reg 0.001 every exp(−C/reg) underflows to 0
    a = 0.5 / (1.0 + np.exp(-(cost[0, 1] + cost[1, 0] - cost[0, 0] - cost[1, 1]) / (2 * reg)))
    plan = sinkhorn_plan(cost, reg, iters=2000)
    np.testing.assert_allclose(plan, [[a, 0.5 - a], [0.5 - a, a]], atol=1e-9)


def test_eq4_default_sinkhorn_has_uniform_marginals_and_rounds_to_the_optimal_permutation():
    rng = np.random.default_rng(0)
    perm = rng.permutation(6)
    cost = 2.0 + rng.uniform(0, 0.3, size=(6, 6))
    cost[np.arange(6), perm] = rng.uniform(0, 0.1, size=6)  # a clear optimum
    plan = sinkhorn_plan(cost, 0.05, 25)
    np.testing.assert_allclose(plan.sum(1), np.full(6, 1 / 6), atol=1e-6)
    assert np.array_equal(plan_to_permutation(plan), perm)
    assert np.array_equal(match(cost), perm)


def test_sinkhorn_iterations_are_pots_to_the_bit():
    ot = pytest.importorskip("ot")
    rng = np.random.default_rng(3)
    for c in (2, 7, 64):
        cost = rng.uniform(0, 4, size=(c, c))
        a = np.full(c, 1.0 / c)
        for iters in (1, 25):
            expected = ot.sinkhorn(a, a, cost, 0.05, numItermax=iters, stopThr=0.0, warn=False)
            assert np.array_equal(sinkhorn_plan(cost, 0.05, iters), expected)


def test_hungarian_is_the_exact_assignment_by_brute_force():
    cost = np.random.default_rng(1).uniform(size=(5, 5))
    best = min(itertools.permutations(range(5)), key=lambda p: cost[np.arange(5), list(p)].sum())
    assert np.array_equal(match(cost, "hungarian"), np.array(best))
    with pytest.raises(ValueError, match="solver"):
        match(cost, "greedy")


def test_assignment_takes_the_row_optima_only_when_they_are_the_unique_optimum(monkeypatch):
    import scipy.optimize

    calls = []
    solver = scipy.optimize.linear_sum_assignment
    monkeypatch.setattr(scipy.optimize, "linear_sum_assignment", lambda *a, **k: calls.append(1) or solver(*a, **k))
    cost = np.array([[0.1, 0.5, 0.9], [0.8, 0.7, 0.2], [0.3, 0.1, 0.6]])  # row minima in distinct columns
    assert assignment(cost).tolist() == [0, 2, 1] and assignment(-cost, maximize=True).tolist() == [0, 2, 1]
    assert not calls
    clash = np.array([[0.1, 0.2, 0.9], [0.15, 0.9, 0.9], [0.9, 0.9, 0.1]])  # rows 0 and 1 both want column 0
    assert assignment(clash).tolist() == [1, 0, 2] and len(calls) == 1  # 0.2 + 0.15 + 0.1 beats 0.1 + 0.9 + 0.1
    tie = np.array([[0.1, 0.1], [0.5, 0.2]])  # row 0's best is not unique
    assert assignment(tie).tolist() == [0, 1] and len(calls) == 2


@pytest.mark.parametrize("solver", ["hungarian", "sinkhorn"])
def test_match_all_screens_in_float32_and_gives_match_per_matrix(solver, monkeypatch):
    import scipy.optimize

    calls = []
    lsa = scipy.optimize.linear_sum_assignment
    monkeypatch.setattr(scipy.optimize, "linear_sum_assignment", lambda *a, **k: calls.append(1) or lsa(*a, **k))
    clean = torch.tensor([[0.1, 0.5, 0.9], [0.8, 0.7, 0.2], [0.3, 0.1, 0.6]])
    clash = torch.tensor([[0.1, 0.2, 0.9], [0.15, 0.9, 0.9], [0.9, 0.9, 0.1]])
    tie = torch.tensor([[0.1, 0.1, 0.5], [0.5, 0.2, 0.9], [0.9, 0.8, 0.3]])
    rand = torch.rand(4, 3, 3, generator=torch.Generator().manual_seed(0))
    costs = torch.cat([torch.stack([clean, clash, tie]), rand])
    got = match_all(costs, solver, reg=0.05, iters=25)
    assert [p.tolist() for p in got] == [match(c.double().numpy(), solver).tolist() for c in costs]
    if solver == "hungarian":
        assert [p.tolist() for p in got[:3]] == [[0, 2, 1], [1, 0, 2], [0, 1, 2]]
        calls.clear()
        match_all(costs[:1], solver)
        assert not calls  # a clean matrix never reaches SciPy
        match_all(costs[1:3], solver)
        assert len(calls) == 2  # the clash and the tie do


def test_large_sinkhorn_groups_are_solved_on_threads_each_plan_in_its_place(monkeypatch):
    """From ``THREADED_SOLVES_FROM`` channels a group's plans are solved on torch's thread budget; every station must
    still get its own plan's permutation, the serial one to the bit."""
    import threading

    from feddg.aggregation import fot

    costs = 4 * torch.rand(5, fot.THREADED_SOLVES_FROM, fot.THREADED_SOLVES_FROM, generator=torch.Generator().manual_seed(0))
    want = [match(c.double().numpy(), "sinkhorn") for c in costs]
    threads, solve = [], fot.match
    monkeypatch.setattr(fot, "match", lambda *a, **k: threads.append(threading.current_thread().name) or solve(*a, **k))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = match_all(costs, "sinkhorn")
    finally:
        torch.set_num_threads(before)
    assert len({tuple(p) for p in want}) == 5 and all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert len(threads) == 5 and all(t.startswith("feddg-sinkhorn") for t in threads)


def test_lemma2_ot_cost_is_invariant_to_a_common_permutation():
    rng = np.random.default_rng(2)
    a, b = torch.randn(7, 12), torch.randn(7, 12)
    p = torch.from_numpy(rng.permutation(7))

    def d_ot(x, y):
        c = cost_matrix(normalise_filters(x), normalise_filters(y)).double().numpy()
        return c[np.arange(7), match(c, "hungarian")].sum()

    assert d_ot(a[p], b[p]) == pytest.approx(d_ot(a, b), rel=1e-6)


def test_eq6_bilinear_resize_of_filters():
    w = torch.tensor([[0.0, 1.0], [2.0, 3.0]]).reshape(1, 1, 2, 2)
    # align_corners=False, 2 -> 4: source positions -0.25, 0.25, 0.75, 1.25 (clamped at the borders)
    row = torch.tensor([0.0, 0.25, 0.75, 1.0])
    expected = (row[None, :] + 2.0 * row[:, None]).reshape(1, 1, 4, 4)
    torch.testing.assert_close(resize_filters(w, (4, 4)), expected)
    const = torch.full((2, 3, 5, 5), 0.7)
    torch.testing.assert_close(resize_filters(const, (3, 3)), torch.full((2, 3, 3, 3), 0.7))
    assert resize_filters(w, (2, 2)) is w


def test_group_cost_resizes_filters_of_another_size_to_the_reference():
    group = PermGroup("c", 2, ("c.weight",), (Axis("c.weight", 0),))
    small = {"c.weight": torch.tensor([[0.0, 1.0], [2.0, 3.0]]).reshape(1, 1, 2, 2).repeat(2, 1, 1, 1)}
    small["c.weight"][1] *= -1
    ref = {"c.weight": resize_filters(small["c.weight"], (4, 4))}  # the reference has 4×4 filters
    cost = group_costs(ref, [small], group)[0]
    assert cost.diagonal().abs().max() < 1e-6 and cost[0, 1] > 3.99  # same filters; opposite ones


def _chain_spec():
    """conv a (4 filters) -> conv b (3 filters) -> linear l (block 2)."""
    ga = PermGroup("a", 4, ("a.weight",), (Axis("a.weight", 0), Axis("a.bias", 0), Axis("b.weight", 1)))
    gb = PermGroup("b", 3, ("b.weight",), (Axis("b.weight", 0), Axis("l.weight", 1, 0, 2)))
    return PermutationSpec((ga, gb))


def test_alignment_undoes_a_known_permutation_and_reports_what_moved():
    g = torch.Generator().manual_seed(0)
    state = {"a.weight": torch.randn(4, 2, 3, 3, generator=g), "a.bias": torch.randn(4, generator=g),
             "b.weight": torch.randn(3, 4, 3, 3, generator=g), "l.weight": torch.randn(5, 6, generator=g)}
    spec = _chain_spec()
    q = {"a": np.array([1, 0, 2, 3]), "b": np.array([0, 1, 2])}  # swaps two of four filters of a
    al = align_to_reference(state, [apply_permutations(state, spec, q)], spec)
    assert al.moved == {"a": 0.5, "b": 0.0}
    assert np.array_equal(al.perms[0]["a"], [1, 0, 2, 3])
    assert all(torch.equal(al.states[0][k], v) for k, v in state.items())
    assert al.cost_after["a"] < 1e-6 < al.cost_before["a"] and al.passes == 1
    same = align_to_reference(state, [state], spec)
    assert same.moved == {"a": 0.0, "b": 0.0} and max(same.cost_before.values()) < 1e-6


# --- the fast path: one GEMM per producer and station, same permutations as the plain algorithm ----------


def _perturbed_permuted_copies(model, spec, n, noise, seed):
    """``n`` copies of ``model``'s state with Gaussian noise (``noise`` × each tensor's std) and random
    channel permutations: what a merge of diverged, independently initialised stations looks like."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    copies = []
    for _ in range(n):
        noisy = {k: v + noise * v.std() * torch.randn(v.shape, generator=g) if v.is_floating_point() and v.numel() > 1
                 else v for k, v in state.items()}
        copies.append(apply_permutations(noisy, spec, random_permutations(spec, rng)))
    return state, copies


def _reference_alignment(ref, others, spec, solver):
    """The plain algorithm (before the fast path) in float64: sweeps over every group with every
    producer, costs rebuilt from the permuted weights, until a sweep changes no permutation."""

    def unit(w):
        flat = w.double().flatten(1)
        return flat / flat.norm(dim=1, keepdim=True).clamp_min(1e-12)

    states = [dict(o) for o in others]
    total = [{g.name: np.arange(g.size) for g in spec.groups} for _ in others]
    for _ in range(MAX_PASSES):
        changed = False
        for g in spec.groups:
            for e, s in enumerate(states):
                cost = sum(cost_matrix(unit(ref[k]), unit(s[k])).numpy() for k in g.producers) / len(g.producers)
                perm = match(cost, solver)
                if (perm != np.arange(g.size)).any():
                    changed = True
                    states[e] = apply_permutations(s, PermutationSpec((g,)), {g.name: perm})
                    total[e][g.name] = total[e][g.name][perm]
        if not changed:
            break
    return total


@pytest.mark.parametrize("solver", ["sinkhorn", "hungarian"])
def test_float32_fast_path_chooses_the_permutations_of_the_float64_plain_algorithm(solver):
    # realistic filters: EfficientNet-Lite0's ImageNet weights up to block 7 (three residual streams,
    # depthwise convs, up to 480 channels), two stations perturbed by 0.5 std and randomly permuted
    torch.manual_seed(0)
    model = create_model("efficientnet_lite0", num_classes=10, pretrained=True)
    spec = PermutationSpec(permutation_spec(model).groups[:12])
    assert spec.groups[-1].name == "_blocks.7._expand_conv" and not spec.acyclic
    ref, others = _perturbed_permuted_copies(model, spec, 2, 0.5, seed=1)
    fast = align_to_reference(ref, others, spec, solver=solver)
    slow = _reference_alignment(ref, others, spec, solver)
    for e in range(2):
        for g in spec.groups:
            assert np.array_equal(fast.perms[e][g.name], slow[e][g.name]), (e, g.name)
    assert min(fast.moved.values()) > 0.5 and fast.passes >= 2


def test_each_producer_is_multiplied_once_per_station_and_unpermuted_stations_stay(monkeypatch):
    torch.manual_seed(0)
    model = create_model("resnet18", num_classes=5, image_size=32)
    spec = permutation_spec(model)
    ref, others = _perturbed_permuted_copies(model, spec, 2, 0.1, seed=2)
    calls = []
    product = fot.cross_product(torch.device("cpu"))
    monkeypatch.setattr(fot, "cross_product", lambda device: lambda a, b, out: calls.append(a.shape) or product(a, b, out))
    al = align_to_reference(ref, others, spec, solver="hungarian")
    producers = sum(len(g.producers) for g in spec.groups)
    # streams wait for their blocks' inner convs in sweep 1 and are matched with all producers in sweep 2
    assert len(calls) == 2 * producers == 40 and al.passes == 2
    assert min(al.moved.values()) > 0.5 and max(al.cost_after.values()) < min(al.cost_before.values())
    calls.clear()
    same = align_to_reference(ref, [ref], spec, solver="hungarian")
    assert len(calls) == producers and max(same.moved.values()) == 0.0 and same.passes == 2
    assert all(same.states[0][k] is v for k, v in ref.items())  # nothing moved: nothing copied


@pytest.mark.parametrize("kernel", ["mkl_cross", "onednn_cross"])
def test_stations_filters_are_multiplied_as_stored_and_the_reference_takes_the_inverse_permutation(kernel, monkeypatch):
    # a station whose input channels moved is not copied: every GEMM reads a station's weights in place, and
    # the permutations are those of the plain float64 algorithm, which permutes the stations' weights themselves;
    # with either CPU GEMM (the moved reference reaches them as a transposed view of its gather)
    if kernel == "onednn_cross" and not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN")
    torch.manual_seed(0)
    model = create_model("resnet18", num_classes=5, image_size=32)
    spec = permutation_spec(model)
    ref, others = _perturbed_permuted_copies(model, spec, 2, 0.1, seed=4)
    stored = {v.data_ptr() for o in others for v in o.values()}
    firsts = []
    product = getattr(fot, kernel)
    monkeypatch.setattr(fot, "cross_product", lambda device: lambda a, b, out: firsts.append(a.data_ptr()) or product(a, b, out))
    al = align_to_reference(ref, others, spec, solver="hungarian")
    assert len(firsts) == 2 * sum(len(g.producers) for g in spec.groups) and set(firsts) <= stored
    slow = _reference_alignment(ref, others, spec, "hungarian")
    assert all(np.array_equal(al.perms[e][g.name], slow[e][g.name]) for e in range(2) for g in spec.groups)
    assert min(al.moved.values()) > 0.5


def test_cost_before_counts_every_producer_even_those_matched_later():
    # the first stream of a ResNet is matched in sweep 1 on the stem alone (its blocks' conv2 inputs are
    # not aligned yet); its identity cost still averages all three producers, as eq. 3 defines it
    torch.manual_seed(0)
    model = create_model("resnet18", num_classes=5, image_size=32)
    spec = permutation_spec(model)
    ref, (other,) = _perturbed_permuted_copies(model, spec, 1, 0.1, seed=3)
    stream = spec.groups[0]
    assert len(stream.producers) == 3
    al = align_to_reference(ref, [other], spec)
    expected = np.diag(group_costs(ref, [other], stream)[0].double().numpy()).mean()
    assert al.cost_before[stream.name] == pytest.approx(expected, rel=1e-5)


def test_eq4_sinkhorn_plan_with_underflowing_kernel_entries_keeps_the_2x2_closed_form() -> None:
    # max C / reg = 950 > 500, but min C = 0: the plain kernel exp(−C/reg) would be [[1, 0], [0, 0]]
    cost = np.array([[0.0, 0.9], [0.95, 0.8]])
    reg = 0.001
    a = 0.5 / (1.0 + np.exp(-(cost[0, 1] + cost[1, 0] - cost[0, 0] - cost[1, 1]) / (2 * reg)))
    np.testing.assert_allclose(sinkhorn_plan(cost, reg, iters=50), [[a, 0.5 - a], [0.5 - a, a]], atol=1e-9)


@pytest.mark.parametrize("solver", ["hungarian", "sinkhorn"])
def test_eq3_costs_and_diagnostics_of_all_zero_filters_by_hand(solver: Solver) -> None:
    # reference filters (1, 0) and 0; station filters 0 and (3, 4) -> unit (0.6, 0.8)
    group = PermGroup("c", 2, ("c.weight",), (Axis("c.weight", 0),))
    ref = {"c.weight": torch.tensor([[1.0, 0.0], [0.0, 0.0]])}
    other = {"c.weight": torch.tensor([[0.0, 0.0], [3.0, 4.0]])}
    # C_ij = ‖ŵ_ref,i − ŵ_other,j‖²: ‖e0 − 0‖² = 1, ‖e0 − (.6, .8)‖² = 0.8, ‖0 − 0‖² = 0, ‖0 − (.6, .8)‖² = 1
    expected = torch.tensor([[1.0, 0.8], [0.0, 1.0]])
    torch.testing.assert_close(group_costs(ref, [other], group)[0], expected)
    al = align_to_reference(ref, [other], PermutationSpec((group,)), solver=solver)
    assert al.perms[0]["c"].tolist() == [1, 0]  # 0.8 + 0 beats 1 + 1
    assert al.cost_before["c"] == pytest.approx(1.0, abs=1e-6)  # (1 + 1) / 2
    assert al.cost_after["c"] == pytest.approx(0.4, abs=1e-6)  # (0.8 + 0) / 2


@pytest.mark.parametrize("solver", ["hungarian", "sinkhorn"])
def test_a_blocked_producer_with_moved_input_channels_is_realigned_exactly(solver: Solver) -> None:
    # a linear head whose channels are blocks of 2 rows, fed by a layer whose 4 channels are permuted too
    ga = PermGroup("a", 4, ("a.weight",), (Axis("a.weight", 0), Axis("h.weight", 1)))
    gh = PermGroup("h", 3, ("h.weight",), (Axis("h.weight", 0, 0, 2),))
    spec = PermutationSpec((ga, gh))
    g = torch.Generator().manual_seed(0)
    ref = {"a.weight": torch.randn(4, 3, generator=g), "h.weight": torch.randn(6, 4, generator=g)}
    q = {"a": np.array([1, 3, 0, 2]), "h": np.array([2, 0, 1])}
    al = align_to_reference(ref, [apply_permutations(ref, spec, q)], spec, solver=solver)
    assert all(np.array_equal(al.perms[0][k], np.argsort(p)) for k, p in q.items())  # the inverse of q
    assert max(al.cost_after.values()) < 1e-6  # an exact copy: zero transport cost
    assert all(torch.equal(al.states[0][k], v) for k, v in ref.items())


def test_a_stream_rematched_in_later_sweeps_composes_its_permutations_and_reports_its_final_cost() -> None:
    # stream s (producers stem and blk) -> inner conv i -> blk. The station is the reference permuted by q, except
    # its stem, whose near-identical rows say "swap the first two": sweep 1 matches s on the stem alone (blk's
    # inputs are not aligned yet), then i; later sweeps correct s and i relative to the orders found so far
    gs = PermGroup("s", 3, ("stem.weight", "blk.weight"),
                   (Axis("stem.weight", 0), Axis("blk.weight", 0), Axis("inner.weight", 1)))
    gi = PermGroup("i", 3, ("inner.weight",), (Axis("inner.weight", 0), Axis("blk.weight", 1)))
    spec = PermutationSpec((gs, gi))
    g = torch.Generator().manual_seed(3)
    ref = {"stem.weight": torch.tensor([[1.0, 0.0], [1.0, 0.1], [1.0, 0.2]]),
           "inner.weight": torch.randn(3, 3, generator=g), "blk.weight": torch.randn(3, 3, generator=g)}
    q = {"s": np.array([2, 0, 1]), "i": np.array([1, 2, 0])}
    other = apply_permutations(ref, spec, q)
    other["stem.weight"] = ref["stem.weight"][[1, 0, 2]]
    al = align_to_reference(ref, [other], spec, solver="hungarian")
    assert all(np.array_equal(al.perms[0][k], np.argsort(p)) for k, p in q.items())  # the inverse of q
    aligned = al.states[0]
    assert torch.equal(aligned["blk.weight"], ref["blk.weight"]) and torch.equal(aligned["inner.weight"], ref["inner.weight"])
    # eq. 3's diagonal at the final order, by hand: blk matches exactly, the stem rows differ
    unit = torch.nn.functional.normalize
    stem = (unit(ref["stem.weight"].double(), dim=1) - unit(aligned["stem.weight"].double(), dim=1)).pow(2).sum(1)
    assert al.cost_after["s"] == pytest.approx(float((stem / 2).mean()), rel=1e-4) and al.cost_after["i"] < 1e-6
    assert al.passes == 3  # s waits for i in sweep 1, is corrected in sweep 2 and rematched after i moved
