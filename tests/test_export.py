"""`feddg export`: a built-in dataset written to DomainBed folders reads back pixel for pixel."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from feddg.cli import app
from feddg.data import load_dataset
from feddg.data.export import export_dataset
from feddg.data.folders import FolderDomainDataset
from feddg.data.tensor_dataset import TensorDomainDataset


def test_exported_digits_read_back_identical(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "digits"
    count = export_dataset("digits-dg", out, cache_dir=cache_dir, max_per_domain=25)
    builtin = load_dataset("digits-dg", cache_dir=cache_dir, max_per_domain=25)
    assert isinstance(builtin, TensorDomainDataset) and count == len(builtin) == 100
    card = json.loads((out / "feddg.json").read_text())
    assert card["image_size"] == 28 and card["transforms"]["preset"] == "none"
    folder = load_dataset("folder", root=str(out), cache_dir=tmp_path / "cache")
    assert isinstance(folder, FolderDomainDataset)
    assert folder.image_shape == (3, 28, 28) and not folder.spec.augments, "feddg.json: 28 px, no augmentation"
    assert sorted(folder.domains) == sorted(builtin.domains) and folder.classes == builtin.classes
    source = np.array([int(f.stem) for f in folder.files])  # file name = index in the built-in dataset
    assert sorted(source.tolist()) == list(range(len(builtin)))
    assert torch.equal(folder.images, builtin.images[source])
    assert np.array_equal(folder.labels, builtin.labels[source])
    assert [folder.domains[d] for d in folder.domain_ids] == [builtin.domains[d] for d in builtin.domain_ids[source]]
    idx = np.arange(0, len(folder), 3)
    g = torch.Generator().manual_seed(0)
    train_batch = folder.get_batch(idx, train=True, generator=g)[0]
    assert torch.equal(train_batch, builtin.get_batch(source[idx], train=False)[0])


def test_export_cli_refuses_a_non_empty_folder_and_non_builtins(tmp_path: Path, cache_dir: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = runner.invoke(app, ["export", "digits-dg", str(out), "--cache-dir", str(cache_dir)])
    assert res.exit_code == 2 and "not empty" in res.output
    res = runner.invoke(app, ["export", "pacs", str(tmp_path / "y")])
    assert res.exit_code == 2 and "only built-in datasets" in res.output
    assert "synthetic-mri as volumes" in res.output  # the CLI exports it too: the refusal names it
    res = runner.invoke(app, ["export", "colored-mnist", str(tmp_path / "c"), "--cache-dir", str(cache_dir),
                              "--max-per-domain", "6"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["+80%", "+90%", "-90%", "feddg.json"]


def test_a_grey_builtin_exports_grey_pngs_of_its_own_pixels(tmp_path: Path, cache_dir: Path) -> None:
    from PIL import Image

    from feddg.data.registry import BUILTINS

    out = tmp_path / "rot"
    builtin = load_dataset("rotated-mnist", cache_dir=cache_dir, max_per_domain=3)
    assert isinstance(builtin, TensorDomainDataset) and builtin.image_shape[0] == 1
    assert export_dataset("rotated-mnist", out, cache_dir=cache_dir, max_per_domain=3) == len(builtin)
    first = Image.open(out / builtin.domains[builtin.domain_ids[0]] / builtin.classes[builtin.labels[0]] /
                       f"{0:0{len(str(len(builtin) - 1))}d}.png")
    assert first.mode == "L" and np.array_equal(np.asarray(first), builtin.images[0, 0].numpy())
    card = json.loads((out / "feddg.json").read_text())["transforms"]
    mean, std = BUILTINS["rotated-mnist"].mean, BUILTINS["rotated-mnist"].std
    assert card["mean"] == [mean[0]] * 3 and card["std"] == [std[0]] * 3  # one grey channel, read back as RGB


def test_export_refuses_a_file_where_its_folder_goes(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "file"
    out.write_text("mine")
    with pytest.raises(FileExistsError, match=r"exists and is not empty$"):
        export_dataset("digits-dg", out, cache_dir=cache_dir, max_per_domain=2)
    assert out.read_text() == "mine"


def test_export_volumes_counts_the_volumes_not_their_masks_at_the_asked_size(tmp_path: Path) -> None:
    import nibabel

    from feddg.data.export import export_volumes
    from feddg.data.prostate import SITES

    out = tmp_path / "mri"
    assert export_volumes(out, image_size=16) == len(SITES) * 8  # export_nifti's 8 cases a site
    assert nibabel.load(out / "UCL" / "Case00.nii.gz").shape[:2] == (16, 16)
