"""The prostate datasets by name: `feddg datasets --check` and `feddg export` on the SAML layout, `load_dataset`'s
options, refusals, and clients whose holdouts are whole cases with FedFA's mini training fraction."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from feddg.cli import app
from feddg.config import build_config
from feddg.data import load_dataset
from feddg.data.synthetic_mri import export_nifti
from feddg.federation.setup import make_clients, make_split


@pytest.fixture(scope="module")
def saml(tmp_path_factory) -> Path:
    """The synthetic sites written as NIfTI: 6 sites × 3 cases of 6 slices at 32 px."""
    return export_nifti(tmp_path_factory.mktemp("saml") / "prostate", cases=3, depth=6, size=32)


def _invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_check_passes_then_names_a_missing_mask_in_one_line(saml, tmp_path):
    ok = _invoke("datasets", "prostate", "--root", str(saml), "--check", "--cache-dir", str(tmp_path))
    assert ok.exit_code == 0 and "no problems in prostate" in ok.output and "cases" in ok.output, ok.output
    mask = saml / "UCL" / "Case01_segmentation.nii.gz"
    kept = mask.read_bytes()
    mask.unlink()
    try:
        res = _invoke("datasets", "prostate", "--root", str(saml), "--check")
    finally:
        mask.write_bytes(kept)
    problems = [line for line in res.output.splitlines() if line.startswith("problem:")]
    assert res.exit_code == 1 and len(problems) == 1 and "Case01" in problems[0] and "UCL" in problems[0], res.output


def test_export_writes_the_layout_and_refuses_a_folder_in_use(tmp_path):
    out = tmp_path / "mri"
    res = _invoke("export", "synthetic-mri", str(out), "--image-size", "32")
    assert res.exit_code == 0 and "48 NIfTI volumes" in res.output, res.output
    assert (out / "ISBI_1.5" / "Case00_Segmentation.nii.gz").is_file() and (out / "HK" / "Case07_segmentation.nii.gz").is_file()
    again = _invoke("export", "synthetic-mri", str(out))
    assert again.exit_code != 0 and "not empty" in again.output


def test_load_dataset_selects_sites_in_order_and_caps_slices(saml, tmp_path):
    ds = load_dataset("prostate", root=str(saml), cache_dir=tmp_path, image_size=32, domains=["UCL", "HK"],
                      max_per_domain=5)
    assert ds.domains == ["UCL", "HK"] and ds.task == "segmentation" and ds.image_shape == (3, 32, 32)
    assert np.bincount(ds.domain_ids).tolist() == [5, 5]
    with pytest.raises(ValueError, match="prostate takes data.transforms hflip or rot90_flip, got 'none'"):
        load_dataset("prostate", root=str(saml), cache_dir=tmp_path, image_size=32, transforms="none")
    rotated = load_dataset("prostate", root=str(saml), cache_dir=tmp_path, image_size=32, transforms="rot90_flip")
    assert ds.augment == "hflip" and rotated.augment == "rot90_flip"
    assert rotated.subset(np.arange(3), rotated.domains).augment == "rot90_flip"  # clients' subsets keep it
    with pytest.raises(ValueError, match="'rot90_flip' is a segmentation slices' augmentation"):
        load_dataset("digits-dg", cache_dir=tmp_path, transforms="rot90_flip")
    with pytest.raises(ValueError, match="prostate needs root="):
        load_dataset("prostate")
    with pytest.raises(ValueError, match="synthetic-mri is built in and takes no root"):
        load_dataset("synthetic-mri", root=str(saml))


def test_clients_hold_out_whole_cases_and_keep_the_mini_fraction(saml, tmp_path):
    ds = load_dataset("prostate", root=str(saml), cache_dir=tmp_path, image_size=32)
    cfg = build_config({"data": {"dataset": "prostate", "root": str(saml)}, "model": {"name": "unet"}},
                       ["split.target=BIDMC", "partition.num_clients=5", "partition.holdout=0.34",
                        "partition.train_fraction=0.2", "partition.train_min=4"])
    split = make_split(ds, cfg)
    full = make_clients(ds, split, build_config({"data": {"dataset": "prostate", "root": str(saml)},
                                                 "model": {"name": "unet"}},
                                                ["split.target=BIDMC", "partition.num_clients=5",
                                                 "partition.holdout=0.34"]))
    for client, whole in zip(make_clients(ds, split, cfg), full, strict=True):
        assert not set(ds.cases[client.holdout_idx]) & set(ds.cases[whole.train_idx])  # no case on both sides
        assert len(np.unique(ds.cases[client.holdout_idx])) == 1  # floor(0.34 × 3 cases)
        assert len(client.train_idx) == max(round(0.2 * len(whole.train_idx)), min(4, len(whole.train_idx)))
        assert set(client.train_idx) <= set(whole.train_idx)
