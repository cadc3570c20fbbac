"""Text models (issue 25): tiny RoBERTa/DeBERTa and local pre-trained transformers in the zoo's contract, the
bag-of-words MLP, create_model's data arguments, config refusals for image-only methods, and the client methods that
act on features/classifier (FedSR, FedIIR, ...) on token batches."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn
from toy_pixels import registered
from toy_tokens import MAX_LENGTH, PAD, VOCAB, ToyTokens, padded, token_batch

from feddg.algorithms import create_method
from feddg.algorithms.base import ClientContext, OptimSettings, ServerContext
from feddg.config import ConfigError, build_config
from feddg.data.tokenizer import load_tokenizer
from feddg.messages import weights_of
from feddg.models import create_model, model_capabilities
from feddg.models.transformer import TextTransformer
from feddg.tasks.classification import Classification

TEXT = {"vocab_size": VOCAB, "max_length": MAX_LENGTH, "pad_token_id": PAD}


def _tiny(name: str, classes: int = 2, **params) -> TextTransformer:
    torch.manual_seed(0)
    model = create_model(name, num_classes=classes, **TEXT, **params)
    assert isinstance(model, TextTransformer)
    return model.eval()


@pytest.mark.parametrize("name", ["tiny-roberta", "tiny-deberta"])
def test_tiny_models_compute_the_hugging_face_logits_from_their_pooled_features(name):
    model = _tiny(name, classes=3)
    x = token_batch([5, 12, 3])
    with torch.no_grad():
        feats, out = model.features(x), model(x)
        ref = model.hf(**x).logits
        more = model(padded(x, 4))
    assert feats.shape == (3, 64) and model.feature_dim == 64 and out.shape == (3, 3)
    assert torch.equal(out, ref) and torch.equal(out, model.classifier(feats))
    assert isinstance(model.classifier, nn.Linear) and model.classifier.in_features == 64
    head = model.hf.classifier if name == "tiny-deberta" else model.hf.classifier.out_proj
    assert model.classifier is head
    assert (more - out).abs().max() <= 1e-5  # padding is masked
    assert model_capabilities(name) == {"tokens"}
    with pytest.raises(AttributeError, match="read-only"):
        model.classifier = nn.Linear(64, 3)


@pytest.mark.parametrize("name", ["tiny-roberta", "tiny-deberta"])
def test_in_training_the_logits_are_the_hugging_face_ones_with_the_same_dropout_draws(name: str) -> None:
    """Train mode, full-length sequences: the head's dropouts sit where the Hugging Face model has them (the same
    draws from the same seed give the same logits), and ``max_length`` tokens fit the position embeddings."""
    model = _tiny(name, classes=3).train()
    x = token_batch([MAX_LENGTH, 5, MAX_LENGTH])
    torch.manual_seed(1)
    out = model(x)
    torch.manual_seed(1)
    ref = model.hf(**x).logits
    torch.manual_seed(2)
    other = model(x)
    assert not torch.allclose(out, other)  # dropout is on: other draws, other logits
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["tiny-roberta", "tiny-deberta"])
def test_model_params_override_the_tiny_sizes(name: str) -> None:
    model = _tiny(name, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48)
    encoder = model.hf.base_model.encoder
    weights = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert len(encoder.layer) == 1 and model.feature_dim == 32
    assert encoder.layer[0].attention.self.num_attention_heads == 2
    assert weights[f"hf.{model.hf.base_model_prefix}.encoder.layer.0.intermediate.dense.weight"] == (48, 32)
    with torch.no_grad():
        assert model.features(token_batch([4, 6])).shape == (2, 32)


def test_tiny_deberta_has_deberta_v3_disentangled_attention():
    """DeBERTa-v3's attention: content↔position terms both ways (c2p, p2c) through the shared query/key projections,
    relative positions only (no absolute position embeddings), LayerNorm'd relative embeddings spanning ±positions."""
    model = _tiny("tiny-deberta")
    config = model.config
    assert config.relative_attention and sorted(config.pos_att_type) == ["c2p", "p2c"] and config.share_att_key
    deberta = model.hf.deberta
    names = {name for name, _ in model.named_modules()}
    assert "hf.deberta.encoder.layer.0.attention.self.query_proj" in names
    assert not any(n.endswith(("pos_query_proj", "pos_key_proj", "position_embeddings")) for n in names)
    assert tuple(deberta.encoder.rel_embeddings.weight.shape) == (2 * config.max_position_embeddings, 64)
    assert "hf.deberta.encoder.LayerNorm" in names and config.norm_rel_ebd == "layer_norm"


def test_the_roberta_representation_is_the_heads_tanh_of_the_first_token():
    model = _tiny("tiny-roberta")
    x = token_batch([4, 6])
    with torch.no_grad():
        cls = model.hf.roberta(**x).last_hidden_state[:, 0]
        head = model.hf.classifier
        expected = torch.tanh(cls @ head.dense.weight.T + head.dense.bias)
        torch.testing.assert_close(model.features(x), expected)


def test_the_bag_of_words_mlp_by_hand():
    model = create_model("mlp", num_classes=2, in_features=3, hidden=2)
    assert model.feature_dim == 2 and model_capabilities("mlp") == {"features"}
    with torch.no_grad():
        model.hidden[0].weight.copy_(torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.5, 0.5]]))
        model.hidden[0].bias.copy_(torch.tensor([0.0, -1.0]))
        model.classifier.weight.copy_(torch.tensor([[1.0, 2.0], [-1.0, 0.0]]))
        model.classifier.bias.copy_(torch.tensor([0.5, 0.0]))
        out = model(torch.tensor([[1.0, 2.0, 3.0]]))
    # hidden = relu([1 - 3, 3 - 1]) = [0, 2]; logits = [0 + 4 + 0.5, 0] = [4.5, 0]
    assert out.tolist() == [[4.5, 0.0]]


def test_a_local_pretrained_directory_loads_with_its_weights(tmp_path):
    model = _tiny("tiny-roberta")
    model.hf.save_pretrained(tmp_path)
    loaded = create_model("transformer", num_classes=2, path=tmp_path, **TEXT).eval()
    x = token_batch([7, 3])
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_a_local_model_refuses_token_ids_or_lengths_beyond_its_embeddings(tmp_path):
    # they failed as an index error in the first forward, after the federation was built
    _tiny("tiny-roberta").hf.save_pretrained(tmp_path)
    positions = json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"]
    fits = positions - TEXT["pad_token_id"] - 1  # RoBERTa's positions start after the padding id
    create_model("transformer", num_classes=2, path=tmp_path, **{**TEXT, "max_length": fits})
    with pytest.raises(ValueError, match=rf"^data.max_length {fits + 1}: the model at .* at most {fits}$"):
        create_model("transformer", num_classes=2, path=tmp_path, **{**TEXT, "max_length": fits + 1})
    with pytest.raises(ValueError, match=r"the tokenizer has 1000000 tokens, the model's embeddings"):
        create_model("transformer", num_classes=2, path=tmp_path, **{**TEXT, "vocab_size": 10**6})


def test_a_model_directory_without_tokenizer_files_is_refused_as_a_tokenizer(tmp_path):
    # transformers built an empty tokenizer from config.json alone: every text became the same two tokens
    _tiny("tiny-roberta").hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^tokenizer .*: no tokenizer files \(tokenizer.json, vocab.json"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(("name", "kwargs", "message"), [
    ("transformer", {"path": "/x", **TEXT}, "model.path /x: no such directory: put a Hugging Face model there"),
    ("transformer", TEXT, "model transformer needs model.path"),
    ("cnn", {"path": "/x"}, "model.path is for swin_t, swin_tiny_test, transformer; model cnn takes none"),
    ("tiny-roberta", {"in_channels": 3, "image_size": 28, **TEXT},
     r"^model tiny-roberta takes tokens, not images \(image_size, in_channels\)$"),
    ("cnn", TEXT, r"^model cnn takes images, not tokens \(max_length, pad_token_id, vocab_size\)$"),
    ("mlp", TEXT, r"^model mlp takes features, not tokens \(max_length, pad_token_id, vocab_size\)$"),
    ("tiny-roberta", {"in_features": 5, **TEXT}, r"^model tiny-roberta takes tokens, not features \(in_features\)$"),
    ("cnn", {"foo": 1}, r"^model\.params\.foo: model cnn has no such option; it takes block_widths$"),
    ("tiny-roberta", {"hiden_size": 8, **TEXT}, r"^model\.params\.hiden_size: model tiny-roberta has no such option"),
    ("tiny-deberta", {"max_position_embeddings": 8, **TEXT}, r"^model\.params\.max_position_embeddings: .*no such"),
    ("tiny-roberta", {"max_position_embeddings": 8, **TEXT}, r"^model\.params\.max_position_embeddings: .*no such"),
    ("tiny-roberta", {"pos_att_type": ["c2p"], **TEXT}, r"^model\.params\.pos_att_type: model tiny-roberta has no such"),
    ("mlp", {"in_features": 0}, "mlp needs in_features and hidden >= 1"),
])
def test_bad_model_arguments_are_refused_in_one_line(name, kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        create_model(name, num_classes=2, **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["method.name=pardon"],
    ["method.name=ccst"],
    ["method.name=fedfa"],
    ["optim.augment=[{name: mixstyle}]"],
])
def test_image_methods_refuse_a_token_dataset_in_one_line(overrides):
    with registered(), pytest.raises(ConfigError, match="needs (conv_stages|images)") as err:
        build_config({}, ["data.dataset=toy-tokens", "model.name=tiny-roberta", *overrides])
    assert "\n" not in str(err.value) and "toy-tokens" in str(err.value)


@pytest.mark.parametrize("overrides", [
    ["method.name=fedavg"], ["method.name=fedprox"], ["method.name=fedsr"], ["method.name=fediir"],
    ["method.name=scaffold", "optim.momentum=0"], ["hierarchy.merge=hfedatm", "partition.num_clients=4"],
])
def test_text_methods_validate_on_a_token_dataset(overrides):
    with registered():
        cfg = build_config({}, ["data.dataset=toy-tokens", "model.name=tiny-deberta", "model.path=null", *overrides])
    assert cfg.model.name == "tiny-deberta" and cfg.model.path is None


@pytest.mark.parametrize("method_name", ["fedavg", "fedprox", "fedsr", "fediir", "scaffold"])
def test_client_methods_train_a_transformer_on_token_batches(method_name):
    method = create_method(method_name, {})
    torch.manual_seed(0)
    model = method.prepare_model(create_model("tiny-roberta", num_classes=2, **TEXT))
    ctx = ClientContext(0, 1, ToyTokens(), np.arange(12), 4, 1, OptimSettings(momentum=0.0),
                        torch.Generator().manual_seed(0),
                        Classification(2, "tokens"))
    state = method.server_init(model, ServerContext(num_clients=1, rounds=1, seed=0))
    msg = {**method.client_config(state, 0, 1), "lr": 0.05, "round": 1}
    before = weights_of(model)
    reply, _ = method.client_update(model, msg, {}, ctx)
    assert np.isfinite(reply["train_loss"]) and reply["num_examples"] == 12
    assert any(not np.array_equal(reply[k], v) for k, v in before.items() if k.endswith("query.weight"))
    model.eval()
    with torch.no_grad():
        assert method.predict(model, token_batch([3, 9])).shape == (2, 2)
