"""Extra evaluation targets (eval.extra) during a run, and `feddg eval` on a finished run's checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.decisive import decisive_argmax
from toy import ToyDomains, toy_federation
from typer.testing import CliRunner

from feddg.cli import app
from feddg.config import ConfigError, ExperimentConfig, ExtraEvalConfig, build_config, dump_config
from feddg.data import load_dataset
from feddg.engines.inprocess import run_inprocess
from feddg.federation.client_store import open_checkpoint
from feddg.federation.extra_eval import evaluate_run
from feddg.federation.server import Server
from feddg.federation.setup import ExtraTarget, Federation, load_extra_target
from feddg.messages import load_weights
from feddg.models.registry import create_model

FRESH = ToyDomains(per_class_domain=10)


def _run_with_two_extras(tmp_path: Path, *over: str) -> tuple[Server, dict]:
    """A toy run with two extra targets: the training data itself ("again") and fresh samples of the same classes
    and domains ("fresh": 10 per class and domain, other noise)."""
    fed = toy_federation("federation.rounds=2", *over)
    fed.extra = [ExtraTarget("again", fed.dataset), ExtraTarget("fresh", FRESH)]
    server = Server(fed, tmp_path / "run")
    return server, run_inprocess(server)


def _accuracy_by_domain(fed: Federation, state: dict, client_id: int | None, ds: ToyDomains) -> list[float]:
    """Percent of ``ds``'s samples of each domain that the model ``client_id`` is evaluated with (``None``: the
    global one) classifies right, by hand."""
    load_weights(fed.model, fed.method.eval_weights(state, client_id))
    fed.model.eval()
    with torch.no_grad():
        right = decisive_argmax(fed.model(ds.x)).numpy() == ds.labels
    return [100.0 * right[ds.domain_ids == d].mean() for d in range(len(ds.domains))]


def test_an_extra_target_is_evaluated_like_the_held_out_domain(tmp_path):
    server, results = _run_with_two_extras(tmp_path)
    final = results["final"]
    assert final["extra/again_acc/c"] == final["ood_acc/c"]  # c is the held-out domain: the same samples
    want = _accuracy_by_domain(server.fed, server.state, None, FRESH)
    assert [final[f"extra/fresh_acc/{d}"] for d in "abc"] == pytest.approx(want)
    assert final["extra/fresh_acc"] == pytest.approx(np.mean(want))
    assert [final[f"extra/again_acc/{d}"] for d in "abc"] != pytest.approx(want)  # another data set, other figures
    assert final["extra/again_acc"] == pytest.approx(sum(final[f"extra/again_acc/{d}"] for d in "abc") / 3)
    assert results["extra"] == {"again": {"dataset": "toy", "domains": ["a", "b", "c"]},
                                "fresh": {"dataset": "toy", "domains": ["a", "b", "c"]}}
    assert all("extra/again_acc" in row and "extra/fresh_acc" in row for row in server.metrics)  # every eval round
    assert json.loads((tmp_path / "run" / "results.json").read_text())["final"] == final


def test_a_personalised_method_reports_the_clients_mean_and_the_global_model(tmp_path):
    server, results = _run_with_two_extras(tmp_path, "method.name=local")
    fed, final = server.fed, results["final"]
    assert final["extra/again_acc/c"] == final["ood_acc/c"]  # mean over the clients' own models
    assert final["extra/again_global_acc/c"] == final["global_ood_acc/c"]
    per_client = [_accuracy_by_domain(fed, server.state, cid, FRESH) for cid in range(len(fed.clients))]
    glob = _accuracy_by_domain(fed, server.state, None, FRESH)
    assert [final[f"extra/fresh_acc/{d}"] for d in "abc"] == pytest.approx(np.mean(per_client, axis=0))
    assert [final[f"extra/fresh_global_acc/{d}"] for d in "abc"] == pytest.approx(glob)
    assert np.mean(per_client, axis=0) != pytest.approx(glob)  # the clients' models are not the global one


def test_an_extra_target_needs_the_training_datas_classes_and_image_shape(cache_dir):
    cfg = build_config({}, [f"data.cache_dir={cache_dir}"])
    with pytest.raises(ValueError, match=r"^eval.extra cm: colored-mnist has classes \['0-4', '5-9'\], the training"):
        load_extra_target(ExtraEvalConfig(name="cm", dataset="colored-mnist"), cfg, _digits_like(ToyDomains()))
    with pytest.raises(ValueError, match=r"^eval.extra rm: rotated-mnist has images of shape \(1, 28, 28\), the model"):
        load_extra_target(ExtraEvalConfig(name="rm", dataset="rotated-mnist", domains=["0"]), cfg,
                          _digits_like(ToyDomains()))
    with pytest.raises(ValueError, match=r"^eval.extra d: bad domains \['mars'\] for digits-dg"):
        load_extra_target(ExtraEvalConfig(name="d", dataset="digits-dg", domains=["mars"]), cfg, ToyDomains())
    with pytest.raises(ValueError, match=r"^--dataset digits-dg: bad domains \['mars'\]"):  # feddg eval's wording
        load_extra_target(ExtraEvalConfig(name="d", dataset="digits-dg", domains=["mars"]), cfg, ToyDomains(),
                          where="--dataset digits-dg")


@pytest.mark.parametrize(("data", "extra", "why"), [
    ("digits-dg", "synthetic-sentiment", "synthetic-sentiment is a classification dataset of tokens, the training "
     "data digits-dg a classification dataset of images: an extra target needs the same task and inputs"),
    ("digits-dg", "synthetic-mri", "synthetic-mri is a segmentation dataset of images, the training data digits-dg a "
     "classification dataset of images"),
    ("digits-dg", "cifar10", "cifar10 has classes ['airplane', "),
    # the same digits in one channel: `feddg eval` failed loading them with the training data's 3-channel statistics
    ("digits-dg", "rotated-mnist", "rotated-mnist has 1-channel images, the training data digits-dg 3-channel ones: an "
     "extra target needs images of the same channels"),
    # a natural source's channels are known before it loads: the writers failed on the 3-channel statistics
    ("digits-dg", "writers", "writers has 1-channel images, the training data digits-dg 3-channel ones"),
    ("femnist", "cifar10", "cifar10 has 3-channel images, the training data femnist 1-channel ones"),
    ("digits-dg", "nosuch", "unknown dataset 'nosuch'"),
    # token ids of feddg's own BPE are the training corpus's: another corpus's ids would name other words
    ("synthetic-sentiment", "text-table", "without data.tokenizer (or model.path) synthetic-sentiment's token ids come "
     "from a BPE trained on its own corpus, which text-table's would not share: an extra text target needs a fixed "
     "tokenizer"),
    ("amazon-bow", "amazon-bow", "amazon-bow's features index its own corpus's vocabulary, which amazon-bow's would "
     "not share: a bag-of-words dataset takes no extra target"),
])
def test_an_extra_target_of_another_task_inputs_or_classes_is_refused_when_the_config_loads(data, extra, why):
    model = {"synthetic-sentiment": "tiny-roberta", "amazon-bow": "mlp"}.get(data, "cnn")
    with pytest.raises(ConfigError) as err:
        build_config({}, [f"data.dataset={data}", f"model.name={model}", f"eval.extra=[{{name: x, dataset: {extra}}}]"])
    assert str(err.value).startswith(f"eval.extra.0 (x): {why}")


def test_a_text_extra_target_loads_with_the_training_datas_tokenizer_and_length(tmp_path, cache_dir):
    from feddg.data import synthetic_text
    from feddg.data.text import Corpus
    from feddg.data.tokenizer import train_bpe
    from feddg.federation.setup import load_data

    texts = Corpus.from_domains(synthetic_text.CLASSES, synthetic_text.generate(0)).texts
    tokenizer = train_bpe(texts, 2000, tmp_path).name_or_path  # a fixed tokenizer directory
    cfg = build_config({"data": {"dataset": "synthetic-sentiment", "max_length": 24, "tokenizer": tokenizer,
                                 "domains": ["books", "dvd"], "cache_dir": str(cache_dir)},
                        "model": {"name": "tiny-roberta"}, "split": {"target": "dvd"},
                        "eval": {"extra": [{"name": "e", "dataset": "synthetic-sentiment", "domains": ["electronics"]}]}})
    train = load_data(cfg)
    extra = load_extra_target(cfg.eval.extra[0], cfg, train).dataset  # it was refused: "takes no image_size"
    assert extra.ids.shape[1] == train.ids.shape[1] == 24 and extra.domains == ["electronics"]


def test_feddg_eval_refuses_another_kind_of_dataset_before_loading_it(tmp_path, cache_dir):
    (tmp_path / "config.yaml").write_text(dump_config(build_config({}, [f"data.cache_dir={cache_dir}"])))
    with pytest.raises(ValueError, match=r"^eval.extra t: synthetic-sentiment is a classification dataset of tokens"):
        evaluate_run(tmp_path, ExtraEvalConfig(name="t", dataset="synthetic-sentiment"))  # no checkpoint, no data read
    with pytest.raises(ValueError, match=r"^--dataset writers: writers has 1-channel images"):  # as feddg eval asks
        evaluate_run(tmp_path, ExtraEvalConfig(name="writers", dataset="writers"), where="--dataset writers")
    assert build_config({}, ["eval.extra=[{name: f, dataset: folder, root: /nowhere}]"])  # a folder's classes: at load


def test_feddg_eval_takes_model_path_as_the_fixed_tokenizer_then_needs_a_checkpoint(tmp_path: Path, cache_dir: Path
                                                                                  ) -> None:
    over = ["data.dataset=synthetic-sentiment", "model.name=transformer", "model.path=/nowhere", "device=cpu",
            f"data.cache_dir={cache_dir}"]
    (tmp_path / "config.yaml").write_text(dump_config(build_config({}, over)))
    with pytest.raises(ValueError, match=r"has no checkpoint.pt to evaluate$"):  # past the tokenizer check
        evaluate_run(tmp_path, ExtraEvalConfig(name="s", dataset="synthetic-sentiment"))


class _Built(Exception):
    """Stops ``evaluate_run`` once it builds the federation."""


def test_feddg_eval_rebuilds_the_run_without_its_own_extra_targets_on_the_device_asked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from feddg.federation import extra_eval

    folder = "eval.extra=[{name: gone, dataset: folder, root: /nowhere}]"  # the run's own target, since removed
    (tmp_path / "config.yaml").write_text(dump_config(build_config({}, ["device=cpu", folder])))
    built: list[ExperimentConfig] = []

    def build(cfg: ExperimentConfig) -> Federation:
        built.append(cfg)
        raise _Built

    monkeypatch.setattr(extra_eval, "open_checkpoint", lambda run_dir: {"round": 1, "server_state": {}})
    monkeypatch.setattr(extra_eval, "build_federation", build)
    for device in ("auto", None):
        with pytest.raises(_Built):
            evaluate_run(tmp_path, ExtraEvalConfig(name="d", dataset="digits-dg"), device)
    assert [(cfg.device, cfg.eval.extra) for cfg in built] == [("auto", []), ("cpu", [])]  # None: the run's own


def _digits_like(ds: ToyDomains) -> ToyDomains:
    ds.classes = [str(k) for k in range(10)]
    ds.image_shape = (3, 28, 28)
    return ds


# one round of 8 local epochs: above chance (on uci 26.7 %), so a wrong model or data set shows in the figures
TINY = ["-o", "data.max_per_domain=150", "-o", "partition.num_clients=3", "-o", "federation.rounds=1",
        "-o", "federation.local_epochs=8", "-o", "model.name=lenet", "-o", "split.target=uci",
        "-o", "federation.workers=1", "-o", "device=cpu"]


def _checkpoint_accuracy(run_dir: Path, cache_dir: Path) -> dict[str, float]:
    """Per Digits-DG domain (150 samples each), the percent the run's checkpointed global model classifies right,
    by hand."""
    model = create_model("lenet", num_classes=10)
    ckpt = open_checkpoint(run_dir)
    assert ckpt is not None
    load_weights(model, ckpt["server_state"]["weights"])
    model.eval()
    ds = load_dataset("digits-dg", cache_dir=cache_dir, max_per_domain=150)
    x, y = ds.get_batch(np.arange(len(ds)), train=False)
    with torch.no_grad():
        right = (decisive_argmax(model(x)) == y).numpy()
    return {d: 100.0 * right[ds.domain_ids == k].mean() for k, d in enumerate(ds.domains)}


def test_run_with_an_extra_target_then_feddg_eval_gives_the_same_accuracy(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("FEDDG_CACHE", str(cache_dir))
    run_dir = tmp_path / "r"
    extra = "eval.extra=[{name: uci150, dataset: digits-dg, domains: [uci], max_per_domain: 150}]"
    res = CliRunner().invoke(app, ["run", "configs/demo.yaml", *TINY, "-o", extra, "--run-dir", str(run_dir),
                                   "--quiet"])
    assert res.exit_code == 0, res.output
    final = json.loads((run_dir / "results.json").read_text())["final"]
    hand = _checkpoint_accuracy(run_dir, cache_dir)
    assert hand["uci"] > 20.0 and hand["mnist"] != hand["uci"]  # above chance (10 %), and the domains differ
    assert final["extra/uci150_acc/uci"] == final["ood_acc/uci"] == pytest.approx(hand["uci"])
    assert "extra/uci150" in res.output  # in the run's table

    res = CliRunner().invoke(app, ["eval", str(run_dir), "--dataset", "digits-dg", "--domains", "uci,mnist",
                                   "--max-per-domain", "150"])
    assert res.exit_code == 0, res.output
    assert "r (round 1) on digits-dg" in res.output  # the checkpoint of the run's one round
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in res.output.splitlines()
            if line.count("│") == 3}
    assert rows["uci"] == f"{hand['uci']:.2f}" and rows["mnist"] == f"{hand['mnist']:.2f}"
    assert rows["mean"] == f"{(hand['uci'] + hand['mnist']) / 2:.2f}"

    for args, words in ((["--dataset", "colored-mnist"], ["classes"]), (["--dataset", "nope"], ["nope"])):
        res = CliRunner().invoke(app, ["eval", str(run_dir), *args])
        lines = res.output.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and all(w in lines[0] for w in words), res.output
    res = CliRunner().invoke(app, ["eval", str(tmp_path), "--dataset", "digits-dg"])
    assert res.exit_code == 2 and "not a run directory" in res.output


def test_a_folder_without_its_card_is_normalised_with_the_training_datas_statistics(tmp_path, cache_dir):
    # the same images in a folder without feddg.json: its own default would be DomainBed's ImageNet statistics, which
    # moved a run's accuracy on them from 49.9 % to 43.1 % (an audit) — read as the training data is, they match
    from feddg.data import load_dataset
    from feddg.data.export import export_dataset

    export_dataset("digits-dg", tmp_path / "f", cache_dir=cache_dir, max_per_domain=20)
    (tmp_path / "f" / "feddg.json").unlink()
    cfg = build_config({}, [f"data.cache_dir={cache_dir}"])
    reference = load_dataset("digits-dg", cache_dir=cache_dir, max_per_domain=20)
    extra = load_extra_target(ExtraEvalConfig(name="f", dataset="folder", root=str(tmp_path / "f")), cfg, reference).dataset
    assert (extra.mean, extra.std) == (reference.mean, reference.std) == ((0.5,) * 3, (0.5,) * 3)
    x_ref, _ = reference.get_batch(np.arange(len(reference)), train=False)
    x_extra, _ = extra.get_batch(np.arange(len(extra)), train=False)
    sums = [np.sort(x.flatten(1).sum(1).numpy()) for x in (x_extra, x_ref)]  # the same images, in any order
    np.testing.assert_allclose(*sums, rtol=1e-5)


def test_an_extra_target_is_normalised_with_the_training_datas_std_as_well_as_its_mean(tmp_path, cache_dir):
    from feddg.data.export import export_dataset

    export_dataset("digits-dg", tmp_path / "f", cache_dir=cache_dir, max_per_domain=20)
    (tmp_path / "f" / "feddg.json").unlink()
    cfg = build_config({}, [f"data.cache_dir={cache_dir}"])
    reference = load_dataset("digits-dg", cache_dir=cache_dir, max_per_domain=20)
    x_ref, _ = reference.get_batch(np.arange(len(reference)), train=False)  # (raw - 0.5) / 0.5
    reference.std = (0.25,) * 3  # training data of half Digits-DG's std: (raw - 0.5) / 0.25, twice x_ref
    extra = load_extra_target(ExtraEvalConfig(name="f", dataset="folder", root=str(tmp_path / "f")), cfg, reference).dataset
    assert (extra.mean, extra.std) == ((0.5,) * 3, (0.25,) * 3)
    x_extra, _ = extra.get_batch(np.arange(len(extra)), train=False)
    sums = [np.sort(x.flatten(1).sum(1).numpy()) for x in (x_extra, 2 * x_ref)]  # the same images, in any order
    np.testing.assert_allclose(*sums, rtol=1e-5, atol=1e-4)
