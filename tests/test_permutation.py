"""Permutation specs of the zoo: function preserving, and exactly undone by FOT alignment."""

import numpy as np
import pytest
import torch
from torch import nn

from feddg.aggregation.fot import align_to_reference
from feddg.aggregation.merges import merge_stations
from feddg.messages import WEIGHT_PREFIX
from feddg.models import create_model
from feddg.models.permutation import (
    Axis,
    apply_permutations,
    permutation_spec,
    permute_grams,
    random_permutations,
)

# (zoo name, options, input size): small inputs keep this fast
ZOO = [
    ("lenet", {}, 28),
    ("cnn", {}, 28),
    ("hfedf-cnn", {}, 32),
    ("alexnet", {"hidden_dim": 64}, 28),
    ("resnet18", {}, 32),
    ("vgg11", {"reduced_head": True}, 32),
    ("efficientnet_lite0", {}, 32),
]


def _model(name: str, options: dict, size: int) -> nn.Module:
    torch.manual_seed(0)
    model = create_model(name, num_classes=5, in_channels=3, image_size=size, **options)
    # non-trivial BatchNorm parameters and statistics, so forgetting to permute them is visible
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.weight.data.normal_()
            m.bias.data.normal_()
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


@pytest.mark.parametrize(("name", "options", "size"), ZOO, ids=[z[0] for z in ZOO])
def test_applying_a_permutation_spec_preserves_the_function(name, options, size):
    model = _model(name, options, size)
    spec = permutation_spec(model)
    x = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)
        perms = random_permutations(spec, np.random.default_rng(0))
        assert any((p != np.arange(len(p))).any() for p in perms.values())
        permuted = apply_permutations(model.state_dict(), spec, perms)
        assert any(not torch.equal(permuted[k], v) for k, v in model.state_dict().items())
        model.load_state_dict(permuted)
        after = model(x)
    scale = before.abs().max()
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5 * float(scale))


@pytest.mark.parametrize(("name", "options", "size"), ZOO, ids=[z[0] for z in ZOO])
def test_a_randomly_permuted_copy_is_exactly_realigned_and_merges_to_the_original(name, options, size):
    model = _model(name, options, size)
    spec = permutation_spec(model)
    original = model.state_dict()
    q = random_permutations(spec, np.random.default_rng(2))
    copy = apply_permutations(original, spec, q)
    al = align_to_reference(original, [copy], spec)
    for g in spec.groups:  # recovered: aligned[i] = copy[p[i]] = original[q[p[i]]] = original[i]
        assert np.array_equal(q[g.name][al.perms[0][g.name]], np.arange(g.size)), g.name
    assert all(torch.equal(al.states[0][k], v) for k, v in original.items())
    assert al.moved and min(al.moved.values()) > 0.5
    assert max(al.cost_after.values()) < 1e-5 < min(al.cost_before.values())
    msgs = [{WEIGHT_PREFIX + k: v.numpy() for k, v in s.items()} for s in (original, copy)]
    merged, _ = merge_stations(msgs, None, [1, 1], spec)
    assert all(np.array_equal(merged[WEIGHT_PREFIX + k], v.numpy()) for k, v in original.items())


def test_bag_of_words_mlp_spec_preserves_the_function_and_is_realigned():
    torch.manual_seed(0)
    model = create_model("mlp", num_classes=5, in_features=20, hidden=16).eval()
    spec = permutation_spec(model)
    original = model.state_dict()
    q = random_permutations(spec, np.random.default_rng(0))
    copy = apply_permutations(original, spec, q)
    assert not torch.equal(copy["classifier.weight"], original["classifier.weight"])
    x = torch.rand(3, 20, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(x)
        model.load_state_dict(copy)
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)
    al = align_to_reference(original, [copy], spec)
    assert all(torch.equal(al.states[0][k], v) for k, v in original.items())


def test_hungarian_solver_realigns_resnet_streams_too():
    model = _model("resnet18", {}, 32)
    spec = permutation_spec(model)
    original = model.state_dict()
    copy = apply_permutations(original, spec, random_permutations(spec, np.random.default_rng(3)))
    al = align_to_reference(original, [copy], spec, solver="hungarian")
    assert all(torch.equal(al.states[0][k], v) for k, v in original.items())
    assert not spec.acyclic and al.passes >= 2  # residual streams need a second sweep


def test_specs_encode_blocks_streams_and_concatenations():
    lenet = permutation_spec(create_model("lenet", num_classes=10, in_channels=3, image_size=28))
    second = lenet.groups[1]  # conv.3: 16 channels of 4×4 flattened into fc.0 (256 inputs)
    assert second.producers == ("conv.3.weight",)
    assert Axis("fc.0.weight", 1, 0, 16) in second.members
    resnet = permutation_spec(create_model("resnet18", num_classes=10, in_channels=3, image_size=32))
    streams = [g for g in resnet.groups if len(g.producers) > 1]
    assert len(resnet.groups) == 12 and len(streams) == 4  # 8 inner convs + 4 residual streams
    assert streams[0].producers == ("conv1.weight", "layer1.0.conv2.weight", "layer1.1.conv2.weight")
    assert Axis("fc.weight", 1) in streams[-1].members
    hfedf = permutation_spec(create_model("hfedf-cnn", num_classes=10, in_channels=3, image_size=32))
    trunk4 = next(g for g in hfedf.groups if g.name == "trunk.4")  # passes through both Inception pools
    assert Axis("trunk.8.branch3.weight", 1, 112) in trunk4.members
    assert Axis("trunk.12.weight", 1, 224, 9) in trunk4.members


def test_full_size_vgg_head_is_blocked_by_the_7x7_pool():
    with torch.device("meta"):
        vgg = create_model("vgg11", num_classes=10, in_channels=3, image_size=32)
    last = permutation_spec(vgg).groups[-1]
    assert Axis("classifier.0.weight", 1, 0, 49) in last.members


def test_gram_of_permuted_inputs_is_the_permuted_gram():
    rng = np.random.default_rng(0)
    spec = permutation_spec(create_model("lenet", num_classes=10, in_channels=3, image_size=28))
    perms = random_permutations(spec, rng)
    x = torch.randn(50, 256, dtype=torch.float64)
    fc_in = next(a for a in spec.groups[1].members if a.key == "fc.0.weight")
    # the permuted network feeds fc.0 the same features with channel blocks reordered
    pos = fc_in.positions(16)
    order = np.arange(256)
    order[pos.ravel()] = pos[perms["conv.3"]].ravel()
    xp = x[:, order]
    got = permute_grams({"fc.0": x.T @ x}, spec, perms)["fc.0"]
    torch.testing.assert_close(got, xp.T @ xp)


def test_unknown_models_have_no_spec():
    with pytest.raises(TypeError, match="no permutation spec"):
        permutation_spec(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2)))
