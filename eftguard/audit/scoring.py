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
from eftguard import metrics
from eftguard.data import ImageSet
from eftguard.rundir import RunDirectory, RunError

GRID_IMAGES = 8


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


@dataclass
class Summary:
    """Scores pooled over clients: score group -> metric -> {"mean", "std", "median", "n"}, per-client means of
    the attack's metrics, details (the attack's own accuracies added) and, for label attacks, the histograms."""

    groups: dict
    per_client: dict
    details: dict
    histograms: dict | None = None


def pooled(clients: list[ClientScores]) -> tuple[dict, dict]:
    """Every score group pooled over clients as {"metric": {"mean", "std", "n"}}, and per-client means."""
    groups = {group: {m: metrics.summarize(np.concatenate([c.groups[group][m] for c in clients]))
                      for m in clients[0].groups[group]} for group in clients[0].groups}
    per_client = {str(c.partition): {m: float(np.mean(v)) if len(v) else None
                                     for m, v in c.groups["metrics"].items()} for c in clients}
    return groups, per_client


def image_summary(clients: list[ClientScores], details: dict) -> Summary:
    """An image attack's scores pooled over clients, with the position and label accuracy of its guesses."""
    accuracies = [c.position_accuracy for c in clients if c.position_accuracy is not None]
    if accuracies:
        details = {**details, "position_accuracy": metrics.summarize(np.concatenate(accuracies))}
    label_accuracies = [c.label_accuracy for c in clients if c.label_accuracy is not None]
    if label_accuracies:
        details = {**details, "label_accuracy": metrics.summarize(np.concatenate(label_accuracies))}
    return Summary(*pooled(clients), details)


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


def prior_baseline(true_counts: np.ndarray) -> LabelEstimate:
    """What an attacker learns from the classes alone: n_k spread uniformly over the present classes."""
    present = true_counts > 0
    counts = np.where(present, true_counts.sum() / max(present.sum(), 1), 0.0)
    return LabelEstimate(counts, present)


def label_scores(estimate: LabelEstimate, true_counts: np.ndarray) -> dict[str, np.ndarray]:
    """One client's scores. l1: L1 distance of the class proportions (0..2); js: Jensen-Shannon distance of the
    proportions (base 2, 0..1); exact_count_accuracy: per truly present class, whether the estimate rounds to the
    true count; presence precision / recall / F1 of the estimated present classes."""
    truth = true_counts.astype(np.float64)
    counts = np.clip(np.asarray(estimate.counts, dtype=np.float64), 0, None)
    p = truth / truth.sum()
    q = counts / counts.sum() if counts.sum() > 0 else np.full(len(truth), 1 / len(truth))
    actual, claimed = truth > 0, np.asarray(estimate.present, dtype=bool)
    hits = float((actual & claimed).sum())
    precision = hits / claimed.sum() if claimed.any() else 0.0
    recall = hits / actual.sum()
    f1 = 2 * precision * recall / (precision + recall) if hits else 0.0
    return {"l1": np.array([np.abs(p - q).sum()]), "js": np.array([jensenshannon(p, q, base=2)]),
            "exact_count_accuracy": (np.rint(counts[actual]) == truth[actual]).astype(np.float64),
            "presence_precision": np.array([precision]), "presence_recall": np.array([recall]),
            "presence_f1": np.array([f1])}


def score_labels(run: RunDirectory, round_number: int, partition: int, estimate: LabelEstimate) -> ClientScores:
    """A client's label-attack scores next to the prior-only baseline, with both histograms for the report."""
    truth = true_class_counts(run, round_number, partition)
    histograms = {"true": truth.tolist(), "estimated": np.round(estimate.counts, 2).tolist(),
                  "attack": estimate.details}
    if estimate.lower_bound is not None:
        histograms["lower_bound_only"] = np.flatnonzero(estimate.lower_bound).tolist()
    return ClientScores(partition, {"metrics": label_scores(estimate, truth),
                                    "baseline": label_scores(prior_baseline(truth), truth)}, histograms=histograms)


def label_summary(clients: list[ClientScores], details: dict) -> Summary:
    """A label attack's l1, js, exact_count_accuracy and presence scores pooled over clients (n: clients, or
    present (client, class) pairs for exact_count_accuracy), per-client means and the true and estimated
    histograms."""
    shown = {f"client {c.partition} (true / estimated)":
             f"{c.histograms['true']} / {[round(x, 1) for x in c.histograms['estimated']]}"
             + (f", lower bounds only: classes {c.histograms['lower_bound_only']}"
                if c.histograms.get("lower_bound_only") else "") for c in clients}
    return Summary(*pooled(clients), {**details, **shown}, {str(c.partition): c.histograms for c in clients})


# --- dp-audit: canaries, their inclusion bits and the one-run epsilon lower bound --------------------------

def canary_bits(run: RunDirectory, sources: dict[int, tuple[int, int]]) -> np.ndarray:
    """The inclusion bits of the canaries, in the order of `sources` (canary id -> (owner, a round in which the
    owner recorded its truth); the bits are the same in every round)."""
    bits = {}
    for partition, round_number in sorted(set(sources.values())):
        truth = run.load_truth(round_number, partition)
        if "canary_ids" not in truth:
            raise RunError(f"truth of client {partition} in round {round_number} names no canaries: the run was "
                           "not trained with --canaries M")
        bits |= dict(zip(truth["canary_ids"].tolist(), truth["canary_included"].tolist()))
    missing = [c for c in sources if c not in bits]
    if missing:
        raise RunError(f"the truth of the canaries' owners does not name canaries {missing[:5]}: the run's truth/ "
                       "does not match its config.toml")
    return np.array([bits[c] for c in sources], dtype=np.int64)


CLAIM_KEYS = {"parameters": "epsilon_parameters", "features": "epsilon_features", "model": "epsilon"}


def claimed_privacy(run: RunDirectory, channel: str, sources: dict[int, tuple[int, int]]) -> tuple[float | None, float]:
    """The (epsilon, delta) the run claims for a channel towards the canaries' owners, from metrics.jsonl: the
    largest epsilon any owner reported spent by the round the audit reads (None: the run has no DP), and the
    largest delta (the run's --dp-delta, else 1 / (10 n_k), n_k without canaries as the server scheduled it; per
    channel at half of it when the features share the budget). A run without DP gets the delta it would have claimed, so that bounds compare across a grid."""
    from defenses.dp import channel_delta, default_delta
    from eftguard.federation.client import client_partition, feature_share

    cfg = run.config()
    records = run.metrics()
    parts = client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed, cfg.clients, cfg.beta)
    epsilons, deltas = [], []
    for partition, round_number in set(sources.values()):
        record = records[round_number - 1]
        total = cfg.dp_delta or default_delta(len(parts[partition]))  # n_k of the schedule: the client's own data
        deltas.append(total if channel == "model" else channel_delta(total, feature_share(cfg)))
        if cfg.dp_eps > 0:
            epsilons.append(float(record[CLAIM_KEYS[channel]][str(partition)]))
    return (max(epsilons) if epsilons else None), max(deltas)


def audit_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """How likely `correct` or more right guesses out of `guesses` are if the run is (epsilon, delta)-DP with respect
    to each of `canaries` canaries (each included with probability 1/2). Steinke, Nasr & Jagielski, "Privacy
    Auditing with One (1) Training Run" (NeurIPS 2023), Theorem 3 (approximate DP; their Appendix D computes it):

        P[W >= v] <= f(v) + 2 m delta * max_{i = 1..v} (f(v - i) - f(v)) / i,
        f(u) = P[B >= u],  B ~ Binomial(r, e^eps / (1 + e^eps)),

    m canaries, r guesses, v correct; f(v - i) - f(v) = P[v - i <= B < v]. delta = 0 gives Theorem 1 (pure DP):
    W is dominated by B."""
    from scipy.special import expit
    from scipy.stats import binom

    q = expit(epsilon)  # the accuracy of epsilon-DP randomised response
    tail = float(binom.sf(correct - 1, guesses, q))
    if delta == 0 or correct == 0:
        return min(tail, 1.0)
    below = np.cumsum(binom.pmf(np.arange(correct - 1, -1, -1), guesses, q))  # P[v - i <= B < v], i = 1..v
    return min(1.0, tail + 2 * canaries * delta * float(np.max(below / np.arange(1, correct + 1))))


def epsilon_lower_bound(canaries: int, guesses: int, correct: int, delta: float, confidence: float) -> float:
    """The largest epsilon the audit rejects at `confidence`: the run is not (epsilon, delta)-DP for any smaller
    epsilon, unless an event of probability below 1 - confidence happened. Bisection on audit_p_value (increasing
    in epsilon), to 1e-6; 0 when the guesses are no better than chance can explain."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct ({correct}) <= guesses ({guesses}) <= canaries ({canaries})")
    level = 1 - confidence
    if guesses == 0 or audit_p_value(canaries, guesses, correct, 0.0, delta) > level:
        return 0.0
    low, high = 0.0, 1.0
    while audit_p_value(canaries, guesses, correct, high, delta) <= level:
        low, high = high, 2 * high
    while high - low > 1e-6:
        middle = (low + high) / 2
        rejected = audit_p_value(canaries, guesses, correct, middle, delta) <= level
        low, high = (middle, high) if rejected else (low, middle)
    return low


@dataclass
class AuditGuesses:
    """The auditor's guesses from canary scores: included for the k+ highest, excluded for the k- lowest,
    abstaining on the rest, and how many of them the inclusion bits prove right."""

    canaries: int
    guesses: int
    correct: int
    guessed_in: int
    correct_in: int
    guessed_out: int
    correct_out: int


def guess_inclusion(scores: np.ndarray, bits: np.ndarray, guesses_in: int, guesses_out: int) -> AuditGuesses:
    """Guess "included" for the guesses_in highest scores and "excluded" for the guesses_out lowest (ties broken
    by canary order, never by the bits), then count the right ones; at most len(scores) guesses in all."""
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    inside, outside = order[:guesses_in], order[len(order) - guesses_out:] if guesses_out else order[:0]
    right_in, right_out = int(bits[inside].sum()), int((1 - bits[outside]).sum())
    return AuditGuesses(len(scores), guesses_in + guesses_out, right_in + right_out, guesses_in, right_in,
                        guesses_out, right_out)
