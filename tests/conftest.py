import builtins
import io
import os
import stat
import subprocess
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
if "PYTEST_XDIST_WORKER" in os.environ:
    # two workers on two cores: one thread each (and in every process a test starts), set before torch is imported;
    # two threads per worker would oversubscribe the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
import torch

from eftguard.config import TrainConfig
from eftguard.model import build_model

MICRO_PRESET = "vit-micro-32"
MICRO_WIDTH = 64
MICRO_DEPTH = 4


# Modules whose tests start a Ray simulation or a local deployment: several processes each, on two cores
FEDERATION_MODULES = {"test_simulation.py", "test_deployment.py", "test_audit_grid.py"}


def pytest_collection_modifyitems(items):
    """The federation modules first, then the modules with the most slow tests, so that the many fast ones fill the
    end of a pytest-xdist run. The sort is stable: the order within a module stays."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: (item.path.name not in FEDERATION_MODULES, -slow[item.path]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's loadfile scheduling (pyproject.toml: two workers), with the federation modules as one unit: one
    worker runs them one after another while the other runs in-process tests beside them (measured: the demo's test
    156 s and the TLS deployment's 181 s, against 196 s and 244 s when they ran beside each other). Not xdist_group
    marks: pytest 9.2 ignores the node ids that --dist loadgroup rewrites."""
    from xdist.scheduler import LoadScopeScheduling

    class FederationModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "federation" if Path(module).name in FEDERATION_MODULES else module

    return FederationModulesTogether(config, log)


@pytest.fixture(scope="module")
def micro_preset():
    """The micro preset (width 64, depth 4, 32 px, patch 4), many times cheaper than vit-tiny-32, so whole in-process
    rounds (tests/fakegrid.py) take a fraction of a second; a product preset, so started processes, Ray workers and
    SuperNodes build it too."""
    return MICRO_PRESET


@pytest.fixture(scope="session")
def tiny_model():
    """vit-tiny-32 split at M=2, seeded: a fresh copy per test via .clone_fresh()."""
    return build_model("vit-tiny-32", num_classes=10, local_layers=2, seed=0)


@pytest.fixture(scope="module")
def photos():
    """The bundled photos dataset at 32 px (tests/test_metrics.py has its own: a dozen of them as float images)."""
    from eftguard.data import load_dataset

    return load_dataset("photos", None, 32)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session", autouse=True)
def _eftguard_home(tmp_path_factory):
    """Client nodes keep their privacy ledgers in $EFTGUARD_HOME: a temporary folder, never ~/.eftguard."""
    saved = os.environ.get("EFTGUARD_HOME")
    os.environ["EFTGUARD_HOME"] = str(tmp_path_factory.mktemp("eftguard-home"))
    yield
    if saved is None:
        del os.environ["EFTGUARD_HOME"]
    else:
        os.environ["EFTGUARD_HOME"] = saved


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def flushes_denormals() -> bool:
    """torch has a setter for flush-to-zero but no getter: a denormal float32 times one reads 0 when it is on."""
    return float(torch.tensor([1e-39]) * 1.0) == 0.0


def torch_global_state() -> dict:
    return {"flush_denormal": flushes_denormals(), "num_threads": torch.get_num_threads(),
            "default_dtype": torch.get_default_dtype(), "grad_enabled": torch.is_grad_enabled(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled())}


@contextmanager
def restored_torch_state():
    """Whatever the block changes of torch's global state is put back afterwards."""
    saved = torch_global_state()
    try:
        yield
    finally:
        torch.set_flush_denormal(saved["flush_denormal"])
        torch.set_num_threads(saved["num_threads"])
        torch.set_default_dtype(saved["default_dtype"])
        torch.set_grad_enabled(saved["grad_enabled"])
        torch.use_deterministic_algorithms(saved["deterministic"][0], warn_only=saved["deterministic"][1])


def images_and_labels(n, seed=0):
    """N random uint8 32x32 RGB images and labels of 10 classes, from a seeded generator."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 32, 32, 3), generator=g, dtype=torch.uint8), torch.randint(0, 10, (n,), generator=g)


def random_images(count: int = 4) -> torch.Tensor:
    """COUNT images of N(0, 1) pixels, 3x32x32, the same on every call (seeded)."""
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def file_mode(path) -> int:
    """A file's permission bits (0o600: only its owner reads and writes it)."""
    return stat.S_IMODE(path.stat().st_mode)


def run_cli(capsys, *argv) -> tuple[int, str]:
    """(exit code, stderr) of `eftguard ARGV`: 0 when main returns, the SystemExit code otherwise."""
    from eftguard.cli import main

    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


@pytest.fixture
def task_identity_set():
    """Messages are stamped with the identity of the running task (fakegrid.task_identity): for tests that build
    or exchange messages outside Flower. Modules of such tests use it with pytest.mark.usefixtures."""
    from fakegrid import task_identity

    with task_identity():
        yield


@pytest.fixture
def in_process_simulation(monkeypatch):
    """`eftguard train` with the in-process grid instead of Ray: the CLI's parsing, checks and run directory, and
    the real server and client code."""
    from eftguard.federation.server import run_server
    from fakegrid import FakeGrid, task_identity

    def simulate(run_dir, cfg, verbose, threat):
        with task_identity():
            run_server(FakeGrid(cfg.clients), run_dir, threat)
    monkeypatch.setattr("eftguard.federation.simulation.run_simulated", simulate)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Double backward of small models is dominated by tiny ops; on a shared 2-core machine a second thread
    made them up to 80x slower. Modules of such tests use it with pytest.mark.usefixtures."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _restore_torch_global_state():
    """Attacks turn on flush-to-zero (eftguard.attacks.gradient.prepare_numerics) and tests change threads or dtypes: no
    test's numbers may depend on which tests ran before it."""
    with restored_torch_state():
        yield


@contextmanager
def truth_out_of_reach(run_path):
    """While the block runs, every way to ground truth raises: RunDirectory's and the auditor's truth accessors, the
    client's images (scoring.client_training_set), and open() or any safetensors loader on a file under RUN/truth/."""
    import safetensors
    import safetensors.numpy
    import safetensors.torch

    from eftguard import rundir
    from eftguard.audit import scoring

    truth = (Path(run_path) / "truth").resolve()

    def refuse(*_, **__):
        raise AssertionError("ground truth was read while an attack ran")

    def guarded(load):
        def load_unless_truth(path, *args, **kwargs):
            if isinstance(path, (str, os.PathLike)) and Path(path).resolve().is_relative_to(truth):
                refuse()
            return load(path, *args, **kwargs)
        return load_unless_truth

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builtins, "open", guarded(builtins.open))
        patch.setattr(io, "open", guarded(io.open))  # pathlib's read_bytes / open
        for module, names in ((safetensors, ["safe_open"]), (safetensors.numpy, ["load_file"]),
                              (safetensors.torch, ["load_file"]), (rundir, ["load_numpy", "load_torch"])):
            for name in names:
                patch.setattr(module, name, guarded(getattr(module, name)))
        for owner, name in ((rundir.RunDirectory, "truth_path"), (rundir.RunDirectory, "load_truth"),
                            (scoring, "client_training_set")):
            if hasattr(owner, name):
                patch.setattr(owner, name, refuse)
        yield


def attacks_guarded(monkeypatch, run_path, *attack_classes) -> list[str]:
    """Make each attack class's reconstruct run under truth_out_of_reach; returns the list it appends the class
    name to on every call (so a test can show the guarded code really ran)."""
    calls = []
    for cls in attack_classes:
        def reconstruct(self, *args, _original=cls.reconstruct, **kwargs):
            calls.append(type(self).__name__)
            with truth_out_of_reach(run_path):
                return _original(self, *args, **kwargs)
        monkeypatch.setattr(cls, "reconstruct", reconstruct)
    return calls


# a command prefix that runs a process in its own PID namespace (as in a container), unprivileged where the
# kernel allows user namespaces; --kill-child: its processes end with it
LINUX_PROC = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
OWN_PID_NAMESPACE = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc", "--kill-child"]


def can_make_pid_namespaces() -> bool:
    try:
        return subprocess.run([*OWN_PID_NAMESPACE, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def train_in_process(path, **config):
    """A run directory written by the real server and client code over an in-process grid (no Ray)."""
    from eftguard.federation.server import run_server
    from eftguard.rundir import RunDirectory
    from fakegrid import FakeGrid, task_identity

    cfg = TrainConfig(**{"clients": 2, "rounds": 1, "train_samples": 160, "test_samples": 40, "batch_size": 32,
                         **config}).resolved()
    run = RunDirectory.create(path, cfg)
    with task_identity():
        run_server(FakeGrid(cfg.clients), run.path)
    return run.path


@pytest.fixture(scope="session")
def feature_run(tmp_path_factory):
    """A finished one-round EFTViT run (2 clients, 75% masking, M=2); tests must not modify it."""
    return train_in_process(tmp_path_factory.mktemp("runs") / "eftvit")
