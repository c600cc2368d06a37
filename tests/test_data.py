import io
import os
import pickle
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

from eftguard.data import DataError, load_dataset
from eftguard.data.cifar import load_cifar
from eftguard.data.imagefolder import UNSCALED_MODES, load_imagefolder, read_image
from eftguard.data.photos import PER_CLASS, TILE_SPLITS, load_photos


def test_photos_sizes_and_classes():
    data = load_photos()
    assert data.num_classes == 10
    for split, count in PER_CLASS.items():
        images = getattr(data, split)
        assert images.images.shape == (10 * count, 32, 32, 3)
        assert np.array_equal(np.bincount(images.labels), np.full(10, count))
    assert PER_CLASS["train"] >= 500 and PER_CLASS["test"] >= 100 and PER_CLASS["public"] >= 200


def test_photos_is_deterministic_and_splits_are_disjoint(tmp_path, monkeypatch):
    """Two builds give the same crops, and no pixel of a source photo lands in two splits (read off the crops the
    real build cuts: per photo, PER_CLASS["train"] train crops, then the test ones, then the public ones)."""
    from eftguard.data import photos
    monkeypatch.setenv("EFTGUARD_CACHE", str(tmp_path))
    crops, crop = [], photos._crop

    def recording_crop(photo, y, x, side, flip):
        crops.append((photo.shape[:2], y, x, side))
        return crop(photo, y, x, side, flip)

    monkeypatch.setattr(photos, "_crop", recording_crop)
    built = photos.build_photos()
    monkeypatch.setattr(photos, "_crop", crop)
    cached = load_photos()  # a second build, into the empty cache
    assert np.array_equal(built["train_images"], cached.train.images)
    assert np.array_equal(built["public_images"], cached.public.images)
    per_photo = sum(PER_CLASS.values())
    splits = [split for split, count in PER_CLASS.items() for _ in range(count)]
    assert len(crops) == 10 * per_photo
    for label in range(10):
        covered = {split: np.zeros(crops[label * per_photo][0], bool) for split in PER_CLASS}
        for (_, y, x, side), split in zip(crops[label * per_photo:(label + 1) * per_photo], splits):
            covered[split][y:y + side, x:x + side] = True
        assert covered["train"].any() and covered["test"].any() and covered["public"].any()
        assert not (covered["train"] & covered["test"]).any() and not (covered["train"] & covered["public"]).any()
        assert not (covered["test"] & covered["public"]).any(), label


@pytest.mark.parametrize("shape", [(300, 451), (1411, 1411), (370, 371)])
def test_photo_crops_stay_inside_their_split_tiles(shape, rng):
    from eftguard.data.photos import random_box, tiles_of
    covered = {split: np.zeros(shape, bool) for split in PER_CLASS}
    for tile, split in zip(tiles_of(shape), TILE_SPLITS):
        for _ in range(50):
            y, x, side = random_box(tile, rng)
            assert tile[0] <= y and y + side <= tile[1] and tile[2] <= x and x + side <= tile[3]
            covered[split][y:y + side, x:x + side] = True
    assert not (covered["train"] & covered["test"]).any() and not (covered["train"] & covered["public"]).any()
    assert not (covered["test"] & covered["public"]).any()


def test_limited_keeps_original_ids():
    data = load_dataset("photos", None, 32).limited(100, 50, seed=1)
    full = load_photos()
    assert len(data.train) == 100 and len(data.test) == 50
    assert np.array_equal(full.train.images[data.train.ids], data.train.images)


def write_cifar10(root, per_batch=4):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 "labels": rng.integers(0, 10, per_batch).tolist(), "batch_label": name}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return folder


def test_cifar_loader_reads_cifar_format(tmp_path):
    folder = write_cifar10(tmp_path)
    data = load_cifar("cifar10", tmp_path)
    assert len(data.train) + len(data.public) == 20 and len(data.test) == 4
    with open(folder / "test_batch", "rb") as f:
        raw = pickle.load(f)
    first = raw["data"][0].reshape(3, 32, 32).transpose(1, 2, 0)
    assert np.array_equal(data.test.images[0], first)
    assert data.test.labels.tolist() == raw["labels"]
    assert data.class_names[3] == "class3"


def test_cifar_loader_refuses_code_in_pickles(tmp_path):
    folder = write_cifar10(tmp_path)

    class Evil:
        def __reduce__(self):
            return (print, ("owned",))

    with open(folder / "test_batch", "wb") as f:
        pickle.dump({"data": Evil()}, f)
    with pytest.raises(DataError, match="refusing to load builtins.print"):
        load_cifar("cifar10", tmp_path)


def test_cifar_without_data_says_what_to_do(tmp_path, monkeypatch):
    import torchvision.datasets as tvd

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(tvd, "CIFAR10", offline)
    with pytest.raises(DataError, match="could not be downloaded.*--data-dir"):
        load_cifar("cifar10", tmp_path)


def write_tree(root, classes=("forest", "river", "beach"), per_class=10, size=40):
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (size, size + 8, 3), dtype=np.uint8)).save(root / name / f"{i}.png")


def test_imagefolder_splits_deterministically(tmp_path):
    write_tree(tmp_path / "ucm")
    a, b = load_imagefolder(tmp_path / "ucm", 32), load_imagefolder(tmp_path / "ucm", 32)
    assert a.class_names == ("beach", "forest", "river")
    assert (len(a.train), len(a.test), len(a.public)) == (18, 6, 6)
    assert a.train.images.shape[1:] == (32, 32, 3)
    assert np.array_equal(a.test.images, b.test.images)
    assert not {i.tobytes() for i in a.train.images} & {i.tobytes() for i in a.test.images}


@pytest.mark.parametrize("tree", ["flat", "presplit"])
def test_imagefolder_ids_are_positions_in_their_split_as_ground_truth_reads_them(tmp_path, tree):
    if tree == "flat":
        write_tree(tmp_path / "t")
    else:  # train is split again into train and public
        write_tree(tmp_path / "t" / "train", per_class=5)
        write_tree(tmp_path / "t" / "test", per_class=2)
    data = load_imagefolder(tmp_path / "t", 32)
    for split in (data.train, data.test, data.public):
        assert np.array_equal(split.ids, np.arange(len(split)))  # truth's sample ids index split.images
    subset = data.limited(5, None, seed=1).train
    assert np.array_equal(data.train.images[subset.ids], subset.images)


def test_imagefolder_keeps_existing_train_test_split(tmp_path):
    write_tree(tmp_path / "t" / "train", per_class=5)
    write_tree(tmp_path / "t" / "test", per_class=2)
    data = load_imagefolder(tmp_path / "t", 32)
    assert len(data.test) == 6 and len(data.train) + len(data.public) == 15


def test_bad_dataset_names_and_paths(tmp_path):
    with pytest.raises(DataError, match="unknown dataset 'mnist'"):
        load_dataset("mnist", None, 32)
    with pytest.raises(DataError, match="not a folder"):
        load_dataset(f"imagefolder:{tmp_path / 'missing'}", None, 32)
    with pytest.raises(DataError, match="needs --data-dir"):
        load_cifar("cifar100", None)


# --- hostile image folders and CIFAR copies (issue 34): every mode Pillow writes, every defect of a batch ----------

def writable_modes() -> list[tuple[str, str]]:
    """(Pillow mode, file suffix) for every mode Pillow can save in a format the image folder reads."""
    pairs = []
    for mode in sorted(Image.MODES):
        for suffix in (".png", ".tif", ".bmp", ".gif", ".webp", ".jpg"):
            try:
                Image.new(mode, (2, 2)).save(io.BytesIO(), Image.registered_extensions()[suffix])
            except (OSError, ValueError, KeyError):
                continue
            pairs.append((mode, suffix))
    return pairs


WRITABLE = writable_modes()
ALPHA_MODES = {"LA", "La", "PA", "RGBA", "RGBa"}
WEB_COLOURS = [(0, 0, 0), (255, 255, 255), (255, 0, 0), (0, 255, 0), (0, 0, 255), (204, 204, 204)]  # exact in "P"


def luma(rgb) -> int:
    """ITU-R 601 luma, the grey of a colour in every grey mode."""
    return round((299 * rgb[0] + 587 * rgb[1] + 114 * rgb[2]) / 1000)


def image_in_mode(mode: str, colour, size: int) -> tuple[Image.Image, np.ndarray]:
    """A square of one colour in mode, its top-left pixel transparent where the mode has alpha; and the RGB the
    folder must read: the colour (its luma in grey modes, black or white in 1-bit), white where transparent."""
    grey = luma(colour)
    expected = np.full((size, size, 3), colour, dtype=np.uint8)
    if mode.startswith("I;16"):
        byte_order = {"I;16B": ">"}.get(mode, "=" if mode == "I;16N" else "<")
        image = Image.frombytes(mode, (size, size), np.full((size, size), grey * 257, f"{byte_order}u2").tobytes())
    elif mode == "1":
        image = Image.new("RGB", (size, size), colour).convert("1", dither=Image.Dither.NONE)
    elif mode == "PA":
        image = Image.new("RGBA", (size, size), (*colour, 255)).convert("PA")
    else:
        image = Image.new("RGBA" if mode in ALPHA_MODES else "RGB", (size, size), colour).convert(mode)
    if mode in ("1", "L", "LA", "La", "I", "F") or mode.startswith("I;16"):
        expected[:] = 255 * (grey >= 128) if mode == "1" else grey
    if mode in ALPHA_MODES:
        image.putpixel((0, 0), (0, 0) if mode in ("LA", "La", "PA") else (0, 0, 0, 0))
        expected[0, 0] = 255
    return image, expected


def kept_by_the_writer(mode: str, saved: Image.Image) -> bool:
    """Whether the file still holds what the mode held: some of Pillow's writers drop alpha (BMP, GIF) or clip
    16-bit grey to 8 bits (GIF, WEBP) themselves, before any reader sees the file."""
    if mode.startswith("I;16"):
        return saved.mode.startswith("I;16")
    return mode not in ALPHA_MODES or saved.has_transparency_data


@pytest.mark.parametrize("mode, suffix", WRITABLE)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(colour=st.sampled_from(WEB_COLOURS), size=st.integers(2, 12))
def test_every_mode_pillow_writes_is_read_as_its_colours_or_refused_in_one_line(mode, suffix, colour, size):
    """Every mode in every format Pillow writes it to, colours and sizes generated: CMYK's K is never alpha,
    16-bit grey is scaled, not clipped, 1-bit is black and white, transparency is white; 32-bit integer and float
    pixels, whose scale no file states, are one DataError naming the fix."""
    image, expected = image_in_mode(mode, colour, size)
    with tempfile.TemporaryDirectory() as folder:
        file = Path(folder) / f"image{suffix}"
        image.save(file)
        with Image.open(file) as held:
            saved, kept = held.mode, kept_by_the_writer(mode, held)
        if saved in UNSCALED_MODES:
            with pytest.raises(DataError, match=rf"{file} has .* pixels \(Pillow mode {saved}\), whose scale is not "
                                                "fixed: convert it to 8- or 16-bit RGB or greyscale"):
                read_image(file)
            return
        read = read_image(file)
    assert read.dtype == np.uint8 and read.shape == (size, size, 3)
    if kept:
        error = np.abs(read.astype(int) - expected).max(axis=-1)
        lossy = suffix in (".jpg", ".webp")  # compressed: edges around the transparent pixel blur
        bound = 24 if mode == "LAB" else 12 if lossy else 3  # LAB: sRGB's primaries sit at the edge of 8-bit a, b
        assert (np.median(error) if lossy else error.max()) <= bound, (mode, suffix, saved, read[1, 1])


def test_cmyk_is_converted_as_colour_not_read_with_k_as_alpha(tmp_path):
    Image.new("CMYK", (4, 4), (0, 255, 255, 0)).save(tmp_path / "red.tif")  # red: no black ink at all
    assert read_image(tmp_path / "red.tif")[0, 0].tolist() == [255, 0, 0]


def decompression_bomb(path: Path, side: int = 100_000) -> None:
    """A valid PNG header of side x side pixels (10 billion) and a few bytes of data: Pillow reads the header only."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


@pytest.mark.parametrize("damage, message", [
    (decompression_bomb, "is refused as a decompression bomb"),
    (lambda path: Image.new("F", (4, 4), 0.5).save(path.with_suffix(".tif")), "floating-point pixels (Pillow mode F)"),
    (lambda path: Image.new("I", (4, 4), 70000).save(path.with_suffix(".tif")), "32-bit integer pixels"),
    (lambda path: os.mkfifo(path), "is not a regular file: give image files only"),
    (lambda path: path.write_bytes(b"not an image"), "cannot read"),
])
def test_an_image_folder_with_an_unreadable_image_is_one_line_before_any_work(tmp_path, capsys, damage, message):
    from conftest import run_cli

    write_tree(tmp_path / "ucm", per_class=3)
    damage(tmp_path / "ucm" / "forest" / "bad.png")
    code, err = run_cli(capsys, "train", "--dataset", f"imagefolder:{tmp_path / 'ucm'}", "--out", tmp_path / "run")
    assert code == 2 and err.count("\n") == 1 and err.startswith("eftguard: error: imagefolder: ")
    assert message in err and str(tmp_path / "ucm" / "forest" / "bad") in err and not (tmp_path / "run").exists()


CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
BATCH_DEFECTS = {
    "a list": lambda batch: [batch["data"], batch["labels"]],
    "an array": lambda batch: batch["data"],
    "a string": lambda batch: "data",
    "no data": lambda batch: {"labels": batch["labels"]},
    "no labels": lambda batch: {"data": batch["data"]},
    "labels under CIFAR-100's key": lambda batch: {"data": batch["data"], "fine_labels": batch["labels"]},
    "flat data": lambda batch: {**batch, "data": batch["data"].ravel()},
    "images as 3x32x32": lambda batch: {**batch, "data": batch["data"].reshape(-1, 3, 32, 32)},
    "a pixel short": lambda batch: {**batch, "data": batch["data"][:, :-1]},
    "no images": lambda batch: {**batch, "data": batch["data"][:0], "labels": []},
    "float pixels": lambda batch: {**batch, "data": batch["data"] / 255.0},
    "pixels above 255": lambda batch: {**batch, "data": batch["data"].astype(np.int64) + 256},
    "negative pixels": lambda batch: {**batch, "data": batch["data"].astype(np.int64) - 256},
    "text pixels": lambda batch: {**batch, "data": batch["data"].astype(str)},
    "a label short": lambda batch: {**batch, "labels": batch["labels"][:-1]},
    "a label too many": lambda batch: {**batch, "labels": batch["labels"] + [0]},
    "labels as text": lambda batch: {**batch, "labels": [str(label) for label in batch["labels"]]},
    "fractional labels": lambda batch: {**batch, "labels": [label + 0.5 for label in batch["labels"]]},
    "a negative label": lambda batch: {**batch, "labels": [-1] + batch["labels"][1:]},
    "a label past the classes": lambda batch: {**batch, "labels": [10] + batch["labels"][1:]},
    "ragged labels": lambda batch: {**batch, "labels": [[0, 1]] + batch["labels"][1:]},
}
META_DEFECTS = {
    "a list": lambda meta: meta["label_names"],
    "no names": lambda meta: {"num_cases_per_batch": 4},
    "names as numbers": lambda meta: {"label_names": list(range(10))},
    "one class": lambda meta: {"label_names": ["only"]},
}
FILE_DEFECTS = {
    "truncated": lambda path: path.write_bytes(path.read_bytes()[: path.stat().st_size // 2]),
    "empty": lambda path: path.write_bytes(b""),
    "a named pipe": lambda path: (path.unlink(), os.mkfifo(path)),
    "a folder": lambda path: (path.unlink(), path.mkdir()),
    "a link to /dev/zero": lambda path: (path.unlink(), path.symlink_to("/dev/zero")),
}


DEFECTS = ([("batch", name) for name in sorted(BATCH_DEFECTS)] + [("meta", name) for name in sorted(META_DEFECTS)]
           + [("file", name) for name in sorted(FILE_DEFECTS)] + [("bytes", "random bytes")])


@pytest.mark.parametrize("kind, damage", DEFECTS, ids=[f"{kind}: {damage}" for kind, damage in DEFECTS])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_defect_of_a_cifar_batch_is_a_data_error_naming_the_file(kind, damage, data):
    """Every defect the format can have, each on a generated file: what a batch holds, its keys, the shape, type
    and range of data and labels, the meta file's class names, the file itself, random bytes. One DataError that
    names the file and says to download it again, never a traceback and never a read that does not end."""
    file = data.draw(st.just("batches.meta") if kind == "meta" else st.sampled_from(
        CIFAR10_FILES + (["batches.meta"] if kind in ("file", "bytes") else [])), label="file")
    if kind == "bytes":
        damage = data.draw(st.binary(max_size=64), label="bytes")
    with tempfile.TemporaryDirectory() as folder:
        path = write_cifar10(Path(folder)) / file
        if kind in ("batch", "meta"):
            with open(path, "rb") as f:
                content = pickle.load(f)
            with open(path, "wb") as f:
                pickle.dump((BATCH_DEFECTS if kind == "batch" else META_DEFECTS)[damage](content), f)
        elif kind == "file":
            FILE_DEFECTS[damage](path)
        else:
            path.write_bytes(damage)
        with pytest.raises(DataError) as refused:
            load_cifar("cifar10", Path(folder))
    assert str(path) in str(refused.value) and "download it again" in str(refused.value)


def test_a_cifar_batch_that_is_a_named_pipe_is_one_line_before_any_work(tmp_path, capsys):
    """A pipe no one writes, read as a batch, never ends: refused before it is opened."""
    from conftest import run_cli

    batch = write_cifar10(tmp_path / "data") / "data_batch_3"
    batch.unlink()
    os.mkfifo(batch)
    code, err = run_cli(capsys, "train", "--dataset", "cifar10", "--data-dir", tmp_path / "data", "--out",
                        tmp_path / "run")
    assert code == 2 and err == (f"eftguard: error: {batch} is not a regular file: the CIFAR copy is damaged; delete "
                                 "it and download it again\n")
    assert not (tmp_path / "run").exists()


def test_load_cifar_names_a_data_dir_that_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("not a folder\n")
    with pytest.raises(DataError, match="afile is a file: give the folder that holds"):
        load_cifar("cifar10", tmp_path / "afile")
