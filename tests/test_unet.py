"""The U-Net of FedHarmo/FedFA: shapes, its conv stages, its permutation spec (function preserving, undone by FOT)
and RegMean of its 1×1 output convolution as a linear layer over pixels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from feddg.aggregation.fot import align_to_reference
from feddg.aggregation.merges import merge_stations
from feddg.algorithms import create_method
from feddg.algorithms.base import ClientContext, OptimSettings
from feddg.algorithms.hfedatm import GRAM_FLAG, GramRecorder, HFedATMParams, gram_layers, update_with_grams
from feddg.data.base import DomainDataset
from feddg.messages import WEIGHT_PREFIX, weights_of
from feddg.models import create_model, list_models, model_capabilities
from feddg.models.permutation import (
    Axis,
    apply_permutations,
    permutation_spec,
    permute_grams,
    random_permutations,
)
from feddg.models.stages import conv_stages, stem_stages
from feddg.models.unet import UNet, UpConv2x2


def _unet(size: int = 32, width: int = 8, depth: int = 3, classes: int = 2) -> UNet:
    torch.manual_seed(0)
    model = create_model("unet", num_classes=classes, in_channels=3, image_size=size, width=width, depth=depth)
    assert isinstance(model, UNet)
    # non-trivial BatchNorm parameters and statistics, so forgetting to permute them is visible
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.normal_()
            m.bias.data.normal_()
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _x(size: int = 32, n: int = 2, seed: int = 1) -> Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


# --- the network --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "depth", "channels"), [(32, 3, 3), (32, 4, 1), (64, 4, 3)])
def test_dense_outputs_and_the_feature_split(size, depth, channels):
    torch.manual_seed(0)
    model = create_model("unet", num_classes=3, in_channels=channels, image_size=size, width=8, depth=depth).eval()
    x = torch.randn(2, channels, size, size)
    with torch.no_grad():
        feats, out = model.features(x), model(x)
    assert model.feature_dim == 8 and feats.shape == (2, 8, size, size)
    assert out.shape == (2, 3, size, size)
    assert torch.equal(out, model.classifier(feats))
    assert len(model.encoders) == len(model.decoders) == len(model.upconvs) == depth


def test_registry_capabilities_and_the_papers_size():
    model = create_model("unet", num_classes=2, in_channels=3, image_size=64, width=8)
    assert "unet" in list_models() and model_capabilities("unet") == {"batchnorm", "conv_stages", "dense_masks"}
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert isinstance(model.classifier, nn.Conv2d) and model.classifier.kernel_size == (1, 1)
    with torch.device("meta"):  # width 32, depth 4: 7.76 M parameters, FedFA §6.1's "29.6 MB" per model
        full = create_model("unet", num_classes=2, in_channels=3, image_size=384)
    assert sum(p.numel() for p in full.parameters()) == 7_763_074
    with pytest.raises(ValueError, match="divisible by 16"):
        create_model("unet", num_classes=2, image_size=40)
    with pytest.raises(ValueError, match="depth >= 1 and width >= 1, got depth 0"):
        UNet(num_classes=2, depth=0)


def test_upconv_is_a_transposed_convolution_with_its_weight_transposed():
    torch.manual_seed(0)
    up = UpConv2x2(6, 4)
    torch.manual_seed(0)
    ref = nn.ConvTranspose2d(6, 4, kernel_size=2, stride=2)
    assert up.weight.shape == (4, 6, 2, 2)
    assert torch.equal(up.weight, ref.weight.transpose(0, 1)) and torch.equal(up.bias, ref.bias)  # same init draws
    x = torch.randn(2, 6, 5, 7)
    with torch.no_grad():
        torch.testing.assert_close(up(x), ref(x), rtol=0, atol=1e-6)


def test_conv_stages_are_the_encoder_blocks_and_the_bottleneck():
    model = _unet(size=32, depth=3)
    names = conv_stages(model)
    assert names == ["encoders.0", "encoders.1", "encoders.2", "bottleneck"] and stem_stages(model) == 0
    modules = dict(model.named_modules())
    seen: dict[str, list[tuple[int, ...]]] = {n: [] for n in names}
    hooks = [modules[n].register_forward_hook(lambda m, i, o, n=n: seen[n].append(tuple(o.shape))) for n in names]
    with torch.no_grad():
        model(_x())
    for h in hooks:
        h.remove()
    assert [s for (s,) in seen.values()] == [(2, 8, 32, 32), (2, 16, 16, 16), (2, 32, 8, 8), (2, 64, 4, 4)]


def _block_by_hand(x: Tensor, block: nn.Sequential) -> Tensor:
    """(conv 3×3, padding 1, no bias → BatchNorm with its running statistics → ReLU) twice."""
    for conv, bn in ((block[0], block[1]), (block[3], block[4])):
        x = F.conv2d(x, conv.weight, padding=1)
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        x = ((x - bn.running_mean[:, None, None]) * scale[:, None, None] + bn.bias[:, None, None]).clamp(min=0)
    return x


def _up_by_hand(x: Tensor, up: UpConv2x2) -> Tensor:
    """out[o, 2i+a, 2j+b] = Σ_c W[o, c, a, b] x[c, i, j] + bias[o]."""
    n, _, h, w = x.shape
    out = torch.einsum("ocab,ncij->noiajb", up.weight, x).reshape(n, up.out_channels, 2 * h, 2 * w)
    return out + up.bias[:, None, None]


def test_forward_is_the_u_net_rebuilt_from_its_weights():
    """Ronneberger et al.'s U-Net by hand: encoder blocks with 2×2 max-pools between them, the bottleneck, then per
    level the transposed conv, the concatenation [up-sampled, encoder output] and a block, and the 1×1 classifier."""
    model = _unet(size=16, width=4, depth=2, classes=3)
    x = _x(16)
    for m in model.modules():  # running statistics of x itself: random ones would swamp the spatial signal
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = 1.0
    with torch.no_grad():
        model.train()(x)
        model.eval()
        h, skips = x, []
        for encoder in model.encoders:
            h = _block_by_hand(h, encoder)
            skips.append(h)
            n, c, rows, cols = h.shape
            h = h.reshape(n, c, rows // 2, 2, cols // 2, 2).amax(dim=(3, 5))  # 2×2 max-pool
        h = _block_by_hand(h, model.bottleneck)
        for up, decoder, skip in zip(model.upconvs, model.decoders, reversed(skips), strict=True):
            h = _block_by_hand(torch.cat((_up_by_hand(h, up), skip), dim=1), decoder)
        expected = torch.einsum("kc,nchw->nkhw", model.classifier.weight[:, :, 0, 0], h)
        expected = expected + model.classifier.bias[:, None, None]
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


# --- FOT: the permutation spec ------------------------------------------------------------------------------------


def test_spec_groups_skip_slices_and_coverage():
    model = _unet(depth=3)
    spec = permutation_spec(model)
    names = [g.name for g in spec.groups]
    assert spec.acyclic and len(names) == 2 * 3 + 2 + 3 * 3  # 2 per block, 1 per transposed conv
    groups = {g.name: g for g in spec.groups}
    assert Axis("decoders.2.0.weight", 1, 8) in groups["encoders.0.3"].members  # skip: the slice [8, 16)
    assert Axis("decoders.2.0.weight", 1, 0) in groups["upconvs.2"].members  # up-sampled: the slice [0, 8)
    assert Axis("upconvs.0.weight", 1) in groups["bottleneck.3"].members
    assert groups["upconvs.0"].producers == ("upconvs.0.weight",) and Axis("upconvs.0.bias", 0) in groups["upconvs.0"].members
    assert Axis("classifier.weight", 1) in groups["decoders.2.3"].members
    touched = {a.key for g in spec.groups for a in g.members}
    never = {k for k in model.state_dict() if k not in touched}
    assert never == {"classifier.bias"} | {k for k in model.state_dict() if k.endswith("num_batches_tracked")}
    assert not any(a.key == "classifier.weight" and a.dim == 0 for g in spec.groups for a in g.members)


@pytest.mark.parametrize(("size", "depth"), [(32, 3), (32, 4)])
def test_random_permutations_of_every_group_preserve_the_function(size, depth):
    model = _unet(size=size, depth=depth)
    spec = permutation_spec(model)
    x = _x(size)
    with torch.no_grad():
        before = model(x)
        perms = random_permutations(spec, np.random.default_rng(0))
        assert all((p != np.arange(len(p))).any() for p in perms.values())
        model.load_state_dict(apply_permutations(model.state_dict(), spec, perms))
        after = model(x)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5 * max(1.0, float(before.abs().max())))


def test_a_randomly_permuted_copy_is_realigned_and_merges_to_the_original():
    model = _unet(depth=3)
    spec = permutation_spec(model)
    original = model.state_dict()
    q = random_permutations(spec, np.random.default_rng(2))
    copy = apply_permutations(original, spec, q)
    al = align_to_reference(original, [copy], spec)
    for g in spec.groups:  # aligned[i] = copy[p[i]] = original[q[p[i]]] = original[i]
        assert np.array_equal(q[g.name][al.perms[0][g.name]], np.arange(g.size)), g.name
    assert all(torch.equal(al.states[0][k], v) for k, v in original.items())
    assert al.passes == 1 and min(al.moved.values()) > 0.5
    assert max(al.cost_after.values()) < 1e-5 < min(al.cost_before.values())
    msgs = [{WEIGHT_PREFIX + k: v.numpy() for k, v in s.items()} for s in (original, copy)]
    merged, _ = merge_stations(msgs, None, [1, 1], spec)
    x = _x()
    with torch.no_grad():
        before = model(x)
        model.load_state_dict({k: torch.from_numpy(np.asarray(merged[WEIGHT_PREFIX + k])) for k in original})
        after = model(x)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5 * max(1.0, float(before.abs().max())))


def test_hfedatm_merge_with_grams_of_the_output_conv_recovers_the_original():
    model = _unet(depth=3)
    spec = permutation_spec(model)
    original = model.state_dict()
    q = random_permutations(spec, np.random.default_rng(4))
    copy = apply_permutations(original, spec, q)
    feats = torch.randn(500, 8, dtype=torch.float64)  # pixels of the last decoder map
    gram = {"classifier": feats.T @ feats}
    grams = [{k: v.numpy() for k, v in g.items()} for g in (gram, permute_grams(gram, spec, q))]
    msgs = [{WEIGHT_PREFIX + k: v.numpy() for k, v in s.items()} for s in (original, copy)]
    merged, metrics = merge_stations(msgs, grams, [1, 3], spec)
    assert metrics["regmean/classifier/fallback"] == 0.0
    w = merged[WEIGHT_PREFIX + "classifier.weight"]
    assert w.shape == (2, 8, 1, 1)
    np.testing.assert_allclose(w, original["classifier.weight"].numpy(), rtol=1e-5, atol=1e-6)


# --- RegMean of the 1×1 output conv -------------------------------------------------------------------------------


class _Head(nn.Module):
    """A model whose ``classifier`` is the layer under test."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.classifier = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(x)


def _recorded(layer: nn.Module, *batches: Tensor, clip: float | None = None) -> Tensor:
    model = _Head(layer).train()
    rec = GramRecorder(model, clip)
    with rec, torch.no_grad():
        rec.new_pass()
        for x in batches:
            rec.new_batch()
            model(x)
    return rec.grams()["classifier"]


def _pixels(x: Tensor) -> Tensor:
    return x.movedim(1, -1).reshape(-1, x.shape[1]).double()


@pytest.mark.parametrize("chunk", [1 << 16, 100])  # 100 pixels: one image (10×12) per chunk
def test_the_gram_of_a_1x1_conv_is_xtx_of_its_pixels(monkeypatch, chunk):
    monkeypatch.setattr("feddg.algorithms.hfedatm.PIXEL_CHUNK", chunk)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(3, 5, 10, 12, generator=g), torch.randn(2, 5, 10, 12, generator=g)]
    conv = nn.Conv2d(5, 2, kernel_size=1)
    rows = torch.cat([_pixels(x) for x in batches])
    torch.testing.assert_close(_recorded(conv, *batches), rows.T @ rows)
    # DP: each image's pixel rows together to Frobenius norm 1.5 (one image moves the Gram by at most 1.5²)
    images = [_pixels(x[i:i + 1]).double() for x in batches for i in range(len(x))]
    assert all(im.norm() > 1.5 for im in images)
    clipped = torch.cat([im * min(1.0, 1.5 / float(im.norm())) for im in images])
    torch.testing.assert_close(_recorded(conv, *batches, clip=1.5), clipped.T @ clipped)


def test_regmean_of_1x1_convs_equals_regmean_of_the_equivalent_linear_layers():
    torch.manual_seed(0)
    xs = [torch.randn(n, 6, 4, 4) * torch.rand(1, 6, 1, 1) * 3 for n in (3, 5, 2)]  # three stations' inputs
    convs = [nn.Conv2d(6, 3, kernel_size=1) for _ in xs]
    linears = [nn.Linear(6, 3) for _ in xs]
    for conv, lin in zip(convs, linears, strict=True):
        lin.weight.data.copy_(conv.weight.data.reshape(3, 6))
        lin.bias.data.copy_(conv.bias.data)
    conv_grams = [{"classifier": _recorded(c, x).numpy()} for c, x in zip(convs, xs, strict=True)]
    lin_grams = [{"classifier": _recorded(lin, _pixels(x).float()).numpy()} for lin, x in zip(linears, xs, strict=True)]
    for cg, lg in zip(conv_grams, lin_grams, strict=True):
        np.testing.assert_allclose(cg["classifier"], lg["classifier"], rtol=1e-6)
    gammas = [1.0, 2.0, 1.0]

    def merge(layers, grams):
        msgs = [{WEIGHT_PREFIX + k: v.detach().numpy() for k, v in _Head(m).state_dict().items()} for m in layers]
        return merge_stations(msgs, grams, gammas, None)

    by_conv, conv_metrics = merge(convs, conv_grams)
    by_linear, _ = merge(linears, lin_grams)
    w = by_conv[WEIGHT_PREFIX + "classifier.weight"]
    assert w.shape == (3, 6, 1, 1) and conv_metrics["regmean/classifier/fallback"] == 0.0
    np.testing.assert_allclose(w.reshape(3, 6), by_linear[WEIGHT_PREFIX + "classifier.weight"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(by_conv[WEIGHT_PREFIX + "classifier.bias"], by_linear[WEIGHT_PREFIX + "classifier.bias"])
    mean = sum(g * c.weight.detach().numpy() for g, c in zip(gammas, convs, strict=True)) / sum(gammas)
    assert not np.allclose(w, mean, atol=1e-3)  # RegMean, not the weighted mean


def test_only_linear_layers_and_pointwise_head_convs_record_grams():
    head = nn.Sequential(nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 1, stride=2), nn.Conv2d(4, 4, 1, groups=2), nn.Conv2d(4, 2, 1))
    model = nn.Module()
    model.trunk = nn.Conv2d(3, 4, 1)  # a pointwise conv outside the head: not a Gram layer
    model.fc = nn.Linear(2, 2)
    model.head = _Head(head)
    assert sorted(gram_layers(model)) == ["fc", "head.classifier.3"]
    assert sorted(gram_layers(_unet(depth=3))) == ["classifier"]
    for name in ("efficientnet_lite0", "resnet50", "hfedf-cnn"):  # trunks with 1×1 convs: unchanged, linears only
        with torch.device("meta"):
            zoo = create_model(name, num_classes=5, image_size=32)
        assert gram_layers(zoo) == {n: m for n, m in zoo.named_modules() if isinstance(m, nn.Linear)}, name


# --- FedFA (and HFedATM's Grams) on a U-Net -----------------------------------------------------------------------


class _Slices(DomainDataset):
    """8 random 3×32×32 "slices" with a foreground mask."""

    name = "slices"
    task = "segmentation"

    def __init__(self) -> None:
        self.x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        self.masks = (self.x[:, 0] > 0.5).long()
        self.labels = np.zeros(8, dtype=np.int64)
        self.domain_ids = np.zeros(8, dtype=np.int64)
        self.domains = ["site"]
        self.classes = ["background", "prostate"]
        self.image_shape = (3, 32, 32)

    def get_batch(self, indices, train, generator=None):
        idx = torch.as_tensor(indices)
        return self.x[idx], self.masks[idx]


def test_fedfa_trains_a_unet_with_ffa_after_every_stage_and_sends_its_grams():
    from feddg.tasks.segmentation import Segmentation

    method = create_method("fedfa", {"p": 1.0})  # FedFA+: every FFA layer active, alignment at the bottleneck
    torch.manual_seed(0)
    model = method.prepare_model(create_model("unet", num_classes=2, in_channels=3, image_size=32, width=8, depth=3))
    ctx = ClientContext(0, 1, _Slices(), np.arange(8), 4, 1, OptimSettings(), torch.Generator().manual_seed(0),
                        Segmentation(2))
    before = {k: v.copy() for k, v in weights_of(model).items()}
    msg = {**before, "lr": 0.01, "round": 1, GRAM_FLAG: 1}
    reply, state = update_with_grams(method, model, msg, {}, ctx, HFedATMParams())
    assert np.isfinite(reply["train_loss"])
    assert {k for k in reply if k.startswith("stat/")} == {f"stat/{k}/{s}" for k in range(1, 5) for s in ("mu_bar", "sigma_bar")}
    assert [reply[f"stat/{k}/mu_bar"].shape for k in range(1, 5)] == [(8,), (16,), (32,), (64,)]
    assert reply["hist/pi"].shape == (64, 8)  # the bottleneck's channels × L bins
    assert {k for k in reply if k.startswith("gram/")} == {"gram/classifier"} and reply["gram/classifier"].shape == (8, 8)
    assert any(not np.array_equal(reply[k], v) for k, v in before.items() if k.endswith(".weight"))
