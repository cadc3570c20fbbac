"""FedMix: the loss of eq. 5 against a hand-computed value, its first-order agreement with mixup, the setup's
group means, the server's bank without the client's own means, and the refusals."""

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.augmentation import shift_training_batches
from toy import ToyDomains, assert_reply_is_sgd_steps, toy_federation
from toy_pixels import NAME, registered

from feddg.algorithms import Reply, fedmix
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.fedmix import MEAN_X, MEAN_Y, FedMix, FedMixParams, fedmix_loss, group_means
from feddg.config import ConfigError, build_config
from feddg.federation.client import client_context
from feddg.messages import Message, weights_of
from feddg.tasks.classification import Classification


def _linear(weight):
    model = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor(weight))
    return model


def test_the_loss_by_hand():
    """``W = [[1, 2], [0, 1]]``, ``x = [1, 1]``, ``y = 0``, ``λ = ½``: logits ``W x/2 = [1.5, 0.5]``, so
    ``ℓ_0 = log(1 + e⁻¹)``, ``ℓ_1 = 1 + ℓ_0``, ``p_1 = 1 − s`` with ``s = 1/(1 + e⁻¹)``; ``∂ℓ/∂x = Wᵀ(p − e_0)
    = −(1 − s)·[1, 1]``, against ``x̄ = [2, −1]``: ``−(1 − s)``; ``ȳ = [¼, ¾]``."""
    loss = fedmix_loss(_linear([[1.0, 2.0], [0.0, 1.0]]), Classification(2), torch.tensor([[1.0, 1.0]]),
                       torch.tensor([0]), torch.tensor([[2.0, -1.0]]), torch.tensor([[0.25, 0.75]]), 0.5)
    l0, s = math.log(1 + math.exp(-1)), 1 / (1 + math.exp(-1))
    expected = 0.5 * l0 + 0.5 * (0.25 * l0 + 0.75 * (1 + l0)) + 0.5 * -(1 - s)
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)


def test_it_is_mixup_to_first_order_in_lambda_and_its_derivative_term_reaches_the_weights():
    torch.manual_seed(0)
    model, task = _linear(torch.randn(2, 2).tolist()), Classification(2)
    x, y = torch.randn(4, 2), torch.tensor([0, 1, 1, 0])
    x_bar, y_bar = torch.randn(4, 2), torch.softmax(torch.randn(4, 2), 1)

    def error(lam):
        mixup = F.cross_entropy(model((1 - lam) * x + lam * x_bar), (1 - lam) * F.one_hot(y, 2) + lam * y_bar)
        return abs(float((fedmix_loss(model, task, x, y, x_bar, y_bar, lam) - mixup).detach()))

    assert error(0.02) / error(0.01) == pytest.approx(4.0, rel=0.1)  # the error is O(λ²)
    model.zero_grad()
    fedmix_loss(model, task, x, y, x_bar, y_bar, 0.3).backward()
    with_term = model.weight.grad.clone()
    model.zero_grad()
    fedmix_loss(model, task, x, y, torch.zeros_like(x_bar), y_bar, 0.3).backward()
    assert not torch.allclose(with_term, model.weight.grad)  # double backprop: ∂/∂W of λ ∂ℓ/∂x · x̄


def test_group_means_average_consecutive_groups_and_drop_the_rest():
    x = torch.arange(5.0).reshape(5, 1)
    onehot = F.one_hot(torch.tensor([0, 1, 1, 1, 0]), 2).float()
    xm, ym = group_means(x, onehot, 2)
    torch.testing.assert_close(xm, torch.tensor([[0.5], [2.5]]))
    torch.testing.assert_close(ym, torch.tensor([[0.5, 0.5], [0.0, 1.0]]))


def test_a_client_uploads_means_of_m_random_unaugmented_samples_only(monkeypatch):
    fed = toy_federation("method.name=fedmix")
    shift_training_batches(monkeypatch, fed.dataset)  # the means are of the data as stored
    ctx = client_context(fed, 0, 0)
    n = ctx.num_examples
    m = next(d for d in range(5, n) if n % d == 0)  # every sample in some group
    reply, _ = FedMix(FedMixParams(mean_size=m)).client_setup(fed.model, {"mean_size": m}, {}, ctx)
    assert set(reply) == {MEAN_X, MEAN_Y} and reply[MEAN_X].shape == (n // m, 1, 6, 6)
    x = fed.dataset.x[ctx.train_idx].numpy()
    np.testing.assert_allclose(reply[MEAN_X].sum(0) * m, x.sum(0), rtol=1e-4, atol=1e-4)
    counts = np.bincount(fed.dataset.labels[ctx.train_idx], minlength=4)
    np.testing.assert_allclose(reply[MEAN_Y].sum(0) * m, counts, rtol=1e-5)
    # random groups: not the consecutive groups of the stored order (sorted by class here)
    consecutive, _ = group_means(torch.from_numpy(x), torch.zeros(n, 1), m)
    assert not np.allclose(reply[MEAN_X], consecutive.numpy(), atol=1e-3)


def test_a_client_without_some_class_uploads_label_means_over_every_class():
    """Client 0 without its class-3 samples: ``mix/y`` rows still have one entry per class (class 3 at 0), so the
    server can stack them with the other clients'."""
    fed = toy_federation("method.name=fedmix")
    ctx = client_context(fed, 0, 0)
    ctx.train_idx = ctx.train_idx[fed.dataset.labels[ctx.train_idx] != 3]
    reply, _ = fed.method.client_setup(fed.model, {"mean_size": 5}, {}, ctx)
    assert reply[MEAN_Y].shape == (ctx.num_examples // 5, 4) and not reply[MEAN_Y][:, 3].any()
    np.testing.assert_allclose(reply[MEAN_Y].sum(1), 1.0, rtol=1e-6)


def test_each_client_receives_the_other_clients_means():
    method = FedMix()
    replies = [Reply(k, {MEAN_X: np.full((k + 1, 1, 2, 2), k, np.float32), MEAN_Y: np.full((k + 1, 3), k, np.float32)})
               for k in range(3)]
    state = method.server_setup({"weights": {"w/a": np.zeros(1, np.float32)}}, replies)
    msg = method.client_config(state, 1, 1)
    assert msg[MEAN_X].shape == (4, 1, 2, 2) and sorted(set(msg[MEAN_X].ravel())) == [0.0, 2.0]
    assert sorted(set(msg[MEAN_Y].ravel())) == [0.0, 2.0] and "w/a" in msg
    with pytest.raises(ValueError, match="needs the means of at least 2 clients, got 1"):
        method.server_setup({}, [replies[0], Reply(1, {MEAN_X: np.zeros((0, 1, 2, 2)), MEAN_Y: np.zeros((0, 3))})])


def test_the_bank_tags_each_mean_with_the_id_of_the_client_that_sent_it():
    """Replies in any order (2, 0, 1): client 2 is sent exactly the means of clients 0 and 1."""
    method = FedMix()
    replies = [Reply(k, {MEAN_X: np.full((k + 1, 1, 2, 2), k, np.float32), MEAN_Y: np.full((k + 1, 3), k, np.float32)})
               for k in (2, 0, 1)]
    state = method.server_setup({"weights": {}}, replies)
    assert state["bank_owner"].tolist() == [2, 2, 2, 0, 1, 1]
    msg = method.client_config(state, 2, 1)
    assert sorted(msg[MEAN_X][:, 0, 0, 0].tolist()) == [0.0, 1.0, 1.0] and sorted(msg[MEAN_Y][:, 0].tolist()) == [
        0.0, 1.0, 1.0]


def test_each_sample_is_mixed_with_a_uniformly_drawn_bank_row_and_that_rows_label_mean(monkeypatch):
    """Three bank rows, row r the constant image r + 1 with label mean e_r: every sample's (x̄, ȳ) is one row's pair,
    and each row is drawn about a third of the time."""
    fed = toy_federation("method.name=fedmix")
    bank = {MEAN_X: np.arange(1.0, 4.0, dtype=np.float32)[:, None, None, None].repeat(6, 2).repeat(6, 3),
            MEAN_Y: np.eye(4, dtype=np.float32)[:3]}
    drawn = []
    loss = fedmix.fedmix_loss

    def recording(model, task, x, y, x_bar, y_bar, lam):
        drawn.append((x_bar.detach().clone(), y_bar.detach().clone()))
        return loss(model, task, x, y, x_bar, y_bar, lam)

    monkeypatch.setattr(fedmix, "fedmix_loss", recording)
    msg = {**weights_of(fed.model), **bank, "lr": 0.1, "round": 1}
    fed.method.client_update(fed.model, msg, {}, client_context(fed, 0, 1))
    x_bar, y_bar = torch.cat([d[0] for d in drawn]), torch.cat([d[1] for d in drawn])
    rows = x_bar[:, 0, 0, 0].long() - 1
    assert torch.equal(x_bar, torch.from_numpy(bank[MEAN_X])[rows])
    assert torch.equal(y_bar, torch.from_numpy(bank[MEAN_Y])[rows])  # the label mean of the same row
    assert len(rows) >= 50  # a sample of every training batch
    assert torch.bincount(rows, minlength=3).min() > len(rows) / 6  # each row drawn (a third expected)


def test_a_client_trains_against_the_bank_and_an_empty_bank_is_refused():
    fed = toy_federation("method.name=fedmix")
    bank: dict[str, np.ndarray] = {MEAN_X: fed.dataset.x[:3].numpy(), MEAN_Y: np.eye(4, dtype=np.float32)[:3]}
    msg = {**weights_of(fed.model), **bank, "lr": 0.1, "round": 1}
    reply, _ = fed.method.client_update(fed.model, dict(msg), {}, client_context(fed, 0, 1))
    assert set(reply) == {*weights_of(fed.model), "num_examples", "train_loss"} and math.isfinite(reply["train_loss"])
    empty = {**msg, MEAN_X: bank[MEAN_X][:0], MEAN_Y: bank[MEAN_Y][:0]}
    with pytest.raises(ValueError, match="client 0 received no other client's means"):
        fed.method.client_update(fed.model, empty, {}, client_context(fed, 0, 1))


def test_a_client_takes_plain_sgd_steps_on_eq_5_against_its_one_row_bank() -> None:
    """One full batch, two epochs, plain SGD: with a one-row bank every sample's ``j`` is that row, so the reply is
    two steps ``w ← w − lr ∇_w ℓ_FedMix`` rebuilt here with ``fedmix_loss``; at a tiny ``λ`` it is FedAvg's."""
    fed = toy_federation("optim.momentum=0", "optim.weight_decay=0", "federation.batch_size=1000")
    data = fed.dataset
    assert isinstance(data, ToyDomains)
    lr, lam = 0.1, 0.3
    bank: dict[str, np.ndarray] = {MEAN_X: 2.0 * data.x[:1].numpy() + 1.0,
                                   MEAN_Y: np.array([[0.0, 0.2, 0.3, 0.5]], np.float32)}
    msg: Message = {**weights_of(fed.model), **bank, "lr": lr, "round": 1}
    ctx = replace(client_context(fed, 0, 1), local_epochs=2)
    model = copy.deepcopy(fed.model).train()
    reply, _ = FedMix(FedMixParams(lam=lam)).client_update(fed.model, dict(msg), {}, ctx)
    x, y = data.x[ctx.train_idx], torch.as_tensor(data.labels[ctx.train_idx])
    x_bar, y_bar = (torch.from_numpy(bank[k]).expand(len(x), *bank[k].shape[1:]) for k in (MEAN_X, MEAN_Y))
    assert_reply_is_sgd_steps(reply, msg, model, lambda: fedmix_loss(model, fed.task, x, y, x_bar, y_bar, lam), lr, 2)
    tiny, _ = FedMix(FedMixParams(lam=1e-7)).client_update(fed.model, dict(msg), {}, ctx)
    avg, _ = FedAvg().client_update(fed.model, dict(msg), {}, ctx)
    for k in weights_of(model):
        np.testing.assert_allclose(np.asarray(tiny[k]), np.asarray(avg[k]), rtol=1e-4, atol=1e-6, err_msg=k)


def test_tasks_without_class_labels_are_refused_when_the_config_loads():
    with registered(), pytest.raises(ConfigError, match="method fedmix needs class_labels"):
        build_config({}, [f"data.dataset={NAME}", "model.name=pixelnet", "method.name=fedmix"])


def test_a_client_with_fewer_samples_than_a_group_uploads_no_mean():
    """A natural client (a writer with 3 digits) below M = 5 samples: no complete group, an empty upload of the
    right trailing shapes (it used to crash reshaping 0 one-hot rows)."""
    x_bar, y_bar = group_means(torch.ones(3, 1, 4, 4), torch.eye(10)[:3], 5)
    assert x_bar.shape == (0, 1, 4, 4) and y_bar.shape == (0, 10)


def test_the_defaults():
    """docs/methods/fedmix.md: λ = 0.05, M = 5."""
    p = FedMixParams()
    assert (p.lam, p.mean_size) == (0.05, 5)
