"""``feddg datasets NAME [--check]`` below the CLI (feddg.data.inspect), from a mutation audit: the summary's
per-domain counts, totals and units for folders, MRI slices and texts, and the check's refusals and their order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.images import png
from support.natural_fixtures import iwildcam_tree, leaf_blob, write_json

from feddg.data import load_dataset
from feddg.data.inspect import check_dataset, describe_dataset
from feddg.data.slices import SliceDataset


def test_a_folder_is_counted_per_domain_and_class_without_decoding(tmp_path: Path) -> None:
    for domain, cls, n in (("a", "x", 2), ("a", "y", 1), ("b", "y", 3), ("b", "x", 1)):
        for i in range(n):
            png(tmp_path / domain / cls / f"{i}.png")
    s = describe_dataset("folder", root=str(tmp_path), image_size=16)
    assert (s.domains, s.classes) == (["a", "b"], ["x", "y"])
    assert s.counts == {"a": {"x": 2, "y": 1}, "b": {"x": 1, "y": 3}}
    assert (s.total, s.unit, s.image_shape) == (7, "images", (3, 16, 16))


def test_a_natural_source_is_counted_from_its_metadata_without_decoding_an_image(tmp_path: Path) -> None:
    """IWildCam's counts come from metadata.csv: the summary built no image cache (it decoded every photo, hours for
    the real 200,000); the counts are those of the loaded dataset."""
    root, cache = iwildcam_tree(tmp_path / "data"), tmp_path / "cache"
    s = describe_dataset("iwildcam", root=str(root), cache_dir=cache, image_size=8)
    assert not cache.exists() or not any(cache.rglob("*"))  # nothing decoded, nothing cached
    ds = load_dataset("iwildcam", root=str(root), cache_dir=cache, image_size=8)
    assert list(cache.rglob("*"))  # the load does decode into the cache: the check above can fail
    assert (s.domains, s.classes, s.counts, s.total) == (ds.domains, ds.classes, ds.counts(), len(ds))
    assert s.image_shape == ds.image_shape == (3, 8, 8)
    writers = describe_dataset("writers", cache_dir=cache)
    assert writers.counts == load_dataset("writers", cache_dir=cache).counts() and writers.image_shape[0] == 1


def test_a_folder_with_a_layout_problem_is_refused_not_summarised(tmp_path: Path) -> None:
    for domain in ("a", "b"):
        png(tmp_path / domain / "x" / "0.png")
    png(tmp_path / "b" / "stray.png")
    with pytest.raises(ValueError, match="lies directly in domain folder"):
        describe_dataset("folder", root=str(tmp_path))


def test_mri_slices_are_summarised_as_cases_slices_and_slices_with_prostate(tmp_path: Path) -> None:
    s = describe_dataset("synthetic-mri", cache_dir=tmp_path, image_size=16)
    ds = load_dataset("synthetic-mri", cache_dir=tmp_path, image_size=16)
    assert isinstance(ds, SliceDataset) and s.unit == "slices" and s.total == len(ds)
    for i, site in enumerate(ds.domains):
        rows = [(int(c), int(y)) for c, y, d in zip(ds.cases, ds.labels, ds.domain_ids, strict=True) if d == i]
        expected = {"cases": len({c for c, _ in rows}), "slices": len(rows), "slices with prostate": sum(y for _, y in rows)}
        assert s.counts[site] == expected
        assert expected["cases"] < expected["slices"]


class _Slices(list[int]):
    """A stand-in for a :class:`SliceDataset`: two sites, site a's second case without prostate in one slice."""

    name, domains, classes, image_shape = "mri", ["a", "b"], ["background", "prostate"], (1, 4, 4)
    domain_ids = np.array([0, 0, 0, 0, 0, 1, 1])
    cases = np.array([0, 0, 1, 1, 1, 0, 0])
    labels = np.array([1, 1, 0, 1, 1, 0, 0])


def test_slice_counts_by_hand() -> None:
    from feddg.data.inspect import _describe_slices

    s = _describe_slices(_Slices(range(7)))
    assert s.counts == {"a": {"cases": 2, "slices": 5, "slices with prostate": 4},
                        "b": {"cases": 1, "slices": 2, "slices with prostate": 0}}
    assert (s.total, s.unit) == (7, "slices")


def test_a_text_dataset_counts_texts(tmp_path: Path) -> None:
    s = describe_dataset("synthetic-sentiment", cache_dir=tmp_path)
    assert s.unit == "texts" and s.total == sum(sum(c.values()) for c in s.counts.values()) > 0


def test_the_synthetic_mri_has_nothing_to_check_and_needs_no_root() -> None:
    assert check_dataset("synthetic-mri") == []


def test_a_malformed_natural_file_is_the_checks_one_line(tmp_path: Path) -> None:
    blob = leaf_blob({"f1": ([0.5], [1])})
    blob["num_samples"] = [5]
    write_json(tmp_path / "all_data_0.json", blob)
    (problem,) = check_dataset("femnist", root=str(tmp_path))
    assert "all_data_0.json: user f1: num_samples says 5, user_data holds 1 samples" in problem


def test_a_presets_check_lists_missing_domains_then_the_scans_problems_then_absent_classes(tmp_path: Path) -> None:
    for domain in ("art_painting", "cartoon", "photo"):  # sketch is missing
        png(tmp_path / domain / "dog" / "0.png")
    png(tmp_path / "photo" / "stray.png")
    problems = check_dataset("pacs", root=str(tmp_path))
    assert problems[0] == f"domain folder {tmp_path / 'sketch'} is missing"
    assert problems[1].startswith(f"image {tmp_path / 'photo' / 'stray.png'} lies directly in domain folder")
    assert len(problems) == 3 and problems[2].startswith(
        "pacs: class(es) elephant, giraffe, guitar, horse, house, person of the preset have no folder in any domain")
