"""``feddg methods`` from its cache (src/feddg/catalog.py): the same listing warm as cold, rebuilt when a source
changes, and a warm call (and ``import feddg.cli``) imports no torch."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import feddg.catalog
from feddg.catalog import build_catalog, catalog, user_cache_dir
from feddg.cli import app


@pytest.fixture
def sources(tmp_path, monkeypatch) -> Path:
    """A frozen copy of feddg's sources as the digest's root (the real tree is edited while tests run), and an
    empty cache folder."""
    root = tmp_path / "src"
    shutil.copytree(feddg.catalog.PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(feddg.catalog, "PACKAGE", root)
    monkeypatch.setenv("FEDDG_CACHE", str(tmp_path / "cache"))
    return root


def _methods() -> str:
    res = CliRunner().invoke(app, ["methods"], terminal_width=200)
    assert res.exit_code == 0, res.output
    return res.output


def _refuse() -> dict:
    raise AssertionError("the listing was rebuilt")


def test_a_warm_listing_prints_what_a_cold_one_does(sources, tmp_path, monkeypatch):
    cold = _methods()
    assert len(list((tmp_path / "cache" / "methods").glob("*.json"))) == 1
    monkeypatch.setattr(feddg.catalog, "build_catalog", _refuse)
    assert _methods() == cold
    assert "fedprox" in cold and "mu=" in cold and "hfedatm-no-fot" in cold and "lambda_ot=0.05" in cold
    assert "fedrc (reconstructed)" in cold and "fedprox (reconstructed)" not in cold


def test_an_edited_source_rebuilds_the_listing_and_a_touched_one_does_not(sources, tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(feddg.catalog, "build_catalog", lambda: built.append(1) or build_catalog())
    catalog()
    fedavg = sources / "algorithms" / "fedavg.py"
    os.utime(fedavg, (0, 0))  # same contents: the key is the contents, not the time
    catalog()
    assert len(built) == 1
    fedavg.write_text(fedavg.read_text() + "\n# edited\n")
    catalog()
    assert len(built) == 2
    assert len(list((tmp_path / "cache" / "methods").glob("*.json"))) == 2  # the older listing is kept too


def test_an_unwritable_cache_folder_only_skips_the_caching(tmp_path, monkeypatch):
    monkeypatch.setattr(feddg.catalog, "build_catalog", lambda: {"methods": [], "merges": [], "hierarchy": ""})
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert catalog(cache_dir=blocker) == {"methods": [], "merges": [], "hierarchy": ""}


def test_the_listing_lives_in_the_dataset_cache_folder(monkeypatch, tmp_path):
    from feddg.data.cache import resolve_cache_dir

    monkeypatch.delenv("FEDDG_CACHE", raising=False)
    assert user_cache_dir() == resolve_cache_dir()
    monkeypatch.setenv("FEDDG_CACHE", str(tmp_path))
    assert user_cache_dir() == resolve_cache_dir() == tmp_path


def test_the_cli_and_a_warm_listing_import_no_torch(sources, tmp_path):
    _methods()  # warm the cache of the frozen sources
    code = (f"import sys, feddg.cli, feddg.catalog, pathlib; assert 'torch' not in sys.modules, 'feddg.cli'; "
            f"feddg.catalog.PACKAGE = pathlib.Path({str(sources)!r}); "
            "feddg.cli.app(['methods'], standalone_mode=False); assert 'torch' not in sys.modules, 'methods'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "client methods" in res.stdout


def test_merges_are_listed_sorted_with_what_each_computes():
    from feddg.aggregation.merges import MERGES

    listing = build_catalog()
    assert [name for name, _ in listing["merges"]] == sorted(MERGES)
    what = dict(listing["merges"])
    assert what["hfedatm-no-fot"] == "RegMean of linear layers (eqs. 8–12)"
    names = [name for name, _ in listing["methods"]]
    assert names == sorted(names) and "fedavg" in names


def test_the_cache_folder_keeps_the_newest_listings_only(tmp_path, monkeypatch):
    monkeypatch.setattr(feddg.catalog, "build_catalog", lambda: {k: [] for k in feddg.catalog.KEYS})
    folder = tmp_path / "methods"
    folder.mkdir()
    for i in range(20):  # older listings, oldest first
        (folder / f"old{i:02d}.json").write_text("{}")
        os.utime(folder / f"old{i:02d}.json", (1000 + i, 1000 + i))
    catalog(cache_dir=tmp_path, root=Path(feddg.catalog.__file__).parent / "aggregation")
    kept = sorted(p.name for p in folder.glob("*.json"))
    assert len(kept) == 16  # the new listing and the 15 newest old ones
    assert [n for n in kept if n.startswith("old")] == [f"old{i:02d}.json" for i in range(5, 20)]
