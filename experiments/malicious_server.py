"""The malicious-server measurements of docs/threat-model.md: the real server and clients over the in-process grid
of tests/fakegrid.py (no Ray), vit-tiny-32 on photos.

1. each tampering in round 1 without the model check (4 clients, 400 training images): kept-patch PSNR of
   `invert --method tampered` and label recovery of `labels --method tampered` (beside `labels --method head`),
   each with its baseline;
2. each tampering with the check on: in round 1 (the node rebuilds the initial model), in round 2 (one round of
   drift allowed), and in round 1 when the node trusts the first model it receives (trust-first-model);
3. the adaptive server's campaigns at the defaults of `eftguard train` (8 clients, 2000 training images, B = 64,
   E = 1, lr 1e-3): each round every client gets the model nearest the tampering (of the initial model, the weights
   it zeroes disguised: eftguard.attacks.tamper.disguised) that its check accepts
   (eftguard.attacks.tamper.nearest_within, DRIFT_MARGIN inside each bound); the real check verifies every
   round's model, and the round's upload is attacked at probe rounds: the first round where the tampering's own
   attack beats its baseline (kept-patch PSNR 6 dB above the mean image's; label L1 at most half the prior's),
   found by bisection between probes. Without the check the tampering works in round 1 (part 1);
4. 20 honest rounds with the check on (4 clients): refusals (false alarms) and how close the models came to each
   drift limit;
5. the imprint (--tamper imprint, on fedavg and eftvit; `attack gradient --method imprint`): single patches
   recovered with the check off for each client (client sizes 100 and 16 images), the check's refusals in rounds
   1 and 2 (and in round 1 under trust-first-model), and the adaptive server: the rounds until the imprint fits
   the check's bounds (the one-round bound from the public configuration, as the campaigns' nearest_within moves)
   and the attack on the model it sends in the campaign's last declared round (a client of 64 images trained from
   it in process);
6. class fishing (--tamper class-fish, fedavg; `attack gradient --method fishing` at its defaults) with the check
   off on the clients holding 1 to 3 images of the fished class, beside Inverting Gradients on the honest update of
   the client holding one; the check's refusals; the adaptive server as in 5 (the probe: a client of 64 images,
   one of the fished class; at rounds 1, 4, 16, 64, 128, 256 and 400: a partly fished head works long before the
   whole tampering fits).
7. feature fishing (--tamper feature-fish, fedavg; `attack gradient --method feature-fishing` at its defaults) with
   the check off (16 and 100 images per client): per client, its images above the public threshold of the fished
   feature (switched on: the fished logit above 5), near it (within 5) and of the fished class below it (which move
   the body too); the attack on each client whose update one image alone moved, scored against the client image it
   matches best and whether that is the one; the check's refusals in rounds 1 and 2 and under trust-first-model;
   the rounds an adaptive server needs before the whole feature-fished head fits the check's bounds (no probe of a
   partly fished head: Inverting Gradients costs minutes per probe here).

    OMP_NUM_THREADS=1 python experiments/malicious_server.py --out /tmp/malicious [--parts 1 2 3 4 5 6 7]
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eftguard.attacks.gradient import GradientObservation, LocalTraining  # noqa: E402
from eftguard.attacks.fishing import FishingAttack  # noqa: E402
from eftguard.attacks.imprint import ImprintAttack  # noqa: E402
from eftguard import metrics  # noqa: E402
from eftguard.attacks.tamper import DRIFT_MARGIN, disguised, fished_class, nearest_within, tamper_state  # noqa: E402
from eftguard.attacks.update_inversion import ADAM_EPS  # noqa: E402
from eftguard.audit.observe import sent_model, upload_observation  # noqa: E402
from eftguard.audit.scoring import client_training_set  # noqa: E402
from eftguard.data.plan import run_dataset  # noqa: E402
from eftguard.model import patch_pixels  # noqa: E402
from eftguard.training import OptimConfig, train_local  # noqa: E402
from eftguard.audit import run_attack  # noqa: E402
from eftguard.runs import server_threat_of
from eftguard.config import TAMPERINGS, TrainConfig  # noqa: E402
from eftguard.defenses.model_check import ModelCheck, ModelCheckError  # noqa: E402
from eftguard.federation.client import check_schedule, initial_model, model_check_limits  # noqa: E402
from eftguard.federation.records import ClientSettings  # noqa: E402
from eftguard.federation.server import run_server  # noqa: E402
from eftguard.methods import method_spec  # noqa: E402
from eftguard.model import build_model  # noqa: E402
from eftguard.rundir import RunDirectory  # noqa: E402
from fakegrid import FakeGrid, task_identity  # noqa: E402
from model_check_margin import margins  # noqa: E402

COMMON = {"clients": 4, "train_samples": 400, "test_samples": 100}
CAMPAIGN_ROUNDS = 400  # the declared rounds of the campaign's run: the clients accept round numbers up to it
PROBES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 400)


def train(path: Path, check: bool, node=None, **changes) -> RunDirectory:
    cfg = TrainConfig(**{**COMMON, "model_check": check, **changes}).resolved()
    run = RunDirectory.create(path, cfg)
    with task_identity():
        run_server(FakeGrid(cfg.clients, node_config={"model-check": check, **(node or {})}), run.path,
                   server_threat_of(cfg))
    return run


def trained(path: Path, **changes) -> RunDirectory:
    """A one-round run with the check off, trained once: a rerun of the script attacks it again."""
    return RunDirectory.open(path) if (path / "metrics.jsonl").exists() else train(path, False, **changes)


def refused(run: RunDirectory, round_number: int) -> str:
    dropped = run.metrics()[round_number - 1]["dropped"]
    return f"{sum('refuses' in r for r in dropped.values())}/{run.config().clients}"


def tampered_figures(run: RunDirectory) -> dict:
    invert = run_attack(run.path, "invert", "tampered", lpips_backend="stlpips-alex", max_images=0).figures()
    labels = run_attack(run.path, "labels", "tampered").figures()
    return {"psnr_kept": invert["psnr_kept"], "baseline_kept.psnr": invert["baseline_kept.psnr"],
            "l1": labels["l1"], "baseline.l1": labels["baseline.l1"]}


def succeeded(tamper: str, figures: dict) -> bool:
    """The tampering's own attack beats its baseline: 6 dB on the kept patches, or half the prior's label error."""
    if tamper == "label-probe":
        return figures["l1"] <= figures["baseline.l1"] / 2
    return figures["psnr_kept"] >= figures["baseline_kept.psnr"] + 6


class Fixed:
    """A server threat that sends one given model to every client (a probe of the campaign's round k)."""

    def __init__(self, state: dict[str, np.ndarray], name: str):
        self.state, self.name = {k: torch.from_numpy(v.astype(np.float32)) for k, v in state.items()}, name

    def prepare(self, initial, current):
        pass

    def tampering(self, round_number):
        return self.name

    def sent(self, round_number, partitions, state):
        return dict.fromkeys(partitions, self.state)

    def accepted(self, round_number, partitions):
        pass


def probe(out: Path, cfg: TrainConfig, tamper: str, state: dict[str, np.ndarray], round_number: int) -> dict:
    """One round whose clients receive `state` (the campaign's model of round_number), attacked."""
    probe_cfg = TrainConfig(**{**cfg.__dict__, "threat": "malicious", "tamper": tamper, "tamper_round": 1,
                               "rounds": 1, "model_check": False}).resolved()
    run = RunDirectory.create(out / f"probe-{tamper}-r{round_number}", probe_cfg)
    with task_identity():
        run_server(FakeGrid(probe_cfg.clients, node_config={"model-check": False}), run.path, Fixed(state, tamper))
    return tampered_figures(run)


class Campaign:
    """The adaptive server's models round by round (every client takes part every round at the defaults), each
    verified by a real client's check before the next is made."""

    def __init__(self, tamper: str, folder: Path):
        self.cfg = TrainConfig(threat="adaptive", tamper=tamper, rounds=CAMPAIGN_ROUNDS).resolved()
        model = build_model(self.cfg.model, 10, self.cfg.local_layers, seed=self.cfg.seed)
        self.initial = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
        target = tamper_state(tamper, model.state_dict(), self.cfg, 0)
        self.target = disguised({k: v.numpy().astype(np.float64) for k, v in target.items()}, self.initial)
        self.limits = model_check_limits(self.cfg)
        self.check = ModelCheck(folder, 0, initial_model())
        self.schedule = check_schedule(self.cfg, 10)
        self.round, self.state, self.accepted = 0, None, 0

    def advance(self) -> dict[str, np.ndarray]:
        """The next round's model, after the check accepted it."""
        self.round += 1
        boxes = [(self.initial, self.limits(self.round, self.initial, self.round - 1))]
        if self.state is not None:
            boxes.append((self.state, self.limits(self.round, self.state, 1)))
        self.state = nearest_within(self.target, boxes)
        settings = ClientSettings.from_config(self.cfg, self.round, run_id="a" * 32)
        self.check.verify(settings, method_spec(self.cfg.method), {k: v.astype(np.float32)
                                                                   for k, v in self.state.items()}, *self.schedule)
        self.accepted += 1
        return self.state

    def remaining(self) -> float:
        """The largest distance left to the target, over every coordinate."""
        return max(float(np.abs(self.target[k] - self.state[k]).max()) for k in self.target)


def campaign(out: Path, tamper: str) -> dict:
    work = out / f"campaign-{tamper}"
    run = Campaign(tamper, work / "nodes")
    figures, found, last_miss = {}, None, 0
    try:
        for round_number in range(1, CAMPAIGN_ROUNDS + 1):
            state = run.advance()
            if round_number in PROBES:
                figures[round_number] = probe(work, run.cfg, tamper, state, round_number)
                print(json.dumps({tamper: {round_number: figures[round_number]}}), flush=True)
                if succeeded(tamper, figures[round_number]):
                    found = round_number
                    break
                last_miss = round_number
    except ModelCheckError as exc:  # the check refused the campaign's model (a structural tell it cannot avoid)
        return {"refused_in_round": run.round, "reason": str(exc), "figures": {str(k): v for k, v in figures.items()}}
    if found is not None and found - last_miss > 1:  # bisect between the probes
        low, high = last_miss, found
        while high - low > 1:
            middle = (low + high) // 2
            again = Campaign(tamper, work / f"nodes-{middle}")
            for _ in range(middle):
                state = again.advance()
            figures[middle] = probe(work, again.cfg, tamper, state, middle)
            low, high = (middle, high) if not succeeded(tamper, figures[middle]) else (low, middle)
        found = high
    return {"rounds_to_success": found, "declared_rounds": CAMPAIGN_ROUNDS, "rounds_checked": run.accepted,
            "largest_distance_left": run.remaining(), "figures": {str(k): v for k, v in sorted(figures.items())}}


IMPRINT = {"threat": "malicious", "tamper": "imprint"}
EXACT_DB = 30.0


def imprint_attack(run: RunDirectory) -> dict:
    """`attack gradient --method imprint` on every client of the run's round 1."""
    rows = {}
    for client in range(run.config().clients):
        report = run_attack(run.path, "gradient", "imprint", clients=[client], lpips_backend="stlpips-alex",
                            power_check=False)
        figures, details = report.figures(), report.details
        rows[client] = {"images": run.metrics()[0]["num_examples"][str(client)],
                        "filled_bins": details["filled_bins"], "single_token_bins": details["single_token_bins"],
                        "patches_above_30_db": details["patches_above_30_db"],
                        **{k: figures[k] for k in ("psnr_kept", "ssim_kept", "baseline_kept.psnr",
                                                   "baseline_kept.ssim")}}
    return rows


def imprint_probe(cfg: TrainConfig, state: dict[str, np.ndarray], images: int = 64) -> dict:
    """A client holding the run's first `images` training images trains one round (the run's optimiser, one epoch) from
    the model an adaptive server sends, and the imprint attack reads its update: patches recovered, their PSNR
    against the nearest patch of the client's images at the same position (beside the mean public image's patch
    there, matched the same way)."""
    model = build_model(cfg.model, 10, cfg.local_layers, seed=cfg.seed)
    model.load_state_dict({k: torch.from_numpy(v.astype(np.float32)) for k, v in state.items()})
    sent = build_model(cfg.model, 10, cfg.local_layers, seed=cfg.seed)
    sent.load_state_dict(model.state_dict())
    data = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).train
    pixels, labels = torch.from_numpy(data.images[:images]), torch.from_numpy(data.labels[:images])
    optim = OptimConfig(cfg.local_epochs, cfg.batch_size, cfg.lr, cfg.weight_decay)
    train_local(model, pixels, labels, cfg.method, cfg.mask_ratio, optim, torch.Generator().manual_seed(cfg.seed))
    uploaded = {k: v.detach().clone() for k, v in model.named_parameters()}
    patch = int(sent.local_module.patch_embed.patch_size[0])
    training = LocalTraining(uploaded, images, cfg.local_epochs, cfg.batch_size, cfg.lr, cfg.weight_decay,
                             sent.local_module.num_patches, None)
    size = data.images.shape[1]
    result = ImprintAttack().reconstruct(GradientObservation(sent, {}, 1, size, sent.mean, sent.std,
                                                             local_training=training))
    truth = patch_pixels(pixels.permute(0, 3, 1, 2).double() / 255, patch)
    recovered = patch_pixels(torch.from_numpy(result.images).permute(0, 3, 1, 2).double(), patch)
    mean_image = patch_pixels(torch.from_numpy(run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples,
                                                           0, cfg.seed).public.images).permute(0, 3, 1, 2).double()
                              .div(255).mean(dim=0, keepdim=True), patch)[0]

    def nearest_psnr(guess: torch.Tensor, at: int) -> float:
        error = float(((truth[:, at] - guess) ** 2).mean(dim=1).min())
        return min(60.0, -10 * np.log10(max(error, 1e-12)))

    positions = result.kept_ids[:, 0]
    psnr = np.array([nearest_psnr(recovered[i, at], at) for i, at in enumerate(positions)])
    baseline = np.array([nearest_psnr(mean_image[at], at) for at in positions])
    return {**result.details, "patches_above_30_db": int((psnr >= EXACT_DB).sum()),
            "median_psnr": float(np.median(psnr)), "median_psnr_of_the_mean_image": float(np.median(baseline))}


def fishing_probe(cfg: TrainConfig, state: dict[str, np.ndarray], images: int = 64) -> dict:
    """A client holding one image of the fished class and `images` - 1 of others trains one round from the model an
    adaptive server sends; `attack gradient --method fishing` (its defaults) on its update, scored against that
    image beside the mean public image."""
    model = build_model(cfg.model, 10, cfg.local_layers, seed=cfg.seed)
    model.load_state_dict({k: torch.from_numpy(v.astype(np.float32)) for k, v in state.items()})
    sent = build_model(cfg.model, 10, cfg.local_layers, seed=cfg.seed)
    sent.load_state_dict(model.state_dict())
    dataset = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed)
    fished = fished_class(cfg, 10)
    chosen = np.concatenate([np.flatnonzero(dataset.train.labels == fished)[:1],
                             np.flatnonzero(dataset.train.labels != fished)[:images - 1]])
    pixels, labels = torch.from_numpy(dataset.train.images[chosen]), torch.from_numpy(dataset.train.labels[chosen])
    optim = OptimConfig(cfg.local_epochs, cfg.batch_size, cfg.lr, cfg.weight_decay)
    train_local(model, pixels, labels, cfg.method, cfg.mask_ratio, optim, torch.Generator().manual_seed(cfg.seed))
    steps = cfg.local_epochs * int(np.ceil(images / cfg.batch_size))
    after = dict(model.named_parameters())
    gradients = {name: (p.detach() - after[name].detach()) / (cfg.lr * steps) - cfg.weight_decay * p.detach()
                 for name, p in sent.named_parameters()}
    public = dataset.public.images.astype(np.float32) / 255
    size = public.shape[1]
    result = FishingAttack().reconstruct(GradientObservation(sent, gradients, 1, size, sent.mean, sent.std,
                                                             prior=public.mean(axis=0)))
    truth = pixels[:1].numpy().astype(np.float32) / 255
    return {"psnr": float(metrics.psnr(result.images, truth)[0]),
            "baseline.psnr": float(metrics.psnr(public.mean(axis=0)[None], truth)[0]),
            "gradient_cosine_distance": result.details["gradient_cosine_distance"]}


def adaptive_campaign(tamper: str, probe, declared_rounds: int = CAMPAIGN_ROUNDS,
                      probe_rounds: tuple[int, ...] = (CAMPAIGN_ROUNDS,)) -> dict:
    """Rounds until a tampering fits the check's bounds at the defaults of `eftguard train` on fedavg: per
    coordinate the distance to it (its zeroed weights disguised) over DRIFT_MARGIN of the one-round bound from the
    initial model; and its attack (probe) on the model the adaptive server sends in each of probe_rounds (round r:
    the tampering clipped to r - 1 rounds' bound from the initial model, where the campaign's steady drift is)."""
    cfg = TrainConfig(method="fedavg", threat="adaptive", tamper=tamper, rounds=declared_rounds).resolved()
    model = build_model(cfg.model, 10, cfg.local_layers, seed=cfg.seed)
    initial = {k: v.numpy().astype(np.float64) for k, v in model.state_dict().items()}
    target = disguised({k: v.numpy().astype(np.float64) for k, v in
                        tamper_state(tamper, model.state_dict(), cfg, 0).items()}, initial)
    limits = model_check_limits(cfg)
    one_round = limits(2, initial, 1)
    needed = {k: float(np.max(np.abs(target[k] - initial[k]) / (DRIFT_MARGIN * np.maximum(one_round[k], 1e-30))))
              for k in target}
    slowest = max(needed, key=needed.get)
    attacks = {}
    for round_number in probe_rounds:
        sent = nearest_within(target, [(initial, limits(round_number, initial, round_number - 1))])
        attacks[f"attack_in_round_{round_number}"] = probe(cfg, sent)
        print(json.dumps({tamper: {round_number: attacks[f"attack_in_round_{round_number}"]}}), flush=True)
    return {"rounds_to_fit": 1 + int(np.ceil(needed[slowest])), "slowest_parameter": slowest,
            "one_round_bound_of_it": float(one_round[slowest].max()), **attacks}


FEATURE_FISH = {"method": "fedavg", "threat": "malicious", "tamper": "feature-fish"}
SWITCHED = 5.0  # the fished logit beyond which an image's gradient is on (above +5) or off (below -5)


def first_step_cosine(run: RunDirectory, client: int, image: int) -> float:
    """Cosine between the client's body update (as `--observe upload` reads it) and AdamW's first step of one of its
    images' gradient, g / (|g| + eps), the image's share of a batch of B: 1 where that image alone moved the body in
    one local step."""
    model = sent_model(run, 1)
    obs, _ = upload_observation(run, 1, client, 1, None, model)
    body = [name for name in obs.gradients if not name.startswith("head.")]
    data = client_training_set(run, client)
    named = dict(model.named_parameters())
    loss = torch.nn.functional.cross_entropy(model(model.normalize(torch.from_numpy(data.images[image:image + 1]))),
                                             torch.from_numpy(data.labels[image:image + 1]))
    gradient = torch.cat([g.flatten().double() for g in torch.autograd.grad(loss, [named[n] for n in body])])
    gradient = gradient / min(run.config().batch_size, len(data.labels))
    step = gradient / (gradient.abs() + ADAM_EPS)
    update = torch.cat([obs.gradients[n].flatten().double() for n in body])
    return float(step @ update / (step.norm() * update.norm()))


def feature_fishing(out: Path, name: str, **changes) -> dict:
    """Part 7 on one run: which of each client's images moved the body (the fished logit of the model sent: above
    the threshold, near it, or of the fished class below it), the attack on every client whose update one image
    alone moved, and whether its best match is that image."""
    run = trained(out / f"feature-fishing-{name}", rounds=1, **FEATURE_FISH, **changes)
    cfg, model = run.config(), sent_model(run, 1).eval()
    fished = fished_class(cfg, 10)
    result, movers = {}, {}
    for client in range(cfg.clients):
        data = client_training_set(run, client)
        with torch.no_grad():
            logits = model(model.normalize(torch.from_numpy(data.images)))[:, fished].numpy()
        below = (logits < -SWITCHED) & (data.labels == fished)
        movers[client] = np.flatnonzero((logits >= -SWITCHED) | below)
        result[client] = {"images": len(data.labels), "switched_on": int((logits > SWITCHED).sum()),
                          "near_the_threshold": int((np.abs(logits) <= SWITCHED).sum()),
                          "fished_class_below": int(below.sum())}
    print(json.dumps({f"feature_fishing {name}": result}), flush=True)
    mean_image = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0,
                             cfg.seed).public.images.mean(axis=0) / 255
    for client in [k for k in movers if len(movers[k]) == 1]:
        report = run_attack(run.path, "gradient", "feature-fishing", clients=[client], lpips_backend="stlpips-alex",
                            power_check=False)
        figures = report.figures()
        matched = np.asarray(report.ranking_rows[0][0], dtype=np.float64)
        mover = client_training_set(run, client).images[movers[client][0]] / 255
        result[client].update({"update_vs_its_first_adamw_step_cosine": first_step_cosine(run, client,
                                                                                           int(movers[client][0])),
                               "matched_the_image_that_moved_the_body": bool(np.allclose(matched, mover, atol=1e-6)),
                               "psnr_of_that_image": float(metrics.psnr(np.asarray(report.ranking_rows[0][1])[None],
                                                                        mover[None])[0]),
                               "mean_image_psnr_of_that_image": float(metrics.psnr(mean_image[None], mover[None])[0]),
                               **{k: figures[k] for k in ("psnr", "ssim", "baseline.psnr", "baseline.ssim")}})
        print(json.dumps({f"feature_fishing {name}": {client: result[client]}}), flush=True)
    return result


def feature_fishing_checked(out: Path) -> dict:
    """Part 7's check: refusals in rounds 1 and 2 and under trust-first-model, and the adaptive server's rounds
    before the whole feature-fished head fits the check's bounds."""
    caught = {
        "round 1": refused(train(out / "feature-fish-check-r1", True, rounds=1, **FEATURE_FISH), 1),
        "round 2": refused(train(out / "feature-fish-check-r2", True, rounds=2, tamper_round=2, **FEATURE_FISH), 2),
        "round 1, trust-first-model": refused(train(out / "feature-fish-check-r1-tofu", True,
                                                    {"trust-first-model": True}, rounds=1, **FEATURE_FISH), 1)}
    print(json.dumps({"caught": caught}), flush=True)
    adaptive = adaptive_campaign("feature-fish", None, probe_rounds=())
    print(json.dumps({"adaptive": adaptive}), flush=True)
    return {"caught": caught, "adaptive": adaptive}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 7])
    args = parser.parse_args()
    out = args.out
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    if 1 in args.parts:
        results["attacks"] = {}
        for tamper in ["none", *TAMPERINGS]:
            for batch in (64, 256):
                if batch == 256 and tamper != "label-probe":
                    continue
                threat = {} if tamper == "none" else {"threat": "malicious", "tamper": tamper}
                run = train(out / f"attack-{tamper}-b{batch}", False, batch_size=batch, rounds=1, **threat)
                tampered = tamper != "none"  # the tampered attacks refuse a round nobody tampered with
                invert = run_attack(run.path, "invert", "tampered", lpips_backend="stlpips-alex",
                                    max_images=0).figures() if tampered else {}
                labels = {m: run_attack(run.path, "labels", m).figures()
                          for m in (("tampered", "head") if tampered else ("head",))}
                key = f"{tamper}, B={batch}"
                results["attacks"][key] = {
                    "psnr_kept": invert.get("psnr_kept"), "baseline_kept.psnr": invert.get("baseline_kept.psnr"),
                    **{f"{m} {k}": v[k] for m, v in labels.items() for k in ("l1", "exact_count_accuracy")},
                    "baseline l1": labels["head"]["baseline.l1"],
                    "baseline exact_count_accuracy": labels["head"]["baseline.exact_count_accuracy"]}
                print(json.dumps({key: results["attacks"][key]}), flush=True)
    if 2 in args.parts:
        results["caught"] = {}
        for tamper in TAMPERINGS:
            threat = {"threat": "malicious", "tamper": tamper}
            results["caught"][tamper] = {
                "round 1": refused(train(out / f"check-{tamper}-r1", True, rounds=1, **threat), 1),
                "round 2": refused(train(out / f"check-{tamper}-r2", True, rounds=2, tamper_round=2, **threat), 2),
                "round 1, trust-first-model": refused(train(out / f"check-{tamper}-r1-tofu", True,
                                                            {"trust-first-model": True}, rounds=1, **threat), 1)}
            print(json.dumps({tamper: results["caught"][tamper]}), flush=True)
    if 3 in args.parts:
        results["adaptive"] = {tamper: campaign(out, tamper) for tamper in TAMPERINGS}
        print(json.dumps({"adaptive": {t: r.get("rounds_to_success", r.get("reason"))
                                       for t, r in results["adaptive"].items()}}))
    if 4 in args.parts:
        honest = train(out / "honest-20", True, rounds=20)
        rows = margins(honest)
        dropped = [reason for r in honest.metrics() for reason in r["dropped"].values()]
        results["honest"] = {"rounds": 20, "client_rounds": sum(len(r["clients"]) for r in honest.metrics()),
                             "refusals": sum("refuses" in reason for reason in dropped), "dropped": len(dropped),
                             "largest_share_of_limit": max(r[1] for r in rows),
                             "median_share_of_limit": float(np.median([r[1] for r in rows])),
                             "largest_share_of_limit_from_initial": max(r[3] for r in rows)}
        print(json.dumps({"honest": results["honest"]}), flush=True)
    if 5 in args.parts:
        results["imprint"] = {}
        for name, changes in {"fedavg, 100 images per client": {"method": "fedavg"},
                              "fedavg, 16 images per client": {"method": "fedavg", "train_samples": 64},
                              "eftvit, 100 images per client": {"method": "eftvit"}}.items():
            run = train(out / f"imprint-{name.replace(', ', '-').replace(' ', '')}", False, rounds=1,
                        **IMPRINT, **changes)
            results["imprint"][name] = imprint_attack(run)
            print(json.dumps({name: results["imprint"][name]}), flush=True)
        results["imprint"]["caught"] = {
            "round 1": refused(train(out / "imprint-check-r1", True, rounds=1, method="fedavg", **IMPRINT), 1),
            "round 2": refused(train(out / "imprint-check-r2", True, rounds=2, tamper_round=2, method="fedavg",
                                     **IMPRINT), 2),
            "round 1, trust-first-model": refused(train(out / "imprint-check-r1-tofu", True,
                                                        {"trust-first-model": True}, rounds=1, method="fedavg",
                                                        **IMPRINT), 1)}
        print(json.dumps({"caught": results["imprint"]["caught"]}), flush=True)
        results["imprint"]["adaptive"] = adaptive_campaign("imprint", imprint_probe)
        print(json.dumps({"adaptive": results["imprint"]["adaptive"]}), flush=True)
    if 6 in args.parts:
        fishing = results["fishing"] = {}
        run = trained(out / "fishing", rounds=1, method="fedavg", threat="malicious", tamper="class-fish")
        honest = trained(out / "fishing-honest", rounds=1, method="fedavg")
        fished = fished_class(run.config(), 10)
        counts = {k: int(run.load_truth(1, k)["class_counts"][fished]) for k in range(run.config().clients)}
        fishing["of_the_fished_class"] = counts
        # IG on a ViT costs minutes on a CPU: the clients holding 1 to 3 images of the fished class, fewest first
        for client in sorted((k for k, n in counts.items() if 1 <= n <= 3), key=counts.get):
            report = run_attack(run.path, "gradient", "fishing", clients=[client], lpips_backend="stlpips-alex",
                                power_check=False)
            figures = report.figures()
            fishing[client] = {"images": run.metrics()[0]["num_examples"][str(client)],
                               "of_the_fished_class": counts[client],
                               "matched_the_fished_class": report.details["label_accuracy"]["mean"],
                               **{k: figures[k] for k in ("psnr", "ssim", "baseline.psnr", "baseline.ssim")}}
            if counts[client] == 1:
                plain = run_attack(honest.path, "gradient", "ig", clients=[client], start="prior", match="body",
                                   lpips_backend="stlpips-alex", power_check=False).figures()
                fishing[client]["honest round, ig --start prior --match body"] = {
                    k: plain[k] for k in ("psnr", "ssim", "baseline.psnr", "baseline.ssim")}
            print(json.dumps({"fishing": {client: fishing[client]}}), flush=True)
            if counts[client] == 1:
                fishing["caught"] = {
                    "round 1": refused(train(out / "fishing-check-r1", True, rounds=1, method="fedavg",
                                             threat="malicious", tamper="class-fish"), 1),
                    "round 1, trust-first-model": refused(train(out / "fishing-check-r1-tofu", True,
                                                                {"trust-first-model": True}, rounds=1,
                                                                method="fedavg", threat="malicious",
                                                                tamper="class-fish"), 1)}
                print(json.dumps({"caught": fishing["caught"]}), flush=True)
                fishing["adaptive"] = adaptive_campaign("class-fish", fishing_probe,
                                                        probe_rounds=(1, 4, 16, 64, 128, 256, CAMPAIGN_ROUNDS))
                print(json.dumps({"adaptive": fishing["adaptive"]}), flush=True)
    if 7 in args.parts:
        results["feature_fishing"] = {
            "16 images per client": feature_fishing(out, "16-per-client", train_samples=64),
            "100 images per client": feature_fishing(out, "100-per-client"),
            **feature_fishing_checked(out)}
    out.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
