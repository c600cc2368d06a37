"""The three attack families, one object each: its options, how its observation is built, how its attack is
constructed and how its result is scored into an AttackReport. Everything else (checks, timing, writing) is
shared, in eftguard.audit.api.

Adding a method to a family is one registered class in attacks/; adding a family is a registry there, an
observation builder in eftguard.audit.observe and a Family here (docs/add-an-attack.md).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

from attacks.base import (Attack, AttackError, Option, Registry, ThreatModel, name_value, option, options_of,
                          path_value, whole_number)
from attacks.gradient import GRADIENT
from attacks.inversion import INVERT
from attacks.labels import LABELS
from eftguard import metrics
from eftguard.audit import observe, scoring
from eftguard.audit.result import AttackReport, json_ready
from eftguard.methods import method_spec
from eftguard.rundir import RunDirectory


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
    options_type: type  # a dataclass of the family's own options, declared with attacks.base.option
    image_metrics: bool  # scored by PSNR / SSIM / LPIPS (takes --lpips-backend)
    seeded: bool  # draws randomness of its own (takes --seed)
    cli_method: str  # --method's default on the command line ("all": every method)

    @property
    def options(self) -> tuple[Option, ...]:
        return options_of(self.options_type)

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

    def report(self, job: Job, attack: Attack, summary: scoring.Summary, lpips_backend: str | None,
               grid: list | None = None) -> AttackReport:
        return AttackReport(self.name, attack.name, f"{self.name}-{attack.name}", str(job.run.path), job.round_number,
                            job.clients, attack.threat_model.capabilities(),
                            {k: json_ready(v) for k, v in job.ran_with.items()}, summary.groups, summary.per_client,
                            summary.details, lpips_backend, summary.histograms, grid)


def public_images(run: RunDirectory) -> np.ndarray:
    """The run dataset's public split as float images: the mean-image baseline and the attacks' prior."""
    from eftguard.federation.client import run_dataset

    cfg = run.config()
    return scoring.as_float_images(run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0,
                                               cfg.seed).public.images)


# --- invert -------------------------------------------------------------------------------------------------

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
    description = ("Feature inversion against an EFTViT run. Scored against truth/ by PSNR, SSIM and LPIPS over the "
                   "whole image and over the kept patches only, beside a mean-image baseline. The features are protected by "
                   "the run's --dp-eps (its feature channel: clipped rows with Gaussian noise) or by --feature-noise; "
                   "the attack applies the run's release to its own training data too.")
    options_type = InvertOptions
    image_metrics = True
    seeded = True
    cli_method = "decoder"

    def threat_model(self, job: Job, cls: type) -> ThreatModel:
        return ThreatModel(aux_data=job.options["aux"], positions_known=job.options["positions"] == "known")

    def observe(self, job: Job, attack: Attack) -> Observed:
        from eftguard.data.registry import load_dataset
        from eftguard.model import PRESETS

        cfg = job.run.config()
        image_size = PRESETS[cfg.model].image_size
        dataset = load_dataset(cfg.dataset, cfg.data_dir, image_size)
        aux = observe.aux_images(job.options["aux"], job.options["aux_data_dir"], dataset, image_size)
        observation, rows_of = observe.observe_features(job.run, job.round_number, job.clients,
                                                        job.options["max_images"], job.seed,
                                                        attack.threat_model.positions_known, aux)
        return Observed(observation, {"rows_of": rows_of, "dataset": dataset})

    def score(self, job: Job, attack: Attack, observed: Observed, result, seconds: float) -> AttackReport:
        from eftguard.model import PRESETS

        cfg = job.run.config()
        lpips = metrics.load_lpips(job.lpips_backend)
        public = scoring.as_float_images(observed.auditor["dataset"].public.images)
        patch = PRESETS[cfg.model].patch_size
        scores = [scoring.score_upload_reconstruction(job.run, job.round_number, k, observed.auditor["rows_of"][k],
                                                      result[k], observed.auditor["dataset"], public, lpips, patch)
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


# --- labels -------------------------------------------------------------------------------------------------

@dataclass
class NoOptions:
    pass


class LabelsFamily(Family):
    name = "labels"
    registry = LABELS
    help = "infer each client's class histogram from what the server observed"
    description = ("Label-distribution inference against an EFTViT run, scored per client against truth/ by L1 and "
                   "Jensen-Shannon distance of the class proportions, exact-count accuracy per present class and "
                   "presence precision / recall / F1, beside a prior-only baseline (n_k spread uniformly over the "
                   "present classes).")
    options_type = NoOptions
    image_metrics = False
    seeded = False  # the label attacks are deterministic
    cli_method = "all"

    def observe(self, job: Job, attack: Attack) -> Observed:
        with_model = attack.threat_model.knows_weights  # the weights only where the threat model grants them
        return Observed(observe.observe_labels(job.run, job.round_number, job.clients, with_model), {})

    def score(self, job: Job, attack: Attack, observed: Observed, result, seconds: float) -> AttackReport:
        cfg = job.run.config()
        scores = [scoring.score_labels(job.run, job.round_number, k, result[k]) for k in job.clients]
        details = {"method": attack.name, "attack_seconds": round(seconds, 2), "balance": cfg.balance,
                   "dp_eps": cfg.dp_eps, "beta": cfg.beta}
        return self.report(job, attack, scoring.label_summary(scores, details), None)


# --- gradient -----------------------------------------------------------------------------------------------

@dataclass
class GradientOptions:
    observe: str = option("upload", "upload: the update the client uploaded in the round (whole ViT for fedavg "
                                    "runs, local module and head for eftvit), treated as one scaled gradient; "
                                    "probe: an in-memory FedSGD probe, one gradient of --batch client images at the "
                                    "round's start weights (masked as the client would, with the run's DP-SGD "
                                    "clipping and noise), the usual worst case",
                          name_value, choices=("upload", "probe"))
    batch: int = option(1, "images to reconstruct; with --observe probe also the probe's batch size", whole_number(1))


ORIGINALS = {
    "probe": "the probe's batch; reconstructions matched to it one-to-one (Hungarian, MSE)",
    "upload": "each reconstruction scored against the client training image it matches best (one-to-one, MSE): "
              "with a whole client set to choose from this flatters the attack, the baseline gets no such choice",
}


class GradientFamily(Family):
    name = "gradient"
    registry = GRADIENT
    help = "reconstruct a client's images from its parameter update or a one-step gradient"
    description = ("Gradient leakage against one client (--clients K; default: the lowest with an upload in the "
                   "round), scored against its images by PSNR, SSIM and LPIPS beside a mean-image baseline.")
    options_type = GradientOptions
    image_metrics = True
    seeded = True
    cli_method = "analytic"

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
            usable = [c.name for c in self.registry.classes.values() if all(map(spec.trains_parameter, c.reads))]
            raise AttackError(f"the {cls.name} attack reads the gradient of {', '.join(missing)}, which a "
                              f"{spec.name} client neither trains nor uploads: use --method "
                              f"{' or '.join(usable) or '(none applies)'}")
        return super().attack(cls, job, method_options)

    def observe(self, job: Job, attack: Attack) -> Observed:
        public = public_images(job.run)
        prior = public.mean(axis=0)
        partition, batch = job.clients[0], job.options["batch"]
        if job.options["observe"] == "probe":
            obs, probe, details = observe.probe_observation(job.run, job.round_number, partition, batch, job.seed,
                                                            prior)
        else:
            (obs, details), probe = observe.upload_observation(job.run, job.round_number, partition, batch, prior), None
        return Observed(obs, {"probe": probe, "details": details, "public": public})

    def score(self, job: Job, attack: Attack, observed: Observed, result, seconds: float) -> AttackReport:
        partition, probe = job.clients[0], observed.auditor["probe"]
        if probe is not None:  # originals: the probe's batch, or the client's whole training set
            pool, pool_labels, pool_keep = scoring.as_float_images(probe.images), probe.labels, probe.keep_ids
        else:
            data = scoring.client_training_set(job.run, partition)
            pool, pool_labels, pool_keep = scoring.as_float_images(data.images), data.labels, None
        rows = metrics.match_to_pool(result.images, pool)
        obs = observed.observation
        patch = int(obs.model.local_module.patch_embed.patch_size[0])
        kept = metrics.kept_pixels(pool_keep[rows], obs.image_size, patch) if pool_keep is not None else None
        labels = (np.asarray(result.details["labels"]), pool_labels)
        lpips = metrics.load_lpips(job.lpips_backend)
        scores = scoring.score_client(partition, replace(result, rows=rows), pool[rows], kept,
                                      observed.auditor["public"], lpips, patch,
                                      pool_keep[rows] if pool_keep is not None else None, labels)
        details = {**observed.auditor["details"], "method": attack.summary, "observe": job.options["observe"],
                   "batch": job.options["batch"], "originals": ORIGINALS[job.options["observe"]],
                   "reconstructed_images": len(result.images), "attack_seconds": round(seconds, 2),
                   **{k: v for k, v in result.details.items() if k != "labels"},
                   "positions": "kept positions read off the positional-embedding gradient" if obs.masked else
                                "no masking"}
        if hasattr(attack, "steps"):
            details["steps"] = attack.steps
        return self.report(job, attack, scoring.image_summary([scores], details), lpips.name, scores.grid_rows)


FAMILIES: dict[str, Family] = {f.name: f for f in (InvertFamily(), LabelsFamily(), GradientFamily())}


def family_named(name: str) -> Family:
    if name not in FAMILIES:
        raise AttackError(f"unknown attack family '{name}': choose one of {', '.join(FAMILIES)}")
    return FAMILIES[name]
