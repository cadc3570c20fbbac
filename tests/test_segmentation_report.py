"""Segmentation overlays: ``examples/<site>.png`` at the end of a run (image, ground truth, prediction), in
report.html's Examples section; none for classification."""

from __future__ import annotations

import re
import struct
from pathlib import Path
from types import SimpleNamespace

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from PIL import Image
from toy import toy_federation

from feddg.config import build_config
from feddg.data.slices import SliceDataset
from feddg.engines.inprocess import run_inprocess
from feddg.evaluation.overlays import example_path
from feddg.experiment import RUN_FILES, clear_run_dir, run_experiment
from feddg.federation.examples import final_predictor, write_examples
from feddg.federation.server import Server
from feddg.messages import load_weights
from feddg.reports.run import report
from feddg.tasks.classification import Classification
from feddg.tasks.segmentation import Segmentation, example_slices

SEG = {"data": {"dataset": "synthetic-mri", "max_per_domain": 12, "image_size": 32},
       "split": {"target": "BIDMC"}, "partition": {"kind": "by_domain", "num_clients": 5, "holdout": 0.25},
       "model": {"name": "unet", "params": {"width": 4}}, "method": {"name": "fedavg"},
       "optim": {"name": "adam", "lr": 0.003, "weight_decay": 0.0},
       "federation": {"rounds": 1, "local_epochs": 1, "batch_size": 8}, "device": "cpu"}
DIGITS = {"data": {"dataset": "digits-dg", "max_per_domain": 20}, "partition": {"kind": "by_domain", "num_clients": 3},
          "model": {"name": "lenet"}, "federation": {"rounds": 1, "batch_size": 32}, "split": {"target": "uci"},
          "device": "cpu"}
PNG = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path_factory, cache_dir, spec) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("run") / "r"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FEDDG_CACHE", str(cache_dir))
        results = run_experiment(build_config(spec), out, progress=False)
    return out, results


@pytest.fixture(scope="module")
def seg_run(tmp_path_factory, cache_dir) -> tuple[Path, dict]:
    return _run(tmp_path_factory, cache_dir, SEG)


def _sites(results: dict) -> list[str]:
    return [*results["source"], *results["val_domain"], *results["target"]]


def test_a_segmentation_run_writes_one_overlay_png_per_site(seg_run):
    run_dir, results = seg_run
    sites = _sites(results)
    assert len(sites) == 6
    assert (run_dir / "results.json").is_file()
    assert sorted(p.name for p in (run_dir / "examples").iterdir()) == sorted(example_path(run_dir, s).name
                                                                              for s in sites)
    for site in sites:
        path = example_path(run_dir, site)
        raw = path.read_bytes()
        assert raw[:8] == PNG
        width, height = struct.unpack(">II", raw[16:24])  # the IHDR chunk
        rows = min(4, results["counts"][f"{'ood' if site in results['target'] else 'id'}_dice/{site}"])
        assert 500 < width < 2000 and height / width == pytest.approx((2.5 * rows + 0.4) / 7.2, rel=0.02)
        with Image.open(path) as img:
            img.load()  # a truncated or corrupt PNG raises
        assert 10_000 < len(raw) < 1_000_000


def test_the_report_shows_the_overlays_in_an_examples_section(seg_run):
    run_dir, results = seg_run
    html = report(run_dir)[0].read_text()
    assert "<h2>Examples</h2>" in html and 'href="#examples"' in html
    section = html.split('<section id="examples">')[1].split("</section>")[0]
    imgs = re.findall(r'<img src="data:image/png;base64,[^"]+" alt="([^"]+)">', section)
    assert sorted(imgs) == sorted(_sites(results))
    captions = re.findall(r"<figcaption>([^<]+)</figcaption>", section)
    assert len(captions) == 6 and all(c.split(" (")[0] == site for c, site in zip(captions, imgs, strict=True))
    assert "(ood, Dice " in section  # the held-out site's caption: its role and figure
    assert imgs.index(results["target"][0]) == 5  # the table's order: the id sites, then the held-out one
    assert "accuracy" not in html.lower()
    assert "chance level" not in html  # Dice has no chance line


def test_a_classification_run_writes_no_examples(tmp_path_factory, cache_dir):
    run_dir, _ = _run(tmp_path_factory, cache_dir, DIGITS)
    assert (run_dir / "results.json").is_file()
    assert not (run_dir / "examples").exists()
    assert '<section id="examples">' not in report(run_dir)[0].read_text()


def test_overwrite_clears_the_examples_folder(tmp_path):
    assert "examples" in RUN_FILES
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "a.png").write_bytes(PNG)
    (tmp_path / "notes.txt").write_text("mine")
    assert clear_run_dir(tmp_path) == ["notes.txt"]
    assert not (tmp_path / "examples").exists()


def _slices(n: int = 6, size: int = 8) -> SliceDataset:
    """``n`` slices of one site: slice i has a 2×2 foreground square unless i is 0 or 3 (empty)."""
    g = np.random.default_rng(0)
    images = g.integers(0, 256, size=(n, 3, size, size), dtype=np.uint8)
    masks = np.zeros((n, size, size), dtype=np.uint8)
    for i in range(n):
        if i not in (0, 3):
            masks[i, 2:4, 2:4] = 1
    return SliceDataset("hand", images, masks, np.zeros(n, dtype=np.int64), np.arange(n) // 2, ["site a"],
                        (0.5,) * 3, (0.5,) * 3)


def _logits(pred: np.ndarray) -> torch.Tensor:
    """Two-class outputs whose argmax is ``pred`` ``[B, H, W]``."""
    p = torch.from_numpy(pred).float()
    return torch.stack([1.0 - p, p], dim=1)


def test_the_hook_draws_the_slices_with_their_own_dice():
    ds = _slices()
    seen = []

    def predict(indices: np.ndarray) -> torch.Tensor:  # predicts the columns 2..4 of rows 2..3: 4 px, 2 of them true
        seen.append(indices.copy())
        pred = np.zeros((len(indices), 8, 8), dtype=np.int64)
        pred[:, 2:4, 3:5] = 1
        return _logits(pred)

    figs = Segmentation(2).examples(ds, {"site a": np.arange(6)[::-1]}, predict, per_site=3)
    assert list(figs) == ["site a"]
    fig = figs["site a"]
    assert [i.tolist() for i in seen] == [[1, 4, 5]]  # evenly spaced over the slices with foreground (1, 2, 4, 5)
    axes = np.array(fig.axes).reshape(3, 3)
    # Dice = 2·|P∩T| / (|P| + |T|) = 2·2 / (4 + 4) = 50 %, on every slice
    assert [ax.get_title() for ax in axes[:, 2]] == ["prediction · Dice 50.0 %"] * 3
    assert [ax.get_title() for ax in axes[:, 0]] == ["slice 1 (case 0)", "slice 4 (case 2)", "slice 5 (case 2)"]
    shown = np.asarray(axes[1, 0].images[0].get_array())
    assert np.allclose(shown, ds.images[4, 1] / 255.0, atol=1e-6)  # the centre channel, de-normalised
    plt.close(fig)


def test_the_hook_scores_a_perfect_and_an_empty_prediction():
    ds = _slices()

    def predict(indices: np.ndarray) -> torch.Tensor:  # slice 1 exactly right, slice 2 nothing predicted
        pred = ds.masks[indices].astype(np.int64)
        pred[indices == 2] = 0
        return _logits(pred)

    fig = Segmentation(2).examples(ds, {"site a": np.array([1, 2])}, predict)["site a"]
    assert [ax.get_title() for ax in fig.axes[2::3]] == ["prediction · Dice 100.0 %", "prediction · Dice 0.0 %"]
    plt.close(fig)


def test_examples_fall_back_to_empty_slices_and_classification_draws_none():
    ds = _slices()
    assert example_slices(ds, np.array([3, 0]), 4).tolist() == [0, 3]  # no foreground anywhere: all of them
    assert Classification(2).examples(ds, {"site a": np.arange(6)}, lambda i: torch.zeros(len(i), 2)) == {}


def test_the_predictor_uses_each_clients_own_model_on_its_holdout(tmp_path):
    server = Server(toy_federation("method.name=local", "partition.num_clients=2", "federation.rounds=1"),
                    tmp_path / "run")
    run_inprocess(server)
    fed = server.fed
    predict = final_predictor(server)
    for who, idx in [(0, fed.clients[0].holdout_idx), (1, fed.clients[1].holdout_idx), (None, fed.split.test_idx)]:
        load_weights(fed.model, fed.method.eval_weights(server.state, who))
        with torch.no_grad():
            expect = fed.model.eval()(fed.dataset.get_batch(idx, train=False)[0])
        assert torch.allclose(predict(idx), expect)
    mixed = np.concatenate([fed.clients[1].holdout_idx[:2], fed.split.test_idx[:2], fed.clients[0].holdout_idx[:2]])
    parts = [predict(mixed[i:i + 2]) for i in (0, 2, 4)]
    assert torch.allclose(predict(mixed), torch.cat(parts))  # each sample keeps its own model in a mixed batch
    load_weights(fed.model, fed.method.eval_weights(server.state, 1))
    with torch.no_grad():
        other = fed.model.eval()(fed.dataset.get_batch(fed.clients[0].holdout_idx, train=False)[0])
    assert not torch.allclose(predict(fed.clients[0].holdout_idx), other)  # the clients' models differ


def test_a_failing_figure_is_one_warning_and_never_an_error(caplog):
    broken = SimpleNamespace(fed=SimpleNamespace(task=Segmentation(2)), run_dir=Path("/nonexistent"))
    with caplog.at_level("WARNING"):
        assert write_examples(broken) == []  # type: ignore[arg-type]
    assert [(r.levelname, r.getMessage().split(":")[0]) for r in caplog.records] == [("WARNING", "examples/ not written")]
    assert "\n" not in caplog.records[0].getMessage()
