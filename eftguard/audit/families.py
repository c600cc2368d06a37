"""The attack families, one object each: its options, how its observation is built, how its attack is constructed,
how its result is scored into an AttackReport, and its leakage channel (`channel`: the figures, verdict row and
plots of eftguard.channels). Everything else (checks, timing, writing) is shared, in eftguard.audit.api.

Adding a method to a family is one registered class in attacks/; adding a family is a registry there, an
observation builder in eftguard.audit.observe, a Family here and its Channel in eftguard.channels
(docs/add-an-attack.md).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from eftguard import channels, metrics
from eftguard.attack_report import AttackReport
from eftguard.attacks.base import Attack, AttackError, Registry, ThreatModel, reads_a_tampered_round
from eftguard.attacks.dp_audit import CHANNELS, DP_AUDIT
from eftguard.attacks.gradient import GRADIENT
from eftguard.attacks.fishing import FishingAttack  # noqa: F401  registers the gradient family's fishing method
from eftguard.attacks.imprint import ImprintAttack  # noqa: F401  registers the gradient family's imprint method
from eftguard.attacks.inversion import INVERT
from eftguard.attacks.labels import LABELS
from eftguard.attacks.membership import MEMBERSHIP, TARGETS, LossAttack, reference_threat
from eftguard.attacks.update_inversion import training_masks
from eftguard.audit import observe, scoring
from eftguard.audit.references import ReferenceOutputs, reference_models
from eftguard.data import ImageSet
from eftguard.data.registry import load_dataset
from eftguard.methods import method_spec
from eftguard.model import PRESETS, build_model
from eftguard.options import Option, finite_number, name_value, option, options_of, path_value, whole_number
from eftguard.rundir import COHORT, RunDirectory


@dataclass
class Job:
    """One attack run after the checks: the run, round, clients and the family's options (defaults filled)."""

    run: RunDirectory
    round_number: int
    clients: list[int]
    seed: int
    lpips_backend: str | None
    options: dict  # the family's options
    ran_with: dict  # every option the attack runs with, as report.json records it


@dataclass
class Observed:
    """An observation for the attack, and what the auditor keeps beside it for scoring (out of the attack's reach)."""

    observation: object
    auditor: dict


class Family:
    """One attack family. Subclasses set the class attributes and implement observe and score."""

    name: str
    registry: Registry
    help: str  # one line: the subcommand in `eftguard attack --help`
    description: str  # the subcommand's --help
    options_type: type  # a dataclass of the family's own options, declared with eftguard.attacks.base.option
    image_metrics: bool  # scored by PSNR / SSIM / CW-SSIM / LPIPS (takes --lpips-backend)
    seeded: bool  # draws randomness of its own (takes --seed)
    cli_method: str  # --method's default on the command line ("all": every method)
    attacks_the_sum: bool = False  # on a --secagg run it attacks the cohort's aggregate (the client COHORT)

    def on_the_sum(self, run: RunDirectory, round_number: int, cls: type) -> bool:
        """Whether the attack class targets the cohort's aggregate (the client COHORT) on this round: a --secagg round
        that holds no client's upload (eftvit's features are per client even then, and attacked so)."""
        return run.config().secagg and self.attacks_the_sum and not run.uploaded_partitions(round_number)

    @property
    def options(self) -> tuple[Option, ...]:
        return options_of(self.options_type)

    @property
    def channel(self) -> channels.Channel:
        """What the family measures and how the verdict, gates and reports show it (its eftguard.channels entry)."""
        return channels.CHANNELS[self.name]

    def pick_clients(self, clients: list[int], choice: str | list[int]) -> list[int]:
        """The attacked clients among those chosen (--clients) with uploads in the round."""
        return clients

    def threat_model(self, job: Job, cls: type) -> ThreatModel:
        """The attack class's own threat model, unless the family's options set it (invert: --positions, --aux)."""
        return cls.threat_model

    def attack(self, cls: type, job: Job, method_options: dict) -> Attack:
        """The attack with its options, its threat model and the seed where the class takes them."""
        takes = {f.name for f in fields(cls) if f.init}
        extra = {"threat_model": self.threat_model(job, cls), "seed": job.seed}
        return cls(**method_options, **{k: v for k, v in extra.items() if k in takes})

    def observe(self, job: Job, attack: Attack) -> Observed:
        """What the attacker holds in the job's round (the family's observation builder in eftguard.audit.observe)."""
        raise NotImplementedError

    def score(self, job: Job, attack: Attack, observed: Observed, result, seconds: float) -> AttackReport:
        """The auditor's turn: join the result with ground truth (eftguard.audit.scoring) into the report."""
        raise NotImplementedError

    def control(self, job: Job, attack: Attack, observed: Observed, progress=None) -> tuple[dict, str] | None:
        """The power check (docs/reports.md): the same attack with the same budget on a positive control, public
        images through the same model and channel with the defense off, scored against their known truth. Returns
        (score groups "control" and "control_baseline" named by the channel's headline figures, what the control
        was); None where the family has none yet (its "low" then reads "unchecked")."""
        return None

    def report(self, job: Job, attack: Attack, summary: scoring.Summary, lpips_backend: str | None,
               grid: list | None = None) -> AttackReport:
        return AttackReport(self.name, attack.name, f"{self.name}-{attack.name}", str(job.run.path), job.round_number,
                            job.clients, attack.threat_model.capabilities(),
                            {k: json_ready(v) for k, v in job.ran_with.items()}, summary.groups, summary.per_client,
                            summary.details, lpips_backend, summary.histograms, grid, summary.ranking,
                            summary.ranking_rows)


def json_ready(value):
    """Option values as report.json holds them: paths as text, numpy scalars as numbers."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


def public_images(run: RunDirectory) -> np.ndarray:
    """The run dataset's public split as float images: the mean-image baseline and the attacks' prior."""
    return scoring.as_float_images(observe.run_public_images(run.config()))


# --- invert -------------------------------------------------------------------------------------------------

CONTROL_IMAGES = 8  # public images the feature channel's power check attacks


@dataclass
class InvertOptions:
    positions: str = option("known", "known: the auditor grants the kept-token positions of each upload (a server "
                                     "that chose the masks); unknown: the attack infers them from the features",
                            name_value, choices=("known", "unknown"))
    aux: str = option("public", "auxiliary images of the attacker: 'public' (the run dataset's public split, "
                                "disjoint from client data) or a dataset name (photos, cifar10, cifar100, "
                                "imagefolder:PATH; its training split)", name_value)
    aux_data_dir: Path | None = option(None, "local copy of the --aux dataset", path_value)
    max_images: int = option(64, "attack at most this many uploaded feature sets per client, a seeded random "
                                 "choice (0: all)", whole_number(0))


class InvertFamily(Family):
    name = "invert"
    registry = INVERT
    help = "reconstruct client images from the patch features the server received"
    description = ("Feature inversion against an EFTViT run. Scored against truth/ by PSNR, SSIM, CW-SSIM and LPIPS "
                   "over the whole image and over the kept patches only, and by identifiability (IIP in pixels, "
                   "LPIPS and the model's features), beside a mean-image baseline. The features are protected by "
                   "the run's --dp-eps (its feature channel: clipped rows with Gaussian noise) or by --feature-noise; "
                   "the attack applies the run's release to its own training data too.")
    options_type = InvertOptions
    image_metrics = True
    seeded = True
    cli_method = "decoder"

    def threat_model(self, job: Job, cls: type) -> ThreatModel:
        return ThreatModel(aux_data=job.options["aux"], positions_known=job.options["positions"] == "known")

    def observe(self, job: Job, attack: Attack) -> Observed:
        cfg = job.run.config()
        image_size = PRESETS[cfg.model].image_size
        dataset = load_dataset(cfg.dataset, cfg.data_dir, image_size)
        aux = observe.aux_images(job.options["aux"], job.options["aux_data_dir"], dataset, image_size)
        observation, rows_of = observe.observe_features(job.run, job.round_number, job.clients,
                                                        job.options["max_images"], job.seed,
                                                        attack.threat_model.positions_known, aux)
        return Observed(observation, {"rows_of": rows_of, "dataset": dataset})

    def score(self, job: Job, attack: Attack, observed: Observed, result, seconds: float) -> AttackReport:
        cfg = job.run.config()
        lpips = metrics.load_lpips(job.lpips_backend)
        patch = PRESETS[cfg.model].patch_size
        features = scoring.model_features(job.run.start_model(job.round_number))
        scores = [scoring.score_upload_reconstruction(job.run, job.round_number, k, observed.auditor["rows_of"][k],
                                                      result[k], observed.auditor["dataset"], lpips, patch, features)
                  for k in job.clients]
        details = {"method": attack.name, "steps": attack.steps, "attack_seconds": round(seconds, 1),
                   "mask_ratio": cfg.mask_ratio, "local_layers": cfg.local_layers,
                   "feature_defense": {"clip": cfg.feature_clip, "noise": cfg.feature_noise},
                   "dp_eps": cfg.dp_eps,
                   "positions": "known" if attack.threat_model.positions_known else "unknown"}  # as the attack ran
        for key in next(iter(result.values())).details:  # per-client figures of the attack, averaged
            details[key] = float(np.mean([r.details[key] for r in result.values()]))
        interleaved = itertools.zip_longest(*(s.grid_rows for s in scores))  # a few images of every client
        grid = [row for group in interleaved for row in group if row is not None][:scoring.GRID_IMAGES]
        return self.report(job, attack, scoring.image_summary(scores, details), lpips.name, grid)

    def control(self, job: Job, attack: Attack, observed: Observed, progress=None) -> tuple[dict, str]:
        observation = observed.observation
        cfg = job.run.config()
        images, labels, chosen = observe.public_sample(cfg, CONTROL_IMAGES, job.seed)
        aux = observation.aux_images
        if job.options["aux"] == "public":  # the control's images are not the attacker's to train on
            aux = np.delete(aux, chosen, axis=0)
        control, keep = observe.public_round_features(replace(observation, aux_images=aux), images, labels, job.seed,
                                                      attack.threat_model.positions_known)
        result = next(iter(attack.reconstruct(control, progress).values()))
        kept = metrics.kept_pixels(keep.numpy(), PRESETS[cfg.model].image_size, PRESETS[cfg.model].patch_size)
        truth = scoring.as_float_images(images)
        return (scoring.control_groups(result.images, truth, kept, public_images(job.run)),
                f"the same attack and budget on {CONTROL_IMAGES} public images through client {job.clients[0]}'s "
                "uploaded local module with the run's masking, released without clipping or noise")


# --- labels -------------------------------------------------------------------------------------------------

@dataclass
class NoOptions:
    pass


class LabelsFamily(Family):
    name = "labels"
    registry = LABELS
    help = "infer each client's class histogram from what the server observed"
    description = ("Label-distribution inference, scored per client against truth/ by L1 and "
                   "Jensen-Shannon distance of the class proportions, exact-count accuracy per present class and "
                   "over all classes, and presence precision / recall / F1, beside a prior baseline with the "
                   "attack's knowledge (n_k spread uniformly over the classes with uploads, or over all classes for "
                   "an attack that does not read the uploaded labels). Runs that upload no features (fedavg, the "
                   "PEFT methods) face the attacks on the head update alone: llg and bias-corrected.")
    options_type = NoOptions
    image_metrics = False
    seeded = False  # the label attacks are deterministic
    cli_method = "all"
    attacks_the_sum = True  # the cohort's histogram from the summed head update, n = the cohort's sample count

    def on_the_sum(self, run: RunDirectory, round_number: int, cls: type) -> bool:
        """Also on eftvit's rounds, whose labels and features are per client: the attacks on the head update alone
        read the sum, those on the uploaded labels each client's uploads."""
        return super().on_the_sum(run, round_number, cls) or (run.config().secagg and not cls.uses_upload_labels)

    def observe(self, job: Job, attack: Attack) -> Observed:
        with_model = attack.threat_model.knows_weights  # the weights only where the threat model grants them
        return Observed(observe.observe_labels(job.run, job.round_number, job.clients, with_model,
                                               attack.uses_upload_labels), {})

    def score(self, job: Job, attack: Attack, observed: Observed, result, seconds: float) -> AttackReport:
        cfg = job.run.config()
        observation = observed.observation
        uploads = {c.partition: np.bincount(c.labels, minlength=observation.num_classes) > 0
                   for c in observation.clients} if attack.uses_upload_labels else {}
        scores = [scoring.score_labels(job.run, job.round_number, k, result[k], uploads.get(k)) for k in job.clients]
        details = {"method": attack.name, "attack_seconds": round(seconds, 2), "balance": cfg.balance,
                   "dp_eps": cfg.dp_eps, "beta": cfg.beta, "knowledge": attack.knowledge,
                   "baseline_knowledge": scoring.BASELINE_KNOWLEDGE[attack.uses_upload_labels]}
        if "baseline_floor" in scores[0].groups:
            details["floor"] = scoring.FLOOR_KNOWLEDGE
        return self.report(job, attack, scoring.label_summary(scores, details), None)

    def control(self, job: Job, attack: Attack, observed: Observed, progress=None) -> tuple[dict, str]:
        cfg, partition, observation = job.run.config(), job.clients[0], observed.observation
        if partition == COHORT:
            return self.sum_control(job, attack, observed, progress)
        num_examples = next(c.num_examples for c in observation.clients if c.partition == partition)
        images, labels = observe.public_skewed_sample(cfg, num_examples, job.seed)
        sent = observe.sent_model(job.run, job.round_number) if attack.threat_model.server == "malicious" else None
        control = observe.public_label_observation(job.run, job.round_number, partition, images, labels, observation,
                                                   sent)
        estimate = attack.reconstruct(control, progress)[partition]
        uploaded = control.clients[0].labels
        uploads = np.bincount(uploaded, minlength=observation.num_classes) > 0 if attack.uses_upload_labels else None
        truth = np.bincount(labels, minlength=observation.num_classes)
        return (scoring.label_control_groups(estimate, truth, uploads),
                f"the same attack on client {partition}'s local training (no DP-SGD) run on {num_examples} public "
                f"images with a seeded Dirichlet({cfg.beta}) class mix from "
                + ("the tampered model the round was sent" if sent is not None else "the round's start weights")
                + (", its features median-sampled and released without clipping or noise"
                   if uploaded is not None and attack.uses_upload_labels else ""))

    def sum_control(self, job: Job, attack: Attack, observed: Observed, progress=None) -> tuple[dict, str]:
        """The power check on a --secagg round's sum: every cohort client's local training (no DP-SGD) on as many
        public images as it reported, each with a seeded Dirichlet(--beta) class mix of its own, from the round's
        start weights, averaged as SecAgg+ sums the updates; scored against the sum of their histograms."""
        cfg, run, observation = job.run.config(), job.run, observed.observation
        samples = cohort_public_samples(job, observe.public_skewed_sample)
        control = observe.public_sum_labels(run, job.round_number, samples, observation)
        estimate = attack.reconstruct(control, progress)[COHORT]
        truth = sum(np.bincount(labels, minlength=observation.num_classes) for _, labels in samples.values())
        return (scoring.label_control_groups(estimate, truth, None),
                f"the same attack on the sum of the cohort's {len(samples)} clients' local training (no DP-SGD), "
                f"each run on as many public images as it reported ({int(truth.sum())} in all) with a seeded "
                f"Dirichlet({cfg.beta}) class mix of its own from the round's start weights, averaged as SecAgg+ sums "
                "them")


def cohort_public_samples(job: Job, sample) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """A power check's public images for each client of a --secagg round's cohort, as many as it reported: sample(cfg,
    count, seed) seeded per client (the clients' samples may share images, as clients never share theirs)."""
    reported = job.run.metrics()[job.round_number - 1]["num_examples"]
    return {partition: sample(job.run.config(), int(reported[str(partition)]), job.seed + partition)[:2]
            for partition in job.run.cohort(job.round_number)}


# --- gradient -----------------------------------------------------------------------------------------------

@dataclass
class GradientOptions:
    observe: str = option("upload", "upload: the update the client uploaded in the round (whole ViT for fedavg "
                                    "runs, local module and head for eftvit), treated as one scaled gradient; "
                                    "probe: an in-memory FedSGD probe, one gradient of --batch client images at the "
                                    "round's start weights (masked as the client would, with the run's DP-SGD "
                                    "clipping and noise), the usual worst case",
                          name_value, choices=("upload", "probe"))
    batch: int = option(1, "images to reconstruct; with --observe probe also the probe's batch size (on a --secagg "
                           "round's sum: each cohort client's, the sum holding all of theirs)", whole_number(1))


EXACT_PATCH_DB = 30.0  # a patch attack's count of patches recovered at least this well (report details)
ORIGINALS = {
    "probe": "the probe's batch; reconstructions matched to it one-to-one (Hungarian, MSE)",
    "upload": "each reconstruction scored against the client training image it matches best (one-to-one, MSE): "
              "with a whole client set to choose from this flatters the attack, the baseline gets no such choice",
    "sum": "each reconstruction scored against the training image of the cohort's clients it matches best "
           "(one-to-one, MSE): with every image in the sum to choose from this flatters the attack, the baseline gets "
           "no such choice",
}


class GradientFamily(Family):
    name = "gradient"
    registry = GRADIENT
    help = "reconstruct a client's images from its parameter update or a one-step gradient"
    description = ("Gradient leakage against one client (--clients K; default: the lowest with an upload in the "
                   "round), scored against its images by PSNR, SSIM, CW-SSIM, LPIPS and identifiability (IIP in "
                   "pixels, LPIPS and the model's features) beside a mean-image baseline. On a --secagg run it attacks "
                   "the cohort's sum instead, the cohort's image count known (the clients report n_k in the clear), "
                   "scored against the images of every client in the sum.")
    options_type = GradientOptions
    image_metrics = True
    seeded = True
    cli_method = "analytic"
    attacks_the_sum = True  # the summed update (or the FedSGD probe summed), the cohort's image count known

    def on_the_sum(self, run: RunDirectory, round_number: int, cls: type) -> bool:
        """Always under --secagg: the attacks read an update, which the server holds only summed (eftvit's
        per-client feature uploads are not what they read)."""
        return run.config().secagg

    def pick_clients(self, clients: list[int], choice: str | list[int]) -> list[int]:
        if choice == "all":
            return clients[:1]
        if len(clients) > 1:
            raise AttackError(f"the gradient attack reconstructs one client's images: give one partition id to "
                              f"--clients, not {clients}")
        return clients

    def attack(self, cls: type, job: Job, method_options: dict) -> Attack:
        """Refused before any work when the run's clients neither train nor upload a gradient the attack reads
        (the analytic attack on a PEFT run: no positional- or patch-embedding gradient)."""
        spec = method_spec(job.run.config().method)
        missing = [name for name in cls.reads if not spec.trains_parameter(name)]
        if missing:
            usable = [c.name for c in self.registry.classes.values()
                      if all(map(spec.trains_parameter, c.reads)) and not reads_a_tampered_round(c)]
            raise AttackError(f"the {cls.name} attack reads the gradient of {', '.join(missing)}, which a "
                              f"{spec.name} client neither trains nor uploads: use --method "
                              f"{' or '.join(usable) or '(none applies)'}")
        return super().attack(cls, job, method_options)

    def observe(self, job: Job, attack: Attack) -> Observed:
        public = public_images(job.run)
        prior = public.mean(axis=0)
        partition, batch = job.clients[0], job.options["batch"]
        if partition == COHORT:
            if job.options["observe"] == "probe":
                obs, probe, details = observe.cohort_probe_observation(job.run, job.round_number, batch, job.seed,
                                                                       prior)
            else:
                (obs, details), probe = observe.aggregate_observation(job.run, job.round_number, batch, prior), None
            return Observed(obs, {"probe": probe, "details": details, "public": public, "sent": None})
        sent = self.sent(job, attack)
        if job.options["observe"] == "probe":
            if sent is not None:
                raise AttackError(f"the {attack.name} attack reads the update of a tampered round: use --observe "
                                  "upload")
            obs, probe, details = observe.probe_observation(job.run, job.round_number, partition, batch, job.seed,
                                                            prior)
        else:
            (obs, details), probe = observe.upload_observation(job.run, job.round_number, partition, batch, prior,
                                                               sent), None
        return Observed(obs, {"probe": probe, "details": details, "public": public, "sent": sent})

    @staticmethod
    def sent(job: Job, attack: Attack):
        """The tampered model a malicious-server attack's round was sent (None for the others); refused where the
        round carries another tampering than the one the attack reads."""
        if attack.threat_model.server != "malicious":
            return None
        tampered = job.run.metrics()[job.round_number - 1]["tampered"]
        if tampered != attack.tampering:
            raise AttackError(f"round {job.round_number} of {job.run.path} was tampered with {tampered}: the "
                              f"{attack.name} method reads a round of --tamper {attack.tampering}")
        return observe.sent_model(job.run, job.round_number)

    @staticmethod
    def matched(attack: Attack, result, pool: np.ndarray, patch: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Each reconstruction's original in the pool, and its scored pixels where the attack says (bool [n, H, W];
        None: the pool's own masks decide). An image attack: a one-to-one match by MSE. A patch attack (one patch
        per reconstruction, at result.kept_ids): the pool image whose patch there is nearest (several recovered
        patches may come from one image)."""
        if getattr(attack, "recovers", "images") != "patches":
            return metrics.match_to_pool(result.images, pool), None
        kept = metrics.kept_pixels(result.kept_ids, pool.shape[1], patch)
        errors = [((pool - image) ** 2)[:, mask].sum(axis=(1, 2)) for image, mask in zip(result.images, kept)]
        return np.array([int(np.argmin(e)) for e in errors]), kept

    def score(self, job: Job, attack: Attack, observed: Observed, result, seconds: float) -> AttackReport:
        partition, probe = job.clients[0], observed.auditor["probe"]
        if probe is not None:  # originals: the probe's batch, or the client's (the cohort's) whole training set
            pool, pool_labels, pool_keep = scoring.as_float_images(probe.images), probe.labels, probe.keep_ids
        else:
            data = scoring.cohort_training_set(job.run, job.round_number) if partition == COHORT else \
                scoring.client_training_set(job.run, partition)
            pool, pool_labels, pool_keep = scoring.as_float_images(data.images), data.labels, upload_masks(observed)
        obs = observed.observation
        patch = int(obs.model.local_module.patch_embed.patch_size[0])
        rows, kept = self.matched(attack, result, pool, patch)
        true_kept = pool_keep[rows] if pool_keep is not None and kept is None else None
        if true_kept is not None:
            kept = metrics.kept_pixels(true_kept, obs.image_size, patch)
        labels = (np.asarray(result.details["labels"]), pool_labels) if "labels" in result.details else None
        lpips = metrics.load_lpips(job.lpips_backend)
        scores = scoring.score_client(partition, replace(result, rows=rows), pool[rows], kept,
                                      observed.auditor["public"], lpips, patch, true_kept, labels,
                                      client_images=pool,
                                      same_label=(pool_labels[rows], observe.run_public_labels(job.run.config())),
                                      features=scoring.model_features(job.run.start_model(job.round_number)))
        details = {**observed.auditor["details"], "method": attack.summary, "observe": job.options["observe"],
                   "batch": job.options["batch"],
                   "originals": ORIGINALS["sum" if partition == COHORT and probe is None else job.options["observe"]],
                   "reconstructed_images": len(result.images), "attack_seconds": round(seconds, 2),
                   **{k: v for k, v in result.details.items() if k != "labels"},
                   "positions": "kept positions read off the positional-embedding gradient" if obs.masked else
                                "no masking"}
        if hasattr(attack, "steps"):
            details["steps"] = attack.steps
        if getattr(attack, "recovers", "images") == "patches":
            details["originals"] = ("each recovered patch scored against the client training image whose patch at "
                                    "its position is nearest (several patches may come from one image)")
            details[f"patches_above_{EXACT_PATCH_DB:g}_db"] = int(
                (scores.groups["metrics_kept"]["psnr"] >= EXACT_PATCH_DB).sum())
        return self.report(job, attack, scoring.image_summary([scores], details), lpips.name, scores.grid_rows)

    def control(self, job: Job, attack: Attack, observed: Observed, progress=None) -> tuple[dict, str]:
        cfg, partition, batch = job.run.config(), job.clients[0], job.options["batch"]
        obs = observed.observation
        if job.options["observe"] == "probe":
            count = obs.batch_size  # the cohort's probe: batch images of each of its clients
            images, labels, _ = observe.public_sample(cfg, count, job.seed)
            client = job.run.cohort(job.round_number)[0] if partition == COHORT else partition
            control, probe = observe.public_probe_observation(job.run, job.round_number, client, images, labels,
                                                              job.seed, obs.prior)
            pool, pool_keep = probe.images, probe.keep_ids
            what = (f"the same attack and budget on a FedSGD probe of {count} public image(s) at the round's start "
                    "weights, masked as the client masks, without DP-SGD"
                    + (f" (the sum of {count // batch} clients' probes of {batch})" if partition == COHORT else ""))
        elif partition == COHORT:
            samples = cohort_public_samples(job, observe.public_sample)
            control = observe.public_sum_observation(job.run, job.round_number, batch, obs.prior, samples)
            pool = np.concatenate([images for images, _ in samples.values()])
            pool_keep = training_masks(control.local_training)
            what = (f"the same attack and budget on the sum of the cohort's {len(samples)} clients' local training "
                    f"(their optimiser, epochs and batches, no DP-SGD), each run on as many public images as it "
                    f"reported ({len(pool)} in all) from the round's start weights, averaged as SecAgg+ sums them")
        else:
            count = obs.local_training.num_examples
            images, labels, _ = observe.public_sample(cfg, count, job.seed)
            control = observe.public_update_observation(job.run, job.round_number, partition, batch, obs.prior,
                                                        images, labels, observed.auditor["sent"])
            pool = images
            pool_keep = training_masks(control.local_training)
            what = (f"the same attack and budget on the update of the client's local training (its optimiser, "
                    f"epochs and batches, no DP-SGD) run on {count} public images from the round's start weights"
                    + (" (the tampered model the round was sent)" if observed.auditor["sent"] is not None else ""))
        result = attack.reconstruct(control, progress)
        truth = scoring.as_float_images(pool)
        patch = int(control.model.local_module.patch_embed.patch_size[0])
        rows, kept = self.matched(attack, result, truth, patch)
        if kept is None and pool_keep is not None:
            kept = metrics.kept_pixels(pool_keep[rows], control.image_size, patch)
        return scoring.control_groups(result.images, truth[rows], kept, observed.auditor["public"]), what


def upload_masks(observed: Observed) -> np.ndarray | None:
    """Each client image's kept patches in the first step that trained on it, where the run's schedule can be
    regenerated (a simulated masked run without DP-SGD); None otherwise."""
    training = observed.observation.local_training
    return None if training is None else training_masks(training)


# --- dp-audit -----------------------------------------------------------------------------------------------

def confidence_level(text: str) -> float:
    """A probability strictly between 0 and 1 (at confidence 1 no finite count rejects anything)."""
    value = finite_number(0, 1)(text)
    if value == 1:
        raise ValueError(f"must be below 1, got '{text}'")
    return value


@dataclass
class DPAuditOptions:
    channel: str = option("parameters", "what the auditor scores the canaries from: parameters (each owner's "
                                        "uploaded update), features (each owner's feature upload) or model (the "
                                        "model after the round)", name_value, choices=CHANNELS)
    guesses_in: int | None = option(None, "guess 'included' for this many highest-scored canaries (default: a "
                                          "quarter of the canaries scored)", whole_number(0))
    guesses_out: int | None = option(None, "guess 'excluded' for this many lowest-scored canaries (default: a "
                                           "quarter of the canaries scored)", whole_number(0))
    confidence: float = option(0.95, "confidence of the epsilon lower bound, in (0, 1)", confidence_level)
    control_dir: Path | None = option(None, "--channel model: cache of its power check's training run (default: "
                                            "RUN/reports/dp-audit-control); runs that differ only in their defenses "
                                            "share it", path_value)


class DPAuditFamily(Family):
    name = "dp-audit"
    registry = DP_AUDIT
    help = "an empirical epsilon lower bound from the run's canaries (eftguard train --canaries M)"
    description = ("One-run DP audit (Steinke, Nasr & Jagielski, NeurIPS 2023) of a run trained with --canaries M. "
                   "The attack scores every canary from one channel without its inclusion bit; the auditor guesses "
                   "'included' for the highest scores and 'excluded' for the lowest, abstains on the rest, and turns "
                   "the number of right guesses into a lower bound on epsilon at --confidence, reported beside the "
                   "epsilon the run claims for that channel (docs/dp.md). A bound above the claim is a bug in "
                   "the trainer.")
    options_type = DPAuditOptions
    image_metrics = False
    seeded = False  # the scores are deterministic
    cli_method = "canary"

    @staticmethod
    def guess_counts(options: dict, scored: int) -> tuple[int, int]:
        """(k+, k-): the guesses 'included' and 'excluded' (default: a quarter of the scored canaries each)."""
        counts = tuple(scored // 4 if options[name] is None else options[name] for name in ("guesses_in",
                                                                                          "guesses_out"))
        if sum(counts) > scored:
            raise AttackError(f"{counts[0]} + {counts[1]} guesses exceed the {scored} canaries scored: lower "
                              "--guesses-in / --guesses-out")
        return counts

    def observe(self, job: Job, attack: Attack) -> Observed:
        sources = observe.canary_sources(job.run, job.round_number, job.options["channel"], job.clients)
        self.guess_counts(job.options, len(sources))  # refused before any work
        observation = observe.observe_canaries(job.run, job.round_number, job.clients, job.options["channel"],
                                               np.array(list(sources), dtype=np.int64))
        return Observed(observation, {"sources": sources})

    def guessed_bound(self, job: Job, observed: Observed, scores: np.ndarray, bits: np.ndarray
                      ) -> tuple[scoring.AuditGuesses, float, float | None, float]:
        """(guesses, epsilon lower bound, claimed epsilon or None, delta) of canary scores against inclusion
        bits, at the job's guess counts and confidence: the audit's statistic, for the run and its control."""
        guesses = scoring.guess_inclusion(scores, bits, *self.guess_counts(job.options, len(bits)))
        claimed, delta = scoring.claimed_privacy(job.run, observed.auditor["sources"])
        bound = scoring.epsilon_lower_bound(guesses.canaries, guesses.guesses, guesses.correct, delta,
                                            job.options["confidence"])
        return guesses, bound, claimed, delta

    def score(self, job: Job, attack: Attack, observed: Observed, result, seconds: float) -> AttackReport:
        sources, options, cfg = observed.auditor["sources"], job.options, job.run.config()
        bits = scoring.canary_bits(job.run, sources)
        guesses, bound, claimed, delta = self.guessed_bound(job, observed, result.scores, bits)
        ceiling, every_canary = (scoring.epsilon_ceiling(guesses.canaries, r, delta, options["confidence"])
                                 for r in (guesses.guesses, guesses.canaries))
        details = {"channel": options["channel"], "canary_kind": cfg.canary_kind, "score": result.details["score"],
                   "epsilon_lower_bound": round(bound, 4),
                   "claimed_epsilon": "no DP" if claimed is None else round(claimed, 4),
                   "delta": delta, "confidence": options["confidence"], **vars(guesses),
                   "ceiling": (f"{guesses.guesses} guesses among {guesses.canaries} canaries certify at most "
                               f"{ceiling:.3f} at confidence {options['confidence']} (every guess right; "
                               f"{every_canary:.3f} guessing all {guesses.canaries})"),
                   "attack_seconds": round(seconds, 2)}
        if claimed is not None and bound > claimed:
            details["warning"] = (f"the epsilon lower bound {bound:.3f} from the {options['channel']} channel exceeds "
                                  f"the claimed total epsilon {claimed:.3f}: the trainer's DP guarantee does not "
                                  "hold (a bug)")
        if claimed is not None and ceiling < claimed:
            details["inconclusive"] = (f"{guesses.canaries} canaries can certify at most {ceiling:.3f} with these "
                                       f"guesses, below the claimed {claimed:.3f}: this audit cannot refute the claim "
                                       "(train with more --canaries, or audit a smaller epsilon)")
        right = np.r_[np.ones(guesses.correct), np.zeros(guesses.guesses - guesses.correct)]
        groups = {"metrics": {"epsilon_lower_bound": metrics.summarize(np.array([bound])),
                              "guess_accuracy": metrics.summarize(right)},
                  "ceiling": {"epsilon_lower_bound": metrics.summarize(np.array([ceiling]))}}
        if claimed is not None:  # the claim beside the bound, in the report's table
            groups["claimed"] = {"epsilon_lower_bound": metrics.summarize(np.array([claimed]))}
        return self.report(job, attack, scoring.Summary(groups, {}, details), None)

    def control(self, job: Job, attack: Attack, observed: Observed, progress=None) -> tuple[dict, str]:
        """The same score, guesses and confidence on the same canaries with fresh seeded coins (model channel:
        model_control). Parameters and features: each owner's local
        training (no DP-SGD) on a mix of public images as skewed as the run's split (the loss-drop score depends on
        it), as many as its natural ones, plus its included control canaries, gives its update and (features)
        every row, released without clipping or noise. The verdict also wants this bound to reach the claimed
        epsilon: below it the audit could not have refuted the claim."""
        channel, obs = job.options["channel"], observed.observation
        if channel == "model":
            return self.model_control(job, attack, observed, progress)
        cfg = job.run.config()
        bits = np.random.default_rng([job.seed, 31]).integers(0, 2, len(obs.labels))
        natural = natural_counts(job, observed)
        updates, features = {}, {}
        for partition in sorted(obs.updates):
            images, labels = observe.public_skewed_sample(cfg, natural[partition], job.seed + partition)
            included = np.flatnonzero((obs.owners == partition) & (bits == 1))
            updates[partition], features[partition] = observe.public_canary_upload(
                job.run, job.round_number, partition, np.concatenate([images, obs.images[included]]),
                np.concatenate([labels, obs.labels[included]]), list(obs.updates[partition]), channel == "features")
        control = replace(obs, start_model=job.run.start_model(job.round_number), updates=updates,
                          features=features if channel == "features" else {})
        return self.control_bound(job, attack, observed, control, bits, progress,
                                  f"each owner's local training (no DP-SGD) from the round's start weights on a "
                                  f"Dirichlet({cfg.beta}) mix of public images, as many as its natural ones, and its "
                                  f"included canaries{', every row released without clipping or noise' if channel == 'features' else ''}")

    def model_control(self, job: Job, attack: Attack, observed: Observed, progress=None) -> tuple[dict, str]:
        """The model channel's control: the federation trained again by the normal trainer for as many rounds, with
        the run's configuration less its defenses (no DP-SGD, no feature clipping or noise, no canaries of its own),
        on half of the public split plus the run's canaries with fresh coins (each in with probability 1/2); the
        same loss-drop score from that run's initial model to its final one. Cached under --control-dir (one
        training run, about what the run's own rounds cost; the same for every defense of a configuration)."""
        obs, cfg = observed.observation, job.run.config()
        public = ImageSet(observe.run_public_images(cfg), observe.run_public_labels(cfg))
        registered = ReferenceOutputs()  # where the control run lies: its initial model is built from its config
        # reference_models counts the included canaries in the run's images; the run's canaries come on top of its
        # natural images, so the control's budget is that many more (about half of the canaries are in)
        budget = cfg.train_samples and cfg.train_samples + len(obs.labels) // 2
        models, trained_on = reference_models(
            job.run, job.round_number, public, 2, job.seed,
            job.options["control_dir"] or job.run.path / "reports" / "dp-audit-control",
            ImageSet(obs.images, obs.labels), progress, registered,
            replace(defense_off(cfg), canaries=0, train_samples=budget), only=[0])
        control_run = RunDirectory.open(registered.folders[models[0]] / "run")
        control = replace(obs, start_model=initial_model(control_run), after=models[0])
        return self.control_bound(job, attack, observed, control, trained_on[0].astype(np.int64), progress,
                                  f"the federation trained for {job.round_number} round(s) without DP-SGD on public "
                                  "images (about as many as the run's natural ones) and the included canaries, "
                                  "scored from its initial to its final model")

    def control_bound(self, job: Job, attack: Attack, observed: Observed, control, bits: np.ndarray, progress,
                      what: str) -> tuple[dict, str]:
        """The control's groups (its epsilon lower bound against guesses at chance) and what it was."""
        guesses, bound, _, _ = self.guessed_bound(job, observed, attack.reconstruct(control, progress).scores, bits)
        return ({"control": {"epsilon_lower_bound": metrics.summarize(np.array([bound]))},
                 "control_baseline": {"epsilon_lower_bound": metrics.summarize(np.array([0.0]))}},
                f"the same score, guesses and confidence on the run's {guesses.canaries} canaries with fresh coins, "
                f"{what}: {guesses.correct} of {guesses.guesses} guesses right")


def initial_model(run: RunDirectory):
    """A run's initial model (checkpoint 0), built from its configuration as its server builds it: a run that
    keeps only its final model (--keep-rounds none) has no checkpoint 0."""
    cfg = run.config()
    classes = int(run.load_checkpoint(cfg.rounds)["head.weight"].shape[0])
    return build_model(cfg.model, classes, cfg.local_layers, cfg.pretrained, cfg.checkpoint or None, cfg.seed,
                       method_spec(cfg.method).model_adapter(cfg)).eval()


def natural_counts(job: Job, observed: Observed) -> dict[int, int]:
    """Each attacked owner's natural images (its reported n_k less the canaries it counts: every canary it owns
    under DP-SGD, whose schedule counts the whole pool, else those it included), so that the control's owners
    train on as much as the run's."""
    obs = observed.observation
    reported = job.run.metrics()[job.round_number - 1]["num_examples"]
    counted = scoring.canary_bits(job.run, observed.auditor["sources"]) if job.run.config().dp_eps <= 0 else \
        np.ones(len(obs.owners), dtype=np.int64)
    return {k: int(reported[str(k)]) - int(counted[obs.owners == k].sum()) for k in obs.updates}


# --- membership ---------------------------------------------------------------------------------------------

@dataclass
class MembershipOptions:
    target: str = option("global", "global: black box on the assembled model after the round; upload: one "
                                   "client's uploaded features and local module (the server); update: one "
                                   "client's uploaded parameters against the round's start weights",
                         name_value, choices=TARGETS)
    candidates: int = option(200, "members scored (a seeded random choice of the attacked clients' training "
                                  "images), and as many held-out non-members", whole_number(1))
    references: int = option(16, "reference models of lira and rmia, each a training run of the run's "
                                  "configuration on half of the attacker's data (cached; each costs about what "
                                  "the attacked run's rounds cost)", whole_number(1))
    positions: str = option("known", "--target upload: known: the auditor grants each upload's kept-patch "
                                     "positions; unknown: the attack matches tokens at any position",
                            name_value, choices=("known", "unknown"))
    references_dir: Path | None = option(None, "cache of the reference models (default: RUN/reports/"
                                               "membership-references)", path_value)
    rows: str = option("unknown", "--target upload, row-likelihood: aligned: the auditor grants each candidate "
                                  "one uploaded row (a member's own, a non-member's a random one: the worst case "
                                  "a DP bound covers); unknown: the attack tests every row",
                       name_value, choices=("unknown", "aligned"))
    population: int = option(500, "the attacker's images that no reference model trains on: rmia's population "
                                  "samples z and row-likelihood's mean features (at most a quarter of its data; "
                                  "the reference models never see the first 500 whatever this is)",
                             whole_number(1))


MEMBERSHIP_THREAT = {
    "global": "black box: the attacker queries the assembled model of the round on an image and its label (any "
              "party holding the final model)",
    "upload": "honest-but-curious server holding one client's uploaded patch features and its uploaded local "
              "module phi_k of the round",
    "update": "honest-but-curious server holding one client's uploaded parameters and the round's start weights "
              "(white box)",
}

POPULATION_SET_ASIDE = 500  # of the attacker's images, kept out of every reference model whatever --population (at
# most this): the methods of one configuration share their reference models at any smaller population


def leave_one_out(observation, models: list, trained_on: np.ndarray):
    """The global power check of an online reference-model attack: reference model 1 of the set in the target's
    place, the others as its references; its row of trained_on is the control's known membership."""
    return replace(observation, model=models[0], references=models[1:], reference_trained_on=trained_on[1:])


def defense_off(cfg):
    """The run's configuration without its defenses (DP-SGD, the feature release's clipping and noise): what the
    global channel's power check trains its control models with."""
    return replace(cfg, dp_eps=0.0, feature_noise=0.0, feature_clip=0.0).resolved()


class MembershipFamily(Family):
    name = "membership"
    registry = MEMBERSHIP
    help = "tell whether an image was in a client's training data"
    description = ("Membership inference against one round (--clients K for upload and update; default: the "
                   "lowest with an upload). Candidates: training images of the attacked clients (members) and as "
                   "many held-out images (non-members), without their membership; scored against it by ROC AUC, "
                   "TPR at 0.1% and 1% FPR and balanced accuracy, beside the LOSS attack and a random guess, with "
                   "the ROC curve in roc.png. On a recorded Flower app: online lira and rmia on its global model "
                   "with --public DIR, 8 references and at most 100 candidates unless given (docs/flower-apps.md).")
    options_type = MembershipOptions
    image_metrics = False
    seeded = True
    cli_method = "loss"

    def pick_clients(self, clients: list[int], choice: str | list[int]) -> list[int]:
        if choice == "all":
            return clients[:1]
        if len(clients) > 1:
            raise AttackError(f"the membership attack targets one client: give one partition id to --clients, "
                              f"not {clients}")
        return clients

    def threat_model(self, job: Job, cls: type) -> ThreatModel:
        target = job.options["target"]
        return ThreatModel(sees_uploads=target != "global", knows_weights=target != "global",
                           aux_data="public split and held-out images" if cls.uses_references or
                           cls.uses_population else None,
                           positions_known=target == "upload" and job.options["positions"] == "known")

    def applicable_targets(self, job: Job, cls: type) -> list[str]:
        uploads_features = method_spec(job.run.config().method).uploads_features
        return [t for t in cls.targets if t != "upload" or uploads_features]

    def attack(self, cls: type, job: Job, method_options: dict) -> Attack:
        """Refused before any work when the target does not apply: upload on a run without feature uploads,
        or a method defined on the global model only."""
        usable = self.applicable_targets(job, cls)
        if job.options["target"] not in usable:
            why = (f"a {job.run.config().method} run uploads no patch features" if job.options["target"] == "upload"
                   and cls.targets == TARGETS else f"the {cls.name} method attacks the global model only")
            raise AttackError(f"--target {job.options['target']} does not apply: {why}. Targets that apply: "
                              f"{', '.join(usable)}")
        attack = super().attack(cls, job, method_options)
        if cls.uses_references and attack.variant == "online" and job.options["references"] < 2:
            raise AttackError(f"the online {cls.name} method needs every candidate inside some reference models and "
                              "outside others: --references 2 or more (16 by default), or --variant offline")
        if cls.uses_references:  # online: the attacker holds the candidates too, and trains on them
            also = " and the candidates' images" if attack.variant == "online" else ""
            attack.threat_model = replace(attack.threat_model, aux_data=attack.threat_model.aux_data + also)
        return attack

    def observe(self, job: Job, attack: Attack) -> Observed:
        """The candidates; the attacker's population (--population of its images, never in a reference model's
        training) and, for lira and rmia, its reference models, trained on the rest of its data (online: and on
        half of the candidates each), their outputs cached beside them."""
        target, partition = job.options["target"], job.clients[0]
        candidates = scoring.membership_candidates(job.run, job.round_number, partition, target,
                                                   job.options["candidates"], job.seed)
        pool = ImageSet(candidates.pool_images, candidates.pool_labels)
        order = np.random.default_rng([job.seed, 17]).permutation(len(pool))
        set_aside = min(max(job.options["population"], POPULATION_SET_ASIDE), len(pool) // 4)
        population = pool.subset(np.sort(order[:min(job.options["population"], set_aside)]))
        auditor = {"is_member": candidates.is_member, "members_from": candidates.members_from,
                   "non_members_from": candidates.non_members_from, "outputs": ReferenceOutputs(),
                   "reference_pool": pool.subset(np.sort(order[set_aside:])),
                   "candidates": ImageSet(candidates.images, candidates.labels)}
        references, trained_on, started = [], None, time.perf_counter()
        if attack.uses_references:
            references, trained_on = self.references(job, auditor, attack.variant == "online")
        observation = observe.observe_membership(job.run, job.round_number, partition, target, candidates.images,
                                                 candidates.labels, attack.threat_model.positions_known,
                                                 references, trained_on, (population.images, population.labels))
        observation.outputs = auditor["outputs"]
        if target == "upload" and job.options["rows"] == "aligned":
            observation.candidate_rows = scoring.granted_rows(job.run, job.round_number, partition,
                                                              candidates.images, job.seed)
        return Observed(observation, {**auditor, "reference_seconds": round(time.perf_counter() - started, 1)})

    @staticmethod
    def references(job: Job, auditor: dict, online: bool, config=None, only: list[int] | None = None,
                   progress=None) -> tuple[list, np.ndarray | None]:
        """The attacker's reference models (of `config`, default the run's), from the cache (--references-dir)."""
        cache = job.options["references_dir"] or job.run.path / "reports" / "membership-references"
        count = job.options["references"] if only is None else max(job.options["references"], 2)
        return reference_models(job.run, job.round_number, auditor["reference_pool"], count, job.seed, Path(cache),
                                auditor["candidates"] if online else None, progress, auditor["outputs"], config,
                                only)

    def control(self, job: Job, attack: Attack, observed: Observed, progress=None) -> tuple[dict, str]:
        if job.options["target"] == "global":
            return self.global_control(job, attack, observed, progress)
        return self.client_control(job, attack, observed, progress)

    def client_control(self, job: Job, attack: Attack, observed: Observed, progress=None) -> tuple[dict, str]:
        """The upload and update channels' power check: public images with the attack's members' class mix (as
        many as the public split allows), released through the client's channel with the defense off, against as
        many public images of the same labels: upload, their features through the client's uploaded phi_k under
        fresh masks, without clipping or noise (rows granted as the attack's were); update, the client's local
        training on them from the round's start weights, without DP-SGD."""
        cfg, obs, partition, auditor = job.run.config(), observed.observation, job.clients[0], observed.auditor
        images, labels, is_member = observe.public_label_matched(cfg, obs.labels[auditor["is_member"]], job.seed)
        members = int(is_member.sum())
        if job.options["target"] == "upload":
            mask_ratio = method_spec(cfg.method).mask_ratio(cfg.mask_ratio)
            features, keep = observe.public_membership_upload(obs, images[is_member], mask_ratio, job.seed,
                                                              cfg.precision)
            rows = None if obs.candidate_rows is None else np.r_[np.arange(members), np.random.default_rng(
                [job.seed, 25]).integers(0, members, len(images) - members)]
            control = replace(obs, images=images, labels=labels, features=features, candidate_rows=rows,
                              kept_ids=keep if obs.kept_ids is not None else None, feature_release=(0.0, 0.0, False))
            what = (f"{members} public images through client {partition}'s uploaded local module under fresh masks, "
                    "released without clipping or noise")
        else:
            state = observe.public_client_update(job.run, job.round_number, partition, images[is_member],
                                                 labels[is_member])
            control = replace(obs, images=images, labels=labels, client_state=state)
            what = f"client {partition}'s local training (no DP-SGD) on {members} public images from the round's start"
        result = attack.reconstruct(control, progress)
        return (scoring.membership_control_groups(result.scores, is_member),
                f"the same attack on {what}, with the members' class mix, against {len(images) - members} other "
                "public images of the same labels")

    def global_control(self, job: Job, attack: Attack, observed: Observed, progress=None) -> tuple[dict, str]:
        """The global channel's power check: a model of the run's configuration with its defense off, trained
        on half of the attacker's data and a known half of the candidates (reference model 1 of the online set),
        attacked in the run's place with the same candidates, queries and population. Online lira and rmia
        score it with the other references of their set (leave-one-out; without a defense to take off, the
        attack's own set, so it costs nothing more); offline, with the attack's offline set trained with the
        defense off; loss needs that one model alone."""
        cfg, obs, auditor = job.run.config(), observed.observation, observed.auditor
        off = defense_off(cfg)
        online = attack.uses_references and attack.variant == "online"
        if online and off == cfg:
            models, trained_on = obs.references, obs.reference_trained_on
        else:
            models, trained_on = self.references(job, auditor, True, off, None if online else [0], progress)
        if online:
            control = leave_one_out(obs, models, trained_on)
        else:
            references = obs.references if not attack.uses_references or off == cfg else \
                self.references(job, auditor, False, off, progress=progress)[0]
            control = replace(obs, model=models[0], references=references)
        result = attack.reconstruct(control, progress)
        count = len(trained_on)
        defense = "its configuration" if off == cfg else "its configuration without DP-SGD or feature noise"
        variance = f", {result.details['variance']} variance" if "variance" in result.details else ""
        scored = (f", scored with the other {count - 1} reference models of the online set (leave-one-out"
                  f"{variance})" if online
                  else f", scored with {len(control.references)} offline reference models"
                  f"{' trained without the defense' if off != cfg else ''}" if attack.uses_references else "")
        return (scoring.membership_control_groups(result.scores, trained_on[0]),
                f"the same attack on reference model 1 of {count} in the run's place: {defense}, trained for "
                f"{job.round_number} round(s) on half of the attacker's data and a known half of the candidates "
                f"({int(trained_on[0].sum())} members, {int((~trained_on[0]).sum())} non-members){scored}")

    def score(self, job: Job, attack: Attack, observed: Observed, result, seconds: float) -> AttackReport:
        cfg = job.run.config()
        target = job.options["target"]
        loss = result if attack.name == LossAttack.name else \
            LossAttack(threat_model=attack.threat_model).reconstruct(observed.observation)
        threat = MEMBERSHIP_THREAT[target] + (f"; {reference_threat(attack.variant)}" if attack.uses_references
                                              else "")
        if observed.observation.candidate_rows is not None:
            threat += ("; the auditor grants each candidate one uploaded row, a member its own (the worst case a DP "
                       "bound covers)")
        details = {"method": attack.summary, "target": target, "threat_model": threat,
                   "members": observed.auditor["members_from"],
                   "non_members": observed.auditor["non_members_from"],
                   "attack_seconds": round(seconds, 2), "dp_eps": cfg.dp_eps, "run_method": cfg.method,
                   **result.details}
        if attack.uses_references:
            details["reference_models"] = (f"{job.options['references']}, each the run's configuration trained for "
                                           f"{job.round_number} round(s) on half of the attacker's data"
                                           f"{' and half of the candidates' if attack.variant == 'online' else ''} "
                                           f"({observed.auditor['reference_seconds']} s incl. loading or training)")
        summary = scoring.membership_summary(result.scores, loss.scores, observed.auditor["is_member"], details)
        if target == "global":
            return self.report(job, attack, summary, None)
        summary.per_client = {str(job.clients[0]): {k: v["mean"] for k, v in summary.groups["metrics"].items()}}
        report = self.report(job, attack, summary, None)
        return replace(report, attack=f"{report.attack}-{target}")  # its own folder: membership-loss-update


FAMILIES: dict[str, Family] = {f.name: f for f in (InvertFamily(), LabelsFamily(), GradientFamily(),
                                                   DPAuditFamily(), MembershipFamily())}


def family_named(name: str) -> Family:
    if name not in FAMILIES:
        raise AttackError(f"unknown attack family '{name}': choose one of {', '.join(FAMILIES)}")
    return FAMILIES[name]
