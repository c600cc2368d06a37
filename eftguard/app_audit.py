"""`eftguard audit RUN` on a run recorded from a user's Flower app (docs/flower-apps.md): every attack that reads it,
each beside its power check, one level per channel by eftguard's thresholds (eftguard.verdict), and the gates.

The power check (docs/reports.md) is the same attack with the same budget on a positive control sent through the
same channel with the defense off: the app's model at the round's start weights, trained as the client trained (the
AppSpec's `trainer`, else eftguard's replay of its SGD or AdamW steps in index order, the replay the update attacks
assume) on as many public images as the client's n_k, drawn with a skewed class mix. The public images are the
auditor's (`--public DIR`, a folder of class folders), else the bundled photos resized to the app's input size. A
"low" stands only behind a passing control; a failing one makes it "inconclusive".

Membership: online LiRA and RMIA on the global model after the round. Their reference models replay the app's federation
(FedAvg over the recorded rounds' client counts and learning rates, from the recorded initial weights, each client
trained as above) on half of the auditor's images and half of the candidates each; candidates are the images the
clients shared as truth (members) and as many of the auditor's images that no reference model trained on
(non-members); RMIA's population is more of the auditor's images, in no reference model. Their control is
leave-one-out: reference model 1 in the global model's place, its members known.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from eftguard.app_attacks import (ClientResult, Head, attack_gradient, attack_labels, estimate_labels, image_scores,
                                  label_scores, last_linear, round_of, update_observation, write_report)
from eftguard.apprun import AppRun, AppSpec
from eftguard.attacks.base import AttackError
from eftguard.attacks.gradient import GRADIENT, LocalTraining
from eftguard.attacks.labels import ClientUploads
from eftguard.attacks.membership import LiRAAttack, MembershipObservation, RMIAAttack
from eftguard.attacks.update_inversion import UpdateInversion, fixed_schedule, simulate_local_training
from eftguard.audit import gate as gates_module
from eftguard.audit.families import leave_one_out
from eftguard.audit.references import half_of_the_models, random_half
from eftguard.audit.scoring import membership_figures
from eftguard.data import ImageSet
from eftguard.data.imagefolder import read_class_folders
from eftguard.data.photos import load_photos
from eftguard.document import Document, Heading, Items, Table, text, write_pages
from eftguard.errors import ConfigError
from eftguard.options import option, path_value
from eftguard.paths import atomic_write
from eftguard.report import LEVEL_CLASS
from eftguard.verdict import NOT_AUDITED, ChannelVerdict, verdict_of_attacks

AUDIT_STEPS = {"idlg": 1000, "updates": 300}  # the gradient attack's budget, the same on the control
AUDIT_SEED = 0  # of the control's images and the membership candidates, reference data and inclusion
FAMILIES = ("gradient", "labels", "membership")
ATTACKS = ("gradient-idlg", "gradient-updates", "labels-bias-corrected", "membership-lira",  # what gates may name
           "membership-rmia")
CONTROL_BETA = 0.5  # Dirichlet concentration of the control's class mix: skewed like a client's, not uniform
REFERENCES = 8  # LiRA's and RMIA's (online: each candidate in 4; leave-one-out scores the control with the other 7)
MEMBER_CANDIDATES = 100  # at most this many members scored, and as many non-members
MIN_CANDIDATES = 10  # fewer members or non-members: refused (an AUC over a handful is noise)
MIN_REFERENCES = 4  # online, leave-one-out: the control's references hold each candidate in and out
POPULATION = 500  # at most this many of the auditor's images as RMIA's population, a quarter where fewer
BATCH = 256
NO_PUBLIC = ("LiRA and RMIA need the auditor's images of the app's own kind as population and non-members: give "
             "--public DIR (a folder of class folders); the bundled photos would tell members apart by their kind, not "
             "their membership")


@dataclass
class ChannelResult:
    """One attack of the app audit: its figures (with its control's, as eftguard.verdict reads them), or why it
    could not run."""

    family: str
    attack: str = ""
    figures: dict | None = None
    control: str = ""       # what the control was, or why none ran
    clients: dict | None = None
    refused: str = ""       # why the channel's attack could not run
    details: dict | None = None


@dataclass(frozen=True)
class PublicImages:
    images: ImageSet
    source: str          # where they come from, for the report
    folder: Path | None  # the auditor's own (--public), None for the bundled photos

    @property
    def given(self) -> bool:
        return self.folder is not None


def public_option():
    """--public, of `eftguard audit` and `eftguard attack membership` on a recorded Flower app."""
    return option(None, "a recorded Flower app: the auditor's images (one subfolder per class, the app's classes in "
                        "sorted order) for the power checks and as the membership attacks' population and "
                        "non-members (default: the bundled photos, for the power checks only)", path_value,
                  metavar="DIR")


def public_images(folder: Path | None, spec: AppSpec, classes: int) -> PublicImages:
    """The auditor's images at the app's input size, those of the model's classes; the bundled photos' public split
    when no folder is given."""
    if folder is None:
        images = load_photos().public.resized(spec.image_size)
        source = f"the bundled photos' public split resized to the app's {spec.image_size} px (no --public given)"
    else:
        images = read_class_folders(folder, spec.image_size)
        source = f"{folder} ({len(images)} images at {spec.image_size} px)"
    kept = images.subset(np.flatnonzero(images.labels < classes))
    if not len(kept):
        raise AttackError(f"{source} holds no image of the model's {classes} classes: give --public DIR whose first "
                          f"{classes} class folders (sorted by name) are the app's classes")
    return PublicImages(kept, source if len(kept) == len(images) else f"{source}, those of the model's {classes} "
                        "classes", folder)


@torch.no_grad()
def output_width(model: nn.Module, spec: AppSpec) -> int:
    """The model's number of outputs: its classes."""
    return int(model(torch.zeros(1, 3, spec.image_size, spec.image_size)).shape[1])


def model_input(images: np.ndarray, spec: AppSpec) -> torch.Tensor:
    """uint8 [n, H, W, 3] as the app's model reads them: [n, 3, H, W], (x - mean) / std with x in [0, 1]."""
    pixels = torch.from_numpy(np.ascontiguousarray(images)).float().permute(0, 3, 1, 2) / 255.0
    return (pixels - torch.tensor(spec.mean).view(1, 3, 1, 1)) / torch.tensor(spec.std).view(1, 3, 1, 1)


def trainer_text(spec: AppSpec) -> str:
    return (f"the app's trainer {spec.trainer}" if spec.trainer else
            f"eftguard's replay of the clients' {spec.optimizer} steps in index order (app.toml names no trainer)")


def trained_state(spec: AppSpec, start: nn.Module, images: np.ndarray, labels: np.ndarray, lr: float
                  ) -> dict[str, torch.Tensor]:
    """The state dict after one client's local training from `start` on these images, as the app trains: its
    trainer where app.toml names one, else the replay of its steps."""
    model = copy.deepcopy(start)
    trainer = spec.build_trainer()
    if trainer is not None:
        model.train()
        trainer(model, images, labels, spec.local_epochs, spec.batch_size, lr)
        return {name: value.detach().clone() for name, value in model.state_dict().items()}
    training = LocalTraining({}, len(labels), spec.local_epochs, spec.batch_size, lr, spec.weight_decay,
                             num_patches=0, mask_ratio=None, optimizer=spec.optimizer)
    params = simulate_local_training(model, {name: p.detach() for name, p in model.named_parameters()},
                                     model_input(images, spec), torch.from_numpy(labels),
                                     fixed_schedule(training, torch.Generator()), lr, spec.weight_decay,
                                     optimizer=spec.optimizer)
    return {**{name: value.detach().clone() for name, value in model.state_dict().items()},
            **{name: value.detach() for name, value in params.items()}}


def control_sample(public: ImageSet, count: int, seed: int) -> ImageSet:
    """`count` distinct public images with a seeded Dirichlet class mix (a client's histogram is skewed; a uniform
    one would leave the label attack nothing to beat the uniform guess by)."""
    if count > len(public):
        raise AttackError(f"the power check needs {count} public images (the client's n_k), there are {len(public)}: "
                          "give --public DIR with more")
    rng = np.random.default_rng([seed, 38])
    classes = np.unique(public.labels)
    mix = dict(zip(classes.tolist(), rng.dirichlet(np.full(len(classes), CONTROL_BETA))))
    weights = np.array([mix[int(label)] for label in public.labels]) + 1e-9
    return public.subset(np.sort(rng.choice(len(public), count, replace=False, p=weights / weights.sum())))


@dataclass
class Control:
    """The start model, the first attacked client's n_k public images and their update, shared by the families."""

    model: nn.Module
    head: str
    sample: ImageSet
    trained: dict[str, torch.Tensor]
    client: int
    lr: float


def build_control(run: AppRun, round_number: int, record: dict, public: PublicImages, seed: int) -> Control:
    spec = run.spec()
    if not record["num_examples"]:
        raise AttackError(f"no client's upload was recorded in round {round_number} (metrics.jsonl says why)")
    client = min(int(c) for c in record["num_examples"])
    sample = control_sample(public.images, int(record["num_examples"][str(client)]), seed)
    model = run.start_model(round_number)
    lr = float(record["lr"])
    return Control(model, last_linear(model, spec.image_size), sample,
                   trained_state(spec, model, sample.images, sample.labels, lr), client, lr)


def gradient_control(spec: AppSpec, control: Control, method: str, options: dict) -> tuple[dict, str]:
    trained = {name: control.trained[name] for name, _ in control.model.named_parameters()}
    observation = update_observation(spec, control.model, control.head, trained, len(control.sample), control.lr)
    scores = image_scores(GRADIENT.get(method)(**options).reconstruct(observation).images, control.sample.images)
    return ({"control.psnr": scores["psnr_db"], "control_baseline.psnr": scores["baseline_psnr_db"]},
            f"{method} on client {control.client}'s local training of {len(control.sample)} public images")


def labels_control(spec: AppSpec, control: Control, method: str, round_number: int) -> tuple[dict, str]:
    head = Head(control.head, control.model.get_submodule(control.head))
    upload = ClientUploads(control.client, len(control.sample), None, None,
                           control.trained[f"{head.name}.weight"].numpy(), control.trained[f"{head.name}.bias"].numpy())
    estimate = estimate_labels(method, round_number, head, [upload])[control.client]
    scores = label_scores(estimate.counts, control.sample.labels, head.module.out_features)
    return ({"control.l1": scores["l1"], "control_baseline.l1": scores["baseline_l1"]},
            f"{method} on client {control.client}'s local training of {len(control.sample)} public images "
            f"({np.count_nonzero(np.bincount(control.sample.labels))} classes)")


def mean_of(results: list[ClientResult], names: dict[str, str]) -> dict:
    """The clients' mean of each scored figure, under its figure name (psnr_db -> psnr)."""
    return {figure: float(np.mean([r.scores[score] for r in results if score in r.scores]))
            for score, figure in names.items() if any(score in r.scores for r in results)}


# --- membership: LiRA on the global model, the app's federation replayed for its reference models ----------

def app_logits(spec: AppSpec):
    """MembershipObservation.outputs for the app's model: logits on uint8 images, normalised as the app does."""

    @torch.no_grad()
    def outputs(model: nn.Module, images: np.ndarray) -> torch.Tensor:
        model.eval()
        return torch.cat([model(model_input(images[i:i + BATCH], spec)) for i in range(0, len(images), BATCH)]
                         ).double()

    return outputs


def averaged(states: list[dict[str, torch.Tensor]], weights: list[int]) -> dict[str, torch.Tensor]:
    """FedAvg: the n_k-weighted mean of floating tensors; other buffers (counters) from the first client."""
    total = float(sum(weights))
    return {name: sum(s[name] * (w / total) for s, w in zip(states, weights)) if value.is_floating_point() else value
            for name, value in states[0].items()}


def replayed_federation(run: AppRun, records: list[dict], data: ImageSet, seed: int) -> nn.Module:
    """The app's federation on `data`: from the recorded initial weights, each recorded round's clients (as many,
    each a fixed share of the data) trained at that round's learning rate and averaged by FedAvg."""
    spec = run.spec()
    model = run.start_model(1)
    shares = None
    for record in records:
        clients = max(1, len(record["num_examples"]))
        if shares is None or len(shares) != clients:
            shares = [s for s in np.array_split(np.random.default_rng(seed).permutation(len(data)), clients) if len(s)]
        states = [trained_state(spec, model, data.images[s], data.labels[s], float(record["lr"])) for s in shares]
        model.load_state_dict(averaged(states, [len(s) for s in shares]))
    return model.eval()


def shared_members(run: AppRun, round_number: int) -> ImageSet | None:
    """Every distinct image a client shared as truth in rounds 1..t: the global model's members the auditor knows."""
    images, labels, seen = [], [], set()
    for t in range(1, round_number + 1):
        for client in run.uploaded_partitions(t):
            if not run.truth_path(t, client).exists():
                continue
            truth = run.load_truth(t, client)
            for image, label in zip(truth["images"], truth["labels"]):
                key = image.tobytes()
                if key not in seen:
                    seen.add(key)
                    images.append(image)
                    labels.append(label)
    return ImageSet(np.stack(images), np.asarray(labels, dtype=np.int64)) if images else None


def membership_attacks(run: AppRun, round_number: int, public: PublicImages, seed: int,
                       methods: tuple[str, ...] = ("lira", "rmia"), references: int = REFERENCES,
                       candidates: int = MEMBER_CANDIDATES, cache: Path | None = None) -> list[ChannelResult]:
    """Online LiRA and RMIA (those of `methods`) on the global model after the round, on the same candidates and
    reference models, each with its leave-one-out control. The reference models are kept under `cache` (default
    RUN/reports/membership-references), keyed by what they depend on, so that the attack and the audit train them
    once."""
    if not public.given:
        raise AttackError(NO_PUBLIC)
    if references < MIN_REFERENCES:
        raise AttackError(f"--references {references}: online LiRA and RMIA with their leave-one-out control need "
                          f"{MIN_REFERENCES} or more (each candidate in and out of the control's references)")
    members = shared_members(run, round_number)
    if members is None:
        raise AttackError("no client shared its truth (the share_truth mod): the members are unknown")
    spec = run.spec()
    rng = np.random.default_rng([seed, 39])
    count = min(candidates, len(members), len(public.images) // 3)
    if count < MIN_CANDIDATES:
        raise AttackError(f"LiRA and RMIA need {MIN_CANDIDATES} members and as many non-members, beside twice as "
                          f"many images for their reference models; the clients shared {len(members)} images, --public "
                          f"holds {len(public.images)}: an AUC over fewer says nothing")
    order = rng.permutation(len(public.images))
    members = members.subset(np.sort(rng.choice(len(members), count, replace=False)))
    non_members = public.images.subset(np.sort(order[:count]))
    population_size = min(POPULATION, (len(order) - count) // 4)  # RMIA's z: in no reference model's training
    population = public.images.subset(np.sort(order[count:count + population_size]))
    pool = public.images.subset(np.sort(order[count + population_size:]))
    candidate_set = ImageSet(np.concatenate([members.images, non_members.images]),
                             np.concatenate([members.labels, non_members.labels]))
    is_member = np.r_[np.ones(count, bool), np.zeros(count, bool)]
    trained_on = half_of_the_models(references, len(candidate_set), np.random.default_rng([seed, round_number, 18]))
    rounds = run.metrics()[:round_number]
    total = sum(int(n) for n in rounds[-1]["num_examples"].values())  # a reference holds as many images as the clients
    folder = reference_folder(run, round_number, public, seed, references, candidates, cache)
    models = []
    for index in range(references):
        file = folder / f"reference-{index:02d}.safetensors"
        cached = kept_reference(run, file)
        if cached is not None:
            models.append(cached)
            continue
        half = pool.subset(random_half(pool.labels, max(1, min(len(pool) // 2, total - int(trained_on[index].sum()))),
                                       np.random.default_rng([seed, round_number, index, 15])))
        chosen = candidate_set.subset(np.flatnonzero(trained_on[index]))
        data = ImageSet(np.concatenate([half.images, chosen.images]), np.concatenate([half.labels, chosen.labels]))
        models.append(replayed_federation(run, rounds, data, seed + index))
        folder.mkdir(parents=True, exist_ok=True)
        state = {name: value.detach().contiguous() for name, value in models[-1].state_dict().items()}
        atomic_write(file, lambda p: save_file(state, str(p)))
    observation = MembershipObservation("global", round_number, candidate_set.images, candidate_set.labels,
                                        run.start_model(round_number + 1),  # the global model after the round
                                        references=models, reference_trained_on=trained_on,
                                        population=population.images, population_labels=population.labels,
                                        outputs=memoised(app_logits(spec)))
    reference_text = (f"{references}, each the app's federation replayed ({round_number} FedAvg round(s) of "
                      f"{len(rounds[-1]['num_examples'])} clients at the recorded learning rates, from the recorded "
                      f"initial weights) by {trainer_text(spec)} on half of the auditor's images and half of the "
                      f"candidates (kept in {folder})")
    results = []
    for attack in [{"lira": LiRAAttack, "rmia": RMIAAttack}[name](variant="online") for name in methods]:
        result = attack.reconstruct(observation)
        control = attack.reconstruct(leave_one_out(observation, models, trained_on))
        figures = {**{k: v for k, v in membership_figures(result.scores, is_member).items() if v is not None},
                   "chance.auc": 0.5, "control.auc": membership_figures(control.scores, trained_on[0])["auc"],
                   "control_baseline.auc": 0.5}
        details = {"members": count, "non_members": count, **result.details, "reference_models": reference_text}
        results.append(ChannelResult("membership", f"membership-{attack.name}", figures,
                                     f"{attack.name} on reference model 1 of {references} in the global model's place "
                                     f"({int(trained_on[0].sum())} members known), scored with the other "
                                     f"{references - 1}", details=details))
    return results


def attack_membership(path: Path, methods: tuple[str, ...], public_folder: Path | None, round_number: int | None,
                      seed: int = AUDIT_SEED, references: int = REFERENCES, candidates: int = MEMBER_CANDIDATES,
                      cache: Path | None = None, out: Path | None = None) -> list[tuple[dict, Path]]:
    """`eftguard attack membership RUN` on a recorded Flower app: the audit's LiRA and RMIA on the global model after
    the round, one report per method (its level behind its leave-one-out power check, its figures); each entry
    with its report.json."""
    run = AppRun.open(path)
    round_number, _ = round_of(run, round_number)
    if public_folder is None:
        raise AttackError(NO_PUBLIC)
    spec = run.spec()
    public = public_images(public_folder, spec, output_width(run.start_model(round_number), spec))
    written = []
    for result in membership_attacks(run, round_number, public, seed, methods, references, candidates, cache):
        entry = next(iter(channel_entries([result]).values()))
        fields = {k: entry[k] for k in ("level", "verdict", "power_check", "control", "figures", "details")}
        written.append((entry, write_report(run, "membership", result.attack.removeprefix("membership-"),
                                            round_number, {"public": public.source, **fields}, out)))
    return written


def kept_reference(run: AppRun, file: Path) -> nn.Module | None:
    """A reference model kept by an earlier attack or audit; None where there is none, or it does not load (a
    damaged or foreign file is trained again and replaced)."""
    if not file.is_file():
        return None
    model = run.start_model(1)
    try:
        model.load_state_dict(load_file(file))
    except (SafetensorError, RuntimeError, OSError):
        return None
    return model.eval()


def reference_folder(run: AppRun, round_number: int, public: PublicImages, seed: int, references: int,
                     candidates: int, cache: Path | None) -> Path:
    """Where the membership attacks' reference models of this round and these options are kept: a folder named by a
    digest of everything they depend on (the options, app.toml, the recorded rounds, the run's shared truth and
    initial weights, the public folder's listing), so that a changed input trains them anew."""
    def entry(file: Path, folder: Path) -> list:
        return [str(file.relative_to(folder)), file.stat().st_size, file.stat().st_mtime_ns]

    def listing(folder: Path) -> list:
        return [entry(f, folder) for f in sorted(folder.rglob("*")) if f.is_file()] if folder.is_dir() else []

    inputs = {"round": round_number, "seed": seed, "references": references, "candidates": candidates,
              "app.toml": (run.path / "app.toml").read_text(), "rounds": run.metrics()[:round_number],
              "truth": listing(run.path / "truth"), "initial": entry(run.checkpoint_path(0), run.path),
              "public": listing(public.folder)}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return (cache or run.path / "reports" / "membership-references") / f"app-round-{round_number:04d}-{digest}"


def memoised(outputs):
    """outputs(model, images), each model's logits on each image set computed once (LiRA and RMIA, and their
    controls, query the same references on the same candidates)."""
    computed: dict = {}

    def cached(model: nn.Module, images: np.ndarray) -> torch.Tensor:
        key = (id(model), images.shape, hashlib.sha256(np.ascontiguousarray(images).tobytes()).digest())
        if key not in computed:
            computed[key] = outputs(model, images)
        return computed[key]

    return cached


# --- the audit -------------------------------------------------------------------------------------------

def gradient_channel(run: AppRun, round_number: int, record: dict, control: Control | None, why_no_control: str
                     ) -> ChannelResult:
    spec = run.spec()
    one_step = all(spec.optimizer == "sgd" and spec.local_epochs * math.ceil(n / spec.batch_size) == 1
                   for n in record["num_examples"].values())
    method = "idlg" if one_step else UpdateInversion.name
    options = {"steps": AUDIT_STEPS[method], **({} if one_step else {"schedule": "fixed"})}
    results = attack_gradient(run, method, options, round_number, "all")
    figures = mean_of(results, {"psnr_db": "psnr", "baseline_psnr_db": "baseline.psnr"})
    channel = ChannelResult("gradient", f"gradient-{method}", figures,
                            clients={str(r.client): r.scores for r in results})
    if control is None:
        channel.control = f"not run: {why_no_control}"
    else:
        figures, channel.control = gradient_control(spec, control, method, options)
        channel.figures.update(figures)
    return channel


def labels_channel(run: AppRun, round_number: int, control: Control | None, why_no_control: str) -> ChannelResult:
    method = "bias-corrected"
    results = attack_labels(run, method, round_number, "all")
    channel = ChannelResult("labels", f"labels-{method}", mean_of(results, {"l1": "l1", "baseline_l1": "baseline.l1"}),
                            clients={str(r.client): {k: v for k, v in r.scores.items() if not isinstance(v, list)}
                                     for r in results})
    if control is None:
        channel.control = f"not run: {why_no_control}"
    else:
        figures, channel.control = labels_control(run.spec(), control, method, round_number)
        channel.figures.update(figures)
    return channel


def audit_app(path: Path, out: Path, public_folder: Path | None = None, gates: tuple[str, ...] = ()) -> dict:
    """Every attack that reads a recorded Flower app, on its last round, each with its power check; OUT/summary.json,
    report.html and report.md hold one level per channel, the checks beside them, then the figures per client. summary's
    "configurations" holds the run as one configuration of an audit file's summary, so that the gates (and
    eftguard's exit status) read it as they read an audit's."""
    parsed = [gates_module.parse_gate(text) for text in gates]
    gates_module.check_before_training(parsed, set(FAMILIES), set(ATTACKS))
    run = AppRun.open(path)
    round_number, record = round_of(run, None)
    spec = run.spec()
    started = time.monotonic()
    model = run.start_model(round_number)
    channels: list[ChannelResult] = []
    public, control, why_no_control = None, None, ""
    try:
        public = public_images(public_folder, spec, output_width(model, spec))
        control = build_control(run, round_number, record, public, AUDIT_SEED)
    except AttackError as exc:
        why_no_control = str(exc)
    for family, attack in (("gradient", lambda: gradient_channel(run, round_number, record, control, why_no_control)),
                           ("labels", lambda: labels_channel(run, round_number, control, why_no_control))):
        try:
            channels.append(attack())
        except AttackError as exc:
            channels.append(ChannelResult(family, refused=str(exc)))
    try:
        if public is None:
            raise AttackError(why_no_control)
        channels += membership_attacks(run, round_number, public, AUDIT_SEED)
    except AttackError as exc:
        channels.append(ChannelResult("membership", refused=str(exc)))
    attacks = {c.attack: {"family": c.family, "status": "done", "figures": c.figures} for c in channels if c.attack}
    configuration = {"id": run.path.name, "status": "done", "attacks": attacks}
    summary = {"run": str(run.path), "model": spec.model, "round": round_number,
               "public": public.source if public else None, "trainer": trainer_text(spec),
               "seconds": round(time.monotonic() - started, 1),
               "channels": channel_entries(channels), "configurations": [configuration], "pending": [], "gates": []}
    try:
        gates_module.check_figures(parsed, [configuration])
        summary["gates"] = gates_module.evaluate(parsed, [configuration])
        for gate, result in zip(parsed, summary["gates"]):
            if not gates_module.matching_attacks(gate, attacks):  # its channel not audited: no evidence, no pass
                result["passed"] = False
                result["failures"].append({"configuration": configuration["id"],
                                           "figure": f"{gate.subject}.{gate.figure}", "value": None})
    finally:
        write_summary(summary, out)
    return summary


def channel_entries(channels: list[ChannelResult]) -> dict:
    """summary.json's "channels": per channel its level (eftguard.verdict, the strongest attack's) behind its power
    check (the family's passing one, else its strongest), that attack's figures, and every attack's."""
    verdicts = {v.family: v for v in verdict_of_attacks(
        {c.attack: {"family": c.family, "figures": c.figures} for c in channels if c.attack})}
    entries = {}
    for family in dict.fromkeys(c.family for c in channels):
        v: ChannelVerdict = verdicts[family]
        ran = {c.attack: c for c in channels if c.family == family and not c.refused}
        if not ran:
            reasons = "; ".join(c.refused for c in channels if c.family == family)
            entries[v.channel] = {"family": family, "attack": None, "level": NOT_AUDITED,
                                  "verdict": f"not audited: {reasons}"}
            continue
        shown = ran.get(v.attack) or next(iter(ran.values()))
        checked = ran.get(v.control.attack) if v.control else None
        entry = {"family": family, "attack": shown.attack, "level": v.level, "verdict": f"{v.summary}: {v.level_text}",
                 "power_check": v.control_text if checked else shown.control,
                 "control": (checked or shown).control, "figures": shown.figures}
        if len(ran) > 1:
            entry["attacks"] = {name: c.figures for name, c in ran.items()}
        if shown.clients:
            entry["clients"] = shown.clients
        if shown.details:
            entry["details"] = shown.details
        entries[v.channel] = entry
    return entries


def write_summary(summary: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "summary.json", lambda p: p.write_text(json.dumps(summary, indent=2) + "\n"))
    write_app_audit_report(summary, out)


def write_app_audit_report(summary: dict, out: Path) -> list[Path]:
    """report.html and report.md, rendered from one document (eftguard.document)."""
    return write_pages(audit_document(summary), out)


def audit_document(summary: dict) -> Document:
    """The level per channel beside its power check, the gates, then each channel's figures per client."""
    channels = summary["channels"]
    title = f"Audit of {summary['run']} ({summary['model']}), round {summary['round']}"
    blocks: list = [Heading(title, 1), Table(
        [["channel", "attack", "level", "headline", "power check"]]
        + [[channel, entry["attack"] or "–", entry["level"], entry["verdict"], entry.get("power_check", "–")]
           for channel, entry in channels.items()],
        [["", "", LEVEL_CLASS.get(entry["level"], "none"), "", ""] for entry in channels.values()]),
        text(f"Control images: {summary['public'] or 'none'}. Clients' training replayed by: {summary['trainer']}. "
             "A level \"low\" stands only behind a passing power check (the same attack on public images sent "
             "through the same channel without a defense); otherwise it reads inconclusive (docs/reports.md).")]
    if summary["gates"]:
        blocks.append(Items([f"gate {gate['expression']}: " + ("holds" if gate["passed"] else
                                                                f"crossed {len(gate['failures'])} times")
                             for gate in summary["gates"]]))
    for channel, entry in channels.items():
        clients = entry.get("clients") or {}
        columns = sorted({k for scores in clients.values() for k, v in scores.items() if not isinstance(v, list)})
        notes = [f"{attack}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items())
                 for attack, figures in (entry.get("attacks") or {}).items()]
        notes += [f"{name.replace('_', ' ')}: {value}" for name, value in (entry.get("details") or {}).items()]
        if not (columns or notes):
            continue
        blocks.append(Heading(channel))
        if columns:
            blocks.append(Table([["client", *columns]] + [
                [client, *(f"{scores[c]:.4g}" if isinstance(scores.get(c), float) else str(scores.get(c, ""))
                           for c in columns)] for client, scores in clients.items()]))
        if notes:
            blocks.append(Items(notes))
    return Document(title, blocks)


def refuse_audit_file_options(shard, key, ray_address) -> None:
    if shard or key or ray_address:
        raise ConfigError("--shard, --key and --ray-address spread or unlock an audit file's trainings; a recorded "
                          "Flower app is one run, audited on one machine as recorded: drop them")
