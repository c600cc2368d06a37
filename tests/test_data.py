import pickle

import numpy as np
import pytest
from PIL import Image

from eftguard.data import DataError, load_dataset
from eftguard.data.cifar import load_cifar
from eftguard.data.imagefolder import load_imagefolder
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
