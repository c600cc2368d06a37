"""Flower ClientApp and ServerApp (Message API). The same two apps run under the simulation engine
and on a deployed SuperLink; the ServerApp finds its run directory in the run config ("run-dir")."""

from __future__ import annotations

from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from eftguard.federation.client import client_round
from eftguard.federation.records import ClientSettings, from_record, to_record

client_app = ClientApp()


def _node_partition(context: Context) -> tuple[int, int]:
    return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])


@client_app.query()
def describe(msg: Message, context: Context) -> Message:
    """Handshake: tells the server which data partition this node holds."""
    partition, partitions = _node_partition(context)
    return Message(RecordDict({"node": ConfigRecord({"partition-id": partition, "num-partitions": partitions})}),
                   reply_to=msg)


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    partition, partitions = _node_partition(context)
    settings = ClientSettings.from_record(msg.content["settings"])
    secret = int(context.node_config.get("noise-secret", 0))  # --node-config "... noise-secret=N"
    upload = client_round(settings, from_record(msg.content["model"], "model"), partition, partitions, secret)
    content = {
        "update": to_record(upload.update),
        "metrics": ConfigRecord({"partition-id": partition, "num-examples": upload.num_examples,
                                 "loss": upload.loss, "epoch-seconds": upload.epoch_seconds,
                                 "feature-seconds": upload.feature_seconds}),
    }
    if upload.features is not None:
        content["features"] = to_record(upload.features)
    if settings.record_truth:
        content["truth"] = to_record(upload.truth)
    return Message(RecordDict(content), reply_to=msg)


def build_server_app(run_dir: Path | None = None) -> ServerApp:
    """A ServerApp bound to run_dir (simulation) or reading "run-dir" from the run config (deployment)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from eftguard.federation.server import run_server

        run_server(grid, run_dir or Path(str(context.run_config["run-dir"])))

    return app


server_app = build_server_app()
