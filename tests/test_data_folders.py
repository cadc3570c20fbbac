"""Tests of folder datasets (root/<domain>/<class>/<image>) and their one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from feddg.cli import app
from feddg.data import dataset_info, load_dataset
from feddg.data.folders import PRESETS, FolderDomainDataset
from feddg.data.inspect import check_dataset

LAYOUT = "root/<domain>/<class>/<image>"
PACS = PRESETS["pacs"]


@pytest.fixture(autouse=True)
def _image_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Folder datasets cache their decoded images under $FEDDG_CACHE: keep each test's apart."""
    monkeypatch.setenv("FEDDG_CACHE", str(tmp_path / "cache"))


def _png(path: Path, colour: tuple[int, int, int], size: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), colour).save(path)


def make_tree(root: Path, domains: tuple[str, ...] | list[str], classes: tuple[str, ...] | list[str],
              per_class: int = 2) -> Path:
    """``root/<domain>/<class>/<i>.png``, each image a flat colour coding (domain, class, i)."""
    for d, dom in enumerate(domains):
        for k, cls in enumerate(classes):
            for i in range(per_class):
                _png(root / dom / cls / f"{i}.png", (40 * d, 30 * k, 100 + 50 * i))
    return root


def _one_line_error(exc: pytest.ExceptionInfo[BaseException], *fragments: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    assert LAYOUT in msg, msg
    for f in fragments:
        assert f in msg, msg
    return msg


def test_generic_folder_discovers_domains_and_classes(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data", ["b_dom", "a_dom"], ["zebra", "cat"], per_class=3)
    (root / "a_dom" / "cat" / "notes.txt").write_text("not an image")
    ds = load_dataset("folder", root=str(root), image_size=16)
    assert isinstance(ds, FolderDomainDataset)
    assert ds.domains == ["a_dom", "b_dom"] and ds.classes == ["cat", "zebra"]
    assert len(ds) == 12 and ds.image_shape == (3, 16, 16)
    assert ds.counts() == {"a_dom": {"cat": 3, "zebra": 3}, "b_dom": {"cat": 3, "zebra": 3}}
    for i in range(len(ds)):
        f = ds.files[i]
        assert ds.domains[ds.domain_ids[i]] == f.parent.parent.name and ds.classes[ds.labels[i]] == f.parent.name


def test_get_batch_eval_and_train(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data", ["a", "b"], ["x", "y"])
    ds = load_dataset("folder", root=str(root), image_size=12)
    idx = np.array([0, 3, 5])
    x, y = ds.get_batch(idx, train=False)
    assert x.shape == (3, 3, 12, 12) and x.dtype == torch.float32
    assert torch.equal(y, torch.from_numpy(ds.labels[idx]))
    colour = torch.tensor(Image.open(ds.files[3]).getpixel((0, 0)), dtype=torch.float32) / 255
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    assert torch.allclose(x[1, :, 0, 0], (colour - mean) / std, atol=1e-5)
    a, _ = ds.get_batch(idx, train=True, generator=torch.Generator().manual_seed(0))
    b, _ = ds.get_batch(idx, train=True, generator=torch.Generator().manual_seed(0))
    assert a.shape == x.shape and torch.equal(a, b)


def test_pacs_preset_and_domain_subset(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "PACS", PACS.domains, PACS.classes, per_class=1)
    ds = load_dataset("pacs", root=str(root), image_size=8)
    assert ds.domains == list(PACS.domains) and ds.classes == list(PACS.classes) and len(ds) == 28
    only = make_tree(tmp_path / "partial", ["sketch", "photo"], ["dog", "horse"], per_class=2)
    sub = load_dataset("pacs", root=str(only), domains=["sketch", "photo"], image_size=8)
    assert sub.domains == ["sketch", "photo"] and sub.num_classes == 7
    assert sub.counts()["sketch"] == {c: (2 if c in ("dog", "horse") else 0) for c in PACS.classes}


def test_max_per_domain(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data", ["a", "b"], ["x", "y"], per_class=5)
    ds = load_dataset("folder", root=str(root), max_per_domain=4, seed=0)
    assert ds.counts() == {"a": {"x": 2, "y": 2}, "b": {"x": 2, "y": 2}}
    again = load_dataset("folder", root=str(root), max_per_domain=4, seed=0)
    assert ds.files == again.files


def test_domainnet_discovers_classes(tmp_path: Path) -> None:
    domains = PRESETS["domainnet"].domains
    root = make_tree(tmp_path / "dn", domains, ["aircraft_carrier", "zebra", "apple"], per_class=1)
    ds = load_dataset("domainnet", root=str(root), image_size=8)
    assert ds.classes == ["aircraft_carrier", "apple", "zebra"] and ds.domains == list(domains)


def test_preset_info() -> None:
    assert dataset_info("pacs")["classes"] == ["dog", "elephant", "giraffe", "guitar", "horse", "house", "person"]
    oh = dataset_info("office-home")
    assert oh["domains"] == ["Art", "Clipart", "Product", "Real_World"] and oh["num_classes"] == 65
    assert len(set(oh["classes"])) == 65
    assert dataset_info("vlcs")["domains"] == ["Caltech101", "LabelMe", "SUN09", "VOC2007"]
    assert dataset_info("terra-incognita")["num_classes"] == 10
    assert dataset_info("domainnet")["num_classes"] == 345 and dataset_info("domainnet")["classes"] == []
    assert dataset_info("office-caltech10")["domains"] == ["amazon", "caltech", "dslr", "webcam"]
    folder = dataset_info("folder")
    assert folder["needs_root"] and folder["domains"] == [] and folder["num_classes"] is None


def test_error_missing_root(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError) as exc:
        load_dataset("pacs", root=str(missing))
    _one_line_error(exc, str(missing))


def test_error_missing_domain_folder(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "PACS", ["art_painting", "cartoon", "photo"], ["dog"])
    with pytest.raises(FileNotFoundError) as exc:
        load_dataset("pacs", root=str(root))
    _one_line_error(exc, str(root / "sketch"), "missing")


def test_error_images_directly_in_domain_folder(tmp_path: Path) -> None:
    root = tmp_path / "flat"
    for dom in ("a", "b"):
        _png(root / dom / "img0.png", (1, 2, 3))
    with pytest.raises(ValueError) as exc:
        load_dataset("folder", root=str(root))
    _one_line_error(exc, str(root / "a" / "img0.png"))


def test_error_no_domain_folders(tmp_path: Path) -> None:
    _png(tmp_path / "img.png", (1, 2, 3))
    with pytest.raises(ValueError) as exc:
        load_dataset("folder", root=str(tmp_path))
    _one_line_error(exc, str(tmp_path), "no domain folders")


def test_error_empty_domain(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data", ["a"], ["x"])
    (root / "b" / "x").mkdir(parents=True)
    (root / "b" / "x" / "readme.txt").write_text("no images here")
    with pytest.raises(ValueError) as exc:
        load_dataset("folder", root=str(root))
    _one_line_error(exc, str(root / "b"), "no images")


def test_error_unknown_class_folder(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "PACS", PACS.domains, ["dog"], per_class=1)
    _png(root / "cartoon" / "dogs" / "0.png", (0, 0, 0))
    with pytest.raises(ValueError) as exc:
        load_dataset("pacs", root=str(root))
    _one_line_error(exc, str(root / "cartoon" / "dogs"), "unknown class folder")


def test_error_corrupt_image_names_file_at_load(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data", ["a", "b"], ["x"], per_class=2)
    bad = root / "b" / "x" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    with pytest.raises(ValueError) as exc:
        load_dataset("folder", root=str(root))
    _one_line_error(exc, str(bad), "cannot read image", "--check")
    assert not list((tmp_path / "cache").rglob("*.npy")), "no cache is left behind by a failed build"


def test_error_misspelled_class_folder_in_discovered_classes(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data", ["a", "b", "c"], ["cat", "dog"], per_class=1)
    (root / "b" / "dog").rename(root / "b" / "dgo")
    with pytest.raises(ValueError) as exc:
        load_dataset("folder", root=str(root))
    _one_line_error(exc, str(root / "b" / "dgo"), "misspelling of dog", "1 more")


def test_error_unknown_class_folder_suggests_the_preset_name(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "PACS", PACS.domains, ["dog", "horse"], per_class=1)
    (root / "cartoon" / "dog").rename(root / "cartoon" / "dgo")
    with pytest.raises(ValueError) as exc:
        load_dataset("pacs", root=str(root))
    _one_line_error(exc, str(root / "cartoon" / "dgo"), "did you mean dog?")


def test_error_class_missing_from_one_domain_and_empty_class(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data", ["a", "b"], ["cat", "zebra"], per_class=1)
    for p in (root / "b" / "zebra").iterdir():
        p.unlink()
    (root / "b" / "zebra").rmdir()
    with pytest.raises(ValueError) as exc:
        load_dataset("folder", root=str(root))
    _one_line_error(exc, str(root / "b" / "zebra"), "missing")
    (root / "b" / "zebra").mkdir()
    with pytest.raises(ValueError) as exc:
        load_dataset("folder", root=str(root))
    _one_line_error(exc, str(root / "b" / "zebra"), "has no images")


def test_images_in_hidden_subfolders_are_not_samples(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data", ["a", "b"], ["cat", "dog"], per_class=2)
    _png(root / "a" / "cat" / "nested" / "2.png", (9, 9, 9))  # an ordinary sub-folder still counts
    _png(root / "a" / "cat" / ".ipynb_checkpoints" / "0-checkpoint.png", (1, 1, 1))
    (root / "b" / "dog" / ".thumbs" / "deep").mkdir(parents=True)
    (root / "b" / "dog" / ".thumbs" / "deep" / "0.png").write_bytes(b"not an image")
    ds = load_dataset("folder", root=str(root), image_size=8)
    assert len(ds) == 9 and root / "a" / "cat" / "nested" / "2.png" in ds.files
    assert not any(part.startswith(".") for f in ds.files for part in f.relative_to(root).parts)
    assert check_dataset("folder", root=str(root)) == []


def test_check_lists_every_problem(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data", ["a", "b", "c"], ["cat", "dog"], per_class=2)
    (root / "b" / "dog").rename(root / "b" / "dgo")
    bad = [root / "c" / "cat" / "broken.png", root / "a" / "dog" / "cut.png"]
    bad[0].write_bytes(b"not an image at all")
    _png(bad[1], (1, 2, 3), size=64)
    bad[1].write_bytes(bad[1].read_bytes()[:60])  # truncated: the header opens, the pixels do not
    problems = check_dataset("folder", root=str(root))
    assert len(problems) == 4, problems
    assert any("b/dgo" in p and "misspelling of dog" in p for p in problems)
    assert any(str(root / "b" / "dog") in p and "missing" in p for p in problems)
    for path in bad:
        assert any(p.startswith(f"cannot read image {path}") for p in problems), (path, problems)
    assert check_dataset("folder", root=str(make_tree(tmp_path / "ok", ["a"], ["x"]))) == []


def test_cli_check_exit_codes_and_image_size(tmp_path: Path) -> None:
    runner = CliRunner()
    root = make_tree(tmp_path / "data", ["a", "b"], ["cat", "dog"], per_class=2)
    ok = runner.invoke(app, ["datasets", "folder", "--root", str(root), "--check", "--image-size", "64"])
    assert ok.exit_code == 0, ok.output
    assert "no problems" in ok.output and "shape (3, 64, 64)" in ok.output
    assert "shape (3, 224, 224)" in runner.invoke(app, ["datasets", "folder", "--root", str(root)]).output
    (root / "a" / "cat" / "0.png").write_bytes(b"garbage")
    bad = runner.invoke(app, ["datasets", "folder", "--root", str(root), "--check"])
    assert bad.exit_code == 1 and f"cannot read image {root / 'a' / 'cat' / '0.png'}" in bad.output, bad.output
    assert not list((tmp_path / "cache").rglob("*.npy")), "datasets NAME scans, it does not decode"


def test_error_unknown_domain_and_missing_root_argument(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data", ["a"], ["x"])
    with pytest.raises(ValueError, match=r"bad domains \['c'\]"):
        load_dataset("folder", root=str(root), domains=["c"])
    with pytest.raises(ValueError, match="needs root"):
        load_dataset("office-home")


def test_a_preset_class_without_any_folder_is_a_check_problem_and_a_load_warning(tmp_path: Path, caplog) -> None:
    """A PACS copy without person/ anywhere loaded with a dead output while --check said every domain has every
    class; a partial copy still loads (the earlier test), now with one warning line."""
    root = make_tree(tmp_path / "PACS", PACS.domains, [c for c in PACS.classes if c != "person"], per_class=1)
    problems = check_dataset("pacs", root=str(root))
    assert problems == [f"pacs: class(es) person of the preset have no folder in any domain under {root}: the model "
                        "keeps their outputs, no sample trains or tests them"]
    with caplog.at_level("WARNING"):
        ds = load_dataset("pacs", root=str(root), image_size=8)
    assert len(ds) == 24 and "class(es) person of the preset have no folder" in caplog.text


def test_images_behind_symlinked_folders_are_read_and_a_dangling_link_is_a_problem(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "data", ["a", "b"], ["x"], per_class=1)
    _png(tmp_path / "elsewhere" / "batch2" / "1.png", (7, 7, 7))
    (root / "a" / "x" / "batch2").symlink_to(tmp_path / "elsewhere" / "batch2", target_is_directory=True)
    (root / "a" / "x" / "batch2" / "loop").symlink_to(root / "a", target_is_directory=True)  # walked once, no cycle
    ds = load_dataset("folder", root=str(root), image_size=8)
    assert root / "a" / "x" / "batch2" / "1.png" in ds.files and len(ds) == 3
    (root / "b" / "x" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    assert check_dataset("folder", root=str(root)) == [
        f"image {root / 'b' / 'x' / 'gone.png'} is a link to nothing ({tmp_path / 'nowhere.png'})"]


def test_a_16_bit_image_is_refused_not_saturated(tmp_path: Path) -> None:
    """PIL's convert("RGB") clips I;16 pixels at 255 (a mid-grey 16-bit image read as white)."""
    root = make_tree(tmp_path / "data", ["a", "b"], ["x"], per_class=1)
    deep = root / "b" / "x" / "deep.png"
    Image.fromarray(np.full((8, 8), 30000, dtype=np.uint16)).save(deep)
    assert Image.open(deep).mode.startswith("I")
    assert check_dataset("folder", root=str(root)) == [
        f"cannot read image {deep}: ValueError: a {Image.open(deep).mode} image (16-bit, 32-bit or float): feddg reads "
        "8-bit images, convert it first"]
    with pytest.raises(ValueError, match="deep.png"):
        load_dataset("folder", root=str(root), image_size=8)
