"""Swin-T (models/swin.py): SwinModel's output, the stage map FedFA hooks, input sizes, model.path, one FedFA round."""

import copy

import numpy as np
import pytest
import torch
from support.natural_fixtures import cifar_batches

from feddg.algorithms import create_method
from feddg.config import build_config
from feddg.engines.inprocess import run_inprocess
from feddg.federation.server import Server
from feddg.federation.setup import build_federation
from feddg.models import create_model
from feddg.models.stages import conv_stages
from feddg.models.swin import default_patch_window

TINY_CHANNELS = [16, 32, 64, 128]


def _tiny(**options):
    torch.manual_seed(0)
    return create_model("swin_tiny_test", num_classes=7, in_channels=3, image_size=32, **options)


def _stage_outputs(model, x):
    """The stage map's outputs in forward order."""
    modules, seen = dict(model.named_modules()), []
    hooks = [modules[n].register_forward_hook(lambda m, i, o: seen.append(o)) for n in conv_stages(model)]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return seen


def test_features_are_swin_models_pooled_output():
    model = _tiny().eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        feats, out = model.features(x), model(x)
        hf = model.swin(x).last_hidden_state.mean(dim=1)  # SwinModel's own forward, then its pooler
    assert feats.shape == (2, 128) and model.feature_dim == 128 and out.shape == (2, 7)
    assert torch.equal(feats, hf) and torch.equal(out, model.classifier(feats))


def test_stage_map_is_the_four_stage_grids_before_each_patch_merging():
    model = _tiny().eval()
    assert conv_stages(model) == ["stage_ends.0", "stage_ends.1", "stage_ends.2", "stage_ends.3"]
    x = torch.randn(2, 3, 32, 32)
    grids = _stage_outputs(model, x)
    # 32 px, patch 1, three 2× merges: 32, 16, 8, 4 tokens a side
    assert [tuple(g.shape) for g in grids] == [(2, c, 32 // 2**k, 32 // 2**k) for k, c in enumerate(TINY_CHANNELS)]
    with torch.no_grad():  # transformers' own [B, C, H, W] view of each stage before its merging: the same layout
        hf = model.swin(x, output_hidden_states=True, output_hidden_states_before_downsampling=True)
    for ours, theirs in zip(grids, hf.reshaped_hidden_states[1:], strict=True):
        assert torch.equal(ours, theirs)


def test_tiny_stages_have_two_blocks_and_a_head_per_16_channels():
    """Two blocks a stage, regular then shifted by half a window (Swin's W-MSA, SW-MSA), and heads 1, 2, 4, 8: one
    column per head in each block's (2·4 − 1)² relative position bias table."""
    model = _tiny()
    state = model.state_dict()
    for k, (stage, channels) in enumerate(zip(model.swin.encoder.layers, TINY_CHANNELS, strict=True)):
        assert [block.shift_size for block in stage.blocks] == [0, 2]
        tables = [v.shape for key, v in state.items()
                  if key.startswith(f"swin.encoder.layers.{k}.") and key.endswith("relative_position_bias_table")]
        assert tables == [(49, channels // 16)] * 2, k


def test_swin_t_has_the_papers_sizes():
    model = create_model("swin_t", num_classes=1000, in_channels=3, image_size=224).eval()
    assert sum(p.numel() for p in model.parameters()) == 28_288_354  # Swin-T's 28 M (timm's swin_tiny_patch4_window7_224)
    grids = _stage_outputs(model, torch.randn(1, 3, 224, 224))
    assert [tuple(g.shape[1:]) for g in grids] == [(96, 56, 56), (192, 28, 28), (384, 14, 14), (768, 7, 7)]


def test_patch_and_window_keep_swin_t_windows_a_side():
    assert [default_patch_window(s) for s in (224, 32, 64, 128)] == [(4, 7), (1, 4), (2, 4), (4, 4)]
    model = create_model("swin_tiny_test", num_classes=2, in_channels=3, image_size=64)
    assert (model.swin.config.patch_size, model.swin.config.window_size) == (2, 4)


@pytest.mark.parametrize(("size", "options", "message"), [
    (28, {}, "image_size 28 does not fit patch 1 and window 4: it must be a multiple of 32"),
    (32, {"patch_size": 2}, "image_size 32 does not fit patch 2 and window 4: it must be a multiple of 64"),
    (32, {"windw_size": 2}, r"^model\.params\.windw_size: model swin_tiny_test has no such option; it takes "
                            r"attention_probs_dropout_prob, .*, window_size$"),
])
def test_bad_sizes_and_options_are_refused_in_one_line(size, options, message):
    with pytest.raises(ValueError, match=message):
        create_model("swin_tiny_test", num_classes=2, in_channels=3, image_size=size, **options)


def test_ffa_fires_once_after_each_stage_and_is_the_identity_in_eval():
    base = _tiny(drop_path_rate=0.0)
    model = create_method("fedfa", {"p": 1.0}).prepare_model(copy.deepcopy(base))
    calls = {k: 0 for k, _ in model.fedfa.items()}
    for k, layer in model.fedfa.items():
        layer.register_forward_hook(lambda m, i, o, k=k: calls.__setitem__(k, calls[k] + 1))
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        augmented, plain = model.train()(x), base.train()(x)
    assert calls == {1: 1, 2: 1, 3: 1, 4: 1}
    assert model.fedfa.channels() == dict(enumerate(TINY_CHANNELS, start=1))
    assert not torch.allclose(augmented, plain, atol=1e-3)  # p = 1: every stage's statistics were perturbed
    assert model.state_dict().keys() == base.state_dict().keys()
    with torch.no_grad():
        assert torch.equal(model.eval()(x), base.eval()(x))


def test_model_path_and_weights_round_trip(tmp_path):
    model = _tiny().eval()
    model.swin.save_pretrained(tmp_path / "hf")  # a local Hugging Face Swin directory: config.json + safetensors
    loaded = create_model("swin_tiny_test", num_classes=7, in_channels=3, image_size=32, path=tmp_path / "hf").eval()
    loaded.classifier.load_state_dict(model.classifier.state_dict())  # the head is fresh: model.path is a backbone
    torch.save(model.state_dict(), tmp_path / "model.pth")  # a whole-model state_dict is model.weights
    weighted = create_model("swin_tiny_test", num_classes=7, in_channels=3, image_size=32,
                            weights=tmp_path / "model.pth").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x)) and torch.equal(weighted(x), model(x))
    with pytest.raises(ValueError, match="no such directory"):
        create_model("swin_t", num_classes=7, path=tmp_path / "missing", image_size=32)
    with pytest.raises(ValueError, match="fixes the architecture"):
        create_model("swin_tiny_test", num_classes=7, path=tmp_path / "hf", image_size=32, window_size=2)
    with pytest.raises(ValueError, match="image_size 48 does not fit patch 1 and window 4"):  # the directory's sizes
        create_model("swin_tiny_test", num_classes=7, path=tmp_path / "hf", image_size=48)
    with pytest.raises(ValueError, match="3-channel images; the data has 1"):
        create_model("swin_tiny_test", num_classes=7, path=tmp_path / "hf", in_channels=1, image_size=32)


def _config(root, method, **over):
    return build_config({"data": {"dataset": "cifar10", "root": str(root), "image_size": 32, "transforms": "none",
                                  "cache_dir": str(root / "cache")},
                         "split": {"target": "test"}, "model": {"name": "swin_tiny_test"},
                         "partition": {"kind": "dirichlet_labels", "num_clients": 2, "params": {"alpha": 0.6}},
                         "method": {"name": method, "params": {}}, "device": "cpu",
                         "federation": {"rounds": 1, "batch_size": 4, "client_fraction": 1.0}, **over})


def test_fedbn_is_refused_for_want_of_batchnorm(tmp_path):
    with pytest.raises(ValueError, match="method fedbn needs batchnorm: .* model swin_tiny_test conv_stages"):
        _config(tmp_path, "fedbn")


def test_one_fedfa_round_sends_per_stage_statistics_and_the_last_stages_histogram(tmp_path):
    cifar_batches(tmp_path / "cifar-10-batches-py")
    server = Server(build_federation(_config(tmp_path, "fedfa")), tmp_path / "run")
    results = run_inprocess(server)
    sent = server.state["broadcast"]
    for k, c in enumerate(TINY_CHANNELS, start=1):  # eq. 7: γ sums to C per stage
        assert sent[f"ffa/{k}/gamma_mu"].shape == (c,) and float(sent[f"ffa/{k}/gamma_mu"].sum()) == pytest.approx(c)
    assert sent["hist/pi"].shape == (128, 8)  # eq. 11 at the last stage, L = 8 bins
    assert np.allclose(sent["hist/pi"].sum(axis=1), 1.0, atol=1e-5)
    # 2 statistics × (16 + 32 + 64 + 128) channels × 4 B a client, plus the 8 key names
    keys = sum(len(f"stat/{k}/{s}") for k in range(1, 5) for s in ("mu_bar", "sigma_bar"))
    assert server.metrics[0]["fedfa/bytes_stats_up"] == 2 * 240 * 4 + keys
    assert 0.0 <= results["final"]["ood_acc"] <= 100.0
