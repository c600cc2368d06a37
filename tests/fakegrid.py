"""An in-process Flower grid for tests: eftguard's InProcessGrid (the real ClientApp handlers in this process, so
the real server loop runs without Ray or sockets) with a tamper hook that can corrupt a client's reply."""

from eftguard.federation.inprocess import InProcessGrid, task_identity

__all__ = ["FakeGrid", "run_with_checking_nodes", "task_identity"]


class FakeGrid(InProcessGrid):
    """node_config: extra node-config keys for every node (like a simulation's, nodes share ground truth and seed
    from the run's seed alone; they keep their privacy ledgers in $EFTGUARD_HOME, a temporary folder in tests)."""

    def __init__(self, clients, tamper=None, partitions=None, node_config=None):
        super().__init__(clients, {"share-truth": True, "noise-secret": 0, **(node_config or {})}, partitions)
        self.tamper = tamper or (lambda node, reply: reply)

    def reply_to(self, node, reply):
        return self.tamper(node, reply)


def run_with_checking_nodes(path, cfg) -> tuple:
    """cfg's server (its threat included) against two nodes that check the model they are sent, keeping what they
    receive under path/nodes; returns (the run, client 0's received models)."""
    import numpy as np

    from eftguard.federation.server import run_server
    from eftguard.rundir import RunDirectory
    from eftguard.runs import server_threat_of

    run = RunDirectory.create(path / "run", cfg)
    run_server(FakeGrid(2, node_config={"model-check": True, "ledger-dir": str(path / "nodes")}), run.path,
               server_threat_of(cfg))
    return run, np.load(path / "nodes" / "received" / f"{run.run_id}-client-00.npz")
