"""Secure aggregation (--secagg) through Flower's SecAgg+: the server learns the weighted average of the cohort's
parameter updates, never one client's.

What is Flower's: the whole protocol. Server side, `flwr.server.workflow.SecAggPlusWorkflow` runs its four stages
(setup, key sharing, masked-vector collection, unmasking with dropout recovery) over the run's Grid; client side,
`flwr.client.mod.secaggplus_mod` answers them (key agreement, Shamir shares, quantisation, pairwise and private
masks). What is ours: the glue between that legacy-Strategy-shaped workflow and eftguard's Message-API round
(`CohortRound` plays the Strategy and hands the workflow eftguard's own train messages; `secure_train` turns a
node's reply into the FitRes the mod masks, its metrics as JSON and its other arrays as npy bytes, since FitRes
metrics hold scalars only), and the choice of what is masked: the update as a difference from the
received model (bounded, so Flower's clipping range of 8 does not cut it), in the order of the method's
uploaded_state.

What SecAgg+ does not cover: everything a reply carries besides the parameter update travels in the clear beside the
masked vector (as FitRes metrics): the metrics (loss, sample count, timings), and for eftvit the patch features and
labels, which cannot be summed (the server trains theta on each row). docs/secagg.md says so for the reader.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable

import flwr.compat.common.recorddict_compat as compat
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.serde import recorddict_to_proto
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.serverapp import Grid

from eftguard.federation.records import UploadError, _npy_layout, from_record

METRICS_KEY = "metrics-json"  # FitRes metrics hold scalars only: the reply's metrics (lists too) as JSON
CLEAR_PREFIX = "clear."  # FitRes metrics keys of the arrays a reply carries unmasked: "clear.features.labels"
RECONSTRUCTION_FRACTION = 0.5  # of the shares needed to rebuild a dropped client's key: tolerates half the cohort
POLL_SECONDS = 0.1  # between pulls for a stage's replies (Flower's own send_and_receive sleeps 3 s between them)
MAX_WEIGHT_MARGIN = 1.0  # Flower's max_weight is the largest sample count; above it the masked sum can overflow


def is_secure_stage(msg: Message) -> bool:
    """Whether a train message is a SecAgg+ stage (the server runs --secagg) rather than a plain round."""
    return RECORD_KEY_CONFIGS in msg.content.config_records


# --- client side -----------------------------------------------------------------------------------------


class _Refused(Exception):
    """A node's own refusal of the round (its ledger, its model check), carried out of Flower's mod unchanged."""

    def __init__(self, reply: Message):
        super().__init__("refused")
        self.reply = reply


def secure_train(msg: Message, context: Context, train_round: Callable[[Message, Context], Message]) -> Message:
    """One SecAgg+ stage on a node: Flower's secaggplus_mod, which calls train_round in the masked-vector stage and
    masks the update it returns; a refusal is the node's reply as without SecAgg+."""
    def masked_reply(stage_msg: Message, stage_context: Context) -> Message:
        reply = train_round(stage_msg, stage_context)
        if reply.has_error():
            raise _Refused(reply)
        received = from_record(stage_msg.content["model"], "model")
        return Message(as_fitres(reply.content, received), reply_to=stage_msg)

    try:
        return secaggplus_mod(msg, context, masked_reply)
    except _Refused as refusal:
        return refusal.reply


def as_fitres(content: RecordDict, received: dict[str, np.ndarray]) -> RecordDict:
    """A node's reply as the FitRes the mod masks: the update as a difference from the received model, and every
    other array in the clear as metrics bytes."""
    update = from_record(content["update"], "update")
    deltas = [(update[k] - received[k]).astype(np.float32) for k in update]
    metrics = {METRICS_KEY: json.dumps(dict(content["metrics"])).encode()}
    for part in ("features", "heads", "truth"):
        if part in content:
            for key, array in content[part].items():
                metrics[f"{CLEAR_PREFIX}{part}.{key}"] = array.data
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(deltas), int(content["metrics"]["num-examples"]),
                    metrics)
    return compat.fitres_to_recorddict(fitres, keep_input=True)


# --- server side -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Node:
    """What SecAggPlusWorkflow reads of a ClientProxy: its node id."""

    node_id: int


class CohortRound(Strategy):
    """The Strategy SecAggPlusWorkflow drives, for one round: it selects the round's nodes and keeps what the
    workflow aggregates (the weighted average of the masked updates) and each node's clear metrics."""

    def __init__(self, node_ids: list[int]):
        self.node_ids = node_ids
        self.average: list[np.ndarray] | None = None
        self.replies: dict[int, FitRes] = {}

    def configure_fit(self, server_round, parameters, client_manager):
        return [(_Node(node), FitIns(Parameters([], ""), {})) for node in self.node_ids]

    def aggregate_fit(self, server_round, results, failures):
        if results:
            self.average = parameters_to_ndarrays(results[0][1].parameters)
            self.replies = {proxy.node_id: fitres for proxy, fitres in results}
        return None, {}

    def initialize_parameters(self, client_manager):
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


class _EftguardMessages(SecAggPlusWorkflow):
    """Flower's workflow, sending eftguard's own train messages (model and settings) in the masked-vector stage."""

    def __init__(self, contents: dict[int, RecordDict], **kwargs):
        super().__init__(**kwargs)
        self.contents = contents

    def setup_stage(self, grid, context, state) -> bool:
        ready = super().setup_stage(grid, context, state)
        state.nid_to_fitins = {node: self.contents[node] for node in state.nid_to_fitins}
        return ready


class CountingGrid:
    """The run's Grid, counting the protocol's traffic in serialised bytes (what SecAgg+ costs on the wire), and
    polling stop_check (Ctrl-C, SIGTERM: it raises) while a stage's replies come in."""

    def __init__(self, grid: Grid, stop_check: Callable[[], None]):
        self.grid = grid
        self.stop_check = stop_check
        self.sent_bytes = self.received_bytes = 0

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def send_and_receive(self, messages, timeout=None):
        """Grid.send_and_receive: the replies that arrive within timeout (None: all of them)."""
        messages = list(messages)
        self.sent_bytes += sum(wire_bytes(m.content) for m in messages)
        pending = {message_id for message_id in self.grid.push_messages(messages) if message_id}
        deadline = None if timeout is None else time.monotonic() + timeout
        replies = []
        while pending and (deadline is None or time.monotonic() < deadline):
            self.stop_check()
            arrived = list(self.grid.pull_messages(sorted(pending)))
            replies += arrived
            pending -= {reply.metadata.reply_to_message_id for reply in arrived}
            if pending:
                time.sleep(POLL_SECONDS)
        self.received_bytes += sum(wire_bytes(r.content) for r in replies if not r.has_error())
        return replies


def wire_bytes(content: RecordDict) -> int:
    return recorddict_to_proto(content).ByteSize()


@dataclass
class SecureRound:
    """What the server learns in a --secagg round: the average update and, per node, its clear metrics; and what
    the protocol cost (all four stages, both directions, serialised bytes)."""

    average: list[np.ndarray] | None  # the sample-weighted average of the cohort's updates (differences)
    metrics: dict[int, dict]  # node id -> its FitRes metrics (clear arrays as npy bytes under CLEAR_PREFIX)
    num_examples: dict[int, int]  # node id -> the weight its masked update carries in the sum
    sent_bytes: int
    received_bytes: int


def run_secure_round(grid: Grid, contents: dict[int, RecordDict], round_number: int, max_examples: int,
                     timeout: float, stop_check: Callable[[], None]) -> SecureRound:
    """One round of Flower's SecAgg+ over the nodes in contents (node id -> its train message's content);
    stop_check is polled while the nodes answer (it raises to end the run)."""
    strategy = CohortRound(sorted(contents))
    state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({Key.CURRENT_ROUND: round_number}),
                        MAIN_PARAMS_RECORD: ArrayRecord()})
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}),
                            strategy=strategy)
    workflow = _EftguardMessages(contents, num_shares=1.0, reconstruction_threshold=RECONSTRUCTION_FRACTION,
                                 max_weight=max(float(max_examples), 1.0) * MAX_WEIGHT_MARGIN, timeout=timeout)
    counting = CountingGrid(grid, stop_check)
    workflow(counting, context)
    return SecureRound(strategy.average, {n: dict(r.metrics) for n, r in strategy.replies.items()},
                       {n: r.num_examples for n, r in strategy.replies.items()}, counting.sent_bytes,
                       counting.received_bytes)


def clear_part(metrics: dict, part: str) -> ArrayRecord | None:
    """The arrays of one reply part (features, heads, truth) a node sent in the clear, as the ArrayRecord the
    validators read (each array declares the layout its npy header announces; None when the part is absent)."""
    prefix = f"{CLEAR_PREFIX}{part}."
    found = {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}
    if not found:
        return None
    arrays = {}
    for key, data in found.items():
        if not isinstance(data, bytes):
            raise UploadError(f"{part}['{key}'] is not an npy payload")
        try:
            dtype, shape = _npy_layout(data)
        except (ValueError, EOFError) as exc:
            raise UploadError(f"{part}['{key}'] cannot be decoded as a numpy array: {str(exc):.200}") from None
        arrays[key] = Array(dtype=dtype, shape=tuple(shape), stype="numpy.ndarray", data=data)
    return ArrayRecord(arrays)


def reply_parts(metrics: dict) -> set[str]:
    """What a reply's FitRes metrics hold: METRICS_KEY, and CLEAR_PREFIX + each part sent in the clear (features,
    heads, truth), each key counted once per part; any other key as it is."""
    parts = set()
    for key in map(str, metrics):
        parts.add(CLEAR_PREFIX + key[len(CLEAR_PREFIX):].partition(".")[0] if key.startswith(CLEAR_PREFIX) else key)
    return parts


def metrics_record(metrics: dict) -> ConfigRecord:
    """The metrics record a node's reply holds without --secagg, decoded from its FitRes metrics."""
    try:
        return ConfigRecord(json.loads(metrics[METRICS_KEY]))
    except (KeyError, TypeError, ValueError, UnicodeDecodeError) as exc:
        raise UploadError(f"the reply's metrics cannot be read: {str(exc):.200}") from None

