"""The ClientApp: trains the received model on this node's images and sends it back. The share_truth mod is the
node's opt-in to an eftguard audit: it also sends the images and labels it trained on, for the auditor only."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from eftguard.federation.recorder import share_truth
from flower_app.task import Net, load_partition, test, train


def node_data(context: Context):
    return load_partition(context.run_config["data-dir"], int(context.node_config["partition-id"]),
                          int(context.node_config["num-partitions"]))


app = ClientApp(mods=[share_truth(node_data)])


@app.train()
def fit(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    images, labels = node_data(context)
    loss = train(model, images, labels, int(context.run_config["local-epochs"]),
                 int(context.run_config["batch-size"]), float(msg.content["config"]["lr"]))
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"train_loss": loss, "num-examples": len(labels)})})
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    images, labels = node_data(context)
    loss, accuracy = test(model, images, labels)
    metrics = MetricRecord({"eval_loss": loss, "eval_acc": accuracy, "num-examples": len(labels)})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
