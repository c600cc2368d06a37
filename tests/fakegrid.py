"""An in-process Flower grid: delivers each message to the real ClientApp handlers in this process, so the
real server loop runs without Ray or sockets. A tamper hook can corrupt a client's reply."""

from contextlib import contextmanager

from flwr.app import Context, Message, Metadata, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from eftguard.federation import apps


class FakeGrid:
    """node_config: extra node-config keys for every node (like a simulation's, nodes share ground truth and seed
    from the run's seed alone; they keep their privacy ledgers in $EFTGUARD_HOME, a temporary folder in tests)."""

    def __init__(self, clients, tamper=None, partitions=None, node_config=None):
        self.partitions = partitions or {100 + k: k for k in range(clients)}
        self.clients = clients
        self.tamper = tamper or (lambda node, reply: reply)
        config = {"share-truth": True, "noise-secret": 0, **(node_config or {})}
        self.node_config = {k: v for k, v in config.items() if v is not None}  # None: the key is not set
        self.outbox = {}

    def get_node_ids(self):
        return list(self.partitions)

    def _deliver(self, msg):
        node = msg.metadata.dst_node_id
        context = Context(run_id=1, node_id=node, state=RecordDict({}), run_config={},
                          node_config={"partition-id": self.partitions[node], "num-partitions": self.clients,
                                       **self.node_config})
        msg.metadata.__dict__["_message_id"] = f"msg-{node}-{len(self.outbox)}"
        handler = apps.describe if msg.metadata.message_type == "query" else apps.train
        reply = handler(msg, context)
        body = {"error": reply.error} if reply.has_error() else {"content": reply.content}
        reply = Message(**body, metadata=Metadata(
            run_id=1, message_id=f"reply-{node}", src_node_id=node, dst_node_id=0,
            reply_to_message_id=msg.metadata.message_id, group_id="", created_at=0.0, ttl=60.0,
            message_type=msg.metadata.message_type))
        return msg.metadata.message_id, self.tamper(node, reply)

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
