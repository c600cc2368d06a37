"""An in-process Flower grid: the real ServerApp loop (`run_server`) talks to the real ClientApp handlers in this
process, without Ray or sockets. The membership attack trains its reference models this way (the run's own
configuration through the normal trainer); tests/fakegrid.py adds a tamper hook on top for hostile replies."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path

from flwr.app import Context, Message, Metadata, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from eftguard.federation import apps, server
from eftguard.federation.server import run_server
from eftguard.federation.simulation import forget_received_models, simulated_node_defaults
from eftguard.rundir import RunDirectory


class InProcessGrid:
    """Delivers each message to apps.describe / apps.train of node 100 + partition, or to client_app (any Flower
    ClientApp, e.g. a user's app under eftguard's recorder) with run_config. node_config: node-config keys for every
    node (a key set to None is left out)."""

    def __init__(self, clients: int, node_config: dict | None = None, partitions: dict[int, int] | None = None,
                 client_app=None, run_config: dict | None = None):
        self.partitions = partitions or {100 + k: k for k in range(clients)}
        self.clients = clients
        self.node_config = {k: v for k, v in (node_config or {}).items() if v is not None}
        self.client_app = client_app
        self.run_config = run_config or {}
        self.outbox = {}
        self.node_states: dict[int, RecordDict] = {}  # each node's Context.state, kept across messages (SecAgg+ stages)

    def get_node_ids(self):
        return list(self.partitions)

    def reply_to(self, node: int, reply: Message) -> Message:
        """The reply as the server receives it (tests override this to tamper with it)."""
        return reply

    def _deliver(self, msg):
        node = msg.metadata.dst_node_id
        context = Context(run_id=1, node_id=node, state=self.node_states.setdefault(node, RecordDict({})),
                          run_config=self.run_config,
                          node_config={"partition-id": self.partitions[node], "num-partitions": self.clients,
                                       **self.node_config})
        msg.metadata.__dict__["_message_id"] = f"msg-{node}-{len(self.outbox)}"
        msg = Message(content=copy.deepcopy(msg.content), metadata=msg.metadata)  # as a transport would: a node's
        # handler (Flower's SecAgg+ mod pops its stage) must not edit the content the server shares between nodes
        handler = self.client_app or (apps.describe if msg.metadata.message_type == "query" else apps.train)
        reply = handler(msg, context)
        body = {"error": reply.error} if reply.has_error() else {"content": reply.content}
        reply = Message(**body, metadata=Metadata(
            run_id=1, message_id=f"reply-{node}", src_node_id=node, dst_node_id=0,
            reply_to_message_id=msg.metadata.message_id, group_id="", created_at=0.0, ttl=60.0,
            message_type=msg.metadata.message_type))
        return msg.metadata.message_id, self.reply_to(node, reply)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            message_id, reply = self._deliver(msg)
            self.outbox[message_id] = reply
            ids.append(message_id)
        return ids

    def pull_messages(self, ids):
        return [self.outbox.pop(i) for i in list(ids) if i in self.outbox]

    def send_and_receive(self, messages, timeout=None):
        return self.pull_messages(self.push_messages(messages))


@contextmanager
def task_identity():
    """Messages are stamped with the identity of the running task; give them one outside Flower."""
    saved = TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def train_in_process(run_dir: Path, clients: int) -> None:
    """Train (or resume) the run in run_dir as a simulation would: nodes share truth as the run asks, keep their
    privacy ledgers in the run directory and seed from the run's seed alone, and their copies of the last model
    they accepted until the run has all its rounds. Server and nodes compute on the command's compute device
    (eftguard.device.computing_on)."""
    cfg = RunDirectory.open(run_dir).config()
    quiet, server.console.quiet = server.console.quiet, True  # a reference model is one step of its caller's progress
    try:  # bar, not rounds and budget tables in the audit's log
        with task_identity():
            run_server(InProcessGrid(clients, simulated_node_defaults(run_dir, cfg)), Path(run_dir))
    finally:
        server.console.quiet = quiet
    forget_received_models(run_dir, cfg)
