"""Eq. 5 fused into eq. 7: the merge gathers each station's permuted rows inside the float64 mean instead of
writing permuted copies first; the bits must be those of the mean of the materialised permuted states."""

import numpy as np
import pytest
import torch

from feddg.aggregation.fot import align_to_reference
from feddg.aggregation.mean import CHUNK, weighted_mean
from feddg.aggregation.merges import HFedATMParams, merge_stations
from feddg.aggregation.regmean import regmean
from feddg.messages import WEIGHT_PREFIX
from feddg.models import create_model
from feddg.models.permutation import (
    Axis,
    PermGroup,
    PermutationSpec,
    RowGather,
    apply_permutations,
    permutation_spec,
    permute_axis,
    permute_grams,
    random_permutations,
    row_indices,
)


def test_weighted_mean_gathers_rows_before_weighting_by_hand():
    a = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    b = np.array([[10.0, 20.0], [30.0, 40.0]], np.float32)
    # (1·a + 3·b[[1, 0]]) / 4 = ([[1, 2], [3, 4]] + [[90, 120], [30, 60]]) / 4
    out = weighted_mean([a, b], [1, 3], [None, RowGather(np.array([1, 0]))])
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [[22.75, 30.5], [8.25, 16.0]])


def test_fused_gather_gives_the_bits_of_the_mean_of_gathered_copies_across_chunks():
    rng = np.random.default_rng(0)
    rows = CHUNK // 9 * 3 + 5  # several chunks of whole 9-element rows, the last one short
    arrays = [rng.normal(size=(rows, 3, 3)).astype(np.float32) for _ in range(4)]
    index = [None] + [RowGather(rng.permutation(rows)) for _ in range(3)]
    weights = [3.0, 1.0, 7.0, 2.5]
    copies = [a if i is None else a.reshape(rows, -1)[i.rows].reshape(a.shape) for a, i in zip(arrays, index, strict=True)]
    assert np.array_equal(weighted_mean(arrays, weights, index), weighted_mean(copies, weights))


def test_gathers_of_both_leading_dims_give_the_bits_of_the_mean_of_permuted_copies_across_chunks():
    """Filters taken along dim 0, then their input channels along dim 1, a chunk of filters at a time."""
    rng = np.random.default_rng(1)
    shape = (CHUNK // (40 * 9) * 3 + 2, 40, 3, 3)  # several chunks of whole filters, the last one short
    arrays = [rng.normal(size=shape).astype(np.float32) for _ in range(3)]
    index = [None] + [RowGather(rng.permutation(shape[0]), rng.permutation(shape[1])) for _ in range(2)]
    copies = [a if i is None else a[i.rows][:, i.cols] for a, i in zip(arrays, index, strict=True)]
    assert all(np.array_equal(i.apply(a), c) for a, i, c in zip(arrays[1:], index[1:], copies[1:], strict=True))
    assert np.array_equal(weighted_mean(arrays, [1.0, 2.0, 4.5], index), weighted_mean(copies, [1.0, 2.0, 4.5]))


@pytest.mark.parametrize("rows, cols", [([0, 2, 2], None), ([0, 1, 3], None), ([1, 0], [0, 0, 1]), ([1, 0], [-1, 0, 1])])
def test_a_row_gather_is_refused_unless_it_is_a_permutation(rows, cols):
    """The gathers clip out-of-range indices, so anything but a permutation would average the wrong rows silently."""
    with pytest.raises(ValueError, match=r"^RowGather (rows|cols) must be a permutation of 0\.\.\d+$"):
        RowGather(np.array(rows), None if cols is None else np.array(cols))


def test_row_gathers_of_one_tensor_must_view_it_alike():
    with pytest.raises(ValueError, match=r"^row gathers of different shapes: \[\(2, 2\), \(4, 1\)\]$"):
        weighted_mean([np.zeros(4), np.zeros(4)], [1, 1], [RowGather(np.arange(4)), RowGather(np.arange(2))])


def test_row_indices_gather_both_axes_as_one_index_select_per_axis_would():
    w = torch.arange(24.0).reshape(2, 3, 4)  # [out, in, k]
    spec = PermutationSpec((
        PermGroup("out", 2, ("w",), (Axis("w", 0), Axis("b", 0))),
        PermGroup("in", 3, (), (Axis("w", 1),)),
    ))
    perms = {"out": np.array([1, 0]), "in": np.array([2, 0, 1])}
    rows = row_indices({"w": (2, 3, 4), "b": (2,)}, spec, perms)
    # row (i, j) of the [6, 4] view is old (out[i], in[j]): (1, 2), (1, 0), (1, 1), (0, 2), (0, 0), (0, 1)
    assert rows["w"].flat().tolist() == [5, 3, 4, 2, 0, 1] and rows["b"].flat().tolist() == [1, 0]
    assert rows["w"].rows.tolist() == [1, 0] and rows["w"].cols is not None and rows["w"].cols.tolist() == [2, 0, 1]
    state = {"w": w, "b": torch.tensor([5.0, 6.0])}
    out = apply_permutations(state, spec, perms)
    expected = permute_axis(permute_axis(w, Axis("w", 0), perms["out"]), Axis("w", 1), perms["in"])
    assert torch.equal(out["w"], expected) and out["b"].tolist() == [6.0, 5.0]
    assert np.array_equal(rows["w"].apply(w.numpy()), expected.numpy())


@pytest.mark.parametrize("solver", ["hungarian", "sinkhorn"])
def test_fused_merge_has_the_bits_of_the_merge_of_the_permuted_states(solver):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = create_model("cnn", num_classes=4, image_size=28)
    spec = permutation_spec(model)
    base = model.state_dict()
    states = []
    for e in range(3):
        s = {k: v + 0.3 * v.std() * torch.randn(v.shape) if v.is_floating_point() and v.numel() > 1 else v
             for k, v in base.items()}
        states.append(s if e == 0 else apply_permutations(s, spec, random_permutations(spec, rng)))
    layer = next(k.removesuffix(".weight") for k, v in base.items() if k.endswith(".weight") and v.dim() == 2)
    dim = base[f"{layer}.weight"].shape[1]
    grams = []
    for _ in states:  # more samples than inputs: RegMean solves eq. 12 (a singular Gram falls back to the mean)
        x = rng.normal(size=(2 * dim, dim)).astype(np.float32)
        grams.append({layer: x.T @ x})
    gammas = [2.0, 3.0, 5.0]
    merged, metrics = merge_stations([{WEIGHT_PREFIX + k: v.numpy() for k, v in s.items()} for s in states], grams,
                               gammas, spec, solver=solver)
    # the unfused algorithm: permute every state (eq. 5), then RegMean on the permuted Grams and the mean
    al = align_to_reference(states[0], states[1:], spec, solver)
    aligned = [states[0], *al.states]
    assert any(not torch.equal(a[k], s[k]) for a, s in zip(aligned[1:], states[1:], strict=True) for k in a)
    permuted = [grams[0]] + [{k: v.numpy() for k, v in permute_grams({k: torch.from_numpy(v) for k, v in g.items()},
                                                                     spec, p).items()}
                             for g, p in zip(grams[1:], al.perms, strict=True)]
    assert metrics[f"regmean/{layer}/fallback"] == 0.0
    for key in base:
        arrays = [s[key].numpy() for s in aligned]
        if key == f"{layer}.weight":
            want = regmean(arrays, [g[layer] for g in permuted], gammas, layer).weight
        else:
            want = weighted_mean(arrays, gammas)
        got = merged[WEIGHT_PREFIX + key]
        assert got.dtype == want.dtype and np.array_equal(got, want), key


def test_regmean_merge_by_hand_with_an_input_no_station_activated():
    """Eq. 12 where the Grams see input 0 only: W[:, 0] = (Σ G_e)⁻¹ Σ G_e W_e = (1·1 + 2·3) / 3; input 1 is dead at
    every station and takes the γ-weighted mean (eq. 7), as the bias does: (1·10 + 3·20) / 4 and (1·0 + 3·4) / 4."""
    weights = [{WEIGHT_PREFIX + "fc.weight": np.array([[w0, w1]], np.float32), WEIGHT_PREFIX + "fc.bias": np.array([b])}
               for w0, w1, b in ((1.0, 10.0, 0.0), (3.0, 20.0, 4.0))]
    grams = [{"fc": np.diag([g, 0.0])} for g in (1.0, 2.0)]
    merged, metrics = merge_stations(weights, grams, [1.0, 3.0], None)
    np.testing.assert_allclose(merged[WEIGHT_PREFIX + "fc.weight"], [[7 / 3, 17.5]], rtol=1e-6)
    np.testing.assert_allclose(merged[WEIGHT_PREFIX + "fc.bias"], [3.0])
    assert metrics["regmean/fc/dead_inputs"] == 1.0 and metrics["regmean/fc/fallback"] == 0.0


def test_hfedatm_defaults_are_the_supplements_table_1():
    params = HFedATMParams()
    assert (params.lambda_ot, params.sinkhorn_iters, params.solver, params.alpha) == (0.05, 25, "sinkhorn", 0.75)


def test_fot_moved_is_the_mean_over_groups_of_the_fraction_of_filters_moved():
    """A copy with a swap of 2 of conv.0's 6 filters and conv.3's 16 reversed (all moved): FOT undoes exactly that,
    so the groups moved 2/6 and 16/16, and the model 2/3 on average."""
    torch.manual_seed(0)
    model = create_model("lenet", num_classes=4, in_channels=3, image_size=28)
    spec = permutation_spec(model)
    state = model.state_dict()
    q = {"conv.0": np.array([1, 0, 2, 3, 4, 5]), "conv.3": np.arange(16)[::-1].copy()}
    copy = apply_permutations(state, spec, q)
    _, metrics = merge_stations([{WEIGHT_PREFIX + k: v.numpy() for k, v in s.items()} for s in (state, copy)], None,
                                [1.0, 1.0], spec, solver="hungarian")
    assert (metrics["fot/conv.0/moved"], metrics["fot/conv.3/moved"]) == pytest.approx((2 / 6, 1.0))
    assert metrics["fot/moved"] == pytest.approx(2 / 3)


def test_merge_on_two_threads_has_the_bits_and_key_order_of_one_thread():
    """The means run on torch's thread count, largest tensors first: each key must get its own mean, in order."""
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    model = create_model("cnn", num_classes=4, image_size=28)
    spec = permutation_spec(model)
    states = [{k: v + 0.3 * torch.randn(v.shape) if v.is_floating_point() else v for k, v in model.state_dict().items()}
              for _ in range(3)]
    states = [states[0]] + [apply_permutations(s, spec, random_permutations(spec, rng)) for s in states[1:]]
    weights = [{WEIGHT_PREFIX + k: v.numpy() for k, v in s.items()} for s in states]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = merge_stations(weights, None, [1.0, 2.0, 4.0], spec, solver="hungarian")
        torch.set_num_threads(2)
        two, _ = merge_stations(weights, None, [1.0, 2.0, 4.0], spec, solver="hungarian")
    finally:
        torch.set_num_threads(before)
    assert list(two) == list(one) == list(weights[0])
    assert all(two[k].dtype == one[k].dtype and np.array_equal(two[k], one[k]) for k in one)
