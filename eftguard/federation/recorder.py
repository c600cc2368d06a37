"""Record what the server of any Flower app received, for eftguard's attacks (docs/flower-apps.md).

A user wraps their own strategy in one line of their ServerApp:

    strategy = RecordingStrategy(FedAvg(...), "runs/my-app", AppSpec("my_app.task:Net", image_size=32))

and every round the wrapper writes, into the run-directory contract (eftguard.apprun.AppRun): the arrays the server
sent (checkpoints/round-(t-1)), each client's ArrayRecord as received (observed/round-t/client-KK/update) and its
metrics (metrics.jsonl). It observes only: the wrapped strategy gets every reply and decides the round as before.
An upload that fails eftguard's validation (another layout than the model sent, values not finite or beyond
MAX_PARAMETER_VALUE, a pickled array) is not recorded, and its reason is in metrics.jsonl["dropped"].

Ground truth is opt-in on each client, as on eftguard's own nodes: a ClientApp that adds `share_truth(truth_of)` to
its mods sends the images and labels it trained on with each train reply; the recorder moves them to truth/ and
takes them out of the reply before the wrapped strategy sees it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from eftguard.apprun import AppRun, AppSpec
from eftguard.federation.records import UploadError, from_record
from eftguard.federation.validation import MAX_PARAMETER_VALUE, _check_bounded, _check_layout, _declared_rows

TRUTH_RECORD = "eftguard.truth"  # the reply's ArrayRecord that share_truth adds: images uint8 [n, H, W, 3], labels
MAX_TRUTH_IMAGES = 100_000


class RecordingStrategy(Strategy):
    """Wraps a Flower strategy and records each round's traffic into an eftguard run directory."""

    def __init__(self, strategy: Strategy, run: str, spec: AppSpec, arrays_key: str = "arrays",
                 num_examples_key: str = "num-examples"):
        self.strategy = strategy
        self.run = AppRun.create(run, spec)
        self.spec = spec
        self.arrays_key = arrays_key
        self.num_examples_key = num_examples_key
        self.clients: dict[int, int] = {}  # Flower node id -> client index (client-KK), in order of first sending
        self.sent_layout: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.round_lr: float = spec.lr

    def __getattr__(self, name: str):  # the wrapped strategy's own settings stay readable
        return getattr(self.__dict__["strategy"], name)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        state = arrays.to_torch_state_dict()
        self.sent_layout = {k: (str(v.numpy().dtype), tuple(v.shape)) for k, v in state.items()}
        self.run.save_checkpoint(server_round - 1, state)
        self.round_lr = float(config.get("lr", self.spec.lr))
        for node in sorted(m.metadata.dst_node_id for m in messages):
            self.clients.setdefault(node, len(self.clients))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        num_examples, losses, dropped, truth_shared = {}, {}, {}, []
        for reply in replies:
            if reply.has_error():
                continue
            client = self.clients.setdefault(reply.metadata.src_node_id, len(self.clients))
            truth = reply.content.array_records.get(TRUTH_RECORD)
            if truth is not None:
                del reply.content[TRUTH_RECORD]
            try:
                update, metrics = self._validated(reply)
                self.run.save_upload(server_round, client, "update", update)
                if truth is not None:
                    self.run.save_truth(server_round, client,
                                        validate_truth(truth, len_of(metrics, self), self.spec.image_size))
                    truth_shared.append(client)
            except UploadError as exc:
                dropped[str(client)] = str(exc)
                continue
            num_examples[str(client)] = len_of(metrics, self)
            losses[str(client)] = {k: float(v) for k, v in metrics.items() if k != self.num_examples_key}
        result = self.strategy.aggregate_train(server_round, replies)
        self.run.append_metrics({"round": server_round, "lr": self.round_lr, "num_examples": num_examples,
                                 "client_metrics": losses, "clients": {str(c): n for n, c in self.clients.items()},
                                 "truth_shared": truth_shared, "dropped": dropped})
        if result[0] is not None:
            self.run.save_checkpoint(server_round, result[0].to_torch_state_dict())
        return result

    def _validated(self, reply: Message) -> tuple[dict[str, np.ndarray], dict]:
        """The client's arrays, in the layout of the model the server sent, decoded without pickle and bounded."""
        record = reply.content.array_records.get(self.arrays_key)
        if record is None:
            raise UploadError(f"the reply has no ArrayRecord '{self.arrays_key}'")
        _check_layout("update", record, self.sent_layout)
        update = from_record(record, "update")
        for name, array in update.items():
            if np.issubdtype(array.dtype, np.floating):
                _check_bounded(f"update '{name}'", array, MAX_PARAMETER_VALUE, "MAX_PARAMETER_VALUE")
        metrics = next(iter(reply.content.metric_records.values()), None)
        if metrics is None:
            raise UploadError("the reply has no MetricRecord")
        return update, dict(metrics)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                           ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        self.strategy.summary()


def len_of(metrics: dict, recorder: RecordingStrategy) -> int:
    """n_k as the client reported it: a positive integer."""
    value = metrics.get(recorder.num_examples_key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or not \
            0 < value <= MAX_TRUTH_IMAGES:
        raise UploadError(f"metric '{recorder.num_examples_key}' {value!r:.40} is not a count of examples")
    return int(value)


def validate_truth(record: ArrayRecord, num_examples: int, image_size: int) -> dict[str, np.ndarray]:
    """A client's shared truth: the n_k images it trained on, as the model saw them (uint8 [n, S, S, 3], S the
    app's image size), and their labels (int64 [n])."""
    images = record["images"] if "images" in record else None
    if images is None or "labels" not in record:
        raise UploadError("the shared truth needs 'images' and 'labels'")
    rows = _declared_rows("truth 'images'", images, num_examples, num_examples)
    shape = (rows, image_size, image_size, 3)
    _check_layout("truth", record, {"images": ("uint8", shape), "labels": ("int64", (rows,))})
    truth = from_record(record, "truth")
    if (truth["labels"] < 0).any():
        raise UploadError("truth 'labels' holds a negative class")
    return truth


def share_truth(truth_of: Callable[[Context], tuple[np.ndarray, np.ndarray]]):
    """A ClientApp mod that sends the client's ground truth with each train reply, for the auditor only:
    truth_of(context) -> (images uint8 [n, H, W, 3], labels [n]), the samples the client trained on. Add it only
    where the data's owner agreed to an audit (`ClientApp(mods=[share_truth(...)])`)."""

    def mod(message: Message, context: Context, call_next) -> Message:
        reply = call_next(message, context)
        if message.metadata.message_type.startswith("train") and not reply.has_error():
            images, labels = truth_of(context)
            reply.content[TRUTH_RECORD] = ArrayRecord({"images": Array(np.asarray(images, dtype=np.uint8)),
                                                      "labels": Array(np.asarray(labels, dtype=np.int64))})
        return reply

    return mod
