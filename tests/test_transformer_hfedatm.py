"""HFedATM on transformers (issue 25): Grams over non-padding tokens, the FOT spec of a transformer block (attention
heads and feed-forward units; function preserving, undone by FOT + RegMean), FOT on block-structured producers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor
from toy_tokens import MAX_LENGTH, PAD, VOCAB, padded, token_batch

from feddg.aggregation.fot import align_to_reference, group_costs
from feddg.aggregation.merges import merge_stations
from feddg.algorithms.hfedatm import GramRecorder, gram_layers
from feddg.messages import WEIGHT_PREFIX
from feddg.models import create_model
from feddg.models.permutation import (
    Axis,
    PermGroup,
    apply_permutations,
    permutation_spec,
    permute_grams,
    random_permutations,
)
from feddg.models.transformer import TextTransformer

TEXT = {"vocab_size": VOCAB, "max_length": MAX_LENGTH, "pad_token_id": PAD}
#: tiny-deberta with its own relative-position projections (pos_query_proj, pos_key_proj) instead of shared ones
MODELS = [("tiny-roberta", {}), ("tiny-deberta", {}), ("tiny-deberta", {"share_att_key": False})]


def _model(name: str = "tiny-roberta", seed: int = 0, **params) -> TextTransformer:
    torch.manual_seed(seed)
    model = create_model(name, num_classes=2, **TEXT, **params)
    assert isinstance(model, TextTransformer)
    with torch.no_grad():  # non-trivial biases and LayerNorms, so forgetting to permute one is visible
        for k, v in model.named_parameters():
            if k.endswith("bias") or "LayerNorm" in k:
                v.normal_(0, 0.5)
    return model.eval()


def _grams(model: TextTransformer, *batches: dict[str, Tensor]) -> dict[str, Tensor]:
    rec = GramRecorder(model)
    model.train()
    with rec, torch.no_grad():
        rec.new_pass()
        for x in batches:
            rec.new_batch(x)
            model.eval()  # the recorder runs in training mode; dropout off keeps the test deterministic
            rec.eval_mode = True
            model(x)
    return rec.grams()


def _load(model: TextTransformer, state: dict) -> None:
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state.items()})


def _msg(state: dict[str, Tensor]) -> dict[str, np.ndarray]:
    return {WEIGHT_PREFIX + k: v.numpy() for k, v in state.items()}


# --- the spec --------------------------------------------------------------------------------------------------------


def test_the_spec_permutes_heads_and_ffn_units_of_every_layer():
    spec = permutation_spec(_model("tiny-deberta", share_att_key=False))
    assert [g.name for g in spec.groups] == [f"hf.deberta.encoder.layer.{i}.{k}" for i in (0, 1) for k in ("heads", "ffn")]
    heads, ffn = spec.groups[0], spec.groups[1]
    att = "hf.deberta.encoder.layer.0.attention"
    assert heads.size == 4 and heads.producers == tuple(f"{att}.self.{n}_proj.weight" for n in ("query", "key", "value"))
    assert Axis(f"{att}.self.pos_key_proj.bias", 0, block=16) in heads.members
    assert Axis(f"{att}.output.dense.weight", 1, block=16) in heads.members
    assert ffn.size == 128 and ffn.producers == ("hf.deberta.encoder.layer.0.intermediate.dense.weight",)
    keys = {a.key for g in spec.groups for a in g.members}
    assert not any("LayerNorm" in k or "embeddings" in k or "classifier" in k or "pooler" in k for k in keys)


@pytest.mark.parametrize(("name", "params"), MODELS)
def test_head_and_ffn_permutations_preserve_the_function_and_fot_with_regmean_undoes_them(name, params):
    model = _model(name, **params)
    spec = permutation_spec(model)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(1)
    perms = random_permutations(spec, rng)
    while any((p == np.arange(len(p))).all() for p in perms.values()):  # every group moves (4 heads: 1 in 24 stay)
        perms = random_permutations(spec, rng)
    copy = apply_permutations(original, spec, perms)
    x = token_batch([12, 5, 3, 9], seed=2)
    with torch.no_grad():
        before = model(x)
        _load(model, copy)
        permuted = model(x)
        grams = _grams(model, x)
    diff = float((permuted - before).abs().max())
    print(f"{name} {params}: permuted copy max |Δ| = {diff:.2e}")
    assert diff <= 1e-5
    # the stations' Grams: the original's, and the permuted copy's (its inputs permuted likewise)
    _load(model, original)
    ref_grams = _grams(model, x)
    for k, g in permute_grams(ref_grams, spec, perms).items():
        torch.testing.assert_close(g, grams[k], rtol=1e-6, atol=1e-6)
    merged, metrics = merge_stations([_msg(original), _msg(copy)], [
        {k: v.numpy() for k, v in ref_grams.items()}, {k: v.numpy() for k, v in grams.items()}], [1, 1], spec)
    assert metrics["fot/moved"] > 0.5 and max(v for k, v in metrics.items() if k.endswith("cost_after")) < 1e-5
    with torch.no_grad():
        _load(model, {k: merged[WEIGHT_PREFIX + k] for k in original})
        after = model(x)
    diff = float((after - before).abs().max())
    print(f"{name} {params}: HFedATM merge of the original and its copy, max |Δ| = {diff:.2e}")
    assert diff <= 1e-5


def test_fot_matches_heads_as_blocks_of_rows():
    # two heads of two rows: station 1 is the reference with its heads swapped
    ref = {"q.weight": torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 4.0], [0.0, 0.0]])}
    other = {"q.weight": ref["q.weight"][[2, 3, 0, 1]]}
    group = PermGroup("heads", 2, ("q.weight",), (Axis("q.weight", 0, block=2),))
    # unit filters: head 0 = (1, 0, 0, 1)/√2 (entries in [c_in, block] order), head 1 = (3, 0, 4, 0)/5;
    # C_01 = ‖h0 − h1‖² = 2 − 2·(3/(5√2)) = 2 − 0.6·√2
    cost = group_costs(ref, [other], group)[0]
    expected = torch.tensor([[2 - 0.6 * 2**0.5, 0.0], [0.0, 2 - 0.6 * 2**0.5]])  # rows: the reference's heads
    torch.testing.assert_close(cost, expected)
    from feddg.models.permutation import PermutationSpec

    al = align_to_reference(ref, [other], PermutationSpec((group,)), solver="hungarian")
    assert al.perms[0]["heads"].tolist() == [1, 0] and torch.equal(al.states[0]["q.weight"], ref["q.weight"])


# --- Grams over non-padding tokens -----------------------------------------------------------------------------------


def _garbage_padding(x: dict[str, Tensor], seed: int) -> dict[str, Tensor]:
    """``x`` with random ids instead of PAD at its padding positions (the mask still 0 there)."""
    noise = torch.randint(5, VOCAB, x["input_ids"].shape, generator=torch.Generator().manual_seed(seed))
    return {**x, "input_ids": torch.where(x["attention_mask"].bool(), x["input_ids"], noise)}


def test_grams_and_the_merge_ignore_padding():
    models = [_model("tiny-roberta", seed=s) for s in (0, 1)]
    batches = [token_batch([12, 4, 7], seed=3), token_batch([2, 6], seed=4)]
    plain = [_grams(m, *batches) for m in models]
    layers = gram_layers(models[0])
    assert set(plain[0]) == set(layers) and "hf.classifier.out_proj" in layers
    # other tokens at the padding positions change the padding rows of every layer's input, not the real ones:
    # the Grams are the same to the bit (so no padding row enters them)
    garbage = [_grams(m, *(_garbage_padding(b, 5 + i) for i, b in enumerate(batches))) for m in models]
    for p, g in zip(plain, garbage, strict=True):
        for k in p:
            assert p[k].dtype == torch.float64 and torch.equal(p[k], g[k]), k
    # extra padding columns: the same rows (up to float32 rounding of the longer attention rows)
    wide = [_grams(m, padded(batches[0], 5), padded(batches[1], 3)) for m in models]
    worst = max(float((p[k] - w[k]).abs().max() / p[k].abs().max()) for p, w in zip(plain, wide, strict=True)
                for k in p)
    print(f"extra padding columns: max relative Gram difference {worst:.2e}")
    assert worst < 1e-6
    # by hand: the first query's Gram is X^T X of the embeddings' outputs at the 12 + 4 + 7 + 2 + 6 real tokens
    emb = models[0].hf.roberta.embeddings
    with torch.no_grad():
        rows = torch.cat([emb(input_ids=b["input_ids"])[b["attention_mask"].bool()] for b in batches]).double()
    assert rows.shape == (31, 64)
    torch.testing.assert_close(plain[0]["hf.roberta.encoder.layer.0.attention.self.query"], rows.T @ rows)
    spec = permutation_spec(models[0])
    merges = [merge_stations([_msg(m.state_dict()) for m in models],
                             [{k: v.numpy() for k, v in g.items()} for g in grams], [1, 2], spec)[0]
              for grams in (plain, garbage, wide)]
    assert all(np.array_equal(merges[0][k], merges[1][k]) for k in merges[0])
    gap = max(float(np.abs(merges[0][k] - merges[2][k]).max()) for k in merges[0])
    print(f"extra padding columns: max |Δ| of the merged weights {gap:.2e}")
    assert gap < 1e-5
