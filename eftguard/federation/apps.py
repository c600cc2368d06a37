"""Flower ClientApp and ServerApp (Message API). The same two apps run under the simulation engine
and on a deployed SuperLink; the deployed ServerApp finds its run directory ("run-dir") and the device it computes
on ("device": cpu, cuda or cuda:N, from eftguard train --federation deployment --device) in the run config.

What a node does is the node operator's decision (Flower's --node-config), never the server's:
  share-truth  send auditor-only ground truth when the run asks for it (default: off)
  ledger-dir   where the node keeps its privacy ledger (default: $EFTGUARD_HOME/ledger, ~/.eftguard/ledger)
  ledger-mark-dir where it keeps its ledgers' high-water marks, apart from the ledger (default:
               $EFTGUARD_HOME/ledger-marks)
  max-epsilon  the node's own privacy ceiling per run (default: none; set, it also refuses rounds without DP)
  noise-secret mixed into the node's random seeds, so the server (which knows the run's seed) cannot regenerate
               the DP noise (default: a fresh secret from the OS every round; 0: seeds from the run's seed alone,
               as simulated nodes do)
  model-check  check every received model and the settings with it (eftguard.defenses.model_check) and refuse the round
               if honest training cannot have produced it, or the settings changed mid-run (default: off;
               eftguard supernode and simulated runs turn it on)
  initial-model the node's copy of the checkpoint the run starts from: the model check rebuilds the run's
               initial model from it (default: none, the seeded initialisation of the run's configuration)
  trust-first-model the model check anchors on the first model the node receives instead of rebuilding the
               initial model (trust on first use; default: false)
  device       where the node trains: cpu, cuda, cuda:N or auto (eftguard.device; default: cpu; eftguard supernode
               sets it from its --device, resolved on the node's host)
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

from eftguard.defenses.dp import PrivacyBudgetError
from eftguard.defenses.ledger import SPENT_NOTE, LedgerError, PrivacyLedger, spent_per_channel
from eftguard.defenses.model_check import ModelCheck, ModelCheckError
from eftguard.device import computing_on, resolve_device
from eftguard.errors import ConfigError
from eftguard.federation import secagg, server
from eftguard.federation.client import ClientUpload, client_round, initial_model
from eftguard.federation.records import ClientSettings, from_record, to_record


def default_ledger_dir() -> Path:
    return Path(os.environ.get("EFTGUARD_HOME") or Path.home() / ".eftguard") / "ledger"


def _node_partition(context: Context) -> tuple[int, int]:
    return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])


def _node_flag(value, key: str) -> bool:
    """A node-config boolean: TOML true/false, or the strings "true"/"false"."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, bool):
        return value
    raise ConfigError(f"node config {key} must be true or false, got {value!r}")


def _node_number(value, key: str, kind: type[int] | type[float]):
    """A node-config number (TOML or a string of one): a boolean or a float for an integer is refused, not cast."""
    try:
        if isinstance(value, bool) or (kind is int and isinstance(value, float)):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"node config {key} must be {'an integer' if kind is int else 'a number'}, "
                          f"got {value!r}") from None


def describe(msg: Message, context: Context) -> Message:
    """Handshake: tells the server which data partition this node holds."""
    partition, partitions = _node_partition(context)
    return Message(RecordDict({"node": ConfigRecord({"partition-id": partition, "num-partitions": partitions})}),
                   reply_to=msg)


def train(msg: Message, context: Context, node_defaults: dict | None = None) -> Message:
    """One round on this node, or one stage of it under the server's --secagg (Flower's SecAgg+ masks the update).
    node_defaults: node-config values for keys the node was not given (simulated nodes: their run's ledger folder,
    truth sharing and noise-secret 0)."""
    if secagg.is_secure_stage(msg):
        return secagg.secure_train(msg, context, lambda stage_msg, stage_context: plain_train(
            stage_msg, stage_context, node_defaults))
    return plain_train(msg, context, node_defaults)


def plain_train(msg: Message, context: Context, node_defaults: dict | None = None) -> Message:
    """One round on this node: its reply holds the update as trained."""
    node = {**(node_defaults or {}), **context.node_config}
    partition, partitions = _node_partition(context)
    settings = ClientSettings.from_record(msg.content["settings"])
    ledger = None
    try:  # a node-config value that can never work refuses every round, with its key named in the server's record
        secret = (_node_number(node["noise-secret"], "noise-secret", int) if "noise-secret" in node
                  else secrets.randbelow(2**62) + 1)
        share_truth = _node_flag(node.get("share-truth", False), "share-truth")
        folder = Path(str(node.get("ledger-dir") or default_ledger_dir()))
        ledger = PrivacyLedger(folder, partition, _node_number(node.get("max-epsilon", 0.0), "max-epsilon", float),
                               node.get("ledger-mark-dir") or None)
        check = None
        if _node_flag(node.get("model-check", False), "model-check"):
            trust_first = _node_flag(node.get("trust-first-model", False), "trust-first-model")
            check = ModelCheck(folder / "received", partition,
                               None if trust_first else initial_model(str(node.get("initial-model", ""))))
        with computing_on(resolve_device(str(node.get("device", "cpu")))):
            upload = client_round(settings, from_record(msg.content["model"], "model"), partition, partitions,
                                  secret, ledger, check)
    except (ConfigError, PrivacyBudgetError, LedgerError, ModelCheckError) as exc:  # recorded by the server as dropped
        return Message(error=Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                   f"client refuses{spent_note(ledger, settings.run_id)}: {exc}"), reply_to=msg)
    return Message(RecordDict(reply_content(upload, partition, settings.record_truth and share_truth)),
                   reply_to=msg)


def spent_note(ledger: PrivacyLedger | None, run_id: str) -> str:
    """What a refusing node has spent in the run so far, for the server's record (metrics.jsonl's epsilon stays the
    truth when a node refuses, say, a round it had already trained in before the server crashed): " [epsilon spent
    in this run: E]", or "" when it spent nothing or its ledger cannot be read."""
    try:
        terms, spends = ledger.read(run_id) if ledger else (None, [])
    except (LedgerError, PrivacyBudgetError):
        return ""
    return f" [{SPENT_NOTE} {spent_per_channel(spends, terms)['total']!r}]" if terms and spends else ""


def reply_content(upload: ClientUpload, partition: int, send_truth: bool) -> dict:
    """Everything a node's reply to a train message holds; the auditor-only truth only when the run asks for it
    and the node grants it (send_truth)."""
    content = {
        "update": to_record(upload.update),
        "metrics": ConfigRecord({"partition-id": partition, "num-examples": upload.num_examples,
                                 "loss": upload.loss, "epoch-seconds": upload.epoch_seconds,
                                 "epoch-cpu-seconds": upload.epoch_cpu_seconds,
                                 "feature-seconds": upload.feature_seconds, **(upload.dp_report or {})}),
    }
    if upload.global_loss is not None:
        content["metrics"]["global-loss"] = upload.global_loss
    if upload.features is not None:
        content["features"] = to_record(upload.features)
    if upload.heads is not None:
        content["heads"] = to_record(upload.heads)
    if send_truth:
        content["truth"] = to_record(upload.truth)
    return content


def build_client_app(node_defaults: dict | None = None) -> ClientApp:
    """The ClientApp; node_defaults as in `train`."""
    app = ClientApp()
    app.query()(describe)

    @app.train()
    def train_round(msg: Message, context: Context) -> Message:
        return train(msg, context, node_defaults)

    return app


client_app = build_client_app()


def build_server_app(run_dir: Path | None = None, threat=None) -> ServerApp:
    """A ServerApp bound to run_dir (simulation: it runs in the command's process, which computes on the command's
    device already) or reading "run-dir" and "device" from the run config (deployment: a process of its own); threat:
    what a simulated --threat run's server sends instead of its model (eftguard.federation.server.ServerThreat)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        if run_dir is not None:
            server.run_server(grid, run_dir, threat)
            return
        with computing_on(resolve_device(str(context.run_config["device"]))):
            server.run_server(grid, Path(str(context.run_config["run-dir"])), threat)

    return app


server_app = build_server_app()
