"""Audit tests of the data loaders' helpers: folder scans and cards, the image and array caches, the torch transforms
and their spec, Digits-DG's builders, the text corpus and tokenizers, and the synthetic MRI volumes."""

from __future__ import annotations

import json
import math
import os
import random
import re
import socket
import subprocess
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from support.images import png

from feddg.data import (
    cache,
    digits,
    folders,
    image_cache,
    load_dataset,
    synthetic_mri,
    synthetic_text,
    text_sets,
    tokenizer,
    transforms,
)
from feddg.data.inspect import check_dataset
from feddg.data.transform_spec import PRESETS as SPEC_PRESETS
from feddg.data.transform_spec import TransformSpec, check_channels, parse_slice_augment, parse_transforms

# --- folders.py ---------------------------------------------------------------------------------------------------


@pytest.fixture
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FEDDG_CACHE", str(tmp_path / "cache"))


def _tree(root: Path, layout: dict[str, dict[str, int]]) -> Path:
    """``root/<domain>/<class>/<i>.png`` with ``layout[domain][class]`` images each."""
    for dom, classes in layout.items():
        (root / dom).mkdir(parents=True, exist_ok=True)
        for cls, n in classes.items():
            (root / dom / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                png(root / dom / cls / f"{i}.png")
    return root


def test_names_shows_up_to_eight_names_in_full_and_counts_longer_lists() -> None:
    eight = [f"n{i}" for i in range(8)]
    assert folders._names(eight) == "n0, n1, n2, n3, n4, n5, n6, n7"
    assert folders._names([*eight, "n8"]) == "n0, n1, n2, n3, n4, n5, n6, n7, ... (9 in all)"


def test_image_extensions_match_in_any_case_for_samples_and_stray_images(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"a": {"x": 0}})
    for name in ("0.PNG", "1.JpG", "2.Jpeg", "notes.TXT"):
        png(root / "a" / "x" / name) if not name.endswith("TXT") else (root / "a" / "x" / name).write_text("t")
    scan = folders.scan_tree(root, ["a"], ["x"], fixed=False)
    assert [f.name for f in scan.files] == ["0.PNG", "1.JpG", "2.Jpeg"] and scan.problems == []
    for name in ("q", "w", "e", "r", "t", "y", "u", "i", "o", "p", "g", "s", "d", "f"):  # ext4 lists by hash
        png(root / "a" / f"{name}.PNG")
    png(root / "a" / "stray.Png")
    png(root / "a" / ".hidden.png")  # a hidden file is not a stray image
    problems = folders.scan_tree(root, ["a"], ["x"], fixed=False).problems
    assert problems == [f"image {root / 'a' / 'd.PNG'} lies directly in domain folder {root / 'a'} (15 such images)"]


def test_hidden_files_in_a_class_folder_are_not_samples(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"a": {"x": 2}})
    png(root / "a" / "x" / ".0.png")
    scan = folders.scan_tree(root, ["a"], ["x"], fixed=False)
    assert sorted(f.name for f in scan.files) == ["0.png", "1.png"]


def test_hidden_domain_and_class_folders_are_neither_domains_nor_classes(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"a": {"x": 1, ".cache": 1}, ".git": {"objects": 1}})
    assert folders.discover_domains(root) == ["a"]
    assert folders.discover_classes(root, ["a"]) == ["x"]


def test_images_domains_and_classes_come_sorted_whatever_the_listing_order(tmp_path: Path) -> None:
    names = ["q", "w", "e", "r", "t", "y", "u", "i", "o", "p", "k", "s", "d", "f", "g", "h"]  # ext4 lists by hash
    _tree(tmp_path / "domains", {n: {} for n in names})
    assert folders.discover_domains(tmp_path / "domains") == sorted(names)
    root = tmp_path / "data"
    for n in names:
        png(root / "a" / n / "0.png")
        png(root / "b" / "x" / f"{n}.png")
    assert folders.discover_classes(root, ["a"]) == sorted(names)
    files = folders.scan_tree(root, ["b"], ["x"], fixed=False).files
    assert files == [root / "b" / "x" / f"{n}.png" for n in sorted(names)]


def test_check_of_a_preset_without_class_names_with_a_missing_domain_lists_it(tmp_path: Path) -> None:
    domains = folders.PRESETS["domainnet"].domains
    root = _tree(tmp_path, {d: {"apple": 1} for d in domains[1:]})
    assert check_dataset("domainnet", root=str(root)) == [f"domain folder {root / domains[0]} is missing"]


def test_a_class_held_by_as_many_domains_as_another_is_no_misspelling_of_it(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"a": {"cat": 1}, "b": {"dog": 1}})
    assert check_dataset("folder", root=str(root)) == [
        f"class folder {root / 'b' / 'cat'} is missing (domains a have cat/)",
        f"class folder {root / 'a' / 'dog'} is missing (domains b have dog/)",
    ]


def test_a_domain_without_class_folders_is_a_domain_without_images(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"a": {"x": 1}, "b": {}})
    assert check_dataset("folder", root=str(root)) == [
        f"domain folder {root / 'b'} has no images",
        f"class folder {root / 'b' / 'x'} is missing (domains a have x/)",
    ]


def test_a_discovered_class_outside_the_chosen_domains_gives_no_absent_class_warning(tmp_path: Path, caplog,
                                                                                     _own_cache) -> None:
    root = _tree(tmp_path / "data", {"a": {"x": 1, "y": 1}, "b": {"x": 1, "y": 1, "z": 1}})
    with caplog.at_level("WARNING"):
        ds = load_dataset("folder", root=str(root), domains=["a"], image_size=4)
    assert ds.classes == ["x", "y", "z"] and len(ds) == 2
    assert "of the preset have no folder" not in caplog.text


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"image_size": 28, "colour": 1}', "expected an object with keys among image_size, transforms, source"),
        ('["image_size"]', "expected an object with keys among"),
        ('{"image_size": 0}', "image_size must be an integer >= 1, got 0"),
        ('{"image_size": true}', "image_size must be an integer >= 1, got True"),
        ('{"image_size": 2.5}', "image_size must be an integer >= 1, got 2.5"),
        ("{not json", "not readable JSON"),
    ],
)
def test_read_card_refuses_a_malformed_card_in_one_line(tmp_path: Path, text: str, fragment: str) -> None:
    (tmp_path / "feddg.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'feddg.json'}: ")) as exc:
        folders.read_card(tmp_path)
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


def test_read_card_accepts_every_known_key_and_a_missing_card_is_empty(tmp_path: Path) -> None:
    assert folders.read_card(tmp_path) == {}
    card = {"image_size": 1, "transforms": "digits", "source": "export of x"}
    (tmp_path / "feddg.json").write_text(json.dumps(card))
    assert folders.read_card(tmp_path) == card


def test_load_image_gives_channels_first_floats_in_unit_range(tmp_path: Path) -> None:
    pixels = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3) * 15  # H=2, W=3
    Image.fromarray(pixels).save(tmp_path / "p.png")
    x = folders.load_image(tmp_path / "p.png")
    assert x.shape == (3, 2, 3) and x.dtype == torch.float32
    expected = torch.tensor(pixels, dtype=torch.float64).permute(2, 0, 1) / 255
    assert torch.allclose(x.double(), expected, atol=1e-7)
    assert x[0, 1, 2].item() == pytest.approx(pixels[1, 2, 0] / 255, abs=1e-7)


def test_load_image_names_an_undecodable_or_16_bit_file(tmp_path: Path) -> None:
    (tmp_path / "bad.png").write_bytes(b"not an image")
    with pytest.raises(ValueError, match=r"^cannot read image .*bad\.png: "):
        folders.load_image(tmp_path / "bad.png")
    Image.fromarray(np.full((4, 4), 30000, dtype=np.uint16)).save(tmp_path / "deep.png")
    with pytest.raises(ValueError, match=r"^cannot read image .*deep\.png: a I;16 image \(16-bit"):
        folders.load_image(tmp_path / "deep.png")


def test_folder_dataset_refuses_files_and_images_of_other_lengths() -> None:
    images = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="^3 files but 2 images$"):
        folders.FolderDomainDataset("folder", [Path("a"), Path("b"), Path("c")], images, np.zeros(2, np.int64),
                                    np.zeros(2, np.int64), ["d"], ["c"], TransformSpec(mean=(0,) * 3, std=(1,) * 3))


def test_folder_dataset_augments_training_batches_only_when_the_spec_augments() -> None:
    images = np.random.default_rng(0).integers(0, 256, (3, 4, 4, 3), dtype=np.uint8)
    args = ([Path("a"), Path("b"), Path("c")], images, np.zeros(3, np.int64), np.zeros(3, np.int64), ["d"], ["c"])
    stats = {"mean": (0.0,) * 3, "std": (1.0,) * 3}
    idx = np.arange(3)
    flipping = folders.FolderDomainDataset("folder", *args, TransformSpec(flip=1.0, **stats))
    x, _ = flipping.get_batch(idx, train=False)
    assert torch.allclose(x, torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255, atol=1e-7)
    assert torch.equal(flipping.get_batch(idx, train=True, generator=torch.Generator().manual_seed(0))[0], x.flip(-1))
    plain = folders.FolderDomainDataset("folder", *args, TransformSpec(**stats))
    assert torch.equal(plain.get_batch(idx, train=True, generator=torch.Generator().manual_seed(0))[0], x)


# --- image_cache.py -----------------------------------------------------------------------------------------------


def _tiny_pngs(folder: Path, count: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(count):
        files.append(folder / f"{i:03d}.png")
        Image.new("RGB", (2, 2), (i % 256, 0, 0)).save(files[-1])
    return files


def test_cache_path_changes_when_a_file_changes_size_at_the_same_modification_time(tmp_path: Path) -> None:
    files = _tiny_pngs(tmp_path / "a", 2)
    before = image_cache.cache_path(tmp_path / "c", "t", tmp_path, files, 8)
    st = files[1].stat()
    files[1].write_bytes(files[1].read_bytes() + b"\0")  # PNG readers ignore trailing bytes
    os.utime(files[1], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert files[1].stat().st_mtime_ns == st.st_mtime_ns
    assert image_cache.cache_path(tmp_path / "c", "t", tmp_path, files, 8) != before


@pytest.mark.parametrize(("array", "mode"), [(np.full((3, 3), 0.5, np.float32), "F"),
                                             (np.full((3, 3), 70000, np.int32), "I")])
def test_rgb8_refuses_float_and_32_bit_images(array: np.ndarray, mode: str) -> None:
    im = Image.fromarray(array)
    assert im.mode == mode
    with pytest.raises(ValueError, match=rf"^a {mode} image \(16-bit, 32-bit or float\): feddg reads 8-bit images"):
        image_cache.rgb8(im)


def test_decode_workers_none_below_two_chunks_then_one_per_chunk_up_to_the_cores(monkeypatch) -> None:
    monkeypatch.setattr(image_cache.os, "sched_getaffinity", lambda pid: set(range(5)), raising=False)
    chunk = image_cache.CHUNK
    assert image_cache.decode_workers(2 * chunk - 1) == 0
    assert image_cache.decode_workers(2 * chunk) == 2
    assert image_cache.decode_workers(2 * chunk + 1) == 3
    assert image_cache.decode_workers(100 * chunk) == 5


def test_unreadable_images_message_counts_the_others() -> None:
    one = image_cache.UnreadableImages([(Path("a.png"), "r1")])
    assert str(one) == "cannot read image a.png: r1"
    three = image_cache.UnreadableImages([(Path("a.png"), "r1"), (Path("b.png"), "r2"), (Path("c.png"), "r3")])
    assert str(three) == "cannot read image a.png: r1 (and 2 more)" and len(three.failures) == 3


def test_check_space_keeps_a_quarter_gibibyte_free(tmp_path: Path, monkeypatch) -> None:
    need = 1 << 30
    free = need + (1 << 28)
    monkeypatch.setattr(image_cache.shutil, "disk_usage", lambda folder: SimpleNamespace(free=free))
    image_cache._check_space(tmp_path, need)  # exactly enough
    free -= 1
    with pytest.raises(OSError, match=r"^the image cache needs 1\.0 GiB but .* has 1\.2 GiB free; point data"):
        image_cache._check_space(tmp_path, need)


def test_load_refuses_a_cache_of_another_shape_or_dtype(tmp_path: Path) -> None:
    path = tmp_path / "c.npy"
    np.save(path, np.zeros((2, 4, 4, 3), dtype=np.float32))
    assert image_cache.load(path, 2, 4) is None
    np.save(path, np.zeros((2, 4, 4, 3), dtype=np.uint8))
    assert image_cache.load(path, 3, 4) is None and image_cache.load(path, 2, 5) is None
    assert image_cache.load(path, 2, 4).shape == (2, 4, 4, 3)
    assert image_cache.load(tmp_path / "missing.npy", 2, 4) is None


def test_writing_into_loaded_images_leaves_the_cache_file_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "c.npy"
    np.save(path, np.zeros((2, 4, 4, 3), dtype=np.uint8))
    images = image_cache.load(path, 2, 4)
    images[0] = 255  # copy-on-write: an in-place augmentation must not reach the shared cache
    del images
    assert not np.load(path).any()


def test_unreadable_and_build_name_the_bad_file_past_the_first_chunk(tmp_path: Path) -> None:
    files = _tiny_pngs(tmp_path / "imgs", image_cache.CHUNK + 6)
    bad = files[image_cache.CHUNK + 3]
    bad.write_bytes(b"garbage")
    found = image_cache.unreadable(files, workers=0)
    assert [f for f, _ in found] == [bad]
    with pytest.raises(image_cache.UnreadableImages) as exc:
        image_cache.build(tmp_path / "c" / "x.npy", files, 2, workers=0)
    assert [f for f, _ in exc.value.failures] == [bad]
    assert str(exc.value).startswith(f"cannot read image {bad}: ")
    assert not (tmp_path / "c" / "x.npy").exists()


def test_build_reports_the_position_of_a_bad_file_within_a_chunk(tmp_path: Path) -> None:
    files = _tiny_pngs(tmp_path / "imgs", 3)
    files[1].write_bytes(b"garbage")
    with pytest.raises(image_cache.UnreadableImages) as exc:
        image_cache.build(tmp_path / "c" / "x.npy", files, 2, workers=0)
    assert [f for f, _ in exc.value.failures] == [files[1]]


def test_cached_images_refuses_a_cache_it_cannot_read_back(tmp_path: Path, monkeypatch) -> None:
    files = _tiny_pngs(tmp_path / "imgs", 2)
    monkeypatch.setattr(image_cache, "load", lambda path, count, size: None)
    with pytest.raises(OSError, match=r"^image cache \S+\.npy could not be read back after writing it$"):
        image_cache.cached_images(tmp_path / "c", "t", tmp_path, files, 2, workers=0)


# --- cache.py -----------------------------------------------------------------------------------------------------


def test_resolve_cache_dir_expands_home_and_an_empty_variable_means_the_default(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache.resolve_cache_dir("~/given") == tmp_path / "given"
    monkeypatch.setenv("FEDDG_CACHE", "~/env")
    assert cache.resolve_cache_dir() == tmp_path / "env"
    monkeypatch.setenv("FEDDG_CACHE", "")
    assert cache.resolve_cache_dir() == tmp_path / ".cache" / "feddg"


def test_cache_file_quotes_every_part_into_one_file_name() -> None:
    assert cache.cache_file(Path("c"), "a/b", "+90%", 3) == Path("c") / "a%2Fb_%2B90%25_3.npz"


def test_a_process_of_another_user_counts_as_alive(monkeypatch) -> None:
    def denied(pid: int, sig: int) -> None:
        raise PermissionError

    monkeypatch.setattr(cache.os, "kill", denied)
    assert cache._alive(12345)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_temporary_beside_keeps_a_temporary_without_a_pid_and_escapes_the_stem(tmp_path: Path) -> None:
    host = socket.gethostname().replace(".", "_")
    odd = tmp_path / f"c.{host}.nopid.abc.tmp"
    odd.write_bytes(b"x")
    fd, tmp = cache.temporary_beside(tmp_path / "c.npz")
    os.close(fd)
    assert odd.exists()
    dead = tmp_path / f"a[1].{host}.{_dead_pid()}.abc.tmp"
    dead.write_bytes(b"x")
    fd, _ = cache.temporary_beside(tmp_path / "a[1].npz")
    os.close(fd)
    assert not dead.exists(), "a killed build's temporary of a stem with glob characters is left"


def test_save_arrays_removes_its_temporary_when_the_rename_fails(tmp_path: Path, monkeypatch) -> None:
    def failing(src: str, dst: Path) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(cache.os, "replace", failing)
    with pytest.raises(OSError, match="disk gone"):
        cache.save_arrays(tmp_path / "a.npz", {"a": np.zeros(2)})
    assert list(tmp_path.iterdir()) == []


def test_load_arrays_refuses_pickled_objects_and_missing_keys(tmp_path: Path) -> None:
    path = tmp_path / "a.npz"
    np.savez(path, a=np.array([{"x": 1}], dtype=object))
    assert cache.load_arrays(path, ("a",)) is None
    cache.save_arrays(path, {"a": np.arange(3)})
    assert cache.load_arrays(path, ("a", "b")) is None
    assert cache.load_arrays(path, ("a",))["a"].tolist() == [0, 1, 2]


# --- transforms.py ------------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_random_resized_crop_may_take_the_whole_image_and_any_offset_up_to_the_last() -> None:
    whole = transforms.RandomResizedCrop(8, scale=(1.0, 1.0), ratio=(1.2, 1.2))
    assert whole.box(100, 120, _gen(0)) == (0, 0, 100, 120)  # w = 120 = width, h = 100 = height: one offset only
    # area 0.8 at ratio 1.5 on 100x120: w = sqrt(9600 * 1.5) = 120 (the full width), h = 80: top uniform in 0..20
    wide = transforms.RandomResizedCrop(8, scale=(0.8, 0.8), ratio=(1.5, 1.5))
    boxes = [wide.box(100, 120, _gen(s)) for s in range(200)]
    assert {(left, h, w) for _, left, h, w in boxes} == {(0, 80, 120)}
    assert {top for top, _, _, _ in boxes} == set(range(21))


def test_random_resized_crop_falls_back_to_the_nearest_ratio_on_either_side() -> None:
    # 40 high x 10 wide at ratio 2: w = 10, h = round(10 / 2) = 5, centred: top (40 - 5) // 2 = 17
    assert transforms.RandomResizedCrop(4, scale=(0.99, 1.0), ratio=(2.0, 2.0)).box(40, 10, _gen(0)) == (17, 0, 5, 10)
    # 10 high x 40 wide at ratio 1/2: h = 10, w = round(10 * 0.5) = 5, centred: left (40 - 5) // 2 = 17
    assert transforms.RandomResizedCrop(4, scale=(0.99, 1.0), ratio=(0.5, 0.5)).box(10, 40, _gen(0)) == (0, 17, 10, 5)


def test_random_resized_crop_tries_again_after_a_box_that_does_not_fit(monkeypatch) -> None:
    draws = iter([1.0, math.log(4 / 3), 0.25, 0.0])  # try 1: 126 x 95 > 120 wide; try 2: a square of area 3000
    monkeypatch.setattr(transforms, "_uniform", lambda low, high, generator: next(draws))
    top, left, h, w = transforms.RandomResizedCrop(8).box(100, 120, _gen(0))
    assert (h, w) == (55, 55) and 0 <= top <= 45 and 0 <= left <= 65


def test_contrast_blends_with_the_mean_luma() -> None:
    red = torch.zeros(3, 2, 2)
    red[0] = 1.0
    out = transforms.ColorJitter._apply(1, red, 0.5)  # mean luma of pure red: 0.299
    assert torch.allclose(out[:, 0, 0], torch.tensor([0.5 + 0.5 * 0.299, 0.5 * 0.299, 0.5 * 0.299]), atol=1e-7)


def test_jitter_clamps_each_blend_to_the_unit_range() -> None:
    bright = transforms.ColorJitter._apply(0, torch.full((3, 2, 2), 0.8), 1.5)  # 1.2 clamped
    assert torch.equal(bright, torch.ones(3, 2, 2))
    img = torch.tensor([0.0, 1.0]).view(1, 1, 2).expand(3, 1, 2)  # mean luma 0.5: 2 * x - 0.5 is -0.5 and 1.5
    assert transforms.ColorJitter._apply(1, img, 2.0)[0, 0].tolist() == [0.0, 1.0]


def test_grey_uses_the_rec601_luma_weights_and_keeps_a_one_channel_image() -> None:
    for channel, weight in enumerate((0.299, 0.587, 0.114)):
        img = torch.zeros(3, 1, 1)
        img[channel] = 1.0
        assert transforms.grey(img).item() == pytest.approx(weight, abs=1e-7)
    one = torch.rand(1, 3, 3, generator=_gen(0))
    assert torch.equal(transforms.grey(one), one)


def test_a_jitter_strength_above_one_never_gives_a_negative_factor() -> None:
    img = torch.full((3, 2, 2), 0.2)
    outs = [transforms.ColorJitter(brightness=1.5)(img, _gen(s)) for s in range(40)]
    assert all(bool((o > 0).all()) for o in outs), "a factor in [0, 2.5] keeps 0.2 above 0"
    assert max(o.max().item() for o in outs) > 0.2 * 2.0


def test_batch_random_crop_reaches_every_offset_from_zero_to_twice_the_padding() -> None:
    batch = torch.rand(64, 1, 6, 6, generator=_gen(0)) + 0.1
    out = transforms.BatchRandomCrop(1)(batch, _gen(1))
    padded = torch.nn.functional.pad(batch, (1, 1, 1, 1))
    offsets = {(dy, dx) for i in range(64) for dy in range(3) for dx in range(3)
               if torch.equal(out[i], padded[i, :, dy : dy + 6, dx : dx + 6])}
    assert {dy for dy, _ in offsets} == {0, 1, 2} and {dx for _, dx in offsets} == {0, 1, 2}


def test_flip_and_grayscale_default_to_torchvisions_probabilities() -> None:
    assert transforms.RandomHorizontalFlip().p == 0.5 and transforms.RandomGrayscale().p == 0.1


def test_train_transform_is_domainbeds_recipe() -> None:
    crop, flip, jitter, greyscale, norm = transforms.train_transform(16).transforms
    assert crop.scale == (0.7, 1.0) and crop.size == (16, 16)
    assert flip.p == 0.5 and jitter.strengths == (0.3, 0.3, 0.3) and greyscale.p == 0.1
    assert torch.allclose(norm.mean.flatten(), torch.tensor(transforms.IMAGENET_MEAN))
    assert torch.allclose(norm.std.flatten(), torch.tensor(transforms.IMAGENET_STD))


def test_resize_is_half_pixel_bilinear_upwards_and_antialiased_downwards() -> None:
    up = transforms.resize(torch.tensor([[[0.0, 1.0]]]), (1, 4))  # sample points -0.25, 0.25, 0.75, 1.25 (clamped)
    assert torch.allclose(up, torch.tensor([[[0.0, 0.25, 0.75, 1.0]]]), atol=1e-7)
    down = transforms.resize(torch.tensor([[[0.0, 1.0, 0.0, 0.0]]]), (1, 2))  # triangle of radius 2: 3/7, 1/7
    assert torch.allclose(down, torch.tensor([[[3 / 7, 1 / 7]]]), atol=1e-6)
    pil = Image.fromarray(np.array([[0, 1, 0, 0]], np.float32)).resize((2, 1), Image.Resampling.BILINEAR)
    assert np.allclose(down.numpy()[0], np.asarray(pil), atol=1e-6)


# --- transform_spec.py --------------------------------------------------------------------------------------------


def test_pad_crop_alone_counts_as_augmenting() -> None:
    assert TransformSpec(pad_crop=2).augments and not TransformSpec(mean=(0.5,), std=(0.5,)).augments


@pytest.mark.parametrize(
    ("spec", "line"),
    [
        (SPEC_PRESETS["domainbed"], "crop 0.7-1, flip 0.5, jitter 0.3/0.3/0.3, grayscale 0.1; "
                                    "mean (0.485, 0.456, 0.406) std (0.229, 0.224, 0.225)"),
        (SPEC_PRESETS["digits"], "no augmentation; mean (0.5, 0.5, 0.5) std (0.5, 0.5, 0.5)"),
        (TransformSpec(pad_crop=2, jitter=(0.1, 0.0, 0.2)), "pad-crop 2px, jitter 0.1/0/0.2; dataset stats"),
        (TransformSpec(mean=(0.5,)), "no augmentation; dataset stats"),
    ],
)
def test_describe_is_one_line_of_augmentations_and_statistics(spec: TransformSpec, line: str) -> None:
    assert spec.describe() == line


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"jitter": math.inf}, "transforms.jitter must be a number, got inf"),
        ({"mean": [0.5, math.nan, 0.5]}, "transforms.mean must be a number, got nan"),
        ({"crop_scale": [0, 1]}, "transforms.crop_scale must be [lo, hi] with 0 < lo <= hi <= 1, got [0, 1]"),
        ({"crop_scale": [0.5, 1.5]}, "transforms.crop_scale must be [lo, hi] with 0 < lo <= hi <= 1"),
        ({"jitter": [0.1, -0.1, 0.1]}, "transforms.jitter strengths must be >= 0, got [0.1, -0.1, 0.1]"),
        ({"pad_crop": True}, "transforms.pad_crop must be an integer >= 0 (pixels), got True"),
        ({"pad_crop": -1}, "transforms.pad_crop must be an integer >= 0 (pixels), got -1"),
        ({"flip": True}, "transforms.flip must be a probability in [0, 1], got True"),
        ({"grayscale": -0.1}, "transforms.grayscale must be a probability in [0, 1], got -0.1"),
        ("hflip", "transforms: 'hflip' is a segmentation slices' augmentation (synthetic-mri, prostate)"),
        ({"preset": "rot90_flip"}, "transforms: 'rot90_flip' is a segmentation slices' augmentation"),
    ],
)
def test_spec_refusals_name_the_key_and_the_value(value: object, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        parse_transforms(value)


def test_spec_refuses_empty_statistics() -> None:
    with pytest.raises(ValueError, match=r"^transforms\.mean must be a list of numbers, got \[\]$"):
        parse_transforms({"mean": [], "std": []})


def test_spec_accepts_the_closed_ends_of_its_ranges() -> None:
    spec = parse_transforms({"flip": 1, "grayscale": 0, "crop_scale": [1, 1], "crop_ratio": [0.2, 5], "jitter": 0,
                             "pad_crop": 0})
    assert (spec.flip, spec.grayscale, spec.crop_scale, spec.crop_ratio) == (1.0, 0.0, (1.0, 1.0), (0.2, 5.0))
    assert spec.jitter == (0.0, 0.0, 0.0) and spec.pad_crop == 0
    assert parse_transforms({"preset": "domainbed", "crop_scale": False}).crop_scale is None


def test_slice_augment_defaults_to_hflip_and_refuses_image_presets() -> None:
    assert parse_slice_augment(None, "prostate") == "hflip"
    assert parse_slice_augment("rot90_flip", "prostate") == "rot90_flip"
    with pytest.raises(ValueError, match=r"^prostate takes data.transforms hflip or rot90_flip, got 'domainbed'"):
        parse_slice_augment("domainbed", "prostate")


def test_check_channels_needs_both_statistics() -> None:
    with pytest.raises(ValueError, match=r"^x: no normalisation statistics \(give transforms mean and std\)$"):
        check_channels(TransformSpec(mean=(0.5,)), 1, "x")
    with pytest.raises(ValueError, match=r"^x: no normalisation statistics"):
        check_channels(TransformSpec(std=(0.5,)), 1, "x")
    assert check_channels(TransformSpec(mean=(0.1,), std=(0.2,)), 1, "x") == ((0.1,), (0.2,))


# --- digits.py ----------------------------------------------------------------------------------------------------


def test_domain_rng_is_reproducible_and_independent_per_domain() -> None:
    a = digits.domain_rng(0, "digits-dg", "synth").random(4)
    assert np.array_equal(a, digits.domain_rng(0, "digits-dg", "synth").random(4))
    assert not np.array_equal(a, digits.domain_rng(0, "digits-dg", "mnistm").random(4))
    assert not np.array_equal(a, digits.domain_rng(1, "digits-dg", "synth").random(4))


def test_mnist_halves_are_sorted_disjoint_and_cover_every_digit() -> None:
    first, second = digits.mnist_halves(0)
    labels = digits.mnist5k()[1]
    assert (np.diff(first) > 0).all() and (np.diff(second) > 0).all()
    assert np.array_equal(np.union1d(first, second), np.arange(len(labels))) and not np.intersect1d(first, second).size
    assert np.bincount(labels[first]).tolist() == np.bincount(labels[second]).tolist() == [250] * 10


def test_uci_digits_are_pils_bilinear_upsampling_scaled_from_16_to_255() -> None:
    from sklearn.datasets import load_digits

    x, y = digits.build_uci(0)
    source = load_digits()
    assert x.shape == (1797, 3, 28, 28) and x.dtype == np.uint8 and np.array_equal(y, source.target)
    for i in (0, 1, 500, 1796):
        small = Image.fromarray((source.images[i] * 255 / 16).astype(np.float32))
        want = np.asarray(small.resize((28, 28), Image.Resampling.BILINEAR))
        assert np.abs(x[i, 0].astype(np.float64) - want).max() <= 1.0, i


def test_synth_colour_pairs_differ_in_luma_by_at_least_80() -> None:
    rng = np.random.default_rng(0)
    luma = np.array([0.299, 0.587, 0.114])
    diffs = [abs(float((bg - fg) @ luma)) for bg, fg in (digits._colour_pair(rng) for _ in range(300))]
    assert min(diffs) >= 80 and min(diffs) < 90  # the bound is reached, not exceeded by a wide margin


def test_textured_corners_are_the_windows_whose_grey_std_reaches_the_threshold() -> None:
    rng = np.random.default_rng(0)
    photo = np.zeros((12, 14, 3))
    photo[3:9, 5:12] = rng.integers(0, 256, (6, 7, 1)) * np.ones(3)  # grey texture in a flat frame
    size, min_std = 4, 40.0
    corners = digits._textured_corners(photo, size, min_std)
    grey = photo.mean(axis=2)
    want = [[t, left] for t in range(12 - size + 1) for left in range(14 - size + 1)
            if grey[t : t + size, left : left + size].std() >= min_std]
    assert 0 < len(want) < (12 - size + 1) * (14 - size + 1)
    assert corners.tolist() == want


def test_resize_uint8_rounds_to_the_nearest_level() -> None:
    ramp = np.array([[[[0, 255], [0, 255]]]], dtype=np.uint8)  # columns sampled at -0.25, 0.25, 0.75, 1.25
    assert digits.resize_uint8(ramp, 4)[0, 0].tolist() == [[0, 64, 191, 255]] * 4  # 63.75 -> 64, 191.25 -> 191


def _fake_builder(calls: list[int]):
    def build(seed: int) -> tuple[np.ndarray, np.ndarray]:
        calls.append(seed)
        return np.full((2, 3, 28, 28), 10 * seed + 5, dtype=np.uint8), np.array([0, 1], dtype=np.int64)

    return build


def test_cached_domain_keys_on_seed_and_version_and_resizes_from_the_native_cache(tmp_path: Path) -> None:
    calls: list[int] = []
    build = _fake_builder(calls)

    def get(seed: int, size: int = 28, version: str = "v1") -> np.ndarray:
        return digits.cached_domain("d", "x", build, image_size=size, seed=seed, cache_dir=tmp_path, version=version)[0]

    assert get(0)[0, 0, 0, 0] == 5 and get(1)[0, 0, 0, 0] == 15 and calls == [0, 1]
    assert get(1, version="v2")[0, 0, 0, 0] == 15 and calls == [0, 1, 1]
    big = get(0, size=32)
    assert big.shape == (2, 3, 32, 32) and (big == 5).all() and calls == [0, 1, 1], "32 px comes from the 28 px cache"
    assert get(0)[0, 0, 0, 0] == 5 and calls == [0, 1, 1]
    with pytest.raises(ValueError, match=r"^d: image_size must be one of \[28, 32\], got 30$"):
        get(0, size=30)


def test_the_display_faces_draw_no_digits() -> None:
    folder = digits._package_dir("matplotlib") / "mpl-data" / "fonts" / "ttf"
    assert not digits._renders_digits(folder / "DejaVuSansDisplay.ttf")
    assert digits._renders_digits(folder / "DejaVuSans.ttf")


def test_a_font_that_draws_one_fallback_box_for_every_digit_is_refused(monkeypatch) -> None:
    from PIL import ImageDraw

    class BoxForEveryGlyph(ImageDraw.ImageDraw):
        def text(self, xy, text, *args, **kwargs) -> None:
            self.rectangle((12, 12, 28, 28), fill=255)

    monkeypatch.setattr(digits.ImageDraw, "Draw", BoxForEveryGlyph)
    folder = digits._package_dir("matplotlib") / "mpl-data" / "fonts" / "ttf"
    assert not digits._renders_digits(folder / "DejaVuSans.ttf")


# --- synthetic_text.py, tokenizer.py, text_sets.py ----------------------------------------------------------------


@pytest.mark.parametrize("noise", [0.5, -0.01])
def test_label_noise_must_stay_below_one_half(noise: float) -> None:
    with pytest.raises(ValueError, match=re.escape(f"label noise must be in [0, 0.5), got {noise}")):
        synthetic_text.generate(0, per_domain=2, noise=noise)


def test_flipping_cues_carry_each_domains_own_polarity_and_shared_cues_are_30_percent() -> None:
    rng = random.Random(0)
    for domain, polarity in synthetic_text.FLIPPED.items():
        same = {synthetic_text._cue(rng, domain, polarity) for _ in range(300)}
        other = {synthetic_text._cue(rng, domain, 1 - polarity) for _ in range(300)}
        assert set(synthetic_text.FLIPPING) <= same and not set(synthetic_text.FLIPPING) & other, domain
    cues = [synthetic_text._cue(rng, "books", 1) for _ in range(4000)]
    shared = sum(c in synthetic_text.SHARED[1] for c in cues) / len(cues)
    assert abs(shared - synthetic_text.SHARED_CUE) < 0.03  # binomial sd 0.7 %


def test_negated_cues_and_shared_phrases_of_a_clean_review_follow_its_label() -> None:
    corpus = synthetic_text.generate(0, per_domain=200, noise=0.0)
    negated = 0
    for domain, reviews in corpus.items():
        for text, label in reviews:
            opposite = [*synthetic_text.SHARED[1 - label], *synthetic_text.SPECIFIC[domain][1 - label],
                        *(synthetic_text.FLIPPING if synthetic_text.FLIPPED[domain] == 1 - label else [])]
            for cue in re.findall(r"is never (.+?) \.", text):
                assert cue in opposite, (domain, label, text)
                negated += 1
            assert not any(p in text for p in synthetic_text.SHARED_PHRASES[1 - label]), (domain, label, text)
    assert negated > 20


def test_corpus_digest_keys_on_the_vocabulary_size_and_the_text_boundaries() -> None:
    assert tokenizer.corpus_digest(["ab", "c"], 300) != tokenizer.corpus_digest(["ab", "c"], 400)
    assert tokenizer.corpus_digest(["ab", "c"], 300) != tokenizer.corpus_digest(["a", "bc"], 300)
    assert tokenizer.corpus_digest(["ab", "c"], 300) == tokenizer.corpus_digest(["ab", "c"], 300)


def test_train_bpe_accepts_the_smallest_vocabulary_and_fills_the_one_asked_for(tmp_path: Path) -> None:
    tok = tokenizer.train_bpe(["a small corpus of words", "another small corpus"] * 3, 261, tmp_path)
    assert len(tok) == 261 and tok.pad_token_id == 1
    texts = ["the plot was gripping and the prose was clear", "the kettle leaks and the lid is cracked"] * 20
    assert len(tokenizer.train_bpe(texts, 280, tmp_path)) == 280  # 5 specials, 256 bytes and 19 merges


def test_load_tokenizer_refuses_a_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^tokenizer \S+nowhere: no such directory"):
        tokenizer.load_tokenizer(tmp_path / "nowhere")


def test_tokenizer_stamp_keys_on_file_sizes_and_the_folders_path(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "vocab.json").write_text("{}")
        os.utime(tmp_path / name / "vocab.json", ns=(10**18, 10**18))
    assert tokenizer.tokenizer_stamp(tmp_path / "a") != tokenizer.tokenizer_stamp(tmp_path / "b")
    before = tokenizer.tokenizer_stamp(tmp_path / "a")
    (tmp_path / "a" / "vocab.json").write_text('{"x": 0}')
    os.utime(tmp_path / "a" / "vocab.json", ns=(10**18, 10**18))
    assert tokenizer.tokenizer_stamp(tmp_path / "a") != before


def test_synthetic_sentiment_takes_no_root_and_has_nothing_to_check() -> None:
    with pytest.raises(ValueError, match=r"^synthetic-sentiment is built in and takes no root \(got 'x'\)$"):
        text_sets.load_synthetic_sentiment(root="x", cache_dir=None, seed=0, tokenizer=None, max_length=8,
                                           vocab_size=300)
    assert check_dataset("synthetic-sentiment") == []


def test_synthetic_sentiment_token_cache_keys_on_the_seed(tmp_path: Path, monkeypatch) -> None:
    real = synthetic_text.generate
    monkeypatch.setattr(text_sets.synthetic_text, "generate", lambda seed: real(seed, per_domain=6))
    kwargs = {"root": None, "cache_dir": tmp_path, "tokenizer": None, "max_length": 12, "vocab_size": 300}
    a = text_sets.load_synthetic_sentiment(seed=0, **kwargs)
    b = text_sets.load_synthetic_sentiment(seed=1, **kwargs)
    assert len(a) == len(b) == 24 and not np.array_equal(np.asarray(a.ids), np.asarray(b.ids))


def test_text_table_classes_are_sorted_by_name(tmp_path: Path) -> None:
    rows = [("first text here", "zeta"), ("second text", "alpha"), ("third one", "mid")] * 2
    table = tmp_path / "t.csv"
    table.write_text("text,label,domain\n" + "".join(f"{t},{k},d\n" for t, k in rows))
    ds = load_dataset("text-table", root=str(table), cache_dir=tmp_path / "cache", vocab_size=300)
    assert ds.classes == ["alpha", "mid", "zeta"]
    assert [ds.classes[k] for k in ds.labels] == [k for _, k in rows]


def _acl(root: Path, positive: str) -> Path:
    for d in ("books", "dvd", "electronics", "kitchen"):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / "positive.review").write_text(positive)
        (root / d / "negative.review").write_text("c:1 #label#:negative\n")
    return root


def test_amazon_bow_keeps_up_to_5000_features_and_its_check_reads_processed_acl(tmp_path: Path) -> None:
    root = _acl(tmp_path / "acl", " ".join(f"f{i}:1" for i in range(700)) + " #label#:positive\n")
    bow = text_sets.load_amazon_bow(root=str(root))
    assert bow.model_args() == {"in_features": 701}
    bad = _acl(tmp_path / "bad", "a:x #label#:positive\n")
    problems = check_dataset("amazon-bow", root=str(bad))
    assert len(problems) == 4 and all("is not feature:count with a positive count" in p for p in problems)
    with pytest.raises(ValueError, match=re.escape(f"needs root=<folder> laid out as {text_sets.ACL_LAYOUT}")):
        text_sets.load_amazon_bow(root=None)


# --- synthetic_mri.py ---------------------------------------------------------------------------------------------


def test_linear_weights_interpolate_between_end_aligned_grids() -> None:
    want = [[1, 0, 0], [0.5, 0.5, 0], [0, 1, 0], [0, 0.5, 0.5], [0, 0, 1]]  # positions 0, 0.5, 1, 1.5, 2
    assert np.allclose(synthetic_mri._linear(5, 3), want, atol=1e-12)


def test_down_up_averages_ceil_bounded_blocks_then_interpolates_back() -> None:
    third = 1 / 3
    area = np.array([[third, third, third, 0, 0], [0, 0, third, third, third]])  # 5 px into 2: blocks 0..2, 2..4
    up = np.array([[1, 0], [0.75, 0.25], [0.5, 0.5], [0.25, 0.75], [0, 1]])
    assert np.allclose(synthetic_mri._down_up(5, 2.0), up @ area, atol=1e-12)
    assert np.allclose(synthetic_mri._down_up(4, 10.0), synthetic_mri._down_up(4, 2.0), atol=1e-12), "at least 2 px"


def test_soft_indicator_is_one_half_on_the_surface_without_overflow() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = synthetic_mri._soft(np.array([0.0, 1.0, 1e3, -1e3]))
    assert out[1] == 0.5 and out[0] > 0.99999 and out[2] < 1e-12 and out[3] > 1 - 1e-12


def _one_case(acq: synthetic_mri.Acquisition) -> np.ndarray:
    return synthetic_mri._case(np.random.default_rng(7), acq, 6, 16)[0].astype(np.float64)


def test_a_sites_resolution_blurs_each_slice_by_down_and_up_sampling() -> None:
    base = {"fov": 1.0, "contrast": 0.5, "bias": 0.2, "gamma": 1.0, "noise": 0.0}
    sharp = _one_case(synthetic_mri.Acquisition(resolution=1.0, **base))
    blurred = _one_case(synthetic_mri.Acquisition(resolution=2.0, **base))
    blur = synthetic_mri._down_up(16, 2.0)
    assert np.allclose(blurred, blur @ sharp @ blur.T, rtol=1e-5)


def test_a_sites_gamma_is_applied_to_the_signal_scaled_to_its_maximum() -> None:
    base = {"fov": 1.0, "contrast": 0.5, "bias": 0.2, "resolution": 1.0, "noise": 0.0}
    linear = _one_case(synthetic_mri.Acquisition(gamma=1.0, **base))
    curved = _one_case(synthetic_mri.Acquisition(gamma=2.0, **base))
    assert np.allclose(curved / curved.max(), (linear / linear.max()) ** 2, rtol=1e-5)


def test_noise_is_rician_the_magnitude_of_complex_gaussian_noise() -> None:
    # a noise far above the signal: magnitudes are Rayleigh, mean/std = sqrt(pi/2) / sqrt(2 - pi/2) = 1.913
    noisy = _one_case(synthetic_mri.Acquisition(fov=1.0, contrast=0.5, bias=0.2, gamma=1.0, resolution=1.0,
                                                noise=1000.0))
    assert noisy.mean() / noisy.std() == pytest.approx(math.sqrt(math.pi / 2) / math.sqrt(2 - math.pi / 2), abs=0.08)


def test_sites_with_the_same_field_of_view_still_image_different_anatomy() -> None:
    volumes = synthetic_mri.synthetic_volumes(seed=0, cases=1, depth=8, size=16)
    assert synthetic_mri.ACQUISITIONS["BIDMC"].fov == synthetic_mri.ACQUISITIONS["ISBI"].fov
    assert not np.array_equal(volumes["BIDMC"][0][1], volumes["ISBI"][0][1])


def test_synthetic_mri_cache_keys_on_seed_and_empty_slices(tmp_path: Path, monkeypatch) -> None:
    real = synthetic_mri.synthetic_volumes
    monkeypatch.setattr(synthetic_mri, "synthetic_volumes", lambda seed: real(seed, cases=1, depth=12, size=16))
    fg = synthetic_mri.load_synthetic_mri(seed=0, image_size=16, cache_dir=tmp_path)
    every = synthetic_mri.load_synthetic_mri(seed=0, image_size=16, drop_empty=False, cache_dir=tmp_path)
    assert len(every) == 6 * 10 and len(fg) < len(every)  # the inner 10 of 12 slices per site
    other = synthetic_mri.load_synthetic_mri(seed=1, image_size=16, cache_dir=tmp_path)
    assert len(other) != len(fg) or not np.array_equal(other.images, fg.images)


# --- refusals and keys found by the second round ------------------------------------------------------------------


def test_text_loaders_without_a_root_name_the_layout() -> None:
    kwargs = {"root": None, "cache_dir": None, "seed": 0, "tokenizer": None, "max_length": 8, "vocab_size": 300}
    with pytest.raises(ValueError, match=re.escape(f"dataset amazon-reviews needs root=<folder> laid out as "
                                                   f"{text_sets.RAW_LAYOUT}")):
        text_sets.load_amazon_reviews(**kwargs)
    with pytest.raises(ValueError, match=re.escape(f"dataset text-table needs root=<file or folder>: "
                                                   f"{text_sets.TABLE_LAYOUT}")):
        text_sets.load_text_table(**kwargs)
    with pytest.raises(ValueError, match=re.escape(f"dataset amazon-reviews needs --root laid out as "
                                                   f"{text_sets.RAW_LAYOUT}")):
        text_sets.check_text("amazon-reviews", None)


def test_text_loaders_stop_at_the_first_layout_problem(tmp_path: Path) -> None:
    kwargs = {"cache_dir": tmp_path / "cache", "seed": 0, "tokenizer": None, "max_length": 8, "vocab_size": 300}
    raw = tmp_path / "raw"
    for d in ("books", "electronics", "kitchen_&_housewares"):
        for polarity in ("positive", "negative"):
            (raw / d).mkdir(parents=True, exist_ok=True)
            (raw / d / f"{polarity}.review").write_text("<review><review_text>ok</review_text></review>\n")
    with pytest.raises(ValueError, match=re.escape(f"{raw / 'dvd'}: domain folder is missing")):
        text_sets.load_amazon_reviews(root=str(raw), **kwargs)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'empty'}: no .csv or .jsonl file")):
        text_sets.load_text_table(root=str(tmp_path / "empty"), **kwargs)
    bad = _acl(tmp_path / "acl", "a:x #label#:positive\n")
    with pytest.raises(ValueError, match=r"is not feature:count with a positive count \(and 3 more: `feddg datasets"):
        text_sets.load_amazon_bow(root=str(bad))


def test_a_tokenizer_folder_that_cannot_be_loaded_is_one_line(tmp_path: Path) -> None:
    for name, content in (("json", "tokenizer.json"), ("spm", "spiece.model")):
        (tmp_path / name).mkdir()
        (tmp_path / name / content).write_bytes(b"not a tokenizer")
        with pytest.raises(ValueError, match=rf"^tokenizer \S+{name}: cannot load it \(") as exc:
            tokenizer.load_tokenizer(tmp_path / name)
        assert "\n" not in str(exc.value)


def test_cache_path_is_the_same_through_a_symlinked_root(tmp_path: Path) -> None:
    files = _tiny_pngs(tmp_path / "real" / "a", 2)
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    via_link = [tmp_path / "link" / "a" / f.name for f in files]
    assert (image_cache.cache_path(tmp_path / "c", "t", tmp_path / "link", via_link, 4)
            == image_cache.cache_path(tmp_path / "c", "t", tmp_path / "real", files, 4))


def test_decoding_uses_the_pool_of_decode_workers_by_default(tmp_path: Path, monkeypatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    pools: list[int] = []

    def threads(workers: int) -> ThreadPoolExecutor:
        pools.append(workers)
        return ThreadPoolExecutor(workers)

    monkeypatch.setattr(image_cache, "decode_workers", lambda count: 2)
    monkeypatch.setattr(image_cache, "_pool", threads)
    files = _tiny_pngs(tmp_path / "imgs", 3)
    assert image_cache.unreadable(files) == [] and pools == [2]
    assert image_cache.unreadable(files, workers=0) == [] and pools == [2]


def test_check_root_expands_the_home_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data").mkdir()
    assert folders.check_root("~/data") == tmp_path / "data"


def test_absent_line_lists_every_absent_class() -> None:
    scan = folders.FolderScan(absent=["dog", "horse"])
    assert scan.absent_line("pacs", Path("/r")) == (
        "pacs: class(es) dog, horse of the preset have no folder in any domain under /r: the model keeps their "
        "outputs, no sample trains or tests them")


def test_check_root_refuses_a_missing_root_or_a_file_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for root in (tmp_path / "nowhere", tmp_path / "file"):
        with pytest.raises(FileNotFoundError, match=re.escape(f"dataset root {root} does not exist or is not a folder; "
                                                              f"{folders.LAYOUT}")):
            folders.check_root(root)


def test_synth_noise_saturates_at_black_and_white_instead_of_wrapping(monkeypatch) -> None:
    monkeypatch.setattr(digits, "SYNTH_PER_CLASS", 2)
    monkeypatch.setattr(digits, "_render_synth", lambda rng, label, size: np.full((3, size, size), 255 * (label % 2),
                                                                                 dtype=np.uint8))
    images, labels = digits.build_synth(0)
    assert (images[labels % 2 == 1] >= 200).all() and (images[labels % 2 == 0] <= 55).all()
    assert (images == 255).any() and (images == 0).any()


def test_a_misspelled_class_folder_in_several_domains_names_them_all(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"a": {"dog": 1, "dgo": 1}, "b": {"dog": 1, "dgo": 1}, "c": {"dog": 1}})
    assert check_dataset("folder", root=str(root)) == [
        f"class folder {root / 'a' / 'dgo'}, {root / 'b' / 'dgo'} (only in a, b) looks like a misspelling of dog/"]
