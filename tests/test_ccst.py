"""CCST: the style bank (overall / single image styles), K styles per batch, CE(x) + CE(x̃)."""

import numpy as np
import pytest
import torch
from toy import toy_federation

from feddg.algorithms import Reply, ccst, create_method
from feddg.algorithms.ccst import CCSTParams, draw_styles
from feddg.algorithms.components.style import EPS, channel_stats
from feddg.engines.inprocess import run_inprocess, run_setup
from feddg.federation.client import client_context
from feddg.federation.server import Server


def test_overall_style_is_the_pooled_style_of_the_client_and_the_bank_excludes_the_own(tmp_path):
    fed = toy_federation("method.name=ccst", "method.params.style_path=pixel")
    server = Server(fed, tmp_path)
    run_setup(server)
    mean, std, owners = server.state["bank"]
    assert mean.shape == std.shape == (4, 1) and list(owners) == [0, 1, 2, 3]
    for cid, client in enumerate(fed.clients):  # eq. 2 by hand over all the client's images and pixels
        x = fed.dataset.x[torch.as_tensor(client.train_idx)].reshape(1, 1, -1, 1)
        m, s = channel_stats(x)
        assert np.allclose(mean[cid], m.numpy()[0], atol=1e-5) and np.allclose(std[cid], s.numpy()[0], atol=1e-4)
    msg = fed.method.client_config(server.state, 2, 1)
    assert np.array_equal(msg["bank/mean"], mean[[0, 1, 3]]) and np.array_equal(msg["bank/std"], std[[0, 1, 3]])
    assert list(msg["bank/owner"]) == [0, 1, 3]


def test_single_image_styles_are_per_image_statistics(tmp_path):
    fed = toy_federation("method.name=ccst", "method.params.style_path=pixel", "method.params.style_type=single",
                         "method.params.images_per_client=3")
    reply, _ = fed.method.client_setup(fed.model, {"style/path": "pixel"}, {}, client_context(fed, 1, 0))
    assert reply["style/mean"].shape == (3, 1)
    images = fed.dataset.x[torch.as_tensor(fed.clients[1].train_idx)]
    per_image = channel_stats(images)[0].numpy()[:, 0]
    assert all(np.isclose(per_image, v, atol=1e-5).any() for v in reply["style/mean"][:, 0])
    # each row's σ is the population std of the same image: sqrt(var + ε)
    flat = images.flatten(1).double()
    means, stds = flat.mean(1).numpy(), (flat.var(1, unbiased=False) + EPS).sqrt().numpy()
    for mu, sigma in zip(reply["style/mean"][:, 0], reply["style/std"][:, 0], strict=True):
        i = np.abs(means - mu).argmin()
        assert abs(means[i] - mu) < 1e-5 and abs(stds[i] - sigma) < 1e-4


def test_the_bank_tags_each_style_with_the_id_of_the_client_that_sent_it():
    """Replies in any order (3 before 1): client 3 is sent client 1's style only."""
    method = ccst.CCST()
    replies = [Reply(k, {"style/mean": np.full((1, 2), k, np.float32), "style/std": np.full((1, 2), k + 10, np.float32)})
               for k in (3, 1)]
    state = method.server_setup({"weights": {}}, replies)
    assert state["bank"][2].tolist() == [3, 1]
    msg = method.client_config(state, 3, 1)
    assert msg["bank/owner"].tolist() == [1] and msg["bank/mean"].tolist() == [[1.0, 1.0]]
    assert msg["bank/std"].tolist() == [[11.0, 11.0]]


def test_under_dp_the_noised_stds_are_floored_at_zero_and_the_means_are_not():
    """σ = 2·2C = 4 against a clip of C = 1: the noise sends about half the entries below zero; a std below zero is
    sent as 0 (AdaIN's target scale), a mean is sent as noised."""
    fed = toy_federation("method.name=ccst", "method.params.style_path=pixel", "method.params.style_type=single",
                         "method.params.images_per_client=20", "method.params.dp.noise_multiplier=2.0",
                         "method.params.dp.clip=1.0")
    reply, _ = fed.method.client_setup(fed.model, {"style/path": "pixel"}, {}, client_context(fed, 1, 0))
    std = reply["style/std"]
    assert std.shape == (20, 1) and (std >= 0).all() and (std == 0).any() and (reply["style/mean"] < 0).any()


def test_draw_styles_are_distinct_and_capped_by_the_bank():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        rows = draw_styles(np.array([4, 0, 2, 3, 1]), 3, g)
        assert len(rows) == 3 and len(set(rows.tolist())) == 3 and rows.max() < 5
    assert sorted(draw_styles(np.array([1, 3]), 3, g).tolist()) == [0, 1]


def test_single_image_styles_are_drawn_from_distinct_clients_each_of_its_rows_alike():
    """Three image styles of each of three other clients: K = 3 styles always come from the three clients (a draw
    over the pooled rows repeats a client in 1 − 9·6·3/(9·8·7) = 68 % of draws), and every row of a client is used."""
    owners = np.repeat([0, 2, 3], 3)
    g = torch.Generator().manual_seed(0)
    draws = [draw_styles(owners, 3, g) for _ in range(300)]
    assert all(sorted(owners[d.numpy()].tolist()) == [0, 2, 3] for d in draws)
    counts = np.bincount(torch.cat(draws).numpy(), minlength=9)
    assert counts.min() > 60  # 100 expected per row
    assert sorted(owners[draw_styles(owners, 2, g).numpy()].tolist()) in ([0, 2], [0, 3], [2, 3])


@pytest.mark.parametrize("k", [1, 3])
def test_loss_is_ce_of_the_batch_plus_ce_of_its_k_stylised_copies(tmp_path, k):
    """With α = 0 the pixel transfer is the identity, so (at lr 0) the loss is exactly 2·CE(x)."""
    fed = toy_federation("method.name=ccst", "method.params.style_path=pixel", "method.params.alpha=0",
                         f"method.params.k={k}")
    server = Server(fed, tmp_path)
    run_setup(server)
    msg = {**fed.method.client_config(server.state, 0, 1), "lr": 0.0, "round": 1}
    ccst = fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 1))[0]["train_loss"]
    avg = create_method("fedavg").client_update(fed.model, msg, {}, client_context(fed, 0, 1))[0]["train_loss"]
    assert ccst == pytest.approx(2 * avg, rel=1e-5)


def _round_message(fed, rows=0):
    """The initial weights, a bank of ``rows`` styles of client 1 and lr 0."""
    return {**fed.method.server_init(fed.model, None)["weights"], "bank/mean": np.full((rows, 1), 0.5, np.float32),
            "bank/std": np.ones((rows, 1), np.float32), "bank/owner": np.ones(rows, np.int64), "lr": 0.0, "round": 1}


def test_without_other_clients_styles_the_loss_is_the_plain_ce():
    """A federation of one client: no style to transfer, the loss is CE(x) alone (FedAvg's, at lr 0)."""
    fed = toy_federation("method.name=ccst", "method.params.style_path=pixel")
    msg = _round_message(fed)
    loss = fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 1))[0]["train_loss"]
    avg = create_method("fedavg").client_update(fed.model, msg, {}, client_context(fed, 0, 1))[0]["train_loss"]
    assert loss == pytest.approx(avg, rel=1e-6)


def test_the_feature_path_refuses_a_client_without_its_frozen_encoder():
    fed = toy_federation("method.name=ccst", "method.params.style_path=feature", "method.params.style_layer=conv")
    with pytest.raises(KeyError, match="no frozen style encoder"):
        fed.method.client_update(fed.model, _round_message(fed, 1), {}, client_context(fed, 0, 1))


def test_each_stylised_copy_takes_the_mean_and_std_of_its_drawn_bank_row(monkeypatch):
    """Pixel AdaIN at α = 1 gives every image of copy j its channel mean and (population) std from bank row r_j: a
    hand-made bank of three distinct rows, the rows each batch drew recorded, the stylised batch read at the model."""
    fed = toy_federation("method.name=ccst", "method.params.style_path=pixel", "method.params.k=2")
    bank_mean, bank_std = np.array([[0.5], [3.0], [-2.0]], np.float32), np.array([[1.0], [0.2], [2.5]], np.float32)
    msg = {**fed.method.server_init(fed.model, None)["weights"], "bank/mean": bank_mean, "bank/std": bank_std,
           "bank/owner": np.array([1, 2, 3]), "lr": 0.0, "round": 1}
    drawn: list[torch.Tensor] = []
    draw = ccst.draw_styles

    def recording_draw(owners: np.ndarray, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
        drawn.append(draw(owners, k, generator))
        return drawn[-1]

    monkeypatch.setattr(ccst, "draw_styles", recording_draw)
    inputs: list[torch.Tensor] = []  # per batch: its K stylised copies, then the batch
    fed.model.conv.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().clone()))
    fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 1))
    assert len(drawn) == 4 and len(inputs) == 8  # 54 examples: 4 batches
    assert any(0 not in rows.tolist() for rows in drawn)  # some batch styles with rows other than the first
    for rows, x_tilde, x in zip(drawn, inputs[::2], inputs[1::2], strict=True):
        copies = x_tilde.reshape(len(rows), len(x), 1, 36)
        for r, copy in zip(rows.tolist(), copies, strict=True):
            np.testing.assert_allclose(copy.mean(-1).numpy(), bank_mean[r][None].repeat(len(x), 0), atol=1e-5)
            np.testing.assert_allclose(copy.std(-1, unbiased=False).numpy(), bank_std[r][None].repeat(len(x), 0),
                                       atol=1e-4)


def test_ccst_trains_on_the_feature_path(tmp_path):
    fed = toy_federation("method.name=ccst", "method.params.style_path=feature", "method.params.style_layer=conv",
                         "method.params.k=2")
    server = Server(fed, tmp_path)
    res = run_inprocess(server)
    assert all(set(s) == {"enc/conv.weight", "enc/conv.bias"} for s in server.client_states.values())
    assert server.metrics[-1]["train_loss"] < server.metrics[0]["train_loss"] and res["final"]["id_acc"] > 60


def test_the_defaults():
    """docs/methods/ccst.md: the pixel path, the overall domain style, K = 3 (PACS), α = 1 (CCST's --alpha), one
    image style per client under ``single``, no DP."""
    p = CCSTParams()
    assert (p.style_path, p.style_type, p.k, p.alpha, p.images_per_client, p.dp) == ("pixel", "overall", 3, 1.0, 1, None)
