"""The auditor: joins attack results with ground truth and scores them. Attacks never come here; this is
the only code that reads truth/ (RunDirectory.load_truth) and the original client images.

One scoring path for every image attack: `score_client` turns reconstructions plus originals into per-image
scores for the attack and the baselines, `image_summary` pools them over clients into the score groups of
report.json (docs/report-schema.md). Label attacks likewise: `score_labels` (per client, next to
the prior-only baseline), then `label_summary`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.spatial.distance import jensenshannon
from scipy.special import expit

from eftguard import metrics
from eftguard.attacks.base import ImageReconstruction, LabelEstimate
from eftguard.attacks.labels import FLOOR
from eftguard.data import ImageSet
from eftguard.data.plan import client_partition, run_dataset
from eftguard.data.registry import load_dataset
from eftguard.defenses.dp import default_delta
from eftguard.model import PRESETS
from eftguard.rundir import COHORT, RunDirectory, RunError

GRID_IMAGES = 8
# Public images of an original's label that compete with its reconstruction for IIP (the first ones of the split):
# bounds the model and LPIPS passes per scoring (a ViT pass per candidate). Fewer candidates can only make an image
# easier to identify, and the chance group says how many there were.
IIP_PUBLIC_PER_LABEL = 50
RANKED_IMAGES = 8  # the most exposed images a report shows


def client_training_set(run: RunDirectory, partition: int) -> ImageSet:
    """The images a client trained on, derived from the run's configuration exactly as the client did."""
    cfg = run.config()
    if not 0 <= partition < cfg.clients:
        raise RunError(f"client {partition} does not exist in {run.path} (clients 0..{cfg.clients - 1})")
    dataset = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed)
    parts = client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed, cfg.clients, cfg.beta)
    return dataset.train.subset(parts[partition])


def cohort_training_set(run: RunDirectory, round_number: int) -> ImageSet:
    """The images of every client in a --secagg round's sum, the cohort's clients in turn (as the attacks on the sum
    order them)."""
    sets = [client_training_set(run, partition) for partition in run.cohort(round_number)]
    return ImageSet(*(np.concatenate([getattr(s, name) for s in sets]) for name in ("images", "labels", "ids")))


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
                 client_images: np.ndarray | None = None, same_label: tuple[np.ndarray, np.ndarray] | None = None,
                 features: Callable[[np.ndarray], np.ndarray] | None = None) -> ClientScores:
    """Score reconstructions against originals (float [n, H, W, 3]); kept: bool [n, H, W] kept pixels or None.

    Reconstructions with unknown order (recon.rows None) are first matched to originals (Hungarian).
    labels: (recovered, true) class labels, scored order-free. iip: whether a reconstruction's nearest image among
    the client's images (client_images, else the originals) and the public images is its own
    (metrics.identifiability_ranks), in pixels, in LPIPS and, given `features` (model_features), in the attacked
    model's feature space; same_label: (the originals' labels, the public images' labels), so that only public
    images of the original's label compete, as the field draws the candidates. The pixel ranks also order the
    images by exposure for the report."""
    images = recon.images
    if recon.rows is None:
        images = images[metrics.hungarian_match(images, originals)]
    scored = metrics.score(images, originals, lpips, kept)
    mean_image = metrics.mean_image_baseline(public_images, len(originals))
    base = metrics.score(mean_image, originals, lpips, kept)
    spaces = {"iip": None, "iip_lpips": lpips.embed, **({"iip_features": features} if features is not None else {})}
    chance, exposure = add_identifiability(partition, images, mean_image, originals,
                                           originals if client_images is None else client_images, public_images,
                                           same_label, kept, scored, base, spaces)
    groups = {"metrics": scored["metrics"], "baseline": base["metrics"]}
    if kept is not None:
        groups["metrics_kept"] = scored["metrics_kept"]
        groups["baseline_kept"] = base["metrics_kept"]
        blurred = metrics.blurred_kept_baseline(originals, kept, sigma=patch_size)
        groups["baseline_blur"] = metrics.score(blurred, originals, lpips)["metrics"]
    groups["chance"] = chance
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
                        client_images: np.ndarray, public_images: np.ndarray,
                        same_label: tuple[np.ndarray, np.ndarray] | None, kept: np.ndarray | None, scored: dict,
                        base: dict, spaces: dict) -> tuple[dict, list[tuple[dict, list[np.ndarray]]]]:
    """Adds each IIP figure of `spaces` (name -> metrics.identifiability_ranks' space) to the attack's and the mean
    image's score groups (metrics.score's dicts), and "iip_kept" (pixels, on the true image's kept patches: what
    was sent) where the run masks. Returns the chance rate of every figure (1 / the image's candidates: a guess
    that carries nothing about the image) and each image's exposure row (PSNR, the pixel rank of its true image
    among the candidates) with its [original, reconstruction]."""
    candidates = np.concatenate([client_images, public_images])
    competes = np.ones((len(originals), len(candidates)), dtype=bool)
    if same_label is not None:
        original_labels, public_labels = map(np.asarray, same_label)
        first = np.zeros(len(public_labels), dtype=bool)  # the first IIP_PUBLIC_PER_LABEL public images of each label
        for label in np.unique(public_labels):
            first[np.flatnonzero(public_labels == label)[:IIP_PUBLIC_PER_LABEL]] = True
        competes[:, len(client_images):] = (public_labels[None, :] == original_labels[:, None]) & first
    # The attack and the mean image ranked in one call, so that each space embeds the candidates once.
    both, truth, competes = (np.concatenate([a, b]) for a, b in ((images, mean_image), (originals, originals),
                                                                  (competes, competes)))
    count = len(images)
    names = [*spaces, *(["iip_kept"] if kept is not None else [])]
    for name in names:
        weights = np.concatenate([kept, kept]) if name == "iip_kept" else None
        ranks, candidate_counts = metrics.identifiability_ranks(both, truth, candidates, weights, spaces.get(name),
                                                                competes)
        group = "metrics_kept" if name == "iip_kept" else "metrics"
        scored[group][name.removesuffix("_kept")] = (ranks[:count] == 1).astype(np.float64)
        base[group][name.removesuffix("_kept")] = (ranks[count:] == 1).astype(np.float64)
        if name == "iip":
            rows = [{"client": partition, "image": i, "psnr": float(scored["metrics"]["psnr"][i]), "rank": int(rank),
                     "candidates": int(n)} for i, (rank, n) in enumerate(zip(ranks[:count], candidate_counts))]
        elif name == "iip_kept":
            for row, rank in zip(rows, ranks[:count]):
                row["rank_kept"] = int(rank)
    chance = {name: 1.0 / candidate_counts[:count] for name in names}
    return chance, [(row, [originals[i], images[i]]) for i, row in enumerate(rows)]


def model_features(model: torch.nn.Module) -> Callable[[np.ndarray], np.ndarray]:
    """The attacked model's feature space for IIP: its pre-head representation (the class token after the global
    module's final norm, what the classifier head reads, as breaching's "self" score takes the last linear layer's
    input) of float images [N, H, W, 3], unit-normalised so that squared distances are 2 (1 - cosine)."""
    known: dict[bytes, np.ndarray] = {}  # the public candidates recur for every client and score group

    def embed(images: np.ndarray, batch_size: int = 64) -> np.ndarray:
        keys = [np.ascontiguousarray(image, dtype=np.float32).tobytes() for image in images]
        missing = [i for i, key in enumerate(keys) if key not in known]
        with torch.no_grad():
            for start in range(0, len(missing), batch_size):
                rows = missing[start:start + batch_size]
                x = torch.from_numpy(np.ascontiguousarray(images[rows], dtype=np.float32)).permute(0, 3, 1, 2)
                tokens = model.local_module(model.standardize(x))
                vectors = torch.nn.functional.normalize(model.global_module(tokens)[:, 0], dim=1).numpy()
                known.update((keys[i], v) for i, v in zip(rows, vectors))
        return np.stack([known[key] for key in keys])
    return embed


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


def image_rows(run: RunDirectory, round_number: int, partition: int, rows: int) -> np.ndarray:
    """The uploaded rows that hold an image, which the auditor scores: all of them, except under --dp-eps the null
    rows of the release (truth sample id -1), which hold noise alone."""
    if run.config().dp_eps <= 0:
        return np.arange(rows)
    return np.flatnonzero(run.load_truth(round_number, partition)["sample_ids"] >= 0)


def score_upload_reconstruction(run: RunDirectory, round_number: int, partition: int, rows: np.ndarray,
                                recon: ImageReconstruction, dataset, lpips: metrics.LPIPS, patch_size: int,
                                features: Callable[[np.ndarray], np.ndarray] | None = None) -> ClientScores:
    """Score reconstructions of a client's uploaded feature sets `rows` against the images behind them, beside
    the dataset's public images (the mean-image baseline; same-label IIP candidates)."""
    truth = run.load_truth(round_number, partition)
    sample_ids = truth["sample_ids"][rows]
    originals = as_float_images(dataset.train.images[sample_ids])
    true_kept = truth["kept_ids"][rows]
    kept = metrics.kept_pixels(true_kept, originals.shape[1], patch_size)
    return score_client(partition, recon, originals, kept, as_float_images(dataset.public.images), lpips, patch_size,
                        true_kept, same_label=(dataset.train.labels[sample_ids], dataset.public.labels),
                        features=features)


# --- label-distribution attacks ---------------------------------------------------------------------------

def true_class_counts(run: RunDirectory, round_number: int, partition: int) -> np.ndarray:
    """The client's class histogram over all its samples (not just the uploaded ones); COHORT: the sum over the
    --secagg round's cohort."""
    if partition == COHORT:
        return sum(true_class_counts(run, round_number, p) for p in run.cohort(round_number))
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



def label_control_groups(estimate: LabelEstimate, true_counts: np.ndarray, upload_classes: np.ndarray | None
                         ) -> dict:
    """The power check's score groups for a label attack: its scores on the control against the control's known
    histogram ("control") and those of the prior with the attack's knowledge ("control_baseline"), as the attack's
    own are scored; figures "control.l1", "control_baseline.l1", ..."""
    classes = np.ones(len(true_counts), dtype=bool) if upload_classes is None else upload_classes
    scored = {"control": estimate, "control_baseline": prior_baseline(int(true_counts.sum()), classes)}
    return {group: {name: metrics.summarize(values) for name, values in label_scores(guess, true_counts).items()}
            for group, guess in scored.items()}

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


def claimed_privacy(run: RunDirectory, sources: dict[int, tuple[int, int]]) -> tuple[float | None, float]:
    """The (epsilon, delta) the run claims towards the canaries' owners, from metrics.jsonl: the largest total
    epsilon (both channels composed: every channel's score may use what the other released, the uploaded phi
    and the parameters trained after earlier releases) any owner reported spent by the round the audit reads
    (None: the run has no DP), and the largest delta (the run's --dp-delta, else default_delta of the owner's
    public schedule size). A run without DP gets the delta it would have claimed, so that bounds compare across a
    grid."""
    from eftguard.federation.client import schedule_size  # Flower (0.4 s): `eftguard attack` starts without it

    cfg = run.config()
    records = run.metrics()
    epsilons, deltas = [], []
    for partition, round_number in set(sources.values()):
        deltas.append(cfg.dp_delta or default_delta(schedule_size(cfg, partition)))
        if cfg.dp_eps > 0:
            epsilons.append(float(records[round_number - 1]["epsilon"][str(partition)]))
    return (max(epsilons) if epsilons else None), max(deltas)


def audit_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """How likely `correct` or more right guesses out of `guesses` are if the run is (epsilon, delta)-DP with respect
    to each of `canaries` canaries (each included with probability 1/2). Steinke, Nasr & Jagielski, "Privacy
    Auditing with One (1) Training Run" (NeurIPS 2023), Theorem 3 (approximate DP; their Appendix D computes it):

        P[W >= v] <= f(v) + 2 m delta * max_{i = 1..v} (f(v - i) - f(v)) / i,
        f(u) = P[B >= u],  B ~ Binomial(r, e^eps / (1 + e^eps)),

    m canaries, r guesses, v correct; f(v - i) - f(v) = P[v - i <= B < v]. delta = 0 gives Theorem 1 (pure DP):
    W is dominated by B."""
    from scipy.stats import binom  # 0.5 s: only the DP audit's p-value needs it

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


def epsilon_ceiling(canaries: int, guesses: int, delta: float, confidence: float) -> float:
    """The largest bound `guesses` guesses among `canaries` canaries can ever show at `confidence`: every guess
    right (the bound grows with every right guess, and with the guesses when all are right). A claimed epsilon
    above it cannot be refuted by this audit, however strong its score."""
    return epsilon_lower_bound(canaries, guesses, guesses, delta, confidence)


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


# --- membership inference ---------------------------------------------------------------------------------

TPR_FPR_LEVELS = {"tpr_at_0.1pct_fpr": 0.001, "tpr_at_1pct_fpr": 0.01}


@dataclass
class MembershipCandidates:
    """The candidates of a membership attack, balanced: members (training images of the attacked clients) and as
    many held-out images of the same distribution, shuffled. is_member is the auditor's alone. pool_images /
    pool_labels: the attacker's own data for reference models, the public split plus held-out images that are
    not candidates (so no reference model is trained on a candidate, and a candidate's presence in the pool
    says nothing)."""

    images: np.ndarray
    labels: np.ndarray
    is_member: np.ndarray
    pool_images: np.ndarray
    pool_labels: np.ndarray
    members_from: str
    non_members_from: str


def held_out_images(run: RunDirectory) -> tuple[ImageSet, str]:
    """Images of the run's dataset that no client trained on, and where they come from: the train split beyond
    --train-samples (the members' own distribution); only when the run used all of it, the test split beyond
    --test-samples (never evaluated on, but possibly of another distribution: photos cuts its splits from
    different regions of each photograph)."""
    cfg = run.config()
    full = load_dataset(cfg.dataset, cfg.data_dir or None, PRESETS[cfg.model].image_size)
    used = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.test_samples, cfg.seed)
    train = full.train.subset(np.setdiff1d(np.arange(len(full.train)), used.train.ids))
    if len(train):
        return train, "train-split images beyond --train-samples (no client trained on them)"
    test = full.test.subset(np.setdiff1d(np.arange(len(full.test)), used.test.ids))
    return test, ("test-split images beyond --test-samples (the run trained on its whole train split; the server "
                  "never evaluated on these)")


def membership_members(run: RunDirectory, round_number: int, partition: int, target: str) -> tuple[ImageSet, str]:
    """global: the training images of every client that took part in rounds 1..t; update: the attacked client's
    training images; upload: the distinct images behind the client's uploaded feature sets of the round (the
    question is "is x among these feature sets?"; median sampling leaves some of a client's images out)."""
    from eftguard.federation.client import select_clients  # Flower (0.4 s): `eftguard attack` starts without it

    if target == "update":
        return client_training_set(run, partition), f"the training images of client {partition}"
    cfg = run.config()
    if target == "upload":
        full = load_dataset(cfg.dataset, cfg.data_dir or None, PRESETS[cfg.model].image_size)
        ids = np.unique(run.load_truth(round_number, partition)["sample_ids"])
        ids = ids[ids >= 0]  # not the null rows of a DP release
        return full.train.subset(ids), (f"the {len(ids)} distinct images behind client {partition}'s uploaded "
                                        f"feature sets of round {round_number}")
    trained = sorted({k for r in range(1, round_number + 1) for k in select_clients(cfg, r)})
    sets = [client_training_set(run, k) for k in trained]
    return (ImageSet(np.concatenate([s.images for s in sets]), np.concatenate([s.labels for s in sets])),
            f"the training images of clients {trained} (rounds 1..{round_number})")


def membership_candidates(run: RunDirectory, round_number: int, partition: int, target: str, count: int,
                          seed: int) -> MembershipCandidates:
    """Up to `count` members and as many held-out non-members with the same labels, a seeded random choice.
    Matching the labels keeps the question to membership: a client of a few classes (non-IID) would otherwise be
    told apart by its classes alone."""
    members, members_from = membership_members(run, round_number, partition, target)
    held_out, held_out_from = held_out_images(run)
    held_out = without_copies_of(members, held_out)
    rng = np.random.default_rng([seed, round_number, partition, 14])
    chosen_members = rng.permutation(len(members))[:count]
    chosen_members, chosen_outside = label_matched(members.labels[chosen_members], held_out.labels, rng,
                                                   chosen_members)
    if not len(chosen_members):
        raise RunError(f"{run.path} left no held-out images of its clients' classes to serve as non-members (it "
                       "trained on its whole dataset): train with --train-samples below the train split's size")
    rest = np.setdiff1d(np.arange(len(held_out)), chosen_outside)
    per_side = len(chosen_members)
    images = np.concatenate([members.images[chosen_members], held_out.images[chosen_outside]])
    labels = np.concatenate([members.labels[chosen_members], held_out.labels[chosen_outside]])
    is_member = np.concatenate([np.ones(per_side, bool), np.zeros(per_side, bool)])
    order = rng.permutation(2 * per_side)
    cfg = run.config()
    public = without_copies_of(members, run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0,
                                                    cfg.seed).public)
    pool = without_copies_of(ImageSet(images, labels),  # nor of a non-member: a reference must never see one
                             ImageSet(np.concatenate([public.images, held_out.images[rest]]),
                                      np.concatenate([public.labels, held_out.labels[rest]])))
    return MembershipCandidates(images[order], labels[order], is_member[order], pool.images, pool.labels,
                                members_from, held_out_from)


def granted_rows(run: RunDirectory, round_number: int, partition: int, images: np.ndarray, seed: int
                 ) -> np.ndarray:
    """--rows aligned: the uploaded row the auditor grants each candidate, the worst case a DP bound covers (the
    neighbouring releases differ in one known row): a member's own row (its first, if median sampling sent it
    twice), a non-member a random row holding an image (never a null row), so that the grant alone tells
    nothing."""
    cfg = run.config()
    full = load_dataset(cfg.dataset, cfg.data_dir or None, PRESETS[cfg.model].image_size)
    sample_ids = run.load_truth(round_number, partition)["sample_ids"]
    with_image = np.flatnonzero(sample_ids >= 0)
    row_of = {}
    for row in with_image[::-1]:  # the first row of an image wins
        row_of[full.train.images[sample_ids[row]].tobytes()] = row
    rng = np.random.default_rng([seed, round_number, partition, 19])
    return np.array([row_of.get(image.tobytes(), rng.choice(with_image)) for image in images], dtype=np.int64)


def without_copies_of(originals: ImageSet, images: ImageSet) -> ImageSet:
    """images without the exact pixel copies of an original (photos has flat crops, e.g. all-white logo corners,
    in several splits): a copy of a member is a member and a non-member at once."""
    copies = {image.tobytes() for image in originals.images}
    return images.subset(np.array([image.tobytes() not in copies for image in images.images], dtype=bool))


def label_matched(member_labels: np.ndarray, pool_labels: np.ndarray, rng: np.random.Generator,
                  member_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(member rows, pool rows) with equal label histograms: per class, as many pool images as chosen members,
    and members dropped where the pool has too few of their class."""
    kept_members, outside = [], []
    for label in np.unique(member_labels):
        mine = member_rows[member_labels == label]
        theirs = rng.permutation(np.flatnonzero(pool_labels == label))
        n = min(len(mine), len(theirs))
        kept_members.append(mine[:n])
        outside.append(theirs[:n])
    return np.concatenate(kept_members), np.concatenate(outside)


def roc_curve(scores: np.ndarray, is_member: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fpr, tpr) at every distinct threshold, from (0, 0) to (1, 1): predict member when score >= threshold."""
    scores, is_member = np.asarray(scores, dtype=np.float64), np.asarray(is_member, dtype=bool)
    order = np.argsort(-scores, kind="stable")
    ranked, hits = scores[order], is_member[order]
    last_of_tie = np.r_[np.flatnonzero(np.diff(ranked)), len(ranked) - 1]
    tp, fp = np.cumsum(hits)[last_of_tie], np.cumsum(~hits)[last_of_tie]
    positives, negatives = max(int(is_member.sum()), 1), max(int((~is_member).sum()), 1)
    return np.r_[0.0, fp / negatives], np.r_[0.0, tp / positives]


def roc_auc(scores: np.ndarray, is_member: np.ndarray) -> float:
    """Area under the ROC curve (trapezoids: a tie between a member and a non-member counts one half)."""
    fpr, tpr = roc_curve(scores, is_member)
    return float(np.trapezoid(tpr, fpr))


def tpr_at_fpr(scores: np.ndarray, is_member: np.ndarray, fpr_level: float) -> float | None:
    """The best TPR at a false-positive rate of at most fpr_level; None (undefined) when there are fewer than
    1 / fpr_level non-members, so that a single false positive already exceeds the level."""
    if (~np.asarray(is_member, dtype=bool)).sum() < round(1 / fpr_level):
        return None
    fpr, tpr = roc_curve(scores, is_member)
    return float(tpr[fpr <= fpr_level + 1e-12].max())


def best_balanced_accuracy(scores: np.ndarray, is_member: np.ndarray) -> float:
    """(TPR + TNR) / 2 at the best threshold."""
    fpr, tpr = roc_curve(scores, is_member)
    return float(((tpr + 1 - fpr) / 2).max())


def membership_figures(scores: np.ndarray, is_member: np.ndarray) -> dict[str, float | None]:
    return {"auc": roc_auc(scores, is_member),
            **{name: tpr_at_fpr(scores, is_member, level) for name, level in TPR_FPR_LEVELS.items()},
            "balanced_accuracy": best_balanced_accuracy(scores, is_member)}


def figure_group(figures: dict, n: int) -> dict:
    """Membership figures as a score group: each one number over all n candidates."""
    return {name: {"mean": value, "std": None if value is None else 0.0, "median": value,
                   "n": n if value is not None else 0} for name, value in figures.items()}


def chance_figures(negatives: int) -> dict:
    """A random guess's figures (TPR at an FPR finer than one non-member undefined)."""
    return {"auc": 0.5, **{name: (level if negatives >= round(1 / level) else None)
                           for name, level in TPR_FPR_LEVELS.items()}, "balanced_accuracy": 0.5}


def membership_summary(scores: np.ndarray, loss_scores: np.ndarray, is_member: np.ndarray, details: dict
                       ) -> Summary:
    """The method's figures ("metrics"), the LOSS attack's ("baseline") and a random guess's ("chance"), with
    both ROC curves in details. Each figure is one number over all candidates: n counts the candidates."""
    n = len(is_member)
    negatives = int((~is_member).sum())
    roc = {name: dict(zip(("fpr", "tpr"), (np.round(a, 6).tolist() for a in roc_curve(s, is_member))))
           for name, s in (("method", scores), ("loss", loss_scores))}
    undefined = [name for name, level in TPR_FPR_LEVELS.items() if negatives < round(1 / level)]
    details = {**details, "member_candidates": int(is_member.sum()), "non_member_candidates": negatives,
               **({"undefined": f"{', '.join(undefined)}: needs at least "
                                f"{round(1 / min(TPR_FPR_LEVELS[u] for u in undefined))} non-members, had "
                                f"{negatives}"} if undefined else {}),
               "roc": roc}
    groups = {"metrics": figure_group(membership_figures(scores, is_member), n),
              "baseline": figure_group(membership_figures(loss_scores, is_member), n),
              "chance": figure_group(chance_figures(negatives), n)}
    return Summary(groups, {}, details)


def membership_control_groups(scores: np.ndarray, is_member: np.ndarray) -> dict:
    """The power check's score groups for a membership attack: its figures on the control's candidates against
    their known membership ("control") and a random guess's ("control_baseline": AUC 0.5); figures
    "control.auc", "control_baseline.auc", ..."""
    return {"control": figure_group(membership_figures(scores, is_member), len(is_member)),
            "control_baseline": figure_group(chance_figures(int((~is_member).sum())), len(is_member))}


def control_groups(recon: np.ndarray, truth: np.ndarray, kept: np.ndarray | None, public_images: np.ndarray
                   ) -> dict:
    """The power check's score groups: PSNR of the control's reconstructions against their known public truth
    ("control") and of the mean public image ("control_baseline"), over the whole image and, where the channel
    masks, the kept patches; figures "control.psnr", "control_baseline.psnr_kept", ..."""
    baseline = metrics.mean_image_baseline(public_images, len(truth))
    groups: dict = {"control": {}, "control_baseline": {}}
    for suffix, weights in (("", None), ("_kept", kept)):
        if suffix and weights is None:
            continue
        groups["control"][f"psnr{suffix}"] = metrics.summarize(metrics.psnr(recon, truth, weights))
        groups["control_baseline"][f"psnr{suffix}"] = metrics.summarize(metrics.psnr(baseline, truth, weights))
    return groups
