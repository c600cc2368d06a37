"""`eftguard attack gradient | labels RUN` on a recorded Flower app (eftguard.federation.recorder, docs/flower-apps.md).

The attacks are eftguard's own, given the user's model rebuilt from app.toml's `module:factory`: iDLG, DLG and
Inverting Gradients on a one-step update (-update / lr is then the client's gradient, exactly, for SGD), and the
label attacks that read the last layer's update alone (bias-corrected, LLG); on a multi-step update, update
inversion (`updates`), which simulates the client's local SGD (or AdamW) steps. All need a classifier whose output
is a linear layer's; any other model, or a multi-step update given to a one-step method, is refused on one line
that says why. Scores join truth/ (shared only by clients with the share_truth mod) after the attack, as the
auditor does for eftguard runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from eftguard.apprun import AppRun, AppSpec
from eftguard.attacks.base import AttackError
from eftguard.attacks.gradient import GRADIENT, GradientObservation, LocalTraining
from eftguard.attacks.labels import LABELS, ClientUploads, LabelObservation
from eftguard.attacks.update_inversion import UpdateInversion
from eftguard.metrics import hungarian_match, psnr
from eftguard.paths import atomic_write
from eftguard.rundir import RunError

GRADIENT_METHODS = ("idlg", "dlg", "ig", UpdateInversion.name)  # any classifier; analytic reads a ViT's embeddings
ONE_STEP_METHODS = ("idlg", "dlg", "ig")  # invert one gradient; updates simulates the client's local steps
LABEL_METHODS = ("bias-corrected", "llg")  # those that read the last layer's update alone
MEMBERSHIP_METHODS = ("lira", "rmia")  # online, on the global model, reference models replaying the app's federation


@dataclass
class ClientResult:
    client: int
    scores: dict


def last_linear(model: nn.Module, image_size: int) -> str:
    """The name of the nn.Linear whose output is the model's output (the classifier's last layer)."""
    produced: list[tuple[str, torch.Tensor]] = []  # the tensors themselves: an id could be reused once freed
    hooks = [module.register_forward_hook(lambda m, i, out, name=name: produced.append((name, out)))
             for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    try:
        with torch.no_grad():
            output = model(torch.zeros(1, 3, image_size, image_size))
    finally:
        for hook in hooks:
            hook.remove()
    names = [name for name, out in produced if out is output]
    if not names:
        last = [type(m).__name__ for m in model.modules()][-1]
        raise AttackError(f"the app's model {type(model).__name__} does not end in a linear layer (its output is not "
                          f"an nn.Linear's; last module: {last}): the gradient and label attacks read a linear last "
                          "layer's update")
    return names[0]


def chosen_clients(run: AppRun, round_number: int, clients) -> list[int]:
    available = run.uploaded_partitions(round_number)
    chosen = available if clients in (None, "all") else [int(c) for c in (clients if isinstance(clients, (list, tuple))
                                                                            else str(clients).split(","))]
    missing = sorted(set(chosen) - set(available))
    if missing:
        raise RunError(f"no uploads of client(s) {missing} in round {round_number}; clients with uploads: {available}")
    return chosen


def round_of(run: AppRun, round_number: int | None) -> tuple[int, dict]:
    records = run.metrics()
    if not records:
        raise RunError(f"{run.path} has no completed round to attack")
    round_number = round_number or len(records)
    if not 1 <= round_number <= len(records):
        raise RunError(f"round {round_number} of {run.path} is not recorded: rounds 1-{len(records)}")
    return round_number, records[round_number - 1]


def client_observation(run: AppRun, model: nn.Module, head: str, round_number: int, record: dict, client: int,
                       method: str) -> GradientObservation:
    """The client's update as the server holds it (update_observation), checked to suit the method."""
    num_examples = int(record["num_examples"][str(client)])
    check_steps(run.spec(), method, num_examples, f"client {client}'s update in round {round_number}")
    update = run.load_upload(round_number, client, "update")
    trained = {name: torch.from_numpy(update[name]) for name, _ in model.named_parameters()}
    return update_observation(run.spec(), model, head, trained, num_examples, float(record["lr"]))


def check_steps(spec: AppSpec, method: str, num_examples: int, what: str) -> None:
    """dlg, idlg and ig invert one SGD step's gradient: a multi-step update is refused on one line."""
    steps = spec.local_epochs * math.ceil(num_examples / spec.batch_size)
    if method in ONE_STEP_METHODS and (steps != 1 or spec.optimizer != "sgd"):
        raise AttackError(f"{what} is {steps} local {spec.optimizer} step(s) (n_k {num_examples}, batch "
                          f"{spec.batch_size}, {spec.local_epochs} epoch(s)): --method {method} inverts one SGD "
                          "step's gradient; use --method updates --schedule fixed")


def update_observation(spec: AppSpec, model: nn.Module, head: str, trained: dict[str, torch.Tensor],
                       num_examples: int, lr: float) -> GradientObservation:
    """An update from the start `model` to the `trained` parameters: -update / (lr * steps), the gradient when the
    client took one SGD step (the only case dlg, idlg and ig may read), and the local training the updates attack
    simulates."""
    steps = spec.local_epochs * math.ceil(num_examples / spec.batch_size)
    gradients = {name: -(trained[name] - p.detach()) / (lr * steps) for name, p in model.named_parameters()}
    training = LocalTraining(trained, num_examples, spec.local_epochs, spec.batch_size, lr, spec.weight_decay,
                             num_patches=0, mask_ratio=None, optimizer=spec.optimizer)
    return GradientObservation(model, gradients, num_examples, spec.image_size, spec.mean, spec.std,
                               head_bias=f"{head}.bias", local_training=training)


def image_scores(reconstructed: np.ndarray, originals: np.ndarray) -> dict:
    """PSNR of the reconstructions (matched to the originals, uint8 [n, H, W, 3]) and of each original's own mean
    colour, the baseline."""
    originals = originals.astype(np.float64) / 255.0
    matched = reconstructed[hungarian_match(reconstructed, originals)]
    mean_colour = np.broadcast_to(originals.mean(axis=(1, 2), keepdims=True), originals.shape)
    return {"psnr_db": float(psnr(matched, originals).mean()),
            "baseline_psnr_db": float(psnr(mean_colour, originals).mean())}


def attack_gradient(run: AppRun, method: str, options: dict, round_number: int | None, clients) -> list[ClientResult]:
    check_gradient_method(method)
    round_number, record = round_of(run, round_number)
    spec = run.spec()
    results = []
    for client in chosen_clients(run, round_number, clients):
        model = run.start_model(round_number)
        observation = client_observation(run, model, last_linear(model, spec.image_size), round_number, record,
                                         client, method)
        reconstruction = GRADIENT.get(method)(**options).reconstruct(observation)
        scores = {"images": observation.batch_size}
        truth = shared_truth(run, round_number, client)
        if truth is not None:
            scores.update(image_scores(reconstruction.images, truth["images"]))
        results.append(ClientResult(client, scores))
    return results


def check_gradient_method(method: str) -> None:
    if method not in GRADIENT_METHODS:
        raise AttackError(f"--method {method} reads a ViT's patch and positional embeddings; on a Flower app's model "
                          f"use --method {' | '.join(GRADIENT_METHODS)}")


def attack_labels(run: AppRun, method: str, round_number: int | None, clients) -> list[ClientResult]:
    check_label_method(method)
    round_number, record = round_of(run, round_number)
    model = run.start_model(round_number)
    head = label_head(model, run.spec().image_size)
    uploads = []
    for client in chosen_clients(run, round_number, clients):
        update = run.load_upload(round_number, client, "update")
        uploads.append(ClientUploads(client, int(record["num_examples"][str(client)]), None, None,
                                     update[f"{head.name}.weight"], update[f"{head.name}.bias"]))
    estimates = estimate_labels(method, round_number, head, uploads)
    results = []
    for client in uploads:
        scores = {"estimated_counts": estimates[client.partition].counts.round(2).tolist()}
        truth = shared_truth(run, round_number, client.partition)
        if truth is not None:
            if truth["labels"].max(initial=0) >= head.module.out_features:
                raise RunError(f"client {client.partition}'s shared truth has label {truth['labels'].max()}, but the "
                               f"model has {head.module.out_features} classes: share the labels the client trained on")
            scores.update(label_scores(estimates[client.partition].counts, truth["labels"], head.module.out_features))
        results.append(ClientResult(client.partition, scores))
    return results


def check_label_method(method: str) -> None:
    if method not in LABEL_METHODS:
        raise AttackError(f"--method {method} reads uploaded features or a ViT; on a Flower app's model use "
                          f"--method {' | '.join(LABEL_METHODS)} (they read the last linear layer's update alone)")


@dataclass
class Head:
    name: str
    module: nn.Linear


def label_head(model: nn.Module, image_size: int) -> Head:
    """The last linear layer, with the bias the label attacks read."""
    name = last_linear(model, image_size)
    head = Head(name, model.get_submodule(name))
    if head.module.bias is None:
        raise AttackError(f"the app's last layer {name} has no bias: the label attacks read the bias update")
    return head


def estimate_labels(method: str, round_number: int, head: Head, uploads: list[ClientUploads]) -> dict:
    observation = LabelObservation(round_number, head.module.out_features, uploads,
                                   start_model=SimpleNamespace(head=head.module))
    return LABELS.get(method)().reconstruct(observation)


def label_scores(estimated: np.ndarray, labels: np.ndarray, classes: int) -> dict:
    """L1 between the estimated and the true class shares, and a uniform guess's (the baseline)."""
    true = np.bincount(labels, minlength=classes).astype(np.float64)
    share = true / true.sum()
    estimate = estimated / max(estimated.sum(), 1e-12)
    return {"true_counts": true.tolist(), "l1": float(np.abs(estimate - share).sum()),
            "baseline_l1": float(np.abs(np.full_like(share, 1 / len(share)) - share).sum())}


def shared_truth(run: AppRun, round_number: int, client: int) -> dict | None:
    return run.load_truth(round_number, client) if run.truth_path(round_number, client).exists() else None


def write_report(run: AppRun, family: str, method: str, round_number: int, fields: dict, out: Path | None) -> Path:
    """reports/<family>-<method>/report.json and report.md: the attack, the app's model, the round and the attack's
    fields (the scores per client; a membership attack's level, power check and figures)."""
    folder = (out or run.path / "reports") / f"{family}-{method}"
    folder.mkdir(parents=True, exist_ok=True)
    report = {"family": family, "method": method, "model": run.spec().model, "round": round_number, **fields}
    atomic_write(folder / "report.json", lambda p: p.write_text(json.dumps(report, indent=2) + "\n"))
    lines = [f"# {family} {method} on {run.path} ({report['model']}), round {round_number}", ""]
    for name, value in fields.items():
        if isinstance(value, dict):
            lines += ["", f"## {name}", ""] + [f"- {key}: {json.dumps(item)}" for key, item in value.items()]
        else:
            lines.append(f"- {name}: {value}")
    atomic_write(folder / "report.md", lambda p: p.write_text("\n".join(lines) + "\n"))
    return folder / "report.json"


def app_methods(family: str) -> tuple[str, ...]:
    """The methods of a family that read a recorded Flower app; a family with none is refused on one line."""
    methods = {"gradient": GRADIENT_METHODS, "labels": LABEL_METHODS, "membership": MEMBERSHIP_METHODS}.get(family)
    if methods is None:
        raise AttackError(f"eftguard attack {family} does not read a recorded Flower app: attack it with "
                          f"gradient (--method {'|'.join(GRADIENT_METHODS)}), labels (--method "
                          f"{'|'.join(LABEL_METHODS)}) or membership (--method {'|'.join(MEMBERSHIP_METHODS)}), or "
                          "audit it (eftguard audit RUN)")
    return methods


def run_app_attack(path: Path, family: str, method: str, options: dict, round_number: int | None, clients,
                   out: Path | None) -> tuple[list[ClientResult], Path]:
    run = AppRun.open(path)
    app_methods(family)
    attack = attack_gradient if family == "gradient" else lambda r, m, o, t, c: attack_labels(r, m, t, c)
    round_number, _ = round_of(run, round_number)
    results = attack(run, method, options, round_number, clients)
    return results, write_report(run, family, method, round_number, {"clients": {str(r.client): r.scores
                                                                                  for r in results}}, out)
