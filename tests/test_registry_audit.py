"""Pins found by a mutation audit of the dataset and model registries: ``data/natural.py``, ``data/registry.py``,
``data/tensor_dataset.py``, ``models/registry.py``, ``models/stages.py`` and ``aggregation/threads.py``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from feddg.aggregation.threads import map_on_threads
from feddg.data import load_dataset
from feddg.data.natural import Samples, Source, check_root, split_order, to_dataset, wilds_split
from feddg.data.registry import (
    PLUGINS,
    Plugin,
    dataset_info,
    default_transforms,
    evaluation_mismatch,
    folder_image_size,
    list_datasets,
    subsample,
)
from feddg.data.tensor_dataset import BatchAugment as BatchAugmentFn
from feddg.data.tensor_dataset import TensorDomainDataset
from feddg.data.transform_spec import TransformSpec
from feddg.models.registry import (
    MODELS,
    check_model_params,
    create_model,
    list_models,
    load_weights,
    model_capabilities,
    model_options,
    options_text,
)
from feddg.models.stages import conv_stages, stem_stages
from feddg.models.swin import OPTIONS as SWIN_OPTIONS

GRAY = TransformSpec(mean=(0.5,), std=(0.5,))


def _samples(n: int = 4, size: int = 4, **kw: object) -> Samples:
    """``n`` grayscale ``size``-px images in two domains ``a``/``b`` (alternating) with groups ``0..n-1``."""
    images = np.arange(n * size * size, dtype=np.uint8).reshape(n, 1, size, size)
    return Samples(["a", "b"], ["x", "y"], np.arange(n, dtype=np.int64) % 2, np.arange(n, dtype=np.int64) % 2, size,
                   1, groups=np.arange(n, dtype=np.int64), group_names=[f"g{i}" for i in range(n)], images=images,
                   **kw)  # type: ignore[arg-type]


# --- data/natural.py -------------------------------------------------------------------------------------------------


def test_take_keeps_the_groups_of_the_taken_rows_in_their_order() -> None:
    """``Samples.take`` subsets and reorders ``groups`` along with the labels."""
    kept = _samples().take(np.array([3, 1]))
    np.testing.assert_array_equal(kept.groups, [3, 1])
    np.testing.assert_array_equal(kept.labels, [1, 1])


def test_restrict_drops_an_ood_test_domain_that_is_not_chosen() -> None:
    """``restrict`` keeps ``ood_test`` only when its domain is among those chosen."""
    s = _samples(ood_test="b")
    assert s.restrict(["a"]).ood_test is None
    assert s.restrict(["b", "a"]).ood_test == "b"


def test_check_root_refuses_a_root_for_a_built_in_source() -> None:
    """A source that reads no folder refuses ``root`` in one line instead of ignoring it."""
    src = Source(lambda root, seed, cache: _samples(), ["a"], ["x"], 4, GRAY, needs_root=False)
    assert check_root("built", src, None) is None
    with pytest.raises(ValueError, match=r"^built is built in and takes no root \(got '/x'\)$"):
        check_root("built", src, "/x")


def test_check_root_refuses_a_file_and_expands_the_home_folder(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``root`` must be a folder (a file is refused naming the layout); ``~`` is the user's home."""
    src = Source(lambda root, seed, cache: _samples(), ["a"], ["x"], 4, GRAY, layout="root/<x>")
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"^dataset d: root .*file is not a folder; expected root/<x>$"):
        check_root("d", src, str(tmp_path / "file"))
    (tmp_path / "data").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    assert check_root("d", src, "~/data") == tmp_path / "data"


def test_wilds_split_strips_blanks_around_a_name_or_code() -> None:
    """A split cell is read without its surrounding blanks, as a name or as WILDS' code."""
    assert wilds_split(" val ") == "val"
    assert wilds_split("2 ") == "test"


def test_split_order_puts_test_first_even_before_names_that_sort_earlier() -> None:
    """``test`` comes first (a LODO split's default target); the other splits are sorted."""
    assert split_order({"train", "test", "abc", "val"}) == ["test", "abc", "train", "val"]


def test_to_dataset_resizes_pixels_to_the_asked_size(tmp_path: Path) -> None:
    """Pixel samples at another size than asked are resized to ``size``."""
    ds = to_dataset("d", _samples(size=4), GRAY, tmp_path, 2)
    assert ds.image_shape == (1, 2, 2)
    assert ds.get_batch(np.arange(4), train=False)[0].shape == (4, 1, 2, 2)


def test_to_dataset_augments_training_batches_when_the_spec_does(tmp_path: Path) -> None:
    """A spec that augments gives the in-memory dataset a training augmentation (and seeded batches)."""
    plain = to_dataset("d", _samples(), GRAY, tmp_path, 4)
    flipped = to_dataset("d", _samples(), TransformSpec(flip=1.0, mean=(0.5,), std=(0.5,)), tmp_path, 4)
    assert plain.augment is None and not plain.seeded_batches
    assert flipped.augment is not None and flipped.seeded_batches
    x, _ = flipped.get_batch(np.arange(1), train=True)
    expected = (np.arange(16, dtype=np.float32).reshape(4, 4)[:, ::-1] / 255 - 0.5) / 0.5  # always mirrored
    np.testing.assert_allclose(x[0, 0].numpy(), expected, rtol=1e-6, atol=1e-6)


# --- data/registry.py ------------------------------------------------------------------------------------------------


def test_natural_dataset_takes_domains_max_per_domain_image_size_and_writer_count(tmp_path: Path) -> None:
    """The ``writers`` plug-in honours ``writer_count``, ``domains`` (in the order given), ``max_per_domain`` and
    ``image_size``."""
    ds = load_dataset("writers", writer_count=3, cache_dir=tmp_path, domains=["w0002", "w0000"], max_per_domain=2,
                      image_size=14)
    assert ds.domains == ["w0002", "w0000"]
    assert np.bincount(ds.domain_ids).tolist() == [2, 2]  # each writer has at least 5 digits
    assert ds.image_shape == (1, 14, 14)
    assert load_dataset("writers", writer_count=2, cache_dir=tmp_path).domains == ["w0000", "w0001"]


def test_natural_dataset_takes_transforms_over_its_own(tmp_path: Path) -> None:
    """``transforms`` override a natural dataset's own statistics (``writers``: 0.5 / 0.5)."""
    ds = load_dataset("writers", writer_count=1, cache_dir=tmp_path, transforms={"mean": [0.25], "std": [0.125]})
    assert (ds.mean, ds.std) == ((0.25,), (0.125,))  # type: ignore[attr-defined]


def test_text_dataset_refuses_an_image_size_and_passes_its_vocab_size_on(tmp_path: Path) -> None:
    """A text dataset refuses ``image_size`` and ``transforms``; its ``vocab_size`` reaches the tokenizer (which
    needs >= 261)."""
    for option in ({"image_size": 8}, {"transforms": "none"}):
        with pytest.raises(ValueError, match="^synthetic-sentiment is a text dataset: it takes no image_size or "
                                             "transforms$"):
            load_dataset("synthetic-sentiment", cache_dir=tmp_path, **option)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^vocab_size must be >= 261 "):
        load_dataset("synthetic-sentiment", cache_dir=tmp_path, vocab_size=100)


def test_list_datasets_names_the_volume_sets() -> None:
    """The segmentation volume sets are among the listed dataset names."""
    assert {"prostate", "synthetic-mri"} <= set(list_datasets())


def test_dataset_info_defaults_and_unknown_class_counts() -> None:
    """A plug-in whose classes come from its rows has ``num_classes`` ``None``; built-ins are 28 px, folder
    presets 224 px."""
    assert dataset_info("text-table")["num_classes"] is None
    assert dataset_info("digits-dg")["image_size"] == 28
    assert dataset_info("pacs")["image_size"] == 224
    # channels: a built-in's or natural source's statistics' length, 3 for a folder (read as RGB), unknown for
    # volumes and for plug-ins that do not declare them
    assert [dataset_info(n)["channels"] for n in ("digits-dg", "rotated-mnist", "pacs", "femnist", "iwildcam",
                                                  "prostate", "text-table")] == [3, 1, 3, 1, 3, None, None]


def test_evaluation_mismatch_needs_the_same_class_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """An extra target with the same classes in another order is refused: outputs index classes by position."""
    monkeypatch.setitem(PLUGINS, "ab", Plugin(load_dataset, ["d"], ["cat", "dog"]))
    monkeypatch.setitem(PLUGINS, "ba", Plugin(load_dataset, ["d"], ["dog", "cat"]))
    assert evaluation_mismatch("ab", "ab") is None
    assert evaluation_mismatch("ba", "ab") == ("ba has classes ['dog', 'cat'], the training data ['cat', 'dog']; an "
                                               "extra target needs the same classes in the same order")


@pytest.mark.parametrize("domains", [[], ["mnist", "mnist"]])
def test_domains_must_be_distinct_and_not_empty(domains: list[str]) -> None:
    """An empty or repeated ``domains`` list is refused before anything is built."""
    with pytest.raises(ValueError, match="^bad domains .* for digits-dg; expected distinct names among"):
        load_dataset("digits-dg", domains=domains)


def test_subsample_seeds_each_domain_by_its_name_and_returns_sorted_indices() -> None:
    """Two domains laid out alike keep different rows (the draw is seeded by the domain's name too); the
    indices come back sorted."""
    domain_ids = np.repeat([0, 1], 50)
    keep = subsample(["a", "b"], domain_ids, np.zeros(100, dtype=np.int64), 5, seed=0)
    assert keep.tolist() == sorted(keep.tolist()) and len(keep) == 10
    assert keep[:5].tolist() != (keep[5:] - 50).tolist()


@pytest.mark.parametrize(("option", "value", "message"), [
    ("seed", -1, "seed must be >= 0, got -1"),
    ("max_per_domain", 0, "max_per_domain must be >= 1, got 0"),
    ("image_size", 0, "image_size must be >= 1, got 0"),
    ("loader_workers", -1, "loader_workers must be >= 0, got -1"),
    ("writer_count", 2, r"digits-dg takes no writer count \(data.writers is the built-in writers dataset's\)"),
])
def test_load_dataset_refuses_out_of_range_options(option: str, value: int, message: str) -> None:
    """Each bound is refused at its edge, in one line naming the option."""
    with pytest.raises(ValueError, match=f"^{message}$"):
        load_dataset("digits-dg", **{option: value})  # type: ignore[arg-type]


def test_load_dataset_sets_the_loader_workers(tmp_path: Path) -> None:
    """``loader_workers`` is recorded on the loaded dataset."""
    assert load_dataset("writers", writer_count=1, cache_dir=tmp_path, loader_workers=2).loader_workers == 2


def test_folder_card_sets_the_transforms_and_the_image_size(tmp_path: Path) -> None:
    """A folder's ``feddg.json`` overrides the preset's transforms and the default image size."""
    (tmp_path / "feddg.json").write_text(json.dumps({"image_size": 32, "transforms": "none"}))
    assert not default_transforms("pacs", tmp_path).augments
    assert default_transforms("pacs").augments
    assert folder_image_size(tmp_path, None) == 32
    assert folder_image_size(tmp_path, 16) == 16


# --- data/tensor_dataset.py ------------------------------------------------------------------------------------------


def _tensor_ds(images: torch.Tensor | None = None, n_ids: int = 2, std: tuple[float, ...] = (0.5,),
               augment: BatchAugmentFn | None = None) -> TensorDomainDataset:
    """Two 1×2×2 images (pixels 0 and 255) of one domain, normalised by mean 0.5 and ``std``."""
    x = torch.tensor([0, 255], dtype=torch.uint8).view(2, 1, 1, 1).expand(2, 1, 2, 2) if images is None else images
    return TensorDomainDataset("t", x, np.zeros(2, dtype=np.int64), np.zeros(n_ids, dtype=np.int64), ["d"], ["c"],
                               (0.5,), std, augment)


@pytest.mark.parametrize("images", [torch.zeros(2, 1, 2, 2), torch.zeros(2, 2, 2, dtype=torch.uint8)])
def test_tensor_dataset_refuses_images_that_are_not_uint8_nchw(images: torch.Tensor) -> None:
    """Float images and 3-D tensors are refused in one line."""
    with pytest.raises(ValueError, match=r"^images must be a uint8 tensor \[N, C, H, W\], got "):
        _tensor_ds(images)


def test_tensor_dataset_refuses_mismatched_domain_ids_and_std() -> None:
    """As many domain ids as images, and one std per channel, are required."""
    with pytest.raises(ValueError, match="^2 images but 2 labels and 3 domain ids$"):
        _tensor_ds(n_ids=3)
    with pytest.raises(ValueError, match="^mean/std need 1 values, got 1 and 2$"):
        _tensor_ds(std=(0.5, 0.5))


def test_tensor_dataset_augments_only_training_batches_and_keeps_float_outputs() -> None:
    """The augmentation runs for training batches only (then batches are seeded); its float output in [0, 1] is
    normalised without another division by 255."""
    def to_half(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return torch.full(x.shape, 0.75)

    ds = _tensor_ds(augment=to_half)
    assert ds.seeded_batches and not _tensor_ds().seeded_batches
    x, _ = ds.get_batch(np.arange(2), train=False)
    np.testing.assert_allclose(x[:, 0, 0, 0].numpy(), [-1.0, 1.0], rtol=1e-6)
    x, _ = ds.get_batch(np.arange(2), train=True)
    np.testing.assert_allclose(x.numpy(), np.full((2, 1, 2, 2), 0.5), rtol=1e-6)  # (0.75 - 0.5) / 0.5


# --- models/registry.py ----------------------------------------------------------------------------------------------


def test_model_params_may_not_set_what_the_data_or_run_gives() -> None:
    """``path`` and ``num_classes`` come from the run and the data, never ``model.params``."""
    for key in ("path", "num_classes"):
        with pytest.raises(ValueError, match=f"^model.params.{key}: given by the data or the run"):
            check_model_params("cnn", [key])


def test_model_options_of_config_and_open_factories() -> None:
    """A Swin's options are its config fields; a factory with ``**options`` judges its own (``None``); a factory
    without options takes ``none``; the first unknown key (sorted) is the one named."""
    assert model_options("swin_tiny_test") == SWIN_OPTIONS
    assert model_options("transformer") is None
    assert options_text("lenet") == "none"
    assert options_text("tiny-roberta") == "RobertaConfig's fields"
    with pytest.raises(ValueError, match="^model.params.bogus: model swin_tiny_test has no such option; it takes "
                                         "attention_probs_dropout_prob, depths, "):
        check_model_params("swin_tiny_test", ["bogus"])
    with pytest.raises(ValueError, match="^model.params.aaa: model lenet has no such option; it takes none$"):
        check_model_params("lenet", ["zzz", "aaa"])


def test_unknown_model_capabilities_and_sorted_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unknown name is refused naming the models; the listing is sorted, wherever a model was registered."""
    with pytest.raises(ValueError, match="^unknown model 'nope'; available: alexnet, cnn, "):
        model_capabilities("nope")
    monkeypatch.setitem(MODELS, "a-late-model", create_model)
    assert list_models()[:2] == ["a-late-model", "alexnet"]


def test_create_model_refuses_a_path_and_other_inputs_for_an_image_model() -> None:
    """``model.path`` names the models that take one; token arguments are refused for an image model."""
    with pytest.raises(ValueError, match="^model.path is for swin_t, swin_tiny_test, transformer; model lenet takes "
                                         "none$"):
        create_model("lenet", 2, path="/x")
    with pytest.raises(ValueError, match=r"^model lenet takes images, not tokens \(vocab_size\)$"):
        create_model("lenet", 2, vocab_size=10)


def test_create_model_defaults_to_3x28_images_and_keeps_given_ones() -> None:
    """Without data arguments an image model takes 3 × 28² inputs; given ones win over the defaults."""
    assert create_model("lenet", 2)(torch.zeros(1, 3, 28, 28)).shape == (1, 2)
    assert create_model("lenet", 2, in_channels=1, image_size=32)(torch.zeros(1, 1, 32, 32)).shape == (1, 2)


def _lenet_state(tmp_path: Path, **extra: torch.Tensor) -> tuple[dict[str, torch.Tensor], Path]:
    """A grayscale LeNet's state_dict with ``extra`` entries set, saved as ``tmp_path/w.pth``."""
    state = dict(create_model("lenet", 2, in_channels=1).state_dict(), **extra)
    torch.save(state, tmp_path / "w.pth")
    return state, tmp_path / "w.pth"


def test_create_model_loads_the_weights(tmp_path: Path) -> None:
    """``weights`` are loaded into the built model."""
    state, path = _lenet_state(tmp_path)
    loaded = create_model("lenet", 2, in_channels=1, weights=path).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_load_weights_names_three_unexpected_keys_and_counts_the_rest(tmp_path: Path) -> None:
    """Unexpected keys alone are refused, naming the first three (sorted) and how many more there are."""
    _, path = _lenet_state(tmp_path, **{k: torch.zeros(1) for k in ("d", "a", "c", "b")})
    with pytest.raises(ValueError, match=r"does not fit LeNet; unexpected keys: a, b, c \(\+1 more\)$"):
        load_weights(create_model("lenet", 2, in_channels=1), path)


def test_load_weights_names_three_mismatched_shapes_and_counts_the_rest(tmp_path: Path) -> None:
    """Trunk shape mismatches are refused, listing three (sorted, checkpoint vs model) and counting the others."""
    _, path = _lenet_state(tmp_path, **{k: torch.zeros(1) for k in ("conv.3.weight", "conv.0.bias", "conv.3.bias",
                                                                     "conv.0.weight")})
    with pytest.raises(ValueError, match=r"w.pth: shape mismatch for LeNet \(checkpoint vs model\): conv.0.bias \[1\] "
                                         r"vs \[6\]; conv.0.weight \[1\] vs \[6, 1, 5, 5\]; conv.3.bias \[1\] vs \[16\] "
                                         r"\(\+1 more\)$"):
        load_weights(create_model("lenet", 2, in_channels=1), path)


def test_load_weights_refuses_a_missing_file_and_a_dict_of_non_tensors(tmp_path: Path) -> None:
    """A missing file is ``FileNotFoundError``; a dict whose values are not tensors is not a state_dict."""
    model = create_model("lenet", 2, in_channels=1)
    with pytest.raises(FileNotFoundError, match="^model weights not found: "):
        load_weights(model, tmp_path / "absent.pth")
    torch.save({"conv.0.weight": [1.0]}, tmp_path / "list.pth")
    with pytest.raises(ValueError, match="not a state_dict"):
        load_weights(model, tmp_path / "list.pth")


def test_load_weights_lets_batchnorm_counters_and_added_keys_be_absent(tmp_path: Path) -> None:
    """Checkpoints without BatchNorm's ``num_batches_tracked`` and without a variant's ``added_keys`` load, those
    keeping their values."""
    model = create_model("cnn", 2, in_channels=1)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    torch.save(state, tmp_path / "bn.pth")
    load_weights(create_model("cnn", 2, in_channels=1), tmp_path / "bn.pth")
    lenet = create_model("lenet", 2, in_channels=1)
    lenet.added_keys = ("fc.0.bias",)
    kept = lenet.state_dict()["fc.0.bias"].clone()
    state, path = _lenet_state(tmp_path)
    torch.save({k: v for k, v in state.items() if k != "fc.0.bias"}, path)
    load_weights(lenet, path)
    assert torch.equal(lenet.state_dict()["fc.0.bias"], kept)
    assert torch.equal(lenet.state_dict()["conv.0.weight"], state["conv.0.weight"])


# --- models/stages.py ------------------------------------------------------------------------------------------------


class _Wrapper(nn.Module):
    """A method's wrapper: ``stages_in`` names the zoo model it wraps."""

    stages_in = "net"

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net


def test_stages_of_a_wrapper_are_its_models_prefixed() -> None:
    """A wrapper's stages are its model's, under the wrapped module's name; so is its stem count."""
    assert conv_stages(_Wrapper(create_model("lenet", 2))) == ["net.conv.2", "net.conv.5"]  # after each max-pool
    assert stem_stages(_Wrapper(create_model("resnet18", 2))) == 1
    assert stem_stages(create_model("lenet", 2)) == 0


def test_stage_counts_match_the_papers_placements() -> None:
    """FedFA's "{1,…,5}": AlexNet and ResNet have five stages (ResNet's first the stem's ``maxpool``); the
    EfficientNet's are the last block at each resolution; a U-Net's the encoders and the bottleneck; a Swin's its
    four stages; HFedF's CNN four."""
    assert conv_stages(create_model("alexnet", 2, image_size=32)) == [f"layer{i}" for i in range(1, 6)]
    assert conv_stages(create_model("resnet18", 2)) == ["maxpool", "layer1", "layer2", "layer3", "layer4"]
    assert conv_stages(create_model("efficientnet_lite0", 2, image_size=32)) == [
        f"_blocks.{i}" for i in (0, 2, 4, 10, 15)]
    unet = conv_stages(create_model("unet", 2, image_size=32))
    assert unet[-1] == "bottleneck" and unet[:-1] == [f"encoders.{i}" for i in range(len(unet) - 1)]
    assert conv_stages(create_model("swin_tiny_test", 2, image_size=32)) == [f"stage_ends.{i}" for i in range(4)]
    assert len(conv_stages(create_model("hfedf-cnn", 2, image_size=32))) == 4


# --- aggregation/threads.py ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2])
def test_map_on_threads_keeps_the_order_of_the_items(threads: int) -> None:
    """Results come back in the items' order, serially and on a pool."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert map_on_threads(lambda x: 10 * x, [1, 2, 3, 4], "t") == [10, 20, 30, 40]
    finally:
        torch.set_num_threads(before)


def test_create_model_gives_a_feature_model_no_image_defaults() -> None:
    """A feature model is built from ``in_features`` alone: the 3 × 28² image defaults are for image models."""
    assert create_model("mlp", 2, in_features=8)(torch.zeros(1, 8)).shape == (1, 2)
