"""The privacy audit's building blocks against closed forms (docs/privacy.md, "Auditing what leaves a client"): the
FID features' preprocessing, the Gram root, the Procrustes error and row cosines, the chance level of re-identification,
the vector inversion's clip and ε, local DP of a DLG update, and the grids' mosaic."""

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from matplotlib.axes import Axes
from toy import ToyNet

from feddg.aggregation.accounting import gaussian_epsilon
from feddg.algorithms.components.style import StyleParams, make_codec
from feddg.algorithms.pardon import PardonParams
from feddg.audit.gradient import TinyNet, dp_update, update_norm
from feddg.audit.gram import best_row_cosine, gram_audit, gram_root, procrustes_error, random_rotation
from feddg.audit.grids import draw_grid
from feddg.audit.inversion import Victims, noised, scores, vector_inversion
from feddg.audit.metrics import PSNR_CAP, denormalise, effnet_features, frechet_distance, psnr, reidentification, to_unit
from feddg.audit.shares import moments_share, style_share
from feddg.models.efficientnet import efficientnet_lite0

# --------------------------------------------------------------------------- FID features


def test_effnet_features_are_the_pretrained_nets_pooled_features_of_resized_imagenet_scaled_rgb() -> None:
    grey = np.random.default_rng(0).uniform(size=(2, 1, 12, 12))
    rgb = torch.as_tensor(grey, dtype=torch.float32).expand(-1, 3, -1, -1)
    resized = F.interpolate(rgb, size=(32, 32), mode="bilinear", align_corners=False)
    with torch.no_grad():  # the checkpoint's input range: (255 x − 127) / 128
        ref = efficientnet_lite0(1000, pretrained=True).eval().features((resized * 255.0 - 127.0) / 128.0)
    out = effnet_features(grey, size=32)
    assert out.shape == (2, 1280)
    np.testing.assert_allclose(out, ref.double().numpy(), rtol=1e-5, atol=1e-6)


def test_effnet_features_resize_to_96_px_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from feddg.audit import metrics

    seen: list[tuple[int, ...]] = []
    net = torch.nn.Flatten()
    net.features = lambda x: seen.append(tuple(x.shape)) or x.flatten(1)[:, :4]  # type: ignore[assignment]
    monkeypatch.setattr(metrics, "_feature_net", lambda: net)
    effnet_features(np.zeros((3, 3, 12, 12)), batch=2)
    assert seen == [(2, 3, 96, 96), (1, 3, 96, 96)]  # docs/privacy.md: "EfficientNet-Lite0 at 96 px"


def test_frechet_distance_of_a_set_with_itself_is_zero_never_a_rounding_negative() -> None:
    for seed in range(10):  # Tr Σ₁ + Tr Σ₂ − 2 Tr(Σ₁Σ₂)^{1/2} cancels to ±1e-15: clamped at 0
        f = np.random.default_rng(seed).standard_normal((10, 6))
        assert 0.0 <= frechet_distance(f, f) < 1e-9, seed


def test_frechet_distance_needs_two_samples_in_either_set() -> None:
    f = np.random.default_rng(0).standard_normal((5, 3))
    for f1, f2 in ((f[:1], f), (f, f[:1])):
        with pytest.raises(ValueError, match="at least 2 samples per set"):
            frechet_distance(f1, f2)


# --------------------------------------------------------------------------- image scores


def test_psnr_of_images_a_millionth_apart_is_capped() -> None:
    x = np.full((1, 7, 7), 0.5)
    assert psnr(x, x + 1e-6) == PSNR_CAP == 100.0  # 10 log10(1 / 1e-12) = 120 dB uncapped


def test_denormalised_values_outside_the_image_range_are_clipped_to_0_1() -> None:
    x = np.array([-3.0, 0.0, 3.0]).reshape(1, 3, 1, 1)  # one value per channel: 0.25 x + 0.5 = −0.25, 0.5, 1.25
    assert denormalise(x, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)).ravel().tolist() == [0.0, 0.5, 1.0]


def test_an_empty_value_range_and_no_reconstructions_are_errors() -> None:
    with pytest.raises(ValueError, match="need hi > lo"):
        to_unit(np.zeros(3), 1.0, 1.0)
    pool = np.zeros((2, 1, 2, 2))
    with pytest.raises(ValueError, match="no reconstructions"):
        reidentification(pool[:0], np.zeros(0, int), pool, np.array([0, 1]))


# --------------------------------------------------------------------------- Gram


def test_gram_root_floors_the_negative_eigenvalues_of_a_noised_gram_at_zero() -> None:
    r = gram_root(np.diag([-1.0, 4.0]))  # the nearest PSD Gram: diag(0, 4)
    np.testing.assert_allclose(r.T @ r, np.diag([0.0, 4.0]), atol=1e-12)


def test_gram_root_takes_the_symmetric_part_of_an_asymmetric_gram() -> None:
    g = np.array([[2.0, 1.0], [0.0, 2.0]])  # only one triangle noised: the root of (G + Gᵀ) / 2, not of a triangle
    r = gram_root(g)
    np.testing.assert_allclose(r.T @ r, [[2.0, 0.5], [0.5, 2.0]], atol=1e-12)


def test_procrustes_error_is_relative_to_the_activations_after_the_best_rotation() -> None:
    a = np.random.default_rng(0).standard_normal((5, 5))
    # R = ½ O A: the rotation Oᵀ aligns it, leaving ‖A − ½A‖ / ‖A‖ = ½ whatever the scale of A
    assert procrustes_error(a, 0.5 * random_rotation(5, 1) @ a) == pytest.approx(0.5, rel=1e-9)
    assert procrustes_error(10 * a, 5 * random_rotation(5, 1) @ a) == pytest.approx(0.5, rel=1e-9)


def test_best_row_cosine_is_the_mean_over_activation_rows_of_the_largest_absolute_cosine() -> None:
    a = np.array([[1.0, 0.0], [1.0, 1.0]])
    assert best_row_cosine(a, np.array([[-2.0, 0.0]])) == pytest.approx((1.0 + 1.0 / math.sqrt(2)) / 2)


def test_row_cosine_top_is_the_grams_top_eigenvector() -> None:
    a = np.array([[3.0, 0.0], [0.0, 1.0], [3.0, 0.0]])  # G = diag(18, 1): the top eigenvector is e₁
    assert gram_audit(a)["row_cosine_top"] == pytest.approx(2 / 3)  # rows 1 and 3 lie on it, row 2 is orthogonal


def test_row_cosine_random_takes_as_many_gaussian_directions_as_the_gram_has_rows() -> None:
    a = np.eye(8)[:5]  # 5 activations, the basis vectors e₁…e₅ of R⁸; the Gram's root recovers them exactly
    outs = [gram_audit(a, seed=s) for s in range(100)]
    assert outs[0]["n"] == 5 and outs[0]["d"] == 8 and outs[0]["row_cosine"] == pytest.approx(1.0)
    # E max_{j ≤ 8} |cos(e₁, u_j)| over 8 Gaussian directions u_j, by Monte Carlo (≈ 0.60; one direction: ≈ 0.29)
    u = np.random.default_rng(123).standard_normal((20_000, 8, 8))
    expected = (np.abs(u[..., 0]) / np.linalg.norm(u, axis=2)).max(axis=1).mean()
    assert np.mean([o["row_cosine_random"] for o in outs]) == pytest.approx(expected, abs=0.03)


# --------------------------------------------------------------------------- vector inversion


def test_reidentification_chance_is_each_rows_owner_share_of_the_pool_averaged_over_rows() -> None:
    pool = np.stack([np.full((1, 7, 7), v) for v in (0.2, 0.4, 0.6, 0.8)])
    owners = np.array([0, 0, 0, 1])  # client 0 holds 3/4 of the pool, client 1 1/4
    victims = Victims(np.zeros((3, 1)), np.array([0, 0, 1]), pool, owners)
    out = scores(pool[:3], victims, pool[:3], fid=False)
    assert out["reid_chance"] == pytest.approx((0.75 + 0.75 + 0.25) / 3)


def test_no_noise_releases_the_statistic_itself_unclipped() -> None:
    v = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_array_equal(noised(v, np.array([0, 0, 1, 1]), 0.0, clip=1e-3, seed=0), v)


def test_the_default_clip_is_the_median_norm_of_a_victims_whole_statistic_and_epsilon_counts_releases() -> None:
    rng = np.random.default_rng(0)
    pool = rng.uniform(size=(6, 1, 8, 8))
    vectors = np.array([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0], [6.0, 8.0], [0.0, 0.0]])
    victims = Victims(vectors, np.repeat([0, 1, 2], 2), pool, np.repeat([0, 1, 2], 2))  # statistic norms 5, 1, 10
    rows, _ = vector_inversion(pool, rng.standard_normal((6, 2)), victims, noise_multipliers=(0.0, 2.0), delta=1e-3,
                               releases=3, steps=1, fid=False)
    assert [r["clip"] for r in rows] == [5.0, 5.0]
    assert rows[0]["epsilon"] is None and rows[1]["delta"] == 1e-3
    # RDP of 3 Gaussian releases of multiplier 2 is one release of multiplier 2/√3
    assert rows[1]["epsilon"] == pytest.approx(gaussian_epsilon(2.0 / math.sqrt(3), 1, 1e-3), rel=1e-6)


def test_fedfa_moments_are_per_image_channel_styles_and_the_release_pools_every_image() -> None:
    x = torch.tensor([[[[0.0, 2.0], [0.0, 2.0]]], [[[4.0, 4.0], [4.0, 4.0]]]])  # 2 images, 1 channel, 2×2
    per_sample, release = moments_share(lambda t: t)
    eps = 1e-5  # σ = sqrt(E[F²] − E[F]² + ε)
    np.testing.assert_allclose(per_sample(x), [[1.0, math.sqrt(1.0 + eps)], [4.0, math.sqrt(eps)]], rtol=1e-5)
    # pooled over the 8 pixels: mean 2.5, E[F²] = 72 / 8 = 9
    np.testing.assert_allclose(release(x, np.zeros(2)), [[2.5, math.sqrt(9.0 - 2.5**2 + eps)]], rtol=1e-6)


def test_ccst_sample_styles_are_each_images_channel_mean_and_std_and_are_released_as_they_are() -> None:
    checker = torch.tensor([[0.0, 1.0], [1.0, 0.0]]).repeat(2, 2)
    x = torch.stack([torch.full((1, 4, 4), 0.8), 0.2 + 0.6 * checker[None]])
    per_sample, release = style_share(make_codec(StyleParams(style_path="pixel"), ToyNet()), "sample")
    eps = 1e-5  # checkered: mean 0.5, E[x²] = (0.04 + 0.64) / 2 = 0.34, so σ² = 0.09
    np.testing.assert_allclose(per_sample(x), [[0.8, math.sqrt(eps)], [0.5, math.sqrt(0.09 + eps)]], rtol=1e-5)
    np.testing.assert_array_equal(release(x, np.zeros(2)), per_sample(x))


def test_pardons_client_style_averages_the_cluster_styles_or_under_moments_their_moments() -> None:
    checker = torch.tensor([[0.0, 1.0], [1.0, 0.0]]).repeat(2, 2)
    x = torch.stack([torch.full((1, 4, 4), 0.8), torch.full((1, 4, 4), 0.6), checker[None], 0.2 + 0.6 * checker[None]])
    codec = make_codec(StyleParams(style_path="pixel"), ToyNet())  # the image's own channel moments
    eps = 1e-5
    # FINCH (cosine) parts flat from checkered: cluster means 0.7 and 0.5, second moments 0.5 and 0.42
    by_styles = style_share(codec, "client", PardonParams(client_average="styles"))[1](x, np.zeros(4))
    np.testing.assert_allclose(by_styles, [[0.6, (math.sqrt(0.01 + eps) + math.sqrt(0.17 + eps)) / 2]], rtol=1e-5)
    by_moments = style_share(codec, "client", PardonParams(client_average="moments"))[1](x, np.zeros(4))
    np.testing.assert_allclose(by_moments, [[0.6, math.sqrt((0.5 + 0.42) / 2 - 0.6**2 + eps)]], rtol=1e-5)


# --------------------------------------------------------------------------- DLG under local DP


UPDATE = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]  # ‖Δ‖ = 5 over all arrays


def test_update_norm_takes_all_arrays_as_one_vector() -> None:
    assert update_norm(UPDATE) == 5.0


def test_local_dp_clips_the_update_to_c_only_above_it_and_adds_noise_of_std_z_c() -> None:
    tiny = 1e-9  # z > 0 to clip, noise negligible
    kept, clipped = dp_update(UPDATE, tiny, 10.0, seed=0), dp_update(UPDATE, tiny, 1.0, seed=0)
    for u, k, c in zip(UPDATE, kept, clipped, strict=True):
        torch.testing.assert_close(k, u, atol=1e-6, rtol=0)  # within the clip: unchanged, not scaled up to it
        torch.testing.assert_close(c, u / 5, atol=1e-6, rtol=0)
    noisy = dp_update(UPDATE, 2.0, 1.0, seed=4)
    gen = torch.Generator().manual_seed(4)  # one stream, array by array: N(0, (z·C)²) = 2·N(0, 1)
    for u, n in zip(UPDATE, noisy, strict=True):
        torch.testing.assert_close(n, u / 5 + 2.0 * torch.randn(u.shape, generator=gen))


def test_tiny_nets_head_takes_the_two_stride_2_convolutions_output_of_an_odd_size() -> None:
    net = TinyNet(1, 7, 6, 3)  # "same" 5×5 stride-2 convolutions: 7 → 4 → 2 and 6 → 3 → 2
    assert net.head.in_features == 12 * 2 * 2
    assert net(torch.zeros(1, 1, 7, 6)).shape == (1, 3)


# --------------------------------------------------------------------------- grids


def test_grid_mosaic_holds_every_tile_in_its_row_and_column_with_white_gaps(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    shown: list[np.ndarray] = []
    imshow = Axes.imshow

    def recording(ax: Axes, x: np.ndarray, **kw: Any) -> Any:  # the mosaic as drawn
        shown.append(x)
        return imshow(ax, x, **kw)

    monkeypatch.setattr(Axes, "imshow", recording)
    rng = np.random.default_rng(0)
    grey, rgb = rng.uniform(0, 0.9, size=(3, 1, 4, 5)), rng.uniform(0, 0.9, size=(4, 3, 4, 5))
    assert draw_grid([("grey", grey), ("rgb", rgb)], "t", tmp_path / "g.png").is_file()
    (mosaic,) = shown
    assert mosaic.shape == (2 * (4 + 2), 3 * (5 + 2), 3)  # the shorter row's 3 columns, 2 px gaps
    for c in range(3):
        tile = np.s_[c * 7 : c * 7 + 5]
        np.testing.assert_array_equal(mosaic[0:4, tile], np.repeat(grey[c].transpose(1, 2, 0), 3, axis=2))
        np.testing.assert_array_equal(mosaic[6:10, tile], rgb[c].transpose(1, 2, 0))
    assert (mosaic[4:6] == 1).all() and (mosaic[:, 5:7] == 1).all()


def test_grid_shows_at_most_twelve_columns_labels_rows_top_down_and_closes_its_figure(tmp_path: Path,
                                                                                     drawn: list[Any]) -> None:
    tiles = np.zeros((14, 3, 4, 5))
    draw_grid([("true", tiles), ("reconstructed", tiles)], "t", tmp_path / "g.png")
    (fig,) = drawn  # closed: an audit draws one grid per client and round
    ax = fig.axes[0]
    assert ax.images[0].get_array().shape == (2 * (4 + 2), 12 * (5 + 2), 3)  # max_cols 12 of the 14
    assert [t.get_text() for t in ax.get_yticklabels()] == ["true", "reconstructed"]
    assert list(ax.get_yticks()) == [2.0, 8.0]  # each row's middle: r·(h + gap) + h/2


def test_dlg_runs_the_asked_outer_lbfgs_steps_of_at_most_20_evaluations_with_a_line_search(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from feddg.audit import gradient

    made: list[dict[str, Any]] = []
    steps: list[int] = []

    class Recording(torch.optim.LBFGS):
        def __init__(self, params: Any, **kw: Any) -> None:
            made.append(kw)
            super().__init__(params, **kw)

        def step(self, closure: Any) -> Any:
            steps.append(1)
            return super().step(closure)

    monkeypatch.setattr(gradient.torch.optim, "LBFGS", Recording)
    net = TinyNet(1, 8, 8, 3)
    update = gradient.one_step_update(net, torch.rand(1, 1, 8, 8), torch.tensor([2]), 0.1)
    _, label = gradient.dlg(net, update, 0.1, (1, 8, 8), iterations=3)
    assert label == 2 and len(steps) == 3  # iDLG's label; one L-BFGS step per outer iteration
    assert made == [{"lr": 1.0, "max_iter": 20, "history_size": 50, "line_search_fn": "strong_wolfe"}]


def test_random_rotations_are_haar_not_qrs_sign_convention() -> None:
    """The first entry of a Haar-random orthogonal matrix has mean 0; LAPACK's QR alone makes it always negative
    (its R has a negative first diagonal for a positive first column entry and vice versa)."""
    first = [random_rotation(3, seed)[0, 0] for seed in range(200)]
    assert abs(np.mean(first)) < 0.15 and min(first) < 0 < max(first)  # Haar: std of the mean ≈ 0.04


def test_a_zero_activation_row_has_cosine_zero_not_nan() -> None:
    """Rows of all zeros (a dead ReLU's input) count as unmatched: |cos| 1 and 0 average to 0.5."""
    assert best_row_cosine(np.array([[2.0, 0.0], [0.0, 0.0]]), np.array([[1.0, 0.0], [0.0, 0.0]])) == 0.5
