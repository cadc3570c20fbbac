"""Text data: the three layouts' readers and their errors, the tokenised cache, padded batches, the BPE tokenizer,
the synthetic corpus, and ``model_args`` for each kind of inputs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from feddg.data import load_dataset
from feddg.data import text_sets as text_sets_module
from feddg.data.base import DomainDataset
from feddg.data.inspect import check_dataset
from feddg.data.synthetic_text import DOMAINS, WORDS, generate
from feddg.data.text import TokenDataset, bag_of_words
from feddg.data.text_formats import TABLE_LAYOUT, read_processed_acl, read_raw, read_table
from feddg.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, tokenizer_stamp, train_bpe

RAW = """<review>
<unique_id>
0001:great:jane
</unique_id>
<rating>
5.0
</rating>
<review_text>
Salt &amp; pepper
 mills that   work
</review_text>
</review>
<review>
<review_text>
Second one &quot;ok&quot;
</review_text>
</review>
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def _raw_root(tmp_path: Path) -> Path:
    root = tmp_path / "raw"
    _write(root / "books" / "positive.review", RAW)
    _write(root / "books" / "negative.review", "<review>\n<review_text>\ndull &lt;3\n</review_text>\n</review>\n")
    _write(root / "books" / "unlabeled.review", "<review> not parsed")
    _write(root / "kitchen_&_housewares" / "positive.review", "<review><review_text>sturdy</review_text></review>")
    _write(root / "kitchen_&_housewares" / "negative.review", "<review><review_text>rusty</review_text></review>")
    return root


def test_raw_reader_reads_texts_labels_and_domains(tmp_path: Path) -> None:
    samples, problems = read_raw(_raw_root(tmp_path), ("books", "kitchen"))
    assert problems == []
    assert samples == {"books": [("dull <3", 0), ("Salt & pepper mills that work", 1), ('Second one "ok"', 1)],
                       "kitchen": [("rusty", 0), ("sturdy", 1)]}


def test_raw_reader_names_the_line_of_a_malformed_review(tmp_path: Path) -> None:
    root = _raw_root(tmp_path)
    bad = _write(root / "books" / "negative.review", "<review>\n<review_text>\na\n</review_text>\n</review>\n"
                 "<review>\n<rating>1</rating>\n</review>\n<review>\n<review_text>\nunclosed\n")
    _, problems = read_raw(root, ("books", "kitchen"))
    assert problems == [f"{bad}:6: review has no <review_text>", f"{bad}:9: <review> is not closed"]
    for domain in ("dvd", "electronics"):  # amazon-reviews reads all four domains
        _write(root / domain / "positive.review", "<review><review_text>fine</review_text></review>")
        _write(root / domain / "negative.review", "<review><review_text>bad</review_text></review>")
    with pytest.raises(ValueError, match=r"^\S+negative.review:6: review has no <review_text> \(and 1 more: "
                                         rf"`feddg datasets amazon-reviews --root {root} --check` lists them\)$"):
        load_dataset("amazon-reviews", root=str(root), cache_dir=tmp_path / "cache")


def test_a_review_file_without_reviews_or_with_two_texts_in_one_is_a_problem(tmp_path: Path) -> None:
    """An empty ``.review`` file, or a processed_acl tree read as raw, loaded as an empty domain that training then
    dropped; a second ``<review_text>`` overwrote the first."""
    root = _raw_root(tmp_path)
    empty = _write(root / "books" / "positive.review", "")
    twice = _write(root / "kitchen_&_housewares" / "negative.review",
                   "<review>\n<review_text>first</review_text>\n<review_text>second</review_text>\n</review>\n")
    assert read_raw(root, ("books", "kitchen"))[1] == [
        f"{empty}: no <review> entries; expected root/<domain>/{{positive,negative}}.review (Blitzer et al.'s "
        "release; domains books, dvd, electronics, kitchen)",
        f"{twice}:3: a second <review_text> in one <review>"]
    acl = tmp_path / "acl"
    for polarity in ("positive", "negative"):
        _write(acl / "books" / f"{polarity}.review", f"good:1 #label#:{polarity}\n")
    assert all("no <review> entries" in p for p in read_raw(acl, ("books",))[1])


def test_table_reader_csv_and_jsonl(tmp_path: Path) -> None:
    root = tmp_path / "table"
    _write(root / "a.csv", 'text,label,domain\n"two\nlines",1,web\nbad stuff,negative,mail\n')
    _write(root / "b.jsonl", json.dumps({"text": "fine", "label": 0, "domain": "web"}) + "\n\n"
           + json.dumps({"text": "x &amp; y", "label": "positive", "domain": "mail"}) + "\n")
    domains, rows, problems = read_table(root)
    assert problems == []
    assert domains == ["mail", "web"]
    assert rows == {"mail": [("bad stuff", "negative"), ("x &amp; y", "positive")],
                    "web": [("two lines", "positive"), ("fine", "negative")]}


def test_table_reader_names_every_malformed_line(tmp_path: Path) -> None:
    jsonl = _write(tmp_path / "t" / "a.jsonl", '{"text": "a", "label": 1, "domain": "d"}\n{"text": "b"\n'
                   '{"text": "", "label": 1, "domain": "d"}\n')
    csv_file = _write(tmp_path / "t" / "b.csv", "text,label\nhello,1\n")
    assert read_table(tmp_path / "t")[2] == [f"{jsonl}:2: not JSON (Expecting ',' delimiter)",
                                             f"{jsonl}:3: the row has an empty text, label or domain",
                                             f"{csv_file}:1: the header lacks column(s) domain; expected text, "
                                             "label, domain"]
    assert len(check_dataset("text-table", root=str(tmp_path / "t"))) == 3



def test_a_table_that_is_no_csv_or_a_jsonl_line_that_is_no_object_is_a_problem(tmp_path: Path) -> None:
    text = _write(tmp_path / "a.txt", "text,label,domain\nfine,1,web\n")
    assert read_table(text) == ([], {}, [f"{text}: no .csv or .jsonl file; expected {TABLE_LAYOUT}"])
    lines = _write(tmp_path / "b.jsonl", '[1, 2]\n{"text": "ok", "label": 1, "domain": "web"}\n')
    assert read_table(lines) == (["web"], {"web": [("ok", "positive")]}, [f"{lines}:1: not a JSON object"])


def test_table_rows_with_extra_fields_or_non_text_values_and_empty_files_are_problems(tmp_path: Path) -> None:
    """An unquoted comma shifted the label and domain (``great, works well,positive,books`` made a domain
    ``positive``); JSON's 1 and 1.0 made two classes; a file without rows loaded nothing."""
    shifted = _write(tmp_path / "t" / "a.csv", "text,label,domain\ngreat, works well,positive,books\nok,1,books\n")
    numbers = _write(tmp_path / "t" / "b.jsonl", "".join(json.dumps(row) + "\n" for row in (
        {"text": "a", "label": 1, "domain": "d"}, {"text": "b", "label": 1.0, "domain": "d"},
        {"text": "c", "label": True, "domain": "d"}, {"text": ["x"], "label": 0, "domain": 3})))
    empty = _write(tmp_path / "t" / "c.csv", "text,label,domain\n")
    domains, rows, problems = read_table(tmp_path / "t")
    assert problems == [f"{shifted}:2: 1 field(s) more than the header's 3",
                        f"{numbers}:2: the row has label 1.0: text must be a string, label and domain strings or "
                        "integers",
                        f"{numbers}:3: the row has label True: text must be a string, label and domain strings or "
                        "integers",
                        f"{numbers}:4: the row has text ['x']: text must be a string, label and domain strings or "
                        "integers",
                        f"{empty}: no rows; expected a .csv or .jsonl file (or a folder of them) with columns text, "
                        "label, domain"]
    assert rows == {"books": [("ok", "positive")], "d": [("a", "positive")]}


def test_a_raw_file_of_mixed_encodings_decodes_each_line_as_its_own(tmp_path: Path) -> None:
    """One Latin-1 byte made the whole file Latin-1: a UTF-8 'café' elsewhere in it read as 'cafÃ©'."""
    root = _raw_root(tmp_path)
    (root / "books" / "positive.review").write_bytes("<review>\n<review_text>\ncafé crème\n</review_text>\n</review>\n"
                                                     "<review>\n<review_text>\n".encode() + b"na\xefve\n"
                                                     + b"</review_text>\n</review>\n")
    samples, problems = read_raw(root, ("books",))
    assert problems == [] and [t for t, k in samples["books"] if k == 1] == ["café crème", "naïve"]


def test_processed_acl_lines_split_at_newlines_and_spaces_only(tmp_path: Path) -> None:
    """A Latin-1 file's byte 0x85 is U+0085, a line break to ``str.splitlines``; 0xA0 a space to ``str.split``."""
    root = tmp_path / "acl"
    (root / "books").mkdir(parents=True)
    (root / "books" / "positive.review").write_bytes(b"caf\xe9\x85:2 a\xa0b:1 #label#:positive\r\n")
    empty = _write(root / "books" / "negative.review", "\n")
    samples, problems = read_processed_acl(root, ("books",))
    assert samples["books"] == [({"caf\xe9\x85": 2, "a\xa0b": 1}, 1)]
    assert problems == [f"{empty}: no review lines; expected root/<domain>/{{positive,negative}}.review with lines "
                        "`tok:count ... #label#:positive|negative`"]


def test_table_reader_drops_a_utf8_bom(tmp_path: Path) -> None:  # Excel's "CSV UTF-8" starts with one
    root = tmp_path / "t"
    (root / "a.csv").parent.mkdir()
    (root / "a.csv").write_bytes("\ufefftext,label,domain\r\ncafé,positive,web\r\n".encode())
    (root / "b.jsonl").write_bytes(("\ufeff" + json.dumps({"text": "ok", "label": 0, "domain": "mail"}) + "\n").encode())
    assert read_table(root) == (["mail", "web"], {"mail": [("ok", "negative")], "web": [("café", "positive")]}, [])


def test_table_that_is_not_utf8_is_named_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "t" / "a.csv"
    bad.parent.mkdir()
    bad.write_bytes("text,label,domain\nadoré,1,web\n".encode("latin-1"))
    problem = f"{bad}:2: not UTF-8 text (byte 0xe9 at offset 22)"
    assert read_table(bad.parent)[2] == check_dataset("text-table", root=str(bad.parent)) == [problem]
    with pytest.raises(ValueError, match=f"^{re.escape(problem)}$"):
        load_dataset("text-table", root=str(bad.parent), cache_dir=tmp_path / "cache")


def test_table_folder_skips_hidden_files(tmp_path: Path) -> None:
    root = tmp_path / "t"
    _write(root / "a.csv", "text,label,domain\nfine,1,web\n")
    (root / "._a.csv").write_bytes(b"\x00\x05\x16\x07\x00\x02Mac OS X\xb0\xff")  # macOS AppleDouble companion
    _write(root / ".b.jsonl", "not json\n")
    assert read_table(root) == (["web"], {"web": [("fine", "positive")]}, [])


def test_table_extensions_are_case_insensitive(tmp_path: Path) -> None:
    root = tmp_path / "t"
    _write(root / "a.csv", "text,label,domain\nfine,1,web\n")
    _write(root / "b.CSV", "text,label,domain\nsturdy,1,kitchen\n")
    _write(root / "c.JSONL", json.dumps({"text": "dull", "label": 0, "domain": "books"}) + "\n")
    assert read_table(root) == (["books", "kitchen", "web"], {"books": [("dull", "negative")],
                                "kitchen": [("sturdy", "positive")], "web": [("fine", "positive")]}, [])
    assert read_table(root / "b.CSV") == (["kitchen"], {"kitchen": [("sturdy", "positive")]}, [])


def test_table_labels_are_renamed_only_when_binary(tmp_path: Path) -> None:
    stars = _write(tmp_path / "stars.jsonl", "".join(json.dumps({"text": f"{s} stars", "label": s, "domain": "d"}) + "\n"
                                                     for s in range(1, 6)))
    assert read_table(stars)[1] == {"d": [(f"{s} stars", str(s)) for s in range(1, 6)]}
    binary = _write(tmp_path / "binary.csv", "text,label,domain\ngood,1,d\nbad,0,d\n")
    assert read_table(binary)[1] == {"d": [("good", "positive"), ("bad", "negative")]}
    ones = _write(tmp_path / "ones.csv", "text,label,domain\na,1,d\nb,2,d\n")
    assert read_table(ones)[1] == {"d": [("a", "1"), ("b", "2")]}

def test_processed_acl_reader_and_bag_of_words(tmp_path: Path) -> None:
    root = tmp_path / "acl"
    _write(root / "books" / "positive.review", "great:2 great_read:1 #label#:positive\nfun:1 #label#:positive\n")
    _write(root / "books" / "negative.review", "dull:3 great:1 #label#:negative\n")
    _write(root / "kitchen" / "positive.review", "sturdy:1 great:1 #label#:positive\n")
    _write(root / "kitchen" / "negative.review", "dull:1 #label#:negative\n")
    samples, problems = read_processed_acl(root, ("books", "kitchen"))
    assert problems == []
    assert samples["books"] == [({"dull": 3, "great": 1}, 0), ({"great": 2, "great_read": 1}, 1), ({"fun": 1}, 1)]
    # totals: great 4, dull 4, then fun/great_read/sturdy 1: the two most frequent, ties by name
    features, labels, domain_ids, vocabulary = bag_of_words(samples, ["negative", "positive"], max_features=2)
    assert vocabulary == ["dull", "great"]
    np.testing.assert_array_equal(features.toarray(), [[3, 1], [0, 2], [0, 0], [1, 0], [0, 1]])
    np.testing.assert_array_equal(labels, [0, 1, 1, 0, 1])
    np.testing.assert_array_equal(domain_ids, [0, 0, 0, 1, 1])


def test_processed_acl_reader_names_the_malformed_line(tmp_path: Path) -> None:
    root = tmp_path / "acl"
    bad = _write(root / "books" / "positive.review", "good:1 #label#:positive\ngood:x #label#:positive\n"
                 "good:1 #label#:negative\ngood:1\ngood:0 #label#:positive\n:3 #label#:positive\n"
                 "good:1 #label#:neutral\n")
    _write(root / "books" / "negative.review", "bad:1 #label#:negative\n")
    assert read_processed_acl(root, ("books",))[1] == [
        f"{bad}:2: 'good:x' is not feature:count with a positive count",
        f"{bad}:3: label negative in the positive file",
        f"{bad}:4: the line does not end with #label#:positive or #label#:negative",
        f"{bad}:5: 'good:0' is not feature:count with a positive count",
        f"{bad}:6: ':3' is not feature:count with a positive count",
        f"{bad}:7: unknown label 'neutral'; expected positive or negative"]


def test_processed_acl_counts_add_up_and_a_feature_may_hold_a_colon(tmp_path: Path) -> None:
    # the count follows the last colon (re:_great:2 is the feature re:_great twice); a repeated feature's counts sum
    root = tmp_path / "acl"
    _write(root / "books" / "positive.review", "re:_great:2 fun:1 fun:3 #label#:positive\n")
    _write(root / "books" / "negative.review", "dull:1 #label#:negative\n")
    samples, problems = read_processed_acl(root, ("books",))
    assert problems == [] and samples["books"] == [({"dull": 1}, 0), ({"re:_great": 2, "fun": 4}, 1)]


def test_a_raw_review_with_an_empty_text_or_left_open_is_a_problem(tmp_path: Path) -> None:
    root = _raw_root(tmp_path)
    bad = _write(root / "books" / "negative.review", "<review>\n<review_text>\n \n</review_text>\n</review>\n"
                 "<review>\n<review>\n<review_text>ok</review_text>\n</review>\n")
    samples, problems = read_raw(root, ("books",))
    assert problems == [f"{bad}:1: review has an empty <review_text>",
                        f"{bad}:6: <review> is not closed before the next <review>"]
    assert samples["books"][0] == ("ok", 0) and [k for _, k in samples["books"]] == [0, 1, 1]


def _table(tmp_path: Path) -> Path:
    long = " ".join(["word"] * 40)
    rows = [("a good film", 1, "web"), ("bad", 0, "web"), (long, 1, "mail"), ("ok then fine", 0, "mail")] * 3
    return _write(tmp_path / "reviews.csv", "text,label,domain\n" + "".join(f"{t},{k},{d}\n" for t, k, d in rows))


def test_token_cache_second_load_reads_no_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    csv_file, cache = _table(tmp_path), tmp_path / "cache"
    first = load_dataset("text-table", root=str(csv_file), cache_dir=cache, vocab_size=300)
    assert (first.domains, first.classes, len(first)) == (["mail", "web"], ["negative", "positive"], 12)
    np.testing.assert_array_equal(first.labels[:4], [1, 0, 1, 0])  # mail's rows first (domains sorted)

    def no_text(*args: object) -> None:
        raise AssertionError("the text was read again")

    monkeypatch.setattr(text_sets_module, "read_table", no_text)
    second = load_dataset("text-table", root=str(csv_file), cache_dir=cache, vocab_size=300)
    assert isinstance(second.ids, np.memmap)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(second.ids, first.ids)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(second.domain_ids, first.domain_ids)


def test_batches_are_padded_to_the_longest_with_masks_and_truncated(tmp_path: Path) -> None:
    ds = load_dataset("text-table", root=str(_table(tmp_path)), cache_dir=tmp_path / "cache", vocab_size=300,
                      max_length=16)
    inputs, labels = ds.get_batch(np.array([3, 4]), train=True)  # "ok then fine" (mail), "a good film" (web)
    assert isinstance(inputs, dict)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    lengths = mask.sum(1).tolist()
    assert ids.dtype == mask.dtype == labels.dtype == torch.int64
    assert ids.shape == (2, max(lengths)) and min(lengths) < max(lengths)
    short = int(np.argmin(lengths))
    assert (ids[short, lengths[short]:] == 1).all() and (mask[short, lengths[short]:] == 0).all()  # <pad> = 1
    assert ids[:, 0].tolist() == [0, 0] and ids[1 - short, -1] == 2  # <s> ... </s>
    assert labels.tolist() == [0, 1]
    long_ids, _ = ds.get_batch(np.array([0]), train=False)  # 40 words, cut to 16 tokens ending in </s>
    assert isinstance(long_ids, dict) and long_ids["input_ids"].shape == (1, 16) and long_ids["input_ids"][0, -1] == 2
    assert ds.model_args() == {"vocab_size": ds.vocab_size, "max_length": 16, "pad_token_id": 1}  # type: ignore[attr-defined]
    assert ds.image_shape == (1, 1, 16)


def test_bpe_round_trips_and_has_robertas_special_ids(tmp_path: Path) -> None:
    texts = ["the plot was gripping and the prose was clear", "the kettle leaks and the lid is cracked"] * 20
    tok = train_bpe(texts, 300, tmp_path)
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2, 3, 4] and tok.pad_token_id == 1
    sentence = "The plot leaks, naïvely!"
    ids = tok(sentence)["input_ids"]
    assert ids[0] == 0 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == sentence
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    assert train_bpe(texts, 300, tmp_path).get_vocab() == tok.get_vocab()  # loaded from the cache
    with pytest.raises(ValueError, match="^vocab_size must be >= 261 "):  # 5 specials + 256 bytes
        train_bpe(texts, 260, tmp_path)


def test_a_tokenizer_folder_without_tokenizer_files_is_refused(tmp_path: Path) -> None:
    _write(tmp_path / "tok" / "config.json", "{}")
    with pytest.raises(ValueError, match=r"^tokenizer \S+tok: no tokenizer files \(tokenizer.json, vocab.json"):
        load_tokenizer(tmp_path / "tok")


def test_a_tokenizer_path_that_is_a_file_is_named_as_no_directory(tmp_path: Path) -> None:
    tokenizer_json = _write(tmp_path / "tokenizer.json", "{}")  # the file, not its folder
    with pytest.raises(ValueError, match=r"^tokenizer \S+tokenizer\.json: no such directory \(a local Hugging Face"):
        load_tokenizer(tokenizer_json)


def test_a_tokenizer_without_a_padding_token_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="[UNK]").save_pretrained(str(tmp_path / "tok"))
    with pytest.raises(ValueError, match=r"^tokenizer \S+tok has no padding token"):
        load_tokenizer(tmp_path / "tok")


def test_tokenizer_stamp_changes_with_a_files_modification_time(tmp_path: Path) -> None:
    vocab = _write(tmp_path / "tok" / "vocab.json", "{}")
    before = tokenizer_stamp(tmp_path / "tok")
    assert tokenizer_stamp(tmp_path / "tok") == before
    os.utime(vocab, ns=(10**18, 10**18))  # same name and size, edited later
    assert tokenizer_stamp(tmp_path / "tok") != before


def test_synthetic_corpus_is_seeded_balanced_and_noisy() -> None:
    a, b = generate(3, per_domain=400), generate(3, per_domain=400)
    assert a == b and a != generate(4, per_domain=400)
    assert list(a) == list(DOMAINS) == ["books", "dvd", "electronics", "kitchen"]
    clean = generate(3, per_domain=400, noise=0.0)
    flipped = 0
    for d in DOMAINS:
        assert [t for t, _ in a[d]] == [t for t, _ in clean[d]]  # the noise draws on its own stream
        assert sum(k for _, k in clean[d]) == 200  # balanced before noise
        assert all(WORDS[0] <= len(t.split()) <= WORDS[1] for t, _ in a[d])
        flipped += sum(k != c for (_, k), (_, c) in zip(a[d], clean[d], strict=True))
    assert abs(flipped / 1600 - 0.1) < 0.03  # 10 % label noise (binomial sd 0.75 %)


class _Images(DomainDataset):
    name, image_shape = "images", (3, 28, 28)

    def get_batch(self, indices: np.ndarray, train: bool, generator: torch.Generator | None = None) -> tuple:
        raise NotImplementedError


def test_model_args_per_kind_of_inputs(tmp_path: Path) -> None:
    assert _Images().model_args() == {"in_channels": 3, "image_size": 28}
    root = tmp_path / "acl"
    for d in ("books", "dvd", "electronics", "kitchen"):
        _write(root / d / "positive.review", "a:1 b:2 #label#:positive\n")
        _write(root / d / "negative.review", "c:1 #label#:negative\n")
    bow = load_dataset("amazon-bow", root=str(root), domains=["dvd", "books"], max_per_domain=1)
    assert bow.inputs == "features" and bow.model_args() == {"in_features": 3} and bow.image_shape == (1, 1, 3)
    x, y = bow.get_batch(np.arange(len(bow)), train=True)
    assert bow.domains == ["dvd", "books"] and x.dtype == torch.float32 and len(y) == 2


def test_text_options_are_refused_where_they_do_not_apply() -> None:
    with pytest.raises(ValueError, match="^digits-dg is not a text dataset: it takes no tokenizer, max_length$"):
        load_dataset("digits-dg", tokenizer="/tok", max_length=64)
    with pytest.raises(ValueError, match="^synthetic-sentiment is a text dataset: it takes no image_size"):
        load_dataset("synthetic-sentiment", image_size=32)
    with pytest.raises(ValueError, match="^amazon-bow is bag-of-words vectors: it takes no tokenizer"):
        load_dataset("amazon-bow", root="/nowhere", max_length=64)


def test_a_jsonl_text_that_is_a_number_is_a_problem_but_a_domain_may_be_one(tmp_path: Path) -> None:
    table = _write(tmp_path / "a.jsonl", '{"text": 5, "label": 1, "domain": "d"}\n{"text": "ok", "label": 0, "domain": 7}\n')
    assert read_table(table) == (["7"], {"7": [("ok", "negative")]}, [
        f"{table}:1: the row has text 5: text must be a string, label and domain strings or integers"])


def test_jsonl_lines_may_end_with_a_bare_carriage_return(tmp_path: Path) -> None:
    """Classic Mac line ends (``\\r``) separate rows as ``\\n`` does; problems name the right line."""
    table = _write(tmp_path / "a.jsonl", '{"text": "up", "label": 1, "domain": "d"}\r[1]\r{"text": "down", "label": 0, '
                                         '"domain": "d"}\r')
    assert read_table(table) == (["d"], {"d": [("up", "positive"), ("down", "negative")]},
                                 [f"{table}:2: not a JSON object"])


def test_a_processed_acl_count_that_is_a_superscript_digit_is_a_problem(tmp_path: Path) -> None:
    """'²'.isdigit() is true but int('²') raises: such a line crashed the reader instead of being listed."""
    root = tmp_path / "acl"
    bad = root / "books" / "positive.review"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"good:1 #label#:positive\ngood:\xb2 #label#:positive\n")  # a Latin-1 line: 0xB2 is U+00B2
    _write(root / "books" / "negative.review", "dull:1 #label#:negative\n")
    samples, problems = read_processed_acl(root, ("books",))
    assert problems == [f"{bad}:2: 'good:\u00b2' is not feature:count with a positive count"]
    assert samples["books"] == [({"dull": 1}, 0), ({"good": 1}, 1)]


def test_stray_closing_tags_are_problems_and_a_file_with_problems_is_not_also_called_empty(tmp_path: Path) -> None:
    root = _raw_root(tmp_path)
    bad = _write(root / "books" / "negative.review", "</review>\n<review>\n</review_text>\n</review>\n")
    assert read_raw(root, ("books",))[1] == [f"{bad}:1: </review> without <review>",
                                            f"{bad}:3: </review_text> without <review_text>",
                                            f"{bad}:2: review has no <review_text>"]


def test_amazon_bow_keeps_mdans_5000_most_frequent_features(tmp_path: Path) -> None:
    from feddg.data.text_formats import AMAZON_DOMAINS
    from feddg.data.text_sets import load_amazon_bow

    root = tmp_path / "acl"
    common = " ".join(f"f{i:04d}:2" for i in range(5000))
    for domain in AMAZON_DOMAINS:
        _write(root / domain / "positive.review", f"{common} rare:1 #label#:positive\n")
        _write(root / domain / "negative.review", "f0000:1 #label#:negative\n")
    ds = load_amazon_bow(root=str(root))
    assert len(ds.vocabulary) == 5000 and "rare" not in ds.vocabulary  # the one feature fewer reviews hold


def test_the_raw_amazon_check_lists_every_malformed_review(tmp_path: Path) -> None:
    root = _raw_root(tmp_path)
    for domain in ("dvd", "electronics"):  # amazon-reviews reads all four domains
        _write(root / domain / "positive.review", "<review><review_text>fine</review_text></review>")
        _write(root / domain / "negative.review", "<review><review_text>bad</review_text></review>")
    bad = _write(root / "books" / "negative.review", "<review>\n<rating>1</rating>\n</review>\n")
    assert check_dataset("amazon-reviews", root=str(root)) == [f"{bad}:1: review has no <review_text>"]


def test_the_synthetic_corpus_cache_is_keyed_by_seed_and_generator_version(monkeypatch: pytest.MonkeyPatch) -> None:
    from feddg.data import synthetic_text

    keys: list[str] = []
    monkeypatch.setattr(text_sets_module, "tokenised", lambda name, key, read, **kw: keys.append(key))
    text_sets_module.load_synthetic_sentiment(root=None, cache_dir=None, seed=3, tokenizer=None, max_length=8,
                                              vocab_size=300)
    assert keys == [f"seed3-{synthetic_text.VERSION}"]  # a changed generator never reads an old cache


def _tokens() -> TokenDataset:
    ids = np.array([[0, 7, 2, 1, 1, 1], [0, 8, 9, 9, 2, 1], [0, 2, 1, 1, 1, 1]], np.int32)
    return TokenDataset("t", ids, np.array([3, 5, 2], np.int32), np.array([1, 0, 1]), np.array([0, 2, 1]),
                        ["a", "b", "c"], ["neg", "pos"], vocab_size=10, pad_token_id=1)


def test_a_token_batch_is_cut_to_its_longest_text_and_masks_each_texts_own_tokens() -> None:
    inputs, labels = _tokens().get_batch(np.array([0, 2]), train=True)
    assert inputs["input_ids"].tolist() == [[0, 7, 2], [0, 2, 1]]  # the longest of the two: 3 tokens
    assert inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]] and labels.tolist() == [1, 1]
    empty, _ = _tokens().get_batch(np.array([], np.int64), train=False)
    assert empty["input_ids"].shape == (0, 1)


def test_a_token_subset_renumbers_its_domains_into_the_kept_ones() -> None:
    sub = _tokens().subset(np.array([1, 2]), ["b", "c"])
    assert sub.domains == ["b", "c"] and sub.domain_ids.tolist() == [1, 0]  # sample 1 of "c" (2), sample 2 of "b" (1)
    assert sub.lengths.tolist() == [5, 2] and sub.pad_token_id == 1


def test_bag_of_words_breaks_count_ties_by_name_and_refuses_no_features() -> None:
    samples = {"d": [({"zeta": 2, "alpha": 2, "mid": 1}, 0)]}
    assert bag_of_words(samples, ["neg"], 2)[3] == ["alpha", "zeta"]
    with pytest.raises(ValueError, match="max_features must be >= 1, got 0"):
        bag_of_words(samples, ["neg"], 0)


def test_text_loads_default_to_128_tokens_and_a_4000_token_bpe(tmp_path: Path) -> None:
    """docs/data.md: ``data.max_length`` 128 and ``data.vocab_size`` 4000 where a load names neither."""
    ds = load_dataset("synthetic-sentiment", cache_dir=tmp_path)
    assert isinstance(ds, TokenDataset) and ds.max_length == 128
    assert [p.name.split("-")[1] for p in (tmp_path / "tokenizers").iterdir()] == ["4000"]


@pytest.mark.parametrize("stale", ["int64", "shape", "garbage"])
def test_a_token_cache_of_another_dtype_shape_or_no_array_is_rebuilt(tmp_path: Path, stale: str) -> None:
    """The cached ``.npy`` is used only as int32 ``[N, max_length]``; anything else at its path is tokenised again."""
    csv_file, cache = _table(tmp_path), tmp_path / "cache"
    first = load_dataset("text-table", root=str(csv_file), cache_dir=cache, vocab_size=300, max_length=16)
    (npy,) = (cache / "text").glob("*.npy")
    assert npy.name.endswith("_16.npy")  # <name>_<source>_<tokenizer>_<max_length>.npy
    ids = np.array(first.ids)  # a copy: the dataset maps the file this test writes over  # type: ignore[attr-defined]
    if stale == "int64":
        np.save(npy, ids.astype(np.int64))
    elif stale == "shape":
        np.save(npy, ids[:, :8])
    else:
        npy.write_bytes(b"not an array")
    again = load_dataset("text-table", root=str(csv_file), cache_dir=cache, vocab_size=300, max_length=16)
    np.testing.assert_array_equal(again.ids, ids)  # type: ignore[attr-defined]
    assert again.ids.dtype == np.int32 and np.load(npy).dtype == np.int32  # type: ignore[attr-defined]


def test_each_max_length_has_its_own_token_cache_and_too_short_is_refused(tmp_path: Path) -> None:
    csv_file, cache = _table(tmp_path), tmp_path / "cache"
    for length in (16, 32):
        load_dataset("text-table", root=str(csv_file), cache_dir=cache, vocab_size=300, max_length=length)
    assert sorted(p.name.rsplit("_", 1)[1] for p in (cache / "text").glob("*.npy")) == ["16.npy", "32.npy"]
    with pytest.raises(ValueError, match="max_length must be >= 8, got 7"):
        load_dataset("text-table", root=str(csv_file), cache_dir=cache, vocab_size=300, max_length=7)


def test_an_interrupted_token_cache_write_leaves_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from feddg.data import text

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(text.np, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        text._save_cache(tmp_path / "t.npy", np.zeros((1, 8), np.int32), {"lengths": np.ones(1)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]  # the meta only; no .tmp, no .npy


def test_the_synthetic_corpus_has_docs_data_mds_size_lengths_and_flipping_cues() -> None:
    """docs/data.md: 2,000 reviews a domain of 20-60 words; "unpredictable" good in books and dvd, bad in electronics
    and kitchen; about 30 % of sentiment cues shared by every domain (module docstring's SHARED_CUE)."""
    import random

    from feddg.data import synthetic_text

    corpus = generate(0, noise=0.0)
    assert {d: len(r) for d, r in corpus.items()} == dict.fromkeys(DOMAINS, 2000)
    words = [len(text.split()) for reviews in corpus.values() for text, _ in reviews]
    assert min(words) >= 20 and max(words) == 60
    for domain, good in (("books", 1), ("dvd", 1), ("electronics", 0), ("kitchen", 0)):
        rng = random.Random(0)
        for polarity in (0, 1):
            cues = [synthetic_text._cue(rng, domain, polarity) for _ in range(400)]
            assert ("unpredictable" in cues) is (polarity == good), (domain, polarity)
    rng = random.Random(1)
    shared = np.mean([synthetic_text._cue(rng, "dvd", 1) in synthetic_text.SHARED[1] for _ in range(4000)])
    assert shared == pytest.approx(0.3, abs=0.03)
