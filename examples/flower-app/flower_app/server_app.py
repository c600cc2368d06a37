"""The ServerApp: FedAvg over the nodes, recorded for eftguard by one wrapper around the strategy."""

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from eftguard.apprun import AppSpec
from eftguard.federation.recorder import RecordingStrategy
from flower_app.task import IMAGE_SIZE, MEAN, STD, Net

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    lr = float(config["lr"])
    strategy = FedAvg(fraction_evaluate=0.0)
    strategy = RecordingStrategy(strategy, config["record-to"], AppSpec(  # the one line that records the run
        "flower_app.task:Net", IMAGE_SIZE, MEAN, STD, int(config["local-epochs"]), int(config["batch-size"]), lr,
        trainer="flower_app.task:train"))
    strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), train_config=ConfigRecord({"lr": lr}),
                   num_rounds=int(config["num-server-rounds"]))
