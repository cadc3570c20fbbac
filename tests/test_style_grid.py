"""PARDON's Fig. 8 style grid: the drawn mosaic, its tiles, the displayed samples and the styles each row uses."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from torch import nn
from toy import ToyDomains, toy_federation, toy_federation_of

from feddg.algorithms import create_method
from feddg.config import dump_config
from feddg.reports import style_grid as sg

EPS = 1e-5  # the style module's ε under the std (σ = sqrt(var + ε))


def test_draw_lays_the_tiles_out_row_by_row_with_two_pixel_white_gaps_and_labels(tmp_path: Path,
                                                                                 drawn: list[Figure]) -> None:
    g = np.random.default_rng(0)
    first, second = g.uniform(0, 0.9, (2, 2, 3, 3)), g.uniform(0, 0.9, (2, 2, 3, 3))  # 2 tiles of 2×3 each
    sg._draw([("original", first), ("PARDON", second)], ["a", "b"], [3, 1], "run\npath", tmp_path / "g.png")
    assert (tmp_path / "g.png").is_file()
    (ax,) = drawn[0].axes
    want = np.ones((8, 10, 3))  # 2 rows of (2 + 2) px, 2 columns of (3 + 2) px; the gaps white
    want[0:2, 0:3], want[0:2, 5:8], want[4:6, 0:3], want[4:6, 5:8] = first[0], first[1], second[0], second[1]
    np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()), want)
    assert list(ax.get_xticks()) == [1.5, 6.5] and [t.get_text() for t in ax.get_xticklabels()] == ["a", "b"]
    assert list(ax.get_yticks()) == [1.0, 5.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["original", "PARDON"]
    # each column's owner below the mosaic (its last row ends at y = 8)
    assert [(t.get_position(), t.get_text()) for t in ax.texts] == [((1.5, 10), "client 3"), ((6.5, 10), "client 1")]
    assert ax.get_title() == "run\npath"


def test_image_tiles_are_shown_on_the_originals_value_range_clipped_channels_last() -> None:
    like = torch.tensor([[[[-1.0, 3.0]], [[0.0, 1.0]], [[1.0, 2.0]]]])  # [1, 3, 1, 2]: values in [-1, 3]
    t = torch.tensor([[[[-3.0, 0.0]], [[1.0, 5.0]], [[2.0, 3.0]]]])
    # (t + 1) / 4 clipped to [0, 1]; pixel (0, w) holds the three channels
    want = np.array([[[0.0, 0.5, 0.75], [0.25, 1.0, 1.0]]])
    np.testing.assert_allclose(sg._tiles(t, like), want[None])


def test_feature_tiles_are_the_channel_mean_upsampled_nearest_and_min_max_per_tile() -> None:
    like = torch.zeros(2, 1, 2, 6)  # images of 2×6
    t = torch.tensor([[[[0.0, 2.0, 4.0]], [[0.0, 0.0, 6.0]]],  # channel mean 0, 1, 5 → 0, .2, 1
                      [[[1.0, 1.0, 1.0]], [[1.0, 5.0, 3.0]]]])  # channel mean 1, 3, 2 → 0, 1, .5
    rows = np.array([[0.0, 0.0, 0.2, 0.2, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0, 0.5, 0.5]])  # each value over 2 columns
    want = np.broadcast_to(rows[:, None, :, None], (2, 2, 6, 3))  # both image rows, grey
    np.testing.assert_allclose(sg._tiles(t, like), want, atol=1e-6)


def test_samples_are_drawn_with_the_runs_seed_per_domain_in_domain_order() -> None:
    fed = toy_federation("seed=7")
    idx, doms = sg._samples(fed, 2)
    assert doms == [0, 0, 1, 1, 2, 2]
    rng = np.random.default_rng(7)  # toy domains: samples 0-119, 120-239, 240-359
    want = [k for d in range(3) for k in rng.choice(np.arange(120 * d, 120 * (d + 1)), size=2, replace=False)]
    assert idx.tolist() == want


def test_a_foreign_client_is_one_without_the_domain_taken_cyclically() -> None:
    fed = toy_federation()  # clients 0, 1 hold domain a; 2, 3 domain b; c is held out
    assert [sg._foreign_client(fed, 0, j) for j in range(4)] == [2, 3, 2, 3]
    assert [sg._foreign_client(fed, 1, j) for j in range(4)] == [0, 1, 0, 1]
    assert [sg._foreign_client(fed, 2, j) for j in range(5)] == [0, 1, 2, 3, 0]


def test_a_ccst_checkpoints_style_of_an_owner_is_its_first_bank_row() -> None:
    fed = toy_federation("method.name=ccst", "method.params.style_path=pixel")
    mean, std = np.arange(5.0)[:, None], 10 + np.arange(5.0)[:, None]
    client = {"enc/w": np.zeros(1)}
    ckpt = {"server_state": {"bank": (mean, std, np.array([2, 3, 2, 0, 3]))}, "client_states": {0: client}}
    styles, owners, state = sg._ccst_styles(fed, create_method("ccst"), ckpt, [0, 0, 1])
    assert owners == [2, 3, 0]  # foreign clients of domains a, a, b
    assert [(float(m), float(s)) for m, s in styles] == [(0.0, 10.0), (1.0, 11.0), (3.0, 13.0)]  # rows 0, 1, 3
    assert state is client


def test_a_pardon_checkpoints_global_style_and_client_state_are_used() -> None:
    fed = toy_federation("method.name=pardon", "method.params.style_path=pixel")
    client = {"enc/w": np.zeros(1)}
    ckpt = {"server_state": {"style": (np.array([0.5]), np.array([2.0]))}, "client_states": {0: client}}
    mean, std, state = sg._pardon_style(fed, create_method("pardon"), ckpt)
    assert (mean.tolist(), std.tolist(), state) == ([0.5], [2.0], client)


def _pixel_style(x: np.ndarray) -> tuple[float, float]:
    """Eq. 2 on one-channel pixels: their mean and sqrt(population variance + ε)."""
    return float(x.mean()), float(np.sqrt(x.var() + EPS))


def test_replay_runs_the_server_setup_only_when_every_client_took_part() -> None:
    fed = toy_federation("method.name=ccst", "method.params.style_path=pixel")
    ccst, x = create_method("ccst", {"style_path": "pixel"}), cast(ToyDomains, fed.dataset).x.double().numpy()
    state, replies, _ = sg.replay_setup(fed, ccst, [2, 0])
    assert "bank" not in state and [r.client_id for r in replies] == [2, 0]
    for r in replies:  # each client's overall pixel style of its training images
        want = _pixel_style(x[fed.clients[r.client_id].train_idx])
        got = (np.asarray(r.message["style/mean"]).item(), np.asarray(r.message["style/std"]).item())
        assert got == pytest.approx(want)
    state, _, _ = sg.replay_setup(fed, ccst)
    mean, std, owners = state["bank"]
    assert owners.tolist() == [0, 1, 2, 3]
    assert mean[:, 0] == pytest.approx([_pixel_style(x[c.train_idx])[0] for c in fed.clients])


def test_replayed_ccst_styles_on_the_feature_path_are_the_owners_overall_conv_styles_and_the_initial_encoder() -> None:
    over = ["method.params.style_path=feature", "method.params.style_layer=conv"]  # E = the toy net's conv
    fed = toy_federation("method.name=ccst", *over)
    conv, data = cast(nn.Conv2d, fed.model.conv), cast(ToyDomains, fed.dataset).x
    ccst = create_method("ccst", {"style_path": "feature", "style_layer": "conv"})
    styles, owners, state = sg._ccst_styles(fed, ccst, None, [0, 0, 1])
    assert owners == [2, 3, 0]
    assert state.keys() == {"enc/conv.weight", "enc/conv.bias"}  # the codec state: the initial encoder
    for key, value in conv.state_dict().items():
        np.testing.assert_array_equal(state[f"enc/conv.{key}"], value.numpy())
    for (mean, std), o in zip(styles, owners, strict=True):  # eq. 2 over the owner's E(x), per channel
        with torch.no_grad():
            e = torch.nn.functional.conv2d(data[fed.clients[o].train_idx], conv.weight, conv.bias, padding=1)
        e = e.double().transpose(0, 1).flatten(1)
        np.testing.assert_allclose(mean.numpy(), e.mean(1).numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(std.numpy(), (e.var(1, unbiased=False) + EPS).sqrt().numpy(), rtol=1e-5)


def _grid_tiles(fig: Figure, rows: int, n: int, size: int = 6) -> np.ndarray:
    """The drawn mosaic cut back into ``[rows, n, size, size, 3]`` tiles (2 px gaps)."""
    mosaic = np.asarray(fig.axes[0].images[0].get_array())
    return np.stack([np.stack([mosaic[r * (size + 2): r * (size + 2) + size, c * (size + 2): c * (size + 2) + size]
                               for c in range(n)]) for r in range(rows)])


@pytest.mark.parametrize("params", [["method.name=pardon", "method.params.alpha=0"],
                                    ["method.name=ccst", "method.params.style_type=single"]], ids=["pardon", "ccst"])
def test_the_grids_ccst_row_adains_each_sample_to_a_foreign_clients_overall_style(
        params: list[str], tmp_path: Path, drawn: list[Figure], monkeypatch: pytest.MonkeyPatch) -> None:
    fed = toy_federation("method.params.style_path=pixel", *params)
    (tmp_path / "config.yaml").write_text(dump_config(fed.cfg))

    monkeypatch.setattr(sg, "build_federation", toy_federation_of)  # the toy data in place of the config's dataset
    assert sg.style_grid(tmp_path) == tmp_path / "styles.png"
    tiles = _grid_tiles(drawn[0], 3, 6)
    ax = drawn[0].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["original", "PARDON: interpolation style",
                                                            "CCST: style of client"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "a", "b", "b", "c", "c"]
    owners = [2, 3, 0, 1, 0, 1]  # foreign clients of domains a, a, b, b, c, c
    assert [t.get_text() for t in ax.texts] == [f"client {o}" for o in owners]
    rng = np.random.default_rng(fed.cfg.seed)
    idx = [k for d in range(3) for k in rng.choice(np.arange(120 * d, 120 * (d + 1)), size=2, replace=False)]
    pixels = cast(ToyDomains, fed.dataset).x[:, 0].double().numpy()
    x = pixels[idx]
    lo, hi = x.min(), x.max()
    np.testing.assert_allclose(tiles[0], np.repeat(((x - lo) / (hi - lo))[..., None], 3, -1), atol=1e-6)
    # CCST (α = 1): AdaIN of each sample to its owner's overall pixel style, on the originals' range
    ccst = []
    for img, o in zip(x, owners, strict=True):
        m, s = _pixel_style(pixels[fed.clients[o].train_idx])
        ccst.append((img - img.mean()) / np.sqrt(img.var() + EPS) * s + m)
    np.testing.assert_allclose(tiles[2], np.repeat(np.clip((np.array(ccst) - lo) / (hi - lo), 0, 1)[..., None], 3, -1),
                               atol=1e-5)
    if "method.params.alpha=0" in params:  # α = 0: PARDON's transfer keeps each sample
        np.testing.assert_allclose(tiles[1], tiles[0], atol=1e-6)
