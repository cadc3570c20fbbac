"""Local augmentation baselines (FedFA Table 10): the formulas on hand-made tensors, the stage hooks,
config validation, and one reproducible training round with each, alone and with FedFA^l."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from toy import ToyDomains

from feddg.algorithms import create_method
from feddg.algorithms.components.augment import (
    Augmenter,
    augment_requirements,
    label_mixing,
    mix,
    mixstyle,
    moex,
    parse_augment,
    soft_targets,
)
from feddg.config import ConfigError, build_config
from feddg.engines.inprocess import run_inprocess
from feddg.federation.server import Server
from feddg.federation.setup import Federation, make_clients, make_split, make_topology
from feddg.models import create_model, list_models, model_capabilities
from feddg.models.stages import conv_stages
from feddg.tasks import CLASS_LABELS, CONV_STAGES, IMAGES

TOL = {"rtol": 1e-5, "atol": 1e-5}


# --- the formulas ----------------------------------------------------------------------------------
def test_mixup_is_the_convex_combination():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])
    assert torch.allclose(mix(a, b, 0.25), torch.tensor([2.5, 4.25]))  # 0.25·a + 0.75·b


def test_soft_targets_interpolate_one_hot_labels():
    y, perm = torch.tensor([0, 1, 2]), torch.tensor([2, 0, 1])
    expected = torch.tensor([[0.7, 0.0, 0.3], [0.3, 0.7, 0.0], [0.0, 0.3, 0.7]])
    assert torch.allclose(soft_targets(y, perm, 0.7, 3), expected)
    # cross-entropy with the soft target is λ CE(y_i) + (1−λ) CE(y_j)
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, 1.0, 3.0], [2.0, 0.0, 1.0]])
    mixed = 0.7 * F.cross_entropy(logits, y) + 0.3 * F.cross_entropy(logits, y[perm])
    assert torch.allclose(F.cross_entropy(logits, soft_targets(y, perm, 0.7, 3)), mixed)


def test_mixstyle_mixes_channel_mean_and_std():
    # sample 0: values [1, 3] -> μ 2, σ 1; sample 1: [2, 10] -> μ 6, σ 4 (one channel, 1×2 map)
    x = torch.tensor([[[[1.0, 3.0]]], [[[2.0, 10.0]]]])
    out = mixstyle(x, torch.tensor([1, 0]), torch.tensor([0.5, 1.0]))
    # sample 0: μ_mix = 0.5·2 + 0.5·6 = 4, σ_mix = 0.5·1 + 0.5·4 = 2.5 -> (x − 2)/1 · 2.5 + 4; sample 1 (λ = 1) kept
    assert torch.allclose(out, torch.tensor([[[[1.5, 6.5]]], [[[2.0, 10.0]]]]), **TOL)


def test_moex_exchanges_positional_moments():
    # PONO over channels at the single position: sample 0 channels [1, 3] (μ 2, σ 1), sample 1 [2, 10] (μ 6, σ 4)
    x = torch.tensor([[1.0, 3.0], [2.0, 10.0]]).view(2, 2, 1, 1)
    out = moex(x, torch.tensor([1, 0]))
    # x̂_0 = (x_0 − 2)/1 · 4 + 6 = [2, 10];  x̂_1 = (x_1 − 6)/4 · 1 + 2 = [1, 3]
    assert torch.allclose(out.view(2, 2), torch.tensor([[2.0, 10.0], [1.0, 3.0]]), **TOL)


def test_the_authors_unbiased_variance_gives_the_same_mixstyle_and_moex_but_for_epsilon():
    """The papers' σ is the population std (MixStyle eq. 1); the authors' code takes torch's unbiased variance, which
    scales σ_i and σ_j by one factor √(n/(n−1)): it cancels in σ_mix/σ_i and σ_j/σ_i, so only ε tells them apart."""
    torch.manual_seed(0)
    x, perm, lam = torch.randn(4, 16, 5, 5), torch.tensor([2, 3, 0, 1]), torch.tensor([0.2, 0.5, 0.9, 1.0])
    mu, sig = x.mean(dim=(2, 3), keepdim=True), (x.var(dim=(2, 3), keepdim=True) + 1e-6).sqrt()
    lam4 = lam.view(-1, 1, 1, 1)
    unbiased = (x - mu) / sig * (lam4 * sig + (1 - lam4) * sig[perm]) + lam4 * mu + (1 - lam4) * mu[perm]
    assert torch.allclose(mixstyle(x, perm, lam), unbiased, atol=1e-5)
    mu, sig = x.mean(dim=1, keepdim=True), (x.var(dim=1, keepdim=True) + 1e-6).sqrt()
    assert torch.allclose(moex(x, perm), (x - mu) / sig * sig[perm] + mu[perm], atol=1e-5)
    # the two variances themselves differ (by 25/24 over a 5×5 map): the test compares outputs, not σ
    assert not torch.allclose(x.var(dim=(2, 3)), x.var(dim=(2, 3), unbiased=False), rtol=1e-2)


def test_mixstyle_statistics_are_detached_so_the_gradient_is_the_style_ratio():
    # μ, σ detached: ∂ x̂ / ∂ x = σ_mix / σ_i elementwise (same tensors as above: σ_mix 2.5, σ_0 1; sample 1 kept)
    x = torch.tensor([[[[1.0, 3.0]]], [[[2.0, 10.0]]]], requires_grad=True)
    mixstyle(x, torch.tensor([1, 0]), torch.tensor([0.5, 1.0])).sum().backward()
    assert torch.allclose(x.grad, torch.tensor([[[[2.5, 2.5]]], [[[1.0, 1.0]]]]), **TOL)
    # a loss on the first pixel only: nothing flows to the other pixel or the partner through μ or σ
    # (the full sum above hides a gradient through σ, as Σ_HW (x − μ) = 0)
    x.grad = None
    mixstyle(x, torch.tensor([1, 0]), torch.tensor([0.5, 1.0]))[..., 0].sum().backward()
    assert torch.allclose(x.grad, torch.tensor([[[[2.5, 0.0]]], [[[1.0, 0.0]]]]), **TOL)


# --- the hooks --------------------------------------------------------------------------------------
def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("cnn", num_classes=4, in_channels=1, image_size=16)


def test_mixup_step_mixes_inputs_and_labels_with_the_drawn_lambda():
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
    with Augmenter(_cnn(), parse_augment([{"name": "mixup", "alpha": 0.2}]), seed=7, num_classes=4) as aug:
        xm, target = aug.step(x, y)
    rng = np.random.default_rng(7)  # the same draws, in the same order: λ, then the permutation
    lam, perm = float(rng.beta(0.2, 0.2)), torch.as_tensor(rng.permutation(4))
    assert torch.allclose(xm, lam * x + (1 - lam) * x[perm])
    assert torch.allclose(target, soft_targets(y, perm, lam, 4))


def test_manifold_mixup_mixes_the_chosen_stage_output_and_the_hooks_go_away():
    model = _cnn().train()
    seen = []  # the input of stage 3 is the output of stage 2 (after our hook)
    model.blocks[2].register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
    model(x)
    spec = parse_augment([{"name": "manifold_mixup", "alpha": 1.0, "stages": [2]}])
    with Augmenter(model, spec, seed=3, num_classes=4) as aug:
        x_out, target = aug.step(x, y)
        model(x_out)
    rng = np.random.default_rng(3)  # λ, the stage, the permutation
    lam, _, perm = float(rng.beta(1.0, 1.0)), rng.choice([2]), torch.as_tensor(rng.permutation(4))
    assert torch.equal(x_out, x)  # stage 2, not the input
    assert torch.allclose(seen[1], mix(seen[0], seen[0][perm], lam), **TOL)
    assert torch.allclose(target, soft_targets(y, perm, lam, 4))
    assert sum(len(m._forward_hooks) for m in model.modules()) == 1  # only the test's own hook is left


def _stage_io(model: torch.nn.Module, spec: dict | list[dict], seed: int, x: Tensor, y: Tensor
              ) -> tuple[Tensor, Tensor, Tensor]:
    """Stage 1's output without and with the Augmenter (as stage 2's input), and the step's target."""
    seen: list[Tensor] = []
    model.get_submodule("blocks.1").register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    model(x)
    with Augmenter(model, parse_augment(spec if isinstance(spec, list) else [spec]), seed=seed, num_classes=4) as aug:
        _, target = aug.step(x, y)
        model(x)
    return seen[0], seen[1], target


def test_moex_step_exchanges_moments_at_its_stage_and_mixes_labels_with_the_fixed_lambda():
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
    before, after, target = _stage_io(_cnn().train(), {"name": "moex", "lam": 0.8, "p": 1.0, "stage": 1}, 5, x, y)
    rng = np.random.default_rng(5)  # the p draw, then the permutation
    rng.random()
    perm = torch.as_tensor(rng.permutation(4))
    assert torch.allclose(after, moex(before, perm), **TOL)
    onehot = torch.eye(4)
    assert torch.allclose(target, 0.8 * onehot[y] + 0.2 * onehot[y[perm]])  # ỹ = λ y_i + (1−λ) y_j, λ = lam


def test_moex_with_p_zero_leaves_features_and_hard_labels():
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
    before, after, target = _stage_io(_cnn().train(), {"name": "moex", "p": 0.0}, 5, x, y)
    assert torch.equal(after, before) and torch.equal(target, y)


def test_mixstyle_step_applies_with_probability_p_using_the_drawn_lambdas():
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
    spec = {"name": "mixstyle", "alpha": 0.1, "p": 1.0, "stages": [1]}
    before, after, target = _stage_io(_cnn().train(), spec, 4, x, y)
    rng = np.random.default_rng(4)  # the p draw (0.94 here: p = 1 applies it, p = 0.5 would not), λ [B], permutation
    assert rng.random() > 0.5
    lams, perm = torch.as_tensor(rng.beta(0.1, 0.1, 4)), torch.as_tensor(rng.permutation(4))
    assert torch.allclose(after, mixstyle(before, perm, lams), **TOL)
    assert torch.equal(target, y)  # labels unchanged
    before, after, _ = _stage_io(_cnn().train(), {**spec, "p": 0.0}, 2, x, y)  # seed 2 draws 0.26 first
    assert torch.equal(after, before)


def test_mixstyle_draws_p_separately_at_each_stage() -> None:
    model, x, y = _cnn().train(), torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        before = model.get_submodule("blocks.1")(model.get_submodule("blocks.0")(x))  # stage 2's output, stage 1 untouched
    seen: list[Tensor] = []
    model.get_submodule("blocks.2").register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    spec = parse_augment([{"name": "mixstyle", "alpha": 0.1, "p": 0.5, "stages": [1, 2]}])
    with Augmenter(model, spec, seed=0, num_classes=4) as aug:
        aug.step(x, y)
        model(x)
    rng = np.random.default_rng(0)  # stage 1: 0.64 ≥ p, skipped; stage 2: 0.27 < p, then λ [B], permutation
    assert rng.random() >= 0.5 and rng.random() < 0.5
    lams, perm = torch.as_tensor(rng.beta(0.1, 0.1, 4)), torch.as_tensor(rng.permutation(4))
    assert torch.allclose(seen[0], mixstyle(before, perm, lams), rtol=1e-5, atol=1e-5)


def test_two_augmentations_at_one_stage_apply_in_list_order() -> None:
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
    specs = [{"name": "mixstyle", "alpha": 0.1, "p": 1.0, "stages": [1]},
             {"name": "manifold_mixup", "alpha": 1.0, "stages": [1]}]
    before, after, target = _stage_io(_cnn().train(), specs, 6, x, y)
    rng = np.random.default_rng(6)  # MixStyle: p draw, λ [B], permutation; Manifold Mixup: λ, stage, permutation
    rng.random()
    lams, perm_s = torch.as_tensor(rng.beta(0.1, 0.1, 4)), torch.as_tensor(rng.permutation(4))
    lam, _, perm_m = float(rng.beta(1.0, 1.0)), rng.choice([1]), torch.as_tensor(rng.permutation(4))
    styled = mixstyle(before, perm_s, lams)
    assert torch.allclose(after, mix(styled, styled[perm_m], lam), rtol=1e-5, atol=1e-5)  # Manifold Mixup of the MixStyle output
    assert torch.allclose(target, soft_targets(y, perm_m, lam, 4))


def test_each_step_replaces_the_previous_steps_draws():
    # two steps, then one forward: only the second step's Manifold Mixup acts on stage 2's output
    model = _cnn().train()
    seen = []
    model.blocks[2].register_forward_hook(lambda m, i, o: seen.append(i[0].detach()))
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
    model(x)
    with Augmenter(model, parse_augment([{"name": "manifold_mixup", "alpha": 1.0, "stages": [2]}]), 3, 4) as aug:
        aug.step(x, y)
        aug.step(x, y)
        model(x)
    rng = np.random.default_rng(3)
    for _ in range(2):  # each step: λ, the stage, the permutation
        lam, _, perm = float(rng.beta(1.0, 1.0)), rng.choice([2]), torch.as_tensor(rng.permutation(4))
    assert torch.allclose(seen[1], mix(seen[0], seen[0][perm], lam), **TOL)


def test_moex_acts_at_its_configured_stage():
    model = _cnn()
    assert hooked(model, {"name": "moex", "stage": 2}) == [conv_stages(model)[1]]


def test_hooks_leave_training_forwards_of_another_batch_size_alone():
    model = _cnn().train()
    x2 = torch.randn(2, 1, 16, 16)
    ref = model(x2)
    with Augmenter(model, parse_augment([{"name": "mixstyle", "p": 1.0, "stages": [1, 2]}]), 0, 4) as aug:
        aug.step(torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3]))
        assert torch.equal(model(x2), ref)


def test_stages_past_the_last_conv_stage_are_refused():
    model = _cnn()  # conv stages 1..4
    with pytest.raises(ValueError, match=r"stages \[5\] out of range"):
        Augmenter(model, parse_augment([{"name": "mixstyle", "stages": [4, 5]}]), 0, 4)


def test_hooks_leave_eval_passes_alone():
    model = _cnn()
    x, y = torch.randn(4, 1, 16, 16), torch.tensor([0, 1, 2, 3])
    model.eval()
    ref = model(x)
    with Augmenter(model, parse_augment([{"name": "mixstyle", "p": 1.0, "stages": [1, 2]}]), 0, 4) as aug:
        aug.step(x, y)
        assert torch.equal(model(x), ref)


# --- config ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("augment", "method", "message"), [
    ([{"name": "mixup"}, {"name": "moex"}], "fedavg", "at most one label-mixing"),
    ([{"name": "mixup", "beta": 1}], "fedavg", "optim.augment.0.mixup.beta: unknown key"),
    ([{"name": "cutmix"}], "fedavg", "does not match"),
    ([{"name": "mixstyle", "stages": [0]}], "fedavg", "1-based"),
    ([{"name": "moex"}], "fpl", "hard labels"),
    ([{"name": "mixup"}], "fedsr", "hard labels"),
    ([{"name": "mixup"}], "pardon", "hard labels"),
])
def test_bad_augment_lists_fail_at_load(augment, method, message):
    with pytest.raises(ConfigError, match=message):
        build_config({"method": {"name": method}, "optim": {"augment": augment}})


def test_defaults_are_the_documented_ones():
    # docs/methods/augmentation.md: mixup α 0.2; manifold_mixup α 2.0; mixstyle α 0.1, p 0.5; moex λ 0.9, p 0.5, stage 1
    (mixup,), (manifold,) = parse_augment([{"name": "mixup"}]), parse_augment([{"name": "manifold_mixup"}])
    (style,), (moex_spec,) = parse_augment([{"name": "mixstyle"}]), parse_augment([{"name": "moex"}])
    assert mixup.alpha == 0.2 and manifold.alpha == 2.0 and (style.alpha, style.p) == (0.1, 0.5)
    assert (moex_spec.lam, moex_spec.p, moex_spec.stage) == (0.9, 0.5, 1)


def test_requirements_and_label_mixing_of_each_augmentation():
    # label-mixing ones need class labels; feature-level ones conv stages; MixStyle keeps the labels
    specs = parse_augment([{"name": "mixstyle"}, {"name": "moex"}])
    assert augment_requirements(specs) == {"mixstyle": {IMAGES, CONV_STAGES}, "moex": {IMAGES, CLASS_LABELS, CONV_STAGES}}
    assert label_mixing(specs) == ["moex"]
    specs = parse_augment([{"name": "mixup"}])
    assert augment_requirements(specs) == {"mixup": {IMAGES, CLASS_LABELS}} and label_mixing(specs) == ["mixup"]
    specs = parse_augment([{"name": "manifold_mixup"}])
    assert augment_requirements(specs) == {"manifold_mixup": {IMAGES, CLASS_LABELS, CONV_STAGES}}


# --- training rounds --------------------------------------------------------------------------------
class Toy28(ToyDomains):
    """The toy domains upsampled to 28 px, so the zoo's LeNet (two conv stages) runs on them."""

    def __init__(self) -> None:
        super().__init__(per_class_domain=8)
        self.x = F.interpolate(self.x, size=28)
        self.image_shape = (1, 28, 28)


def _server(tmp_path, name, *over):
    cfg = build_config({"partition": {"kind": "by_domain", "num_clients": 2}, "split": {"target": "c"},
                        "federation": {"rounds": 1, "batch_size": 8}, "optim": {"lr": 0.05}, "device": "cpu"},
                       list(over))
    ds = Toy28()
    split = make_split(ds, cfg)
    clients = make_clients(ds, split, cfg)
    torch.manual_seed(0)
    method = create_method(cfg.method.name, cfg.method.params)
    model = method.prepare_model(create_model("lenet", num_classes=4, in_channels=1, image_size=28))
    fed = Federation(cfg, ds, split, clients, method, model, torch.device("cpu"), make_topology(cfg, clients, model))
    server = Server(fed, tmp_path / name)
    run_inprocess(server)
    return server


@pytest.fixture(scope="module")
def plain_weights(tmp_path_factory) -> dict:
    return _server(tmp_path_factory.mktemp("plain"), "plain").state["weights"]


AUGMENTS = {
    "mixup": "[{name: mixup, alpha: 0.2}]",
    "manifold_mixup": "[{name: manifold_mixup, stages: [0, 1, 2]}]",
    "mixstyle": "[{name: mixstyle, p: 1.0, stages: [1, 2]}]",
    "moex": "[{name: moex, p: 1.0}]",
}


@pytest.mark.parametrize("name", list(AUGMENTS))
def test_a_round_with_each_augmentation_runs_and_is_reproducible(tmp_path, plain_weights, name):
    over = f"optim.augment={AUGMENTS[name]}"
    a, b = _server(tmp_path, "a", over), _server(tmp_path, "b", over)
    wa, wb, wp = a.state["weights"], b.state["weights"], plain_weights
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)
    assert max(float(np.abs(wa[k] - wp[k]).max()) for k in wa) > 1e-5  # the augmentation changed training
    assert np.isfinite(a.metrics[0]["train_loss"])


@pytest.mark.parametrize("method", ["fedsr", "fpl"])
def test_methods_with_their_own_loop_train_with_mixstyle(tmp_path, method):
    over = [f"method.name={method}", f"optim.augment={AUGMENTS['mixstyle']}"]
    a, b = _server(tmp_path, "a", *over), _server(tmp_path, "b", *over)
    plain = _server(tmp_path, "plain", f"method.name={method}").state["weights"]
    wa, wb = a.state["weights"], b.state["weights"]
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)
    assert max(float(np.abs(wa[k] - plain[k]).max()) for k in wa) > 1e-5  # the augmentation changed training


def test_fedfa_l_composes_with_a_feature_level_augmentation(tmp_path):
    over = ["method.name=fedfa", "method.params.lambda_h=0", f"optim.augment={AUGMENTS['mixstyle']}"]
    a, b = _server(tmp_path, "a", *over), _server(tmp_path, "b", *over)
    assert all(np.array_equal(a.state["weights"][k], b.state["weights"][k]) for k in a.state["weights"])
    assert "ffa/1/gamma_mu" in a.state["broadcast"]  # FFA's statistics still flowed


# The papers' placements: MixStyle after res1 and res2, Manifold Mixup's k in {input, res1, res2}, MoEx after the
# first convolution. A ResNet's first conv stage is its stem (maxpool), so its res1 is stage 2.
PLACEMENTS = {
    "resnet18": (["layer1", "layer2"], ["maxpool"]),
    "resnet50": (["layer1", "layer2"], ["maxpool"]),
    "cnn": (["blocks.0", "blocks.1"], ["blocks.0"]),
    "cnn4": (["blocks.0", "blocks.1"], ["blocks.0"]),
    "cnn_gn": (["blocks.0", "blocks.1"], ["blocks.0"]),
    "lenet": (["conv.2", "conv.5"], ["conv.2"]),
    "hfedf-cnn": (["trunk.2", "trunk.6"], ["trunk.2"]),
    "alexnet": (["layer1", "layer2"], ["layer1"]),
    "vgg11": (["features.2", "features.5"], ["features.2"]),
    "vgg11_bn": (["features.3", "features.7"], ["features.3"]),
    "efficientnet_lite0": (["_blocks.0", "_blocks.2"], ["_blocks.0"]),
    "unet": (["encoders.0", "encoders.1"], ["encoders.0"]),
    "swin_t": (["stage_ends.0", "stage_ends.1"], ["stage_ends.0"]),  # token grids after stages 1, 2
    "swin_tiny_test": (["stage_ends.0", "stage_ends.1"], ["stage_ends.0"]),
}


def hooked(model, spec):
    aug = Augmenter(model, parse_augment([spec]), 0, 10)
    return [aug.names.get(k, "input") for k in aug.placed[0][1]]


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_default_placements_are_the_papers_on_every_zoo_model(name):
    staged = {m for m in list_models() if "conv_stages" in model_capabilities(m)}
    assert set(PLACEMENTS) == staged  # a new zoo model with conv stages needs its placement checked here
    model = create_model(name, num_classes=10, in_channels=3, image_size=32)
    two_stages, first_conv = PLACEMENTS[name]
    assert hooked(model, {"name": "mixstyle"}) == two_stages
    assert hooked(model, {"name": "manifold_mixup"}) == ["input", *two_stages]
    assert hooked(model, {"name": "moex"}) == first_conv
    assert hooked(model, {"name": "mixstyle", "stages": [1]}) == [conv_stages(model)[0]]  # explicit stages as given
