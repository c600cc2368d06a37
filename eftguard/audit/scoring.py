"""The auditor: joins attack results with ground truth and scores them. Attacks never come here; this is
the only code that reads truth/ (RunDirectory.load_truth) and the original client images.

One scoring path for every image attack: `score_client` turns reconstructions plus originals into per-image
scores for the attack and the baselines, `image_summary` pools them over clients into the score groups of
report.json (docs/report-schema.md). Label attacks likewise: `score_labels` (per client, next to
the prior-only baseline), then `label_summary`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.spatial.distance import jensenshannon

from attacks.base import ImageReconstruction, LabelEstimate
from attacks.labels import FLOOR
from eftguard import metrics
from eftguard.data import ImageSet
from eftguard.rundir import RunDirectory, RunError

GRID_IMAGES = 8
RANKED_IMAGES = 8  # the most exposed images a report shows


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
    histograms: dict | None = None  # label attacks: true and estimated class counts
    exposure: list[tuple[dict, list[np.ndarray]]] = field(default_factory=list)  # per image: its row, [original, recon]


def score_client(partition: int, recon: ImageReconstruction, originals: np.ndarray, kept: np.ndarray | None,
                 public_images: np.ndarray, lpips: metrics.LPIPS, patch_size: int,
                 true_kept_ids: np.ndarray | None = None, labels: tuple[np.ndarray, np.ndarray] | None = None,
                 client_images: np.ndarray | None = None) -> ClientScores:
    """Score reconstructions against originals (float [n, H, W, 3]); kept: bool [n, H, W] kept pixels or None.

    Reconstructions with unknown order (recon.rows None) are first matched to originals (Hungarian).
    labels: (recovered, true) class labels, scored order-free. iip: whether a reconstruction's nearest image
    among the client's images (client_images, else the originals) and the public images is its own
    (metrics.identifiability_ranks); the ranks also order the images by exposure for the report."""
    images = recon.images
    if recon.rows is None:
        images = images[metrics.hungarian_match(images, originals)]
    scored = metrics.score(images, originals, lpips, kept)
    mean_image = metrics.mean_image_baseline(public_images, len(originals))
    base = metrics.score(mean_image, originals, lpips, kept)
    others = np.concatenate([originals if client_images is None else client_images, public_images])
    exposure = add_identifiability(partition, images, mean_image, originals, others, kept, scored, base)
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
    return ClientScores(partition, groups, grid_rows, position_accuracy, label_accuracy, exposure=exposure)


def add_identifiability(partition: int, images: np.ndarray, mean_image: np.ndarray, originals: np.ndarray,
                        others: np.ndarray, kept: np.ndarray | None, scored: dict, base: dict
                        ) -> list[tuple[dict, list[np.ndarray]]]:
    """Adds "iip" to the attack's and the mean image's score groups (metrics.score's dicts): on the whole image,
    and where the run masks also on the true image's kept patches (what was sent); returns each image's exposure
    row (PSNR, the rank of its true image among the candidates) with its [original, reconstruction]."""
    ranks, candidates = metrics.identifiability_ranks(images, originals, others)
    rows = [{"client": partition, "image": i, "psnr": float(scored["metrics"]["psnr"][i]), "rank": int(rank),
             "candidates": candidates} for i, rank in enumerate(ranks)]
    scored["metrics"]["iip"] = (ranks == 1).astype(np.float64)
    base["metrics"]["iip"] = (metrics.identifiability_ranks(mean_image, originals, others)[0] == 1).astype(np.float64)
    if kept is not None:
        ranks_kept = metrics.identifiability_ranks(images, originals, others, kept)[0]
        scored["metrics_kept"]["iip"] = (ranks_kept == 1).astype(np.float64)
        base["metrics_kept"]["iip"] = (metrics.identifiability_ranks(mean_image, originals, others, kept)[0] == 1
                                       ).astype(np.float64)
        for row, rank in zip(rows, ranks_kept):
            row["rank_kept"] = int(rank)
    return [(row, [originals[i], images[i]]) for i, row in enumerate(rows)]


@dataclass
class Summary:
    """Scores pooled over clients: score group -> metric -> {"mean", "std", "median", "n"}, per-client means of
    the attack's metrics, details (the attack's own accuracies added) and, for label attacks, the histograms."""

    groups: dict
    per_client: dict
    details: dict
    histograms: dict | None = None
    ranking: list[dict] | None = None  # image attacks: the most exposed images, most exposed first
    ranking_rows: list[list[np.ndarray]] | None = None  # their [original, reconstruction]


def pooled(clients: list[ClientScores]) -> tuple[dict, dict]:
    """Every score group pooled over clients as {"metric": {"mean", "std", "n"}}, and per-client means."""
    groups = {group: {m: metrics.summarize(np.concatenate([c.groups[group][m] for c in clients]))
                      for m in clients[0].groups[group]} for group in clients[0].groups}
    per_client = {str(c.partition): {m: float(np.mean(v)) if len(v) else None
                                     for m, v in c.groups["metrics"].items()} for c in clients}
    return groups, per_client


def exposure_order(entry: tuple[dict, list]) -> tuple:
    """Most exposed first: by the better rank of the true image (whole image, or kept patches where the run masks;
    1: identified), then by PSNR."""
    row = entry[0]
    best = min(row["rank"], row.get("rank_kept", row["rank"]))
    return best, -row["psnr"]


def image_summary(clients: list[ClientScores], details: dict) -> Summary:
    """An image attack's scores pooled over clients, with the position and label accuracy of its guesses."""
    accuracies = [c.position_accuracy for c in clients if c.position_accuracy is not None]
    if accuracies:
        details = {**details, "position_accuracy": metrics.summarize(np.concatenate(accuracies))}
    label_accuracies = [c.label_accuracy for c in clients if c.label_accuracy is not None]
    if label_accuracies:
        details = {**details, "label_accuracy": metrics.summarize(np.concatenate(label_accuracies))}
    ranked = sorted((e for c in clients for e in c.exposure), key=exposure_order)[:RANKED_IMAGES]
    return Summary(*pooled(clients), details, ranking=[row for row, _ in ranked],
                   ranking_rows=[images for _, images in ranked])


def granted_positions(run: RunDirectory, round_number: int, partition: int) -> np.ndarray:
    """The kept-patch ids of each uploaded feature set: the auditor grants them to an attack run with
    positions_known (they are never uploaded)."""
    truth = run.load_truth(round_number, partition)
    if "kept_ids" not in truth:
        raise RunError(f"truth of client {partition} in round {round_number} has no kept positions "
                       "(a fedavg run): use --positions unknown")
    return truth["kept_ids"]


def score_upload_reconstruction(run: RunDirectory, round_number: int, partition: int, rows: np.ndarray,
                                recon: ImageReconstruction, dataset, public_images: np.ndarray,
                                lpips: metrics.LPIPS, patch_size: int) -> ClientScores:
    """Score reconstructions of a client's uploaded feature sets `rows` against the images behind them."""
    truth = run.load_truth(round_number, partition)
    sample_ids = truth["sample_ids"][rows]
    originals = as_float_images(dataset.train.images[sample_ids])
    true_kept = truth["kept_ids"][rows]
    kept = metrics.kept_pixels(true_kept, originals.shape[1], patch_size)
    return score_client(partition, recon, originals, kept, public_images, lpips, patch_size, true_kept)


# --- label-distribution attacks ---------------------------------------------------------------------------

def true_class_counts(run: RunDirectory, round_number: int, partition: int) -> np.ndarray:
    """The client's class histogram over all its samples (not just the uploaded ones)."""
    return run.load_truth(round_number, partition)["class_counts"].astype(np.int64)


def prior_baseline(num_examples: int, classes: np.ndarray, floored: np.ndarray | None = None) -> LabelEstimate:
    """What an attacker learns from the classes alone: n_k spread uniformly over `classes` (bool [C]: the classes
    with uploads where the attack reads them, else every class). floored: the classes an attack raised to one
    sample; the baseline given the same floor puts one sample there and spreads the rest over the other classes."""
    floored = np.zeros(len(classes), dtype=bool) if floored is None else floored & classes
    others = classes & ~floored
    counts = np.where(floored, 1.0, 0.0)
    counts[others] = (num_examples - floored.sum()) / max(others.sum(), 1)
    return LabelEstimate(counts, classes)


BASELINE_KNOWLEDGE = {True: "n_k spread uniformly over the classes with uploads",
                      False: "n_k spread uniformly over all classes (the attack does not read the uploaded labels)"}
FLOOR_KNOWLEDGE = ("baseline_floor: the baseline given the attack's floor, one sample on each class the attack raised "
                   "to one, the rest over the other classes with uploads; unfloored: the attack's counts before it")


def label_scores(estimate: LabelEstimate, true_counts: np.ndarray) -> dict[str, np.ndarray]:
    """One client's scores. l1: L1 distance of the class proportions (0..2); js: Jensen-Shannon distance of the
    proportions (base 2, 0..1); exact_count_accuracy: per truly present class, whether the estimate rounds to the
    true count; exact_count_accuracy_all: the same over all classes (absent ones hit by estimating zero, as iLRG
    scores); presence precision / recall / F1 of the estimated present classes."""
    truth = true_counts.astype(np.float64)
    counts = np.clip(np.asarray(estimate.counts, dtype=np.float64), 0, None)
    p = truth / truth.sum()
    q = counts / counts.sum() if counts.sum() > 0 else np.full(len(truth), 1 / len(truth))
    actual, claimed = truth > 0, np.asarray(estimate.present, dtype=bool)
    hits = float((actual & claimed).sum())
    precision = hits / claimed.sum() if claimed.any() else 0.0
    recall = hits / actual.sum()
    f1 = 2 * precision * recall / (precision + recall) if hits else 0.0
    exact = (np.rint(counts) == truth).astype(np.float64)
    return {"l1": np.array([np.abs(p - q).sum()]), "js": np.array([jensenshannon(p, q, base=2)]),
            "exact_count_accuracy": exact[actual], "exact_count_accuracy_all": exact,
            "presence_precision": np.array([precision]), "presence_recall": np.array([recall]),
            "presence_f1": np.array([f1])}


def score_labels(run: RunDirectory, round_number: int, partition: int, estimate: LabelEstimate,
                 upload_classes: np.ndarray | None) -> ClientScores:
    """A client's label-attack scores next to the prior baseline given the attack's knowledge (upload_classes,
    bool [C]: the classes with uploads, where the attack reads them; None: it does not), with both histograms.
    An attack that floored classes at one sample (details[FLOOR]) is also scored on its counts before the floor
    (group "unfloored"), and the baseline given the same floor beside it ("baseline_floor")."""
    truth = true_class_counts(run, round_number, partition)
    classes = np.ones(len(truth), dtype=bool) if upload_classes is None else upload_classes
    histograms = {"true": truth.tolist(), "estimated": np.round(estimate.counts, 2).tolist(),
                  "attack": estimate.details}
    if estimate.lower_bound is not None:
        histograms["lower_bound_only"] = np.flatnonzero(estimate.lower_bound).tolist()
    n_k = int(truth.sum())
    groups = {"metrics": label_scores(estimate, truth),
              "baseline": label_scores(prior_baseline(n_k, classes), truth)}
    if FLOOR in estimate.details:
        floor = estimate.details[FLOOR]
        unfloored = np.asarray(floor["unfloored_counts"], dtype=np.float64)
        floored = np.isin(np.arange(len(truth)), floor["classes"])
        groups["unfloored"] = label_scores(LabelEstimate(unfloored, unfloored > 0), truth)
        groups["baseline_floor"] = label_scores(prior_baseline(n_k, classes, floored), truth)
    return ClientScores(partition, groups, histograms=histograms)


def label_summary(clients: list[ClientScores], details: dict) -> Summary:
    """A label attack's l1, js, exact_count_accuracy and presence scores pooled over clients (n: clients, or
    present (client, class) pairs for exact_count_accuracy), per-client means and the true and estimated
    histograms."""
    shown = {f"client {c.partition} (true / estimated)":
             f"{c.histograms['true']} / {[round(x, 1) for x in c.histograms['estimated']]}"
             + (f", lower bounds only: classes {c.histograms['lower_bound_only']}"
                if c.histograms.get("lower_bound_only") else "") for c in clients}
    return Summary(*pooled(clients), {**details, **shown}, {str(c.partition): c.histograms for c in clients})
