"""The server's side of a run: handshake, rounds, validation, aggregation, global training, evaluation,
and everything written to the run directory."""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from eftguard import headprune
from eftguard.canaries import canary_set
from eftguard.config import TrainConfig
from eftguard.data import Dataset, seeded
from eftguard.data.plan import run_dataset
from eftguard.defenses.dp import ClientBudget
from eftguard.defenses.ledger import SPENT_NOTE
from eftguard.errors import FederationError, Interrupted
from eftguard.federation import secagg
from eftguard.federation.client import dp_budget, participation, release_size, schedule_size, select_clients
from eftguard.federation.rows import RoundRows
from eftguard.federation.records import ClientSettings, UploadError, to_record
from eftguard.federation.validation import (UploadSpec, validate_features, validate_heads, validate_metrics,
                                            validate_truth, validate_update)
from eftguard.masking import kept_token_count
from eftguard.methods import method_spec
from eftguard.model import EFTViT, build_model
from eftguard.retention import Retention
from eftguard.rundir import RunDirectory
from eftguard.training import OptimConfig, TrainResult, evaluate, keep_if_not_worse, train_global

log = logging.getLogger("eftguard.server")
console = Console(stderr=True)
HANDSHAKE_SECONDS = 600.0
POLL_SECONDS = 0.1
GUARD_IMAGES = 500  # public images scored before and after server training under DP (accuracy to about ±2%)


STOP_REQUESTED = threading.Event()  # set by the runtime on Ctrl-C; the server stops at the next poll

State = dict[str, torch.Tensor]


class ServerThreat(Protocol):
    """What a malicious server sends instead of its own model (simulation only, to measure attacks and the
    clients' model check): attacks/tamper.py builds one for --threat, and the server is given it (run_server)."""

    def prepare(self, initial: State, current: State) -> None:
        """Before round 1: the run's initial model, and the model the server holds now; raises FederationError
        when this model cannot be tampered with."""

    def tampering(self, round_number: int) -> str | None:
        """The name the round's metrics.jsonl records under "tampered" (None: an honest round)."""

    def sent(self, round_number: int, partitions: list[int], state: State) -> dict[int, State]:
        """The model each client gets in the round, from the server's own `state`."""

    def accepted(self, round_number: int, partitions: list[int]) -> None:
        """The clients that trained on what they were sent (they did not refuse it)."""


def check_stop() -> None:
    if STOP_REQUESTED.is_set():
        raise Interrupted("interrupted")


@dataclass
class AcceptedUpload:
    partition: int
    update: dict[str, np.ndarray]
    features: dict[str, np.ndarray] | None
    num_examples: int
    loss: float
    epoch_seconds: list[float]
    epoch_cpu_seconds: list[float]
    upload_bytes: int
    heads: dict[str, np.ndarray] | None = None  # headprune-lora: the client's head importance and kept head ids
    global_loss: float | None = None  # --client-selection loss-gap: the received model's loss on the client's data


def upload_spec(model: EFTViT, cfg: TrainConfig, dataset: Dataset) -> UploadSpec:
    """What this run's clients can validly upload: bounds on every part of a reply, from the model and data."""
    method = method_spec(cfg.method)
    num_patches = model.local_module.num_patches
    head_index, heads = method.heads.upload_layout(model, cfg.head_sparsity)
    canary_ids = canary_set(cfg).ids if cfg.canaries else np.empty(0, np.int64)  # canaries are training images too
    return UploadSpec(
        update_shapes={k: tuple(v.shape) for k, v in method.uploaded_state(model).items()},
        tokens=1 + kept_token_count(num_patches, method.mask_ratio(cfg.mask_ratio)) if method.uploads_features
        else None,
        width=model.local_module.token_embedding.pos_embed.shape[-1],
        num_classes=dataset.num_classes, num_patches=num_patches, train_ids=np.sort(np.concatenate([dataset.train.ids,
                                                                                                   canary_ids])),
        balance=cfg.balance, local_epochs=cfg.local_epochs, round_seconds=cfg.round_timeout,
        head_index=head_index, heads=heads,
        reports_global_loss=cfg.client_selection == "loss-gap", canaries=cfg.canaries,
        dp_sizes={k: (schedule_size(cfg, k), release_size(cfg, k)) for k in range(cfg.clients)} if cfg.dp_eps else None)


def discover_nodes(grid: Grid, clients: int, timeout: float) -> dict[int, int]:
    """Wait for the nodes and ask each which partition it holds: {partition-id: node-id}.

    timeout bounds the wait for nodes to connect and, separately, for their answers (a simulated
    node starts its process on the first message, which takes a while on a loaded machine)."""
    deadline = time.monotonic() + timeout
    node_ids: list[int] = []
    while time.monotonic() < deadline:
        node_ids = sorted(grid.get_node_ids())
        if len(node_ids) >= clients:
            break
        time.sleep(0.5)
    if len(node_ids) < clients:
        raise FederationError(f"only {len(node_ids)} of {clients} client nodes connected within {timeout:.0f} s: "
                              "start one SuperNode per partition")
    messages = [Message(RecordDict({}), node_id, MessageType.QUERY) for node_id in node_ids]
    replies = list(grid.send_and_receive(messages, timeout=timeout))
    if not replies:
        raise FederationError(f"no client node answered the handshake within {timeout:.0f} s")
    partitions: dict[int, int] = {}
    for reply in replies:
        if reply.has_error():
            raise FederationError(f"node {reply.metadata.src_node_id} failed the handshake: {reply.error.reason}")
        info = reply.content["node"]
        if int(info["num-partitions"]) != clients:
            raise FederationError(f"node {reply.metadata.src_node_id} was started for {info['num-partitions']} "
                                  f"partitions, the run has {clients}")
        partitions[int(info["partition-id"])] = reply.metadata.src_node_id
    missing = sorted(set(range(clients)) - set(partitions))
    if missing:
        raise FederationError(f"no node holds partition(s) {missing} (or it did not answer within {timeout:.0f} s): "
                              f"each partition-id 0..{clients - 1} needs a node")
    return partitions


def parse_reply(reply: Message, partition: int, spec: UploadSpec, method: str,
                record_truth: bool = True) -> tuple[AcceptedUpload, dict | None]:
    """Decode and validate one client's reply (and its ground truth, when the run asks for it and the node
    shares it); raises UploadError naming what is wrong, and nothing else, whatever the client sent."""
    if reply.has_error():
        raise UploadError(f"client failed: {str(reply.error.reason):.200}")
    content = reply.content
    uploads_features = method_spec(method).uploads_features
    required = {"update", "metrics", *method_spec(method).heads.records} | ({"features"} if uploads_features else set())
    allowed = required | ({"truth"} if record_truth else set())
    missing, extra = sorted(required - set(content.keys())), sorted(set(content.keys()) - allowed)
    if missing or extra:
        raise UploadError(f"reply has wrong records (missing {missing}, unexpected {[k[:40] for k in extra[:3]]})")
    metrics = validate_metrics(content["metrics"], partition, spec)
    # Features first: the one part whose size the client chooses, refused before anything is decoded if too large.
    rows = spec.dp_sizes[partition][1] if spec.dp_sizes else None
    features = validate_features(content["features"], spec, metrics.num_examples, rows) if uploads_features else None
    heads = validate_heads(content["heads"], spec) if "heads" in required else None
    kept = headprune.kept_mask(heads["kept"], spec.heads[1]) if heads else None
    update = validate_update(content["update"], spec, kept)
    truth = None
    if "truth" in content:
        truth = validate_truth(content["truth"], spec, metrics.num_examples,
                               len(features["labels"]) if features else None)
    upload_bytes = sum(a.nbytes for part in (update, features or {}, heads or {}) for a in part.values())
    return AcceptedUpload(partition, update, features, metrics.num_examples, metrics.loss, metrics.epoch_seconds,
                          metrics.epoch_cpu_seconds, upload_bytes, heads, metrics.global_loss), truth


def check_dp_report(metrics: ConfigRecord, budget: ClientBudget, dp_eps: float) -> dict[str, float]:
    """A DP run's upload must report what it applied on every channel: the noise the server sent (or more),
    DP-SGD's sample rate and steps of the client's schedule, and a finite spend within --dp-eps. An upload that
    claims less (or no DP at all) is dropped. Returns the epsilon the client reports it has spent, per channel
    ("parameters", "features") and in total."""
    channels = ["parameters"] + (["features"] if budget.feature_share else [])
    try:
        sigma, rate = float(metrics["dp-noise-multiplier"]), float(metrics["dp-sample-rate"])
        steps = metrics["dp-steps"]
        spent = {"total": float(metrics["dp-epsilon-spent"]),
                 **{channel: float(metrics[f"dp-epsilon-{channel}"]) for channel in channels}}
        feature_sigma = float(metrics["dp-feature-noise-multiplier"]) if budget.feature_share else math.inf
    except (KeyError, TypeError, ValueError):
        raise UploadError("the run uses DP but the reply does not report what it applied (dp-noise-multiplier, "
                          "dp-sample-rate, dp-steps, dp-epsilon-spent, dp-epsilon-parameters"
                          + (", dp-feature-noise-multiplier, dp-epsilon-features)" if budget.feature_share else ")")
                          ) from None
    if not sigma >= budget.noise_multiplier:  # also catches NaN
        raise UploadError(f"the client applied noise multiplier {sigma}, below the {budget.noise_multiplier:.4f} sent")
    if not feature_sigma >= budget.feature_noise_multiplier:
        raise UploadError(f"the client applied feature noise multiplier {feature_sigma}, below the "
                          f"{budget.feature_noise_multiplier:.4f} sent")
    if isinstance(steps, bool) or steps != budget.steps_per_round or not math.isclose(rate, budget.sample_rate):
        raise UploadError(f"the client reports {steps} DP-SGD steps at sample rate {rate}, its schedule is "
                          f"{budget.steps_per_round} at {budget.sample_rate:.4g}")
    for channel, value in spent.items():  # the budget is the total; each channel alone spends no more than it
        if not 0 < value <= dp_eps * (1 + 1e-9):
            raise UploadError(f"the client reports {channel} epsilon {value} spent, outside (0, {dp_eps:.6g}] "
                              f"(--dp-eps {dp_eps})")
    return spent


def exchange(grid: Grid, messages: dict[int, Message], timeout: float, progress: Progress, task,
             receive: Callable[[int, Message], None]) -> set[int]:
    """Send one message per partition and hand each reply to receive as it arrives (progress per client), so that
    each is decoded and let go before the next is pulled; returns the partitions that replied in time."""
    ids = dict(zip(grid.push_messages(messages.values()), messages))
    replied: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(replied) < len(ids) and time.monotonic() < deadline:
        check_stop()
        pending = [i for i, p in ids.items() if p not in replied]
        pulled = list(grid.pull_messages(pending))
        while pulled:
            reply = pulled.pop()
            partition = ids[reply.metadata.reply_to_message_id]
            replied.add(partition)
            receive(partition, reply)
            progress.update(task, completed=len(replied))
        if len(replied) < len(ids):
            time.sleep(POLL_SECONDS)
    return replied


def run_server(grid: Grid, run_dir: Path, threat: ServerThreat | None = None) -> None:
    """Serve the run's rounds; threat: what a --threat run's server sends instead of its model (None: honest)."""
    cfg = RunDirectory.open(run_dir).config()
    cfg.validate()  # a config.toml edited by hand (dp_eps = nan) must not reach the rounds
    if (cfg.threat != "honest") != (threat is not None):
        raise FederationError(f"--threat {cfg.threat} needs its server threat (eftguard.attacks.tamper.server_threat), "
                              "an honest run none")
    run = RunDirectory.open(run_dir, cfg.encrypt_at_rest or None)
    with run.lock():
        serve_rounds(grid, run, cfg, threat)


def serve_rounds(grid: Grid, run: RunDirectory, cfg: TrainConfig, threat: ServerThreat | None = None) -> None:
    """The rounds still to run, from the last intact completed round on (run locked by the caller)."""
    done = run.resume()
    dataset = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.test_samples, cfg.seed)
    test_images, test_labels = torch.from_numpy(dataset.test.images), torch.from_numpy(dataset.test.labels)
    if done:
        model = build_model(cfg.model, dataset.num_classes, cfg.local_layers,
                            adapt=method_spec(cfg.method).model_adapter(cfg))
        model.load_state_dict(run.load_checkpoint(done))
        console.print(f"resuming {run.path} after round {done} of {cfg.rounds}")
    else:
        model = build_model(cfg.model, dataset.num_classes, cfg.local_layers, cfg.pretrained,
                            cfg.checkpoint or None, cfg.seed, method_spec(cfg.method).model_adapter(cfg))
        run.save_checkpoint(0, model.state_dict())
    if done >= cfg.rounds:
        console.print(f"{run.path} already has all {cfg.rounds} rounds")
        return
    if threat:  # a tampering this model cannot take fails here, before any round
        threat.prepare(run.load_checkpoint(0), model.state_dict())
    spec = upload_spec(model, cfg, dataset)
    budgets = dp_budgets(cfg)
    public = guard_images(dataset, cfg.seed) if budgets else None
    nodes = discover_nodes(grid, cfg.clients, min(cfg.round_timeout, HANDSHAKE_SECONDS))
    started = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        rounds_task = progress.add_task("rounds", total=cfg.rounds, completed=done)
        for round_number in range(done + 1, cfg.rounds + 1):
            check_stop()
            record = run_round(grid, run, cfg, model, spec, nodes, round_number, test_images, test_labels, progress,
                               budgets, public, threat)
            record["elapsed_seconds"] = round(time.perf_counter() - started, 3)
            run.append_metrics(record)
            run.drop_unkept(round_number)
            progress.update(rounds_task, completed=round_number)
            progress.console.print(round_summary(record, cfg.rounds))


def guard_images(dataset: Dataset, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's own labelled images that judge theta's update under DP: a seeded subset of the public split
    (GUARD_IMAGES at most: two evaluations per round)."""
    ids = np.sort(np.random.default_rng([seed, 5]).permutation(len(dataset.public))[:GUARD_IMAGES])
    return torch.from_numpy(dataset.public.images[ids]), torch.from_numpy(dataset.public.labels[ids])


def round_summary(record: dict, rounds: int) -> str:
    """The line printed after a round; losses are absent (None) when no upload was accepted."""
    losses = "".join(f"  {name.replace('_', ' ')} {record[name]:.3f}" for name in ("client_loss", "server_loss")
                     if record[name] is not None)
    dropped = f"  dropped {len(record['dropped'])}" if record["dropped"] else ""
    return f"round {record['round']}/{rounds}: test accuracy {record['test_accuracy']:.3f}{losses}{dropped}"


def dp_budgets(cfg: TrainConfig) -> dict[int, ClientBudget]:
    """Each client's budget over all its rounds of the run, every channel ({} without DP): fixed before round 1
    (and printed) and recomputed identically on resume, since client selection and schedule sizes are seeded."""
    if cfg.dp_eps == 0:
        return {}
    with console.status("calibrating the DP noise per client"):
        budgets = {k: dp_budget(cfg, k, schedule_size(cfg, k), cfg.rounds) for k in range(cfg.clients)
                   if participation(cfg, k, cfg.rounds)}
    console.print(budget_table(budgets, cfg))
    return budgets


def budget_table(budgets: dict[int, ClientBudget], cfg: TrainConfig) -> Table:
    """The noise each client is calibrated to and what it spends, printed before round 1: the total (both channels
    composed: the guarantee) is --dp-eps; each channel alone spends less."""
    features = next(iter(budgets.values())).feature_share > 0
    split = f" (features' share {cfg.dp_feature_share:g} in Gaussian-DP terms)" if features else ""
    table = Table(box=None, pad_edge=False, title=f"privacy budget per client: epsilon {cfg.dp_eps:g} in total over "
                                                  f"its rounds, at its delta{split}")
    columns = ["client", "rounds", "delta", "DP-SGD σ", "ε params alone"]
    columns += ["feature σ", "ε features alone"] if features else []
    for column in columns + ["ε total"]:
        table.add_column(column, justify="right")
    for k, budget in budgets.items():
        last = max(budget.rounds)
        spent = budget.channel_epsilons_after(last)
        row = [str(k), str(len(budget.rounds)), f"{budget.delta:.2g}", f"{budget.noise_multiplier:.3f}",
               f"{spent['parameters']:.3f}"]
        row += [f"{budget.feature_noise_multiplier:.3f}", f"{spent['features']:.3f}"] if features else []
        table.add_row(*row, f"{budget.epsilon_after(last):.3f}")
    return table


def refusal_spend(reply: Message, dp_eps: float) -> float | None:
    """The epsilon a refusing DP node says it has spent in the run (apps.spent_note), when it says so sensibly."""
    if not (dp_eps and reply.has_error()):
        return None
    found = re.match(rf"client refuses \[{re.escape(SPENT_NOTE)} ([0-9.e+-]{{1,30}})\]", str(reply.error.reason))
    try:
        spent = float(found.group(1)) if found else math.nan
    except ValueError:
        return None
    return spent if 0 < spent <= dp_eps * (1 + 1e-9) else None


def privacy_metrics(budgets: dict[int, ClientBudget], selected: list[int], round_number: int,
                    reported: dict[str, dict[str, float]]) -> dict:
    """metrics.jsonl's privacy keys. epsilon: the total each client reports it has spent in the run (its ledger:
    with its upload, or with its refusal); epsilon_parameters / epsilon_features: each channel alone, as accepted
    clients report them; epsilon_server: the server's own total; the noise multipliers sent per channel. All None
    without DP."""
    if not budgets:
        return dict.fromkeys(("epsilon", "epsilon_parameters", "epsilon_features", "epsilon_server",
                              "noise_multiplier", "feature_noise_multiplier"))
    features = any(b.feature_share for b in budgets.values())
    return {
        "epsilon": {p: spent["total"] for p, spent in reported.items()},
        "epsilon_parameters": {p: spent["parameters"] for p, spent in reported.items() if "parameters" in spent},
        "epsilon_features": {p: spent["features"] for p, spent in reported.items() if "features" in spent}
        if features else None,
        "epsilon_server": {str(p): budgets[p].epsilon_after(round_number) for p in selected},
        "noise_multiplier": {str(p): budgets[p].noise_multiplier for p in selected},
        "feature_noise_multiplier": {str(p): budgets[p].feature_noise_multiplier for p in selected}
        if features else None,
    }


def load_average(model: EFTViT, averaged: dict[str, np.ndarray]) -> None:
    """Put the averaged parameters into the model; every averaged key must name one of its parameters (a
    non-strict load would silently skip renamed keys and leave FedAvg a no-op)."""
    state = model.state_dict()
    unknown = sorted(set(averaged) - set(state))
    if unknown:
        raise FederationError(f"averaged parameters {unknown[:3]} are not in the model")
    model.load_state_dict({**state, **{k: torch.from_numpy(v) for k, v in averaged.items()}}, strict=True)


def round_clients(cfg: TrainConfig, round_number: int, history: list[dict]) -> list[int]:
    """The round's clients: seeded random, or (--client-selection loss-gap, after round 1) the clients whose last
    reported local loss most exceeds the loss they reported for the global model they received; clients never
    heard from yet come first (their gap counts as infinite), so every client is seen before it is ranked."""
    if cfg.client_selection != "loss-gap" or round_number == 1:
        return select_clients(cfg, round_number)
    local, received = dict.fromkeys(range(cfg.clients), math.inf), dict.fromkeys(range(cfg.clients), 0.0)
    for record in history:
        for partition, loss in record.get("global_losses", {}).items():
            local[int(partition)], received[int(partition)] = record["local_losses"][partition], loss
    return headprune.loss_gap_selection(local, received, cfg.clients_per_round)


def average(cfg: TrainConfig, spec: UploadSpec, model: EFTViT, accepted: list[AcceptedUpload]
            ) -> dict[str, np.ndarray]:
    """FedAvg of the accepted updates by sample count; headprune-lora: per head over the clients that kept it,
    weighted by their importance (--head-weighting samples: by their sample counts)."""
    return method_spec(cfg.method).heads.average([u.update for u in accepted], [u.num_examples for u in accepted],
                                                 [u.heads for u in accepted], cfg.head_weighting, model.state_dict(),
                                                 spec.heads, spec.head_index)


def plain_uploads(grid: Grid, run: RunDirectory, cfg: TrainConfig, spec: UploadSpec, messages: dict[int, Message],
                  round_number: int, budgets: dict[int, ClientBudget], progress: Progress,
                  threat: ServerThreat | None, rows: RoundRows) -> tuple[list[AcceptedUpload], dict[str, str], dict]:
    """The round's exchange without --secagg: each client's upload is validated as it arrives, kept for the auditor
    as the run's retention says and its feature rows given to rows, and accepted or dropped (reason per partition);
    also what each DP client reports it spent."""
    selected = list(messages)
    retention = Retention.of(cfg)
    outcomes: dict[int, AcceptedUpload | UploadError] = {}
    epsilon: dict[str, dict[str, float]] = {}  # what each DP client reports it has spent (its ledger)
    failed: set[int] = set()

    def receive(partition: int, reply: Message) -> None:
        if reply.has_error():
            failed.add(partition)
        refused_spend = refusal_spend(reply, cfg.dp_eps)
        if refused_spend is not None:
            epsilon[str(partition)] = {"total": refused_spend}
        try:
            upload, truth = parse_reply(reply, partition, spec, cfg.method, cfg.record_truth)
            if budgets:
                epsilon[str(partition)] = check_dp_report(reply.content["metrics"], budgets[partition], cfg.dp_eps)
        except UploadError as exc:
            outcomes[partition] = exc
            return
        outcomes[partition] = keep_upload(run, retention, rows, round_number, upload, truth)

    task = progress.add_task(f"round {round_number}: client training", total=len(selected))
    replied = exchange(grid, messages, cfg.round_timeout, progress, task, receive)
    progress.remove_task(task)
    if threat:
        threat.accepted(round_number, sorted(replied - failed))

    accepted: list[AcceptedUpload] = []
    dropped: dict[str, str] = {}
    for partition in selected:
        outcome = outcomes.get(partition)
        if outcome is None:
            dropped[str(partition)] = f"no reply within {cfg.round_timeout:.0f} s"
        elif isinstance(outcome, UploadError):
            dropped[str(partition)] = str(outcome)
            progress.console.print(f"[yellow]round {round_number}: dropped client {partition}'s upload: {outcome}")
        else:
            accepted.append(outcome)
    return accepted, dropped, epsilon


def keep_upload(run: RunDirectory, retention: Retention, rows: RoundRows, round_number: int, upload: AcceptedUpload,
                truth: dict | None) -> AcceptedUpload:
    """What the server keeps of an accepted upload: the auditor's copy where the run's retention keeps it (the
    round trains on it either way), and its feature rows, which move to rows (the upload returned holds none)."""
    partition = upload.partition
    if retention.keeps_upload(round_number, partition):
        if upload.update:  # none under --secagg: the client's update is only in the sum
            run.save_upload(round_number, partition, "update", upload.update)
        if upload.features is not None:
            run.save_upload(round_number, partition, "features", upload.features)
        if upload.heads is not None:
            run.save_upload(round_number, partition, "heads", upload.heads)
        if truth is not None:
            run.save_truth(round_number, partition, truth)
    if upload.features is None:
        return upload
    rows.add(partition, upload.features["features"], upload.features["labels"])
    return replace(upload, features=None)


def parse_clear(metrics: dict, weight: int, partition: int, spec: UploadSpec, method: str,
                record_truth: bool) -> tuple[AcceptedUpload, dict | None]:
    """A --secagg reply's clear parts (its update is only in the sum, weighted by `weight`): metrics, eftvit's
    features and the auditor's truth, validated as parse_reply validates them; raises UploadError naming what is
    wrong."""
    uploads_features = method_spec(method).uploads_features
    allowed = {secagg.METRICS_KEY} | {secagg.CLEAR_PREFIX + part for part, wanted in
                                      (("features", uploads_features), ("truth", record_truth)) if wanted}
    extra = sorted(secagg.reply_parts(metrics) - allowed)
    if extra:
        raise UploadError(f"reply has unexpected parts {[name[:40] for name in extra[:3]]}")
    reported = validate_metrics(secagg.metrics_record(metrics), partition, spec)
    if reported.num_examples != weight:
        raise UploadError(f"its update is weighted by n = {weight} in the sum, it reports n = {reported.num_examples}")
    features = None
    if uploads_features:
        record = secagg.clear_part(metrics, "features")
        if record is None:
            raise UploadError("reply has no features")
        rows = spec.dp_sizes[partition][1] if spec.dp_sizes else None
        features = validate_features(record, spec, reported.num_examples, rows)
    record = secagg.clear_part(metrics, "truth")
    truth = None if record is None else validate_truth(record, spec, reported.num_examples,
                                                       len(features["labels"]) if features else None)
    upload_bytes = sum(a.nbytes for a in (features or {}).values())
    return AcceptedUpload(partition, {}, features, reported.num_examples, reported.loss, reported.epoch_seconds,
                          reported.epoch_cpu_seconds, upload_bytes, None, reported.global_loss), truth


def secure_uploads(grid: Grid, run: RunDirectory, cfg: TrainConfig, model: EFTViT, spec: UploadSpec,
                   nodes: dict[int, int], messages: dict[int, Message], round_number: int,
                   budgets: dict[int, ClientBudget], progress: Progress, rows: RoundRows):
    """The round's exchange under --secagg (Flower's SecAgg+, eftguard.federation.secagg): the server learns the
    cohort's sample-weighted average update and keeps only it (observed/round-NNN/aggregate.safetensors); each
    client's clear parts are validated and kept as without --secagg (feature rows to rows). A client whose clear
    parts fail validation gives no feature rows, but its update is in the sum already: the server cannot take it
    out.

    Returns the averaged parameters (None: no sum), the accepted clear parts, the dropped clients, what each DP
    client reports it spent, and metrics.jsonl's "secagg" record (the cohort in the sum, clients whose clear parts
    were refused, and the protocol's serialised bytes sent to and received from the nodes over its four stages)."""
    partition_of = {nodes[p]: p for p in messages}
    task = progress.add_task(f"round {round_number}: client training under SecAgg+", total=None)
    result = secagg.run_secure_round(grid, {nodes[p]: m.content for p, m in messages.items()}, round_number,
                                     len(spec.train_ids), cfg.round_timeout, check_stop)
    progress.remove_task(task)
    summed = sorted(partition_of[node] for node in result.metrics)
    dropped = {str(p): "not in the secure sum (no masked update: dropped out or refused)"
               for p in messages if p not in summed}
    retention = Retention.of(cfg)
    accepted: list[AcceptedUpload] = []
    epsilon: dict[str, dict[str, float]] = {}
    unverified: dict[str, str] = {}
    for node, metrics in sorted(result.metrics.items(), key=lambda item: partition_of[item[0]]):
        partition = partition_of[node]  # in partition order, as plain rounds: theta trains on the rows in this order
        try:
            upload, truth = parse_clear(metrics, result.num_examples[node], partition, spec, cfg.method,
                                        cfg.record_truth)
            if budgets:
                epsilon[str(partition)] = check_dp_report(secagg.metrics_record(metrics), budgets[partition],
                                                          cfg.dp_eps)
        except UploadError as exc:
            unverified[str(partition)] = str(exc)
            progress.console.print(f"[yellow]round {round_number}: client {partition}'s clear parts refused (its "
                                   f"update is in the sum): {exc}")
            continue
        accepted.append(keep_upload(run, retention, rows, round_number, upload, truth))
    averaged = None
    if result.average is not None:
        shapes = [tuple(a.shape) for a in result.average]
        if shapes != list(spec.update_shapes.values()):
            raise FederationError(f"the secure sum has layout {shapes[:3]}..., the method uploads "
                                  f"{list(spec.update_shapes.values())[:3]}...")
        deltas = dict(zip(spec.update_shapes, result.average))
        if round_number in retention.rounds_kept:
            run.save_aggregate(round_number, deltas)
        state = model.state_dict()
        averaged = {k: state[k].numpy() + delta for k, delta in deltas.items()}
    return averaged, accepted, dropped, epsilon, {"cohort": summed, "unverified": unverified,
                                                  "sent_bytes": result.sent_bytes,
                                                  "received_bytes": result.received_bytes}


def run_round(grid: Grid, run: RunDirectory, cfg: TrainConfig, model: EFTViT, spec: UploadSpec,
              nodes: dict[int, int], round_number: int, test_images: torch.Tensor, test_labels: torch.Tensor,
              progress: Progress, budgets: dict[int, ClientBudget],
              public: tuple[torch.Tensor, torch.Tensor] | None = None, threat: ServerThreat | None = None) -> dict:
    """One round. public: the server's own labelled images, given under DP, where theta's update on the noisy
    feature rows is kept only if their accuracy did not fall (None: always kept). threat: what a --threat run's
    server sends instead of its model; it keeps aggregating into its own model either way."""
    selected = round_clients(cfg, round_number, run.metrics())
    state = model.state_dict()
    sent = threat.sent(round_number, selected, state) if threat else dict.fromkeys(selected, state)
    records = {id(s): to_record(s) for s in sent.values()}  # one record per distinct model
    messages = {}
    for p in selected:
        sigma, feature_sigma = (budgets[p].noise_multiplier, budgets[p].feature_noise_multiplier) if budgets else (0, 0)
        settings = ClientSettings.from_config(cfg, round_number, float(sigma), run.run_id,
                                              float(feature_sigma)).to_record()
        messages[p] = Message(RecordDict({"model": records[id(sent[p])], "settings": settings}), nodes[p],
                              MessageType.TRAIN)
    rows = RoundRows.of(cfg.server_rows, run.path, round_number)
    try:
        if cfg.secagg:
            averaged, accepted, dropped, epsilon, secure = secure_uploads(grid, run, cfg, model, spec, nodes, messages,
                                                                          round_number, budgets, progress, rows)
        else:
            accepted, dropped, epsilon = plain_uploads(grid, run, cfg, spec, messages, round_number, budgets,
                                                       progress, threat, rows)
            averaged, secure = (average(cfg, spec, model, accepted) if accepted else None), None
        server_loss, server_seconds, server_update_kept = train_server(cfg, model, averaged, accepted, rows,
                                                                       round_number, progress, public)
        feature_sets = rows.counts([u.partition for u in accepted])
    finally:
        rows.close()

    eval_start = time.perf_counter()
    accuracy = evaluate(model, test_images, test_labels, precision=cfg.precision)
    eval_seconds = time.perf_counter() - eval_start
    run.save_checkpoint(round_number, model.state_dict())
    weights = sum(u.num_examples for u in accepted)
    return {
        "round": round_number,
        "method": cfg.method,
        "test_accuracy": accuracy,
        "client_loss": sum(u.loss * u.num_examples for u in accepted) / weights if accepted and not budgets else None,
        "server_loss": server_loss,
        "server_update_kept": server_update_kept,
        **client_timings(accepted, withheld=bool(budgets)),
        "server_seconds": round(server_seconds, 4),
        "eval_seconds": round(eval_seconds, 4),
        "upload_bytes": {str(u.partition): u.upload_bytes for u in accepted},
        "num_examples": {str(u.partition): u.num_examples for u in accepted},
        "feature_sets": feature_sets,
        "local_losses": {str(u.partition): u.loss for u in accepted if not budgets},
        "global_losses": {str(u.partition): u.global_loss for u in accepted if u.global_loss is not None},
        **privacy_metrics(budgets, selected, round_number, epsilon),
        "clients": selected,
        "dropped": dropped,
        "tampered": threat.tampering(round_number) if threat else None,
        "secagg": secure,
    }


def train_server(cfg: TrainConfig, model: EFTViT, averaged: dict[str, np.ndarray] | None,
                 accepted: list[AcceptedUpload], rows: RoundRows, round_number: int, progress: Progress,
                 public: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[float | None, float, bool | None]:
    """The server's part of a round: the averaged update loaded, then (eftvit) theta trained on the round's rows.
    Returns theta's loss, seconds, and whether its update was kept (see run_round's public)."""
    server_loss, server_seconds, server_update_kept = None, 0.0, None
    if averaged is None:
        progress.console.print(f"[red]round {round_number}: no valid upload, the model is unchanged")
        return server_loss, server_seconds, server_update_kept
    load_average(model, averaged)
    if method_spec(cfg.method).server_trains and cfg.server_epochs:
        features, labels = rows.tensors([u.partition for u in accepted])
        task = progress.add_task(f"round {round_number}: server training", total=cfg.server_epochs)
        generator = torch.Generator().manual_seed(seeded(cfg.seed, round_number, 4))

        def train() -> TrainResult:
            return train_global(model, features, labels,
                                OptimConfig(cfg.server_epochs, cfg.batch_size,
                                            cfg.server_lr * cfg.lr_factor(round_number), cfg.weight_decay),
                                generator, lambda done, total: progress.update(task, completed=done),
                                cfg.precision)

        if public is None:
            result = train()
        else:  # DP rows are mostly noise: keep theta's update only if the server's own public images agree
            result, server_update_kept = keep_if_not_worse(model.global_module, train,
                                                           lambda: evaluate(model, *public, precision=cfg.precision))
        progress.remove_task(task)
        server_loss, server_seconds = result.loss, result.seconds
    return server_loss, server_seconds, server_update_kept


def client_timings(accepted: list[AcceptedUpload], withheld: bool) -> dict:
    """metrics.jsonl's client timings; None under --dp-eps, where clients withhold them (they depend on the size of
    the client's data)."""
    if withheld:
        return dict.fromkeys(("client_seconds", "client_epoch_seconds", "client_epoch_cpu_seconds"))
    return {"client_seconds": {str(u.partition): round(sum(u.epoch_seconds), 4) for u in accepted},
            "client_epoch_seconds": {str(u.partition): round(sum(u.epoch_seconds) / max(len(u.epoch_seconds), 1), 4)
                                     for u in accepted},
            "client_epoch_cpu_seconds": {str(u.partition): round(sum(u.epoch_cpu_seconds) /
                                                                 max(len(u.epoch_cpu_seconds), 1), 4)
                                         for u in accepted}}
