"""Reference models for the membership attacks that need them (LiRA, RMIA): the attacked run's configuration,
trained by the normal trainer (the real server and clients over an in-process grid) on a random half of the
attacker's own data, for as many rounds as the attacked round.

The attacker's data (the reference pool) is the public split plus held-out images that are not candidates.
Offline, that is all a reference model trains on: none ever saw a candidate. Online (the attacker knows the
candidates), every candidate is added to a random half of the reference models, exactly half of them, as in
LiRA's reference code. Each reference model is a run directory under the cache folder, named by a digest of the
configuration, its training images, the round and the seed: a second audit with the same inputs loads the
finished run instead of training again, and an interrupted one resumes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from eftguard.attacks.base import Progress
from eftguard.data import ImageSet
from eftguard.data.plan import run_dataset
from eftguard.rundir import RunDirectory

DATA = "data"
RUN = "run"


def reference_key(config_toml: str, training: ImageSet, round_number: int, seed: int, index: int) -> str:
    digest = hashlib.sha256(config_toml.encode())
    for array in (training.images, training.labels):
        digest.update(np.ascontiguousarray(array).tobytes())
    digest.update(repr((round_number, seed, index)).encode())
    return digest.hexdigest()[:16]


def random_half(labels: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """About `size` indices drawn per class in proportion (at least one of every class the pool holds), so that
    the reference run sees every class the attacked run's model knows."""
    fraction = size / len(labels)
    chosen = [rng.choice(members, max(1, round(len(members) * fraction)), replace=False)
              for members in (np.flatnonzero(labels == c) for c in np.unique(labels))]
    return np.sort(np.concatenate(chosen))


def write_split(folder: Path, images: ImageSet, classes: int) -> None:
    """One PNG per image under folder/cNNN/ (lossless; sorted class folders keep the label order)."""
    for c in range(classes):
        (folder / f"c{c:03d}").mkdir(parents=True, exist_ok=True)
    for i, (image, label) in enumerate(zip(images.images, images.labels)):
        Image.fromarray(image).save(folder / f"c{int(label):03d}" / f"{i:06d}.png")


def with_every_class(split: ImageSet, donor: ImageSet, classes: int) -> ImageSet:
    """split plus one donor image of each class it lacks (an image folder needs every class in every split)."""
    missing = [int(np.flatnonzero(donor.labels == c)[0]) for c in range(classes) if not (split.labels == c).any()]
    if not missing:
        return split
    extra = donor.subset(np.array(missing))
    return ImageSet(np.concatenate([split.images, extra.images]), np.concatenate([split.labels, extra.labels]))


def half_of_the_models(count: int, images: int, rng: np.random.Generator) -> np.ndarray:
    """[count, images] bool: each image in exactly count // 2 models, a random choice per image."""
    return np.argsort(rng.random((count, images)), axis=0) < count // 2


def reference_models(run: RunDirectory, round_number: int, pool: ImageSet, count: int, seed: int, cache: Path,
                     candidates: ImageSet | None = None, progress: Progress | None = None
                     ) -> tuple[list, np.ndarray | None]:
    """`count` models of the run's configuration after `round_number` rounds, each trained on a random half of
    the pool and, online (candidates given), on the candidates of its row of the returned [count, candidates]
    inclusion, at most as many images in all as the run's clients hold (where the pool allows); loaded from the
    cache or trained into it."""
    # Flower (0.4 s): `eftguard attack` starts without it, only the reference models' training needs it
    from eftguard.federation.inprocess import train_in_process
    from eftguard.federation.server import guard_images

    cfg = run.config()
    dataset = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.test_samples, cfg.seed)
    trained_on = None if candidates is None else half_of_the_models(
        count, len(candidates), np.random.default_rng([seed, round_number, 18]))
    guard = ImageSet(*(t.numpy() for t in guard_images(dataset, cfg.seed)))  # all a run reads of its public split
    models = []
    for index in range(count):
        added = 0 if trained_on is None else int(trained_on[index].sum())  # online: as many images as the run, all in
        half = pool.subset(random_half(pool.labels, max(1, min(len(pool) // 2, len(dataset.train) - added)),
                                       np.random.default_rng([seed, round_number, index, 15])))
        if trained_on is not None:
            chosen = candidates.subset(np.flatnonzero(trained_on[index]))
            half = ImageSet(np.concatenate([half.images, chosen.images]), np.concatenate([half.labels, chosen.labels]))
        folder = cache / f"reference-{reference_key(cfg.to_toml(), half, round_number, seed, index)}"
        if not (folder / RUN).is_dir() or RunDirectory.open(folder / RUN).completed_rounds() < round_number:
            data = folder / DATA
            if not data.is_dir():  # written aside and renamed, so that an interrupted write is never used
                partial = folder / f"{DATA}.partial"
                shutil.rmtree(partial, ignore_errors=True)
                write_split(partial / "train", half, dataset.num_classes)
                write_split(partial / "test", with_every_class(dataset.test, dataset.public, dataset.num_classes),
                            dataset.num_classes)
                write_split(partial / "public", with_every_class(guard, half, dataset.num_classes),
                            dataset.num_classes)
                partial.rename(data)
            if not (folder / RUN).is_dir():
                reference_cfg = dataclasses.replace(
                    cfg, dataset=f"imagefolder:{data.resolve()}", data_dir="", train_samples=0, test_samples=0,
                    rounds=round_number, record_truth=False, encrypt_at_rest="", keep_rounds="none",  # final model only
                    seed=int(np.random.default_rng([seed, index, 16]).integers(2 ** 31))).resolved()
                RunDirectory.create(folder / RUN, reference_cfg)
            train_in_process(folder / RUN, cfg.clients)
        models.append(RunDirectory.open(folder / RUN).start_model(round_number + 1))
        if progress:
            progress("reference models", index + 1, count)
    return models, trained_on
