"""FedBN: BatchNorm stays with each client, everything else is FedAvg; the unseen-domain BN choices."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from toy import ToyNet, toy_federation

from feddg.algorithms import Reply
from feddg.algorithms.fedavg import FedAvg
from feddg.algorithms.fedbn import BN_PREFIX, FedBN, FedBNParams, batch_statistics, bn_keys
from feddg.federation.client import client_context
from feddg.messages import load_weights

BN = ["w/bn.weight", "w/bn.bias", "w/bn.running_mean", "w/bn.running_var", "w/bn.num_batches_tracked"]


def test_bn_keys_are_every_batchnorm_parameter_and_buffer():
    assert sorted(bn_keys(ToyNet())) == sorted(BN)
    with pytest.raises(ValueError, match="BatchNorm"):
        bn_keys(nn.Linear(2, 2))


def _round(fed, state, round, clients=range(4)):
    """One round of ``clients``; the others' client states are kept."""
    method = fed.method
    sent = {cid: {**method.client_config(state, cid, round), "lr": 0.1, "round": round} for cid in clients}
    replies, states = [], dict(fed.cstates)
    for cid, msg in sent.items():
        reply, states[cid] = method.client_update(fed.model, dict(msg), fed.cstates.get(cid, {}),
                                                  client_context(fed, cid, round))
        replies.append(Reply(cid, reply))
    fed.cstates = states
    new, _ = method.aggregate(state, replies)
    return sent, replies, new


def test_bn_stays_local_and_everything_else_is_averaged():
    fed = toy_federation("method.name=fedbn")
    fed.cstates = {}
    state = fed.method.server_init(fed.model, None)
    sent1, replies1, state = _round(fed, state, 1)
    assert all(BN_PREFIX + k in msg for msg in sent1.values() for k in BN)  # round 1: the initial BN, once
    for r in replies1:  # the client keeps its BN; it reports it under bn/ only
        assert not set(BN) & set(r.message)
        assert all(np.array_equal(fed.cstates[r.client_id][k], r.message[BN_PREFIX + k]) for k in BN)
    avg, _ = FedAvg().aggregate({}, replies1)  # FedAvg of the w/ keys = the non-BN keys
    assert set(avg["weights"]) == set(state["weights"]) - set(BN)
    assert all(np.array_equal(state["weights"][k], avg["weights"][k]) for k in avg["weights"])
    n = np.array([r.num_examples for r in replies1], dtype=np.float64)
    bn_mean = sum(w * r.message[BN_PREFIX + "w/bn.weight"] for w, r in zip(n / n.sum(), replies1))
    np.testing.assert_allclose(state["weights"]["w/bn.weight"], bn_mean, rtol=1e-6)  # the unseen-domain BN

    sent2, replies2, _ = _round(fed, state, 2)
    assert all(not any(k.startswith(BN_PREFIX) or k in BN for k in msg) for msg in sent2.values())  # BN never sent
    # round 2 starts from the global non-BN weights and the client's *own* BN
    own = {k: replies1[0].message[BN_PREFIX + k] for k in BN}
    ref, _ = FedAvg().client_update(fed.model, {**sent2[0], **own}, {}, client_context(fed, 0, 2))
    assert all(np.array_equal(replies2[0].message[k], ref[k]) for k in ref if k.startswith("w/") and k not in BN)
    assert all(np.array_equal(replies2[0].message[BN_PREFIX + k], ref[k]) for k in BN)

    assert all(np.array_equal(fed.method.eval_weights(state, 1)[k], replies1[1].message[BN_PREFIX + k]) for k in BN)
    assert fed.method.eval_weights(state, None) is state["weights"]


def test_a_client_absent_this_round_is_evaluated_with_the_bn_it_uploaded_last():
    """Partial participation: clients 0, 1 in round 1, clients 2, 3 in round 2. Client 0's model after round 2 is
    the round-2 global non-BN weights with the BN of its round-1 reply."""
    fed = toy_federation("method.name=fedbn")
    fed.cstates = {}
    state = fed.method.server_init(fed.model, None)
    _, replies1, state = _round(fed, state, 1, [0, 1])
    _, replies2, state = _round(fed, state, 2, [2, 3])
    for cid, reply in ((0, replies1[0]), (3, replies2[1])):
        mine = fed.method.eval_weights(state, cid)
        assert all(np.array_equal(mine[k], reply.message[BN_PREFIX + k]) for k in BN), cid
        assert all(np.array_equal(mine[k], state["weights"][k]) for k in state["weights"] if k not in BN)
    assert not np.array_equal(replies1[0].message[BN_PREFIX + "w/bn.weight"], state["weights"]["w/bn.weight"])


def test_target_mode_resets_the_statistics_and_predicts_with_the_batchs_own():
    method = FedBN(FedBNParams(unseen_bn="target"))
    model = method.prepare_model(ToyNet())
    weights = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    weights = {"w/" + k: v + 0.5 if "running" in k else v for k, v in weights.items()}
    weights["w/bn.num_batches_tracked"] = np.array(7)
    state = {"weights": weights, "clients": {}}
    unseen = method.eval_weights(state, None)
    np.testing.assert_array_equal(unseen["w/bn.running_mean"], 0.0)
    np.testing.assert_array_equal(unseen["w/bn.running_var"], 1.0)
    assert int(unseen["w/bn.num_batches_tracked"]) == 0
    np.testing.assert_array_equal(unseen["w/bn.weight"], weights["w/bn.weight"])

    x = torch.randn(8, 1, 6, 6) * 3 + 1
    load_weights(model, unseen)
    model.eval()
    h = model.conv(x)
    expected = F.batch_norm(h, None, None, model.bn.weight, model.bn.bias, training=True, eps=model.bn.eps)
    with batch_statistics(model):
        torch.testing.assert_close(model.bn(h), expected)
    assert model.bn.running_mean is not None  # restored
    with torch.no_grad():
        torch.testing.assert_close(method.predict(model, x), model.classifier(_features(model, expected)))
    load_weights(model, weights)
    with torch.no_grad():
        torch.testing.assert_close(method.predict(model, x), model(x))  # tracked statistics are used as they are


def _features(model, bn_out):
    return torch.relu(model.fc(torch.relu(bn_out).flatten(1)))


def test_bn1d_layers_are_kept_local_and_the_unseen_bn_is_weighted_by_examples():
    """A ``Linear`` + ``BatchNorm1d`` model, clients of 1 and 3 examples: the non-BN weights and the unseen-domain BN
    are both the 1:3 means; a client never heard from is evaluated with that average BN."""
    method = FedBN()
    model = method.prepare_model(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    bn = ["w/1.weight", "w/1.bias", "w/1.running_mean", "w/1.running_var", "w/1.num_batches_tracked"]
    assert sorted(method.bn) == sorted(bn)
    state = method.server_init(model, None)

    def reply(cid, value, n):
        w = {k: np.full_like(v, value) for k, v in state["weights"].items()}
        return Reply(cid, {**{k: v for k, v in w.items() if k not in bn}, **{BN_PREFIX + k: w[k] for k in bn},
                           "num_examples": n})

    state, _ = method.aggregate(state, [reply(0, 2.0, 1), reply(1, 6.0, 3)])  # (1·2 + 3·6) / 4 = 5
    assert all(np.array_equal(v, np.full_like(v, 5.0)) for v in state["weights"].values())
    assert int(state["weights"]["w/1.num_batches_tracked"]) == 5
    assert all(np.array_equal(method.eval_weights(state, 0)[k], np.full_like(state["weights"][k], 2.0)) for k in bn)
    assert all(np.array_equal(method.eval_weights(state, 2)[k], state["weights"][k]) for k in state["weights"])
