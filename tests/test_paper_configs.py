"""configs/<method>/paper-*.yaml: every variant validates, and each config's last variant (the paper's method)
runs one round at toy size on a generated folder with its preset's domain and class names."""

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support.natural_fixtures import cifar_batches, iwildcam_tree, leaf_blob, tiny_imagenet_tree, write_json

from feddg.config import build_config, read_yaml
from feddg.data import load_dataset
from feddg.data.registry import dataset_info
from feddg.data.synthetic_mri import export_nifti
from feddg.experiment import run_experiment

ROOT = Path(__file__).parent.parent
CONFIGS = sorted(ROOT.glob("configs/*/paper-*.yaml"))
PER_CLASS = 2  # images per (domain, class)
_ran: dict[str, str] = {}  # method, hierarchy, protocol -> the config file that already ran them


def test_every_paper_table_has_a_config():
    names = {f"{p.parent.name}/{p.stem}" for p in CONFIGS}
    assert {"hfedatm/paper-table1", "hfedatm/paper-table2", "hfedatm/paper-table4", "hfedf/paper-table2-pacs",
            "hfedf/paper-table3", "hfedf/paper-table4", "hfedf/paper-table5", "fedfa/paper-table3",
            "fedfa/paper-table6", "fedfa/paper-table10", "pardon/paper-table1", "pardon/paper-table2",
            "pardon/paper-table5", "hfedatm/paper-fig2", "fedfa/paper-table4", "fedfa/paper-fig3",
            "fedfa/paper-table6-prostate", "hfedatm/paper-amazon", "hfedatm/paper-amazon-privacy",
            "fedfa/paper-table5-cifar10-dir0.6", "fedfa/paper-table5-cifar10-dir0.3", "fedfa/paper-table5-tinyimagenet-dir0.6",
            "fedfa/paper-table5-tinyimagenet-dir0.3", "fedfa/paper-table5-femnist", "fedfa/paper-table10-dac-sc",
            "pardon/paper-table3", "fedfa/paper-table5-cifar10-swin"} <= names
    for path in CONFIGS:
        assert path.read_text().startswith("# ") and "Table" in path.read_text().splitlines()[0], path


def _load(path: Path) -> tuple[dict, dict]:
    raw = read_yaml(path)
    return raw.pop("sweep"), raw


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_variant_validates(path):
    sweep, raw = _load(path)
    for name, over in sweep["variants"].items():
        cfg = build_config(raw, [f"{k}={json.dumps(v)}" for k, v in over.items()])
        assert cfg.data.root is None, name  # the user points at their copy of the dataset


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """root/<domain>/<class>/<i>.png for each preset the paper configs use (8 px noise images)."""
    base, rng, roots = tmp_path_factory.mktemp("presets"), np.random.default_rng(0), {}
    for name in ("pacs", "office-home", "vlcs", "office-caltech10"):
        info = dataset_info(name)
        for d in info["domains"]:
            for c in info["classes"]:
                folder = base / name / d / c
                folder.mkdir(parents=True)
                for i in range(PER_CLASS):
                    Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.png")
        roots[name] = base / name
    roots["prostate"] = export_nifti(base / "prostate", cases=2, depth=4, size=32)  # the SAML layout, 2 cases a site
    roots["amazon-reviews"] = _amazon_raw(base / "amazon")
    cifar_batches(base / "cifar" / "cifar-10-batches-py")
    roots["cifar10"] = base / "cifar"
    tiny_imagenet_tree(roots.setdefault("tiny-imagenet", base / "tiny-imagenet"))
    for split, users in (("train", ("w1", "w2", "w3")), ("test", ("w1", "w2"))):  # LEAF's split files, 3 writers
        write_json(base / "femnist" / split / "all.json", leaf_blob({u: ([0.2, 0.7, 0.4], [1, 2, 3]) for u in users}))
    roots["femnist"] = base / "femnist"
    roots["iwildcam"] = iwildcam_tree(base / "iwildcam")  # WILDS' metadata.csv and JPEGs: 4 training locations
    return roots


def _amazon_raw(root: Path) -> Path:
    """Blitzer et al.'s raw layout, root/<domain>/{positive,negative}.review, PER_CLASS × 3 reviews a file."""
    for d in dataset_info("amazon-reviews")["domains"]:
        for label in ("positive", "negative"):
            reviews = "".join(f"<review>\n<review_text>\n{d} {label} review {i} of a product\n</review_text>\n"
                              "</review>\n" for i in range(3 * PER_CLASS))
            (root / d).mkdir(parents=True, exist_ok=True)
            (root / d / f"{label}.review").write_text(reviews)
    return root


def _tiny(cfg_raw: dict, root: Path, cache: Path) -> list[str]:
    """Overrides that shrink a paper config to one round of LeNet on 28 px images."""
    over = [f"data.root={root}", f"data.cache_dir={cache}", "federation.rounds=1", "federation.local_epochs=1",
            "federation.batch_size=8", "eval.every=1", "device=cpu"]
    if dataset_info(cfg_raw["data"]["dataset"])["inputs"] == "tokens":  # the tiny RoBERTa, a BPE trained on the fixture
        over += ["model.name=tiny-roberta", "model.path=null", "data.max_length=16", "data.vocab_size=300"]
    elif cfg_raw["data"]["dataset"] == "prostate":  # a U-Net at 32 px on 2 cases a site, its fixed transforms
        over += ["data.image_size=32", "model.params={width: 4}", "partition.holdout=0.5", "partition.train_min=0"]
    elif cfg_raw["model"].get("params", {}).get("normalization") == "dac_sc":  # DAC-SC is the ResNet: keep it, 8 px
        over += ["data.image_size=8", "data.transforms=none"]
    elif cfg_raw["model"]["name"] == "swin_t":  # the small Swin at 32 px (patch 1, window 4)
        over += ["data.image_size=32", "data.transforms=none", "model.name=swin_tiny_test"]
    else:
        over += ["data.image_size=28", "data.transforms=none", "model.name=lenet", "model.params={}"]
    if cfg_raw["partition"]["kind"] == "lambda":
        over += ["partition.num_clients=4", "federation.client_fraction=1.0"]
    if cfg_raw["partition"]["kind"] == "dirichlet_labels":  # a handful of fixture samples
        over += ["partition.num_clients=2", "federation.client_fraction=1.0"]
    if cfg_raw["partition"]["kind"] == "natural":  # the fixture's 3 writers
        over += ["federation.client_fraction=1.0"]
    if cfg_raw.get("hierarchy"):
        over += ["hierarchy.stations=2", "hierarchy.station_rounds=1"]
    if cfg_raw.get("split", {}).get("protocol") == "ltdo" and not cfg_raw["split"].get("val_domain"):
        domains = dataset_info(cfg_raw["data"]["dataset"])["domains"]
        over += [f"split.val_domain={domains[0]}", f"split.target={domains[1]}"]
    return over


@pytest.mark.parametrize("name", ["pacs", "office-home", "vlcs", "office-caltech10"])
def test_the_fixture_folders_load_as_their_preset(name, folders, tmp_path):
    ds = load_dataset(name, root=folders[name], cache_dir=tmp_path, image_size=8)
    info = dataset_info(name)
    assert ds.domains == info["domains"] and ds.classes == info["classes"]
    assert len(ds) == len(info["domains"]) * len(info["classes"]) * PER_CLASS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_last_variant_runs_one_tiny_round(path, folders, tmp_path):
    sweep, raw = _load(path)
    variant, over = list(sweep["variants"].items())[-1]
    over = [f"{k}={json.dumps(v)}" for k, v in over.items()]
    cfg = build_config(raw, over + _tiny(raw, folders[raw["data"]["dataset"]], tmp_path / "cache"))
    key = (f"{cfg.method.name} {cfg.hierarchy is not None} {cfg.split.protocol} {cfg.data.dataset} {cfg.model.name} "
           f"{cfg.model.params.get('normalization')}")
    if key in _ran:  # one run per code path
        pytest.skip(f"{variant}: the same run as {_ran[key]}")
    _ran[key] = path.name
    results = run_experiment(cfg, tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "results.json").is_file()
    metric = results["task"]["metric"]
    headline = f"id_{metric}" if cfg.split.protocol == "federated" else f"ood_{metric}"
    assert 0.0 <= results["final"][headline] <= 100.0
