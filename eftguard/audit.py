"""The auditor: joins attack results with ground truth and scores them. Attacks never come here; this is
the only code that reads truth/ (RunDirectory.truth_path) and the original client images.

One scoring path for every image attack: `score_client` turns reconstructions plus originals into per-image
scores for the attack and the baselines, `image_report` sums them up in DESIGN.md's report.json shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from attacks.base import ImageReconstruction, ThreatModel
from eftguard import metrics
from eftguard.data import ImageSet
from eftguard.rundir import RunDirectory, RunError

GRID_IMAGES = 8


def load_truth(run: RunDirectory, round_number: int, partition: int) -> dict[str, np.ndarray]:
    path = run.truth_path(round_number, partition)
    if not path.exists():
        raise RunError(f"{path} does not exist: this run kept ground truth on the clients (--no-record-truth), so "
                       "attacks can run but cannot be scored")
    return run.load_arrays(path)


def client_training_set(run: RunDirectory, partition: int) -> ImageSet:
    """The images a client trained on, derived from the run's configuration exactly as the client did."""
    from eftguard.federation.client import client_partition, run_dataset

    cfg = run.config()
    if not 0 <= partition < cfg.clients:
        raise RunError(f"client {partition} does not exist in {run.path} (clients 0..{cfg.clients - 1})")
    dataset = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed)
    parts = client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed, cfg.clients, cfg.beta)
    return dataset.train.subset(parts[partition])


def as_float_images(images_uint8: np.ndarray) -> np.ndarray:
    return images_uint8.astype(np.float32) / 255.0


@dataclass
class ClientScores:
    """Per-image scores of one client: group name ("metrics", "baseline", ...) -> metric -> values."""

    partition: int
    groups: dict[str, dict[str, np.ndarray]]
    grid_rows: list[list[np.ndarray]] = field(default_factory=list)
    position_accuracy: np.ndarray | None = None
    label_accuracy: np.ndarray | None = None  # per recovered label: 1 if it pairs with a true one (metrics.label_hits)


def score_client(partition: int, recon: ImageReconstruction, originals: np.ndarray, kept: np.ndarray | None,
                 public_images: np.ndarray, lpips: metrics.LPIPS, patch_size: int,
                 true_kept_ids: np.ndarray | None = None, labels: tuple[np.ndarray, np.ndarray] | None = None
                 ) -> ClientScores:
    """Score reconstructions against originals (float [n, H, W, 3]); kept: bool [n, H, W] kept pixels or None.

    Reconstructions with unknown order (recon.rows None) are first matched to originals (Hungarian).
    labels: (recovered, true) class labels, scored order-free."""
    images = recon.images
    if recon.rows is None:
        images = images[metrics.hungarian_match(images, originals)]
    scored = metrics.score(images, originals, lpips, kept)
    mean_image = metrics.mean_image_baseline(public_images, len(originals))
    base = metrics.score(mean_image, originals, lpips, kept)
    groups = {"metrics": scored["metrics"], "baseline": base["metrics"]}
    if kept is not None:
        groups["metrics_kept"] = scored["metrics_kept"]
        groups["baseline_kept"] = base["metrics_kept"]
        blurred = metrics.blurred_kept_baseline(originals, kept, sigma=patch_size)
        groups["baseline_blur"] = metrics.score(blurred, originals, lpips)["metrics"]
    shown = np.where(kept[..., None], originals, 0.5) if kept is not None else originals
    grid_rows = [[originals[i], shown[i], images[i]] for i in range(min(GRID_IMAGES, len(images)))]
    position_accuracy = None
    if recon.kept_ids is not None and true_kept_ids is not None:
        # Jaccard index, so that claiming extra positions costs as much as missing some.
        position_accuracy = np.array([len(np.intersect1d(a, b)) / len(np.union1d(a, b))
                                      for a, b in zip(recon.kept_ids, true_kept_ids)])
    label_accuracy = metrics.label_hits(*labels).astype(np.float64) if labels is not None else None
    return ClientScores(partition, groups, grid_rows, position_accuracy, label_accuracy)


def image_report(attack: str, run: RunDirectory, round_number: int, threat: ThreatModel, lpips_backend: str,
                 clients: list[ClientScores], details: dict) -> dict:
    """DESIGN.md's report.json for an image attack, pooled over clients, with per-client means."""
    report = {"attack": attack, "run": str(run.path), "round": round_number, "clients": [c.partition for c in clients],
              "capabilities": threat.capabilities(), "lpips_backend": lpips_backend}
    for group in clients[0].groups:
        report[group] = {m: metrics.summarize(np.concatenate([c.groups[group][m] for c in clients]))
                         for m in clients[0].groups[group]}
    report["per_client"] = {str(c.partition): {m: float(np.mean(v)) for m, v in c.groups["metrics"].items()}
                            for c in clients}
    accuracies = [c.position_accuracy for c in clients if c.position_accuracy is not None]
    if accuracies:
        details = {**details, "position_accuracy": metrics.summarize(np.concatenate(accuracies))}
    label_accuracies = [c.label_accuracy for c in clients if c.label_accuracy is not None]
    if label_accuracies:
        details = {**details, "label_accuracy": metrics.summarize(np.concatenate(label_accuracies))}
    report["details"] = details
    return report
