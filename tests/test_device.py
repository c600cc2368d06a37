"""--device (eftguard.device): declared once for every command that computes, a GPU that is not there refused in one
line before any work, models and batches placed by one helper, and a run directory whose bytes do not depend on
the flag."""

import hashlib
import re
from pathlib import Path

import pytest
import torch

import eftguard.device as device
import eftguard.training as training
from eftguard.cli import build_parser, main
from eftguard.config import TrainConfig
from eftguard.device import DeviceOptions, computing_on, parse_device, resolve_device
from eftguard.errors import ConfigError
from eftguard.model import build_model
from eftguard.options import options_of
from eftguard.training import OptimConfig, evaluate, extract_features, train_global, train_local

ROOT = Path(__file__).resolve().parents[1]
COMPUTING_COMMANDS = (["train"], ["pretrain", "--out", "x.safetensors"], ["bench"], ["audit", "a.toml"], ["demo"],
                      *(["attack", family, "RUN"] for family in ("invert", "labels", "gradient", "membership")),
                      ["supernode", "--superlink", "h:9092", "--partition", "0", "--clients", "2"])
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch finds no GPU")


@pytest.mark.parametrize("text", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_the_device_choices_parse(text):
    assert parse_device(text) == text


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "CPU", "cuda:-1", "mps", ""])
def test_a_device_that_is_no_choice_is_refused_naming_the_choices(text):
    with pytest.raises(ValueError, match=re.escape(f"must be auto, cpu, cuda or cuda:N, got '{text}'")):
        parse_device(text)


@pytest.mark.parametrize("command", COMPUTING_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_computing_command_takes_the_one_declared_device_flag(command):
    declared = options_of(DeviceOptions)[0]
    args = build_parser().parse_args([*command, "--device", "cuda:1"])
    assert args.device == "cuda:1"
    assert build_parser().parse_args(command).device == declared.default == "auto"


@pytest.mark.parametrize("command", COMPUTING_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_every_computing_command_refuses_a_device_that_is_no_choice(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*command, "--device", "gpu"])
    assert exit_.value.code == 2
    assert "argument --device: must be auto, cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err.strip(
    ).splitlines()[-1]


def test_the_device_is_not_a_training_option_so_config_toml_does_not_name_it():
    """A run's bytes (config.toml, and the audit's reuse of a configuration) are the same whatever computed it."""
    assert "device" not in {o.name for o in options_of(TrainConfig)}
    assert "device" not in TrainConfig().resolved().to_toml()


@NO_GPU
@pytest.mark.parametrize("command", [["bench"], ["train", "--out", "{tmp}/run", "--rounds", "1"],
                                     ["pretrain", "--out", "{tmp}/p.safetensors"],
                                     ["attack", "invert", "{tmp}/run"], ["audit", "{tmp}/a.toml"],
                                     ["demo", "--out", "{tmp}/demo"]], ids=lambda c: c[0])
def test_cuda_where_torch_finds_none_is_one_line_before_any_work(command, tmp_path, capsys, monkeypatch):
    import eftguard.cli as cli

    def no_work(*args, **kwargs):
        raise AssertionError("work started")
    for name in ("cmd_train", "cmd_bench", "cmd_pretrain", "cmd_attack", "cmd_audit", "cmd_demo"):
        monkeypatch.setattr(cli, name, no_work)
    with pytest.raises(SystemExit) as exit_:
        main([part.format(tmp=tmp_path) for part in command] + ["--device", "cuda"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("eftguard: error: --device cuda: torch finds no CUDA GPU here") and "--device cpu" in err
    assert not any(tmp_path.iterdir())


def test_auto_takes_a_gpu_where_torch_finds_one_and_a_missing_index_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda:1") and resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"--device cuda:2: this machine has 2 CUDA GPU\(s\), numbered 0..1"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")


def test_computing_on_sets_the_device_for_the_block_only():
    assert device.compute_device() == torch.device("cpu")
    with computing_on(torch.device("meta")):
        assert device.compute_device() == torch.device("meta")
        with pytest.raises(RuntimeError):
            with computing_on("cpu"):
                assert device.compute_device() == torch.device("cpu")
                raise RuntimeError
        assert device.compute_device() == torch.device("meta")
    assert device.compute_device() == torch.device("cpu")


def test_computing_holds_the_model_on_the_device_for_the_block_and_brings_it_back(monkeypatch):
    """In the block the model is moved (by the one helper) to the compute device, after it (an error too) back where
    it was; a model already there is not moved."""
    moves = []
    monkeypatch.setattr(device, "placed", lambda value, where=None: moves.append((value, where)) or value)
    model = torch.nn.Linear(2, 2)
    with computing_on("meta"):
        with pytest.raises(KeyboardInterrupt):
            with device.computing(model) as where:
                assert where == torch.device("meta") and moves == [(model, torch.device("meta"))]
                raise KeyboardInterrupt
        assert moves == [(model, torch.device("meta")), (model, torch.device("cpu"))]
    moves.clear()
    with device.computing(model):  # on the CPU already
        pass
    assert moves == []


def test_training_places_every_model_and_batch_through_the_one_helper(monkeypatch):
    """Every tensor that reaches a forward pass of the trainer's functions went through eftguard.device.placed (or
    came out of a layer fed by one), and the model computes inside `computing`: the compute device is chosen in one
    place. Outputs are CPU tensors."""
    placed, computed = set(), []
    real_placed, real_computing = device.placed, device.computing

    def spy_placed(value, where=None):
        moved = real_placed(value, where)
        placed.add(id(moved))
        return moved

    def spy_computing(model):
        computed.append(model)
        return real_computing(model)
    monkeypatch.setattr(training, "placed", spy_placed)
    monkeypatch.setattr(training, "computing", spy_computing)
    model = build_model("vit-tiny-32", 4, 2, seed=0)
    unplaced = []

    def check_inputs(module, args):
        unplaced.extend(a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.int64
                        and id(a) not in placed)  # keep ids: passed on as placed
    model.local_module.register_forward_pre_hook(check_inputs)
    normalized = []
    real_normalize = model.normalize
    model.normalize = lambda images: normalized.append(id(images) in placed) or real_normalize(images)
    images = torch.randint(0, 255, (8, 32, 32, 3), dtype=torch.uint8)
    labels = torch.arange(8) % 4
    generator = torch.Generator().manual_seed(0)
    train_local(model, images, labels, "eftvit", 0.75, OptimConfig(1, 4, 1e-3, 0.0), generator)
    features, keep = extract_features(model, images, 0.75, generator)
    train_global(model, features, labels, OptimConfig(1, 4, 1e-3, 0.0), generator)
    evaluate(model, images, labels)
    assert computed == [model] * 4
    assert normalized and all(normalized) and not unplaced
    assert features.device.type == keep.device.type == "cpu"


def test_no_code_moves_a_tensor_to_a_gpu_but_the_device_module():
    """No scattered .cuda() or "cuda" device: eftguard.device is the one place a device is chosen."""
    found = []
    for folder in ("eftguard", "attacks", "defenses"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "device.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\.cuda\(|device=['\"]cuda|\.to\(['\"]cuda", line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found


def _bytes_of(run: Path) -> dict[str, str]:
    """Every file's digest but the lock, the manifest's creation stamp and the timings in metrics.jsonl."""
    digests = {}
    for path in sorted(run.rglob("*")):
        if path.is_file() and path.name not in (".lock", "manifest.json", "metrics.jsonl"):
            digests[str(path.relative_to(run))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


@pytest.mark.slow
def test_a_run_on_device_cpu_has_the_bytes_of_the_default(tmp_path):
    """The same seeded run trained outside any device block (the default) and under --device cpu: every checkpoint,
    upload and truth file has the same bytes (each safetensors file a CPU tensor's)."""
    from eftguard.federation.inprocess import train_in_process
    from eftguard.rundir import RunDirectory

    cfg = TrainConfig(clients=2, rounds=1, train_samples=96, test_samples=16, batch_size=32).resolved()
    runs = []
    for name, block in (("default", None), ("cpu", "cpu")):
        RunDirectory.create(tmp_path / name, cfg)
        if block is None:
            train_in_process(tmp_path / name, cfg.clients)
        else:
            with computing_on(resolve_device(block)):
                train_in_process(tmp_path / name, cfg.clients)
        runs.append(_bytes_of(tmp_path / name))
    assert runs[0] == runs[1] and any(name.startswith("observed/") for name in runs[0])


def test_simulated_clients_share_a_gpu_as_the_cpus_run_them_and_train_on_the_one_ray_assigns(monkeypatch, tmp_path):
    import eftguard.federation.simulation as simulation

    cfg = TrainConfig(cpus_per_client=2.0)
    assert simulation.gpus_per_client(cfg) == 0.0  # a CPU run asks Ray for no GPU
    assert simulation.simulated_node_defaults(tmp_path, cfg)["device"] == "cpu"
    monkeypatch.setattr(simulation.os, "cpu_count", lambda: 16)
    with computing_on("meta"):  # a device that is no GPU: none asked for either
        assert simulation.gpus_per_client(cfg) == 0.0
    monkeypatch.setattr(simulation, "compute_device", lambda: torch.device("cuda:1"))
    assert simulation.gpus_per_client(cfg) == 2 / 16  # 8 clients at once on 16 cores, 8 on the GPU
    assert simulation.gpus_per_client(TrainConfig(cpus_per_client=32.0)) == 1.0
    assert simulation.simulated_node_defaults(tmp_path, cfg)["device"] == "cuda:1"  # the in-process grid's nodes


def test_an_audit_on_a_ray_cluster_computes_where_its_tasks_get_a_gpu(monkeypatch, capsys):
    """--device does not reach a cluster's nodes: --gpus-per-configuration does (the task's child reads the GPU Ray
    assigned it); --device with --ray-address is refused in one line."""
    pytest.importorskip("ray")
    from eftguard.audit.cluster import task_device

    monkeypatch.delenv("RAY_OVERRIDE_RESOURCES", raising=False)
    assert task_device() == torch.device("cpu")
    monkeypatch.setenv("RAY_OVERRIDE_RESOURCES", '{"CPU": 1, "GPU": 0}')
    assert task_device() == torch.device("cpu")
    monkeypatch.setenv("RAY_OVERRIDE_RESOURCES", '{"CPU": 1, "GPU": 0.5}')
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert task_device() == torch.device("cuda")
    monkeypatch.undo()
    with pytest.raises(SystemExit) as exit_:
        main(["audit", "a.toml", "--ray-address", "127.0.0.1:1", "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--device cpu with --ray-address" in err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run it where the device tool lends one)")
def test_a_gpu_run_makes_the_choices_of_a_cpu_run_and_writes_the_same_layout(tmp_path):
    """On a GPU the seeded choices (sample ids, kept patches, class counts: truth/) are the CPU run's byte for byte,
    and every checkpoint and upload has the CPU run's keys, dtypes and shapes, with finite values."""
    from safetensors.torch import load_file

    from eftguard.federation.inprocess import train_in_process
    from eftguard.rundir import RunDirectory

    cfg = TrainConfig(clients=2, rounds=1, train_samples=96, test_samples=16, batch_size=32).resolved()
    for name in ("cpu", "cuda"):
        RunDirectory.create(tmp_path / name, cfg)
        with computing_on(resolve_device(name)):
            train_in_process(tmp_path / name, cfg.clients)
    cpu, gpu = _bytes_of(tmp_path / "cpu"), _bytes_of(tmp_path / "cuda")
    assert cpu.keys() == gpu.keys()
    assert all(cpu[name] == gpu[name] for name in cpu if name.startswith("truth/"))
    for name in (n for n in cpu if n.endswith(".safetensors") and not n.startswith("truth/")):
        on_cpu, on_gpu = load_file(tmp_path / "cpu" / name), load_file(tmp_path / "cuda" / name)
        assert {k: (v.dtype, v.shape) for k, v in on_cpu.items()} == {k: (v.dtype, v.shape) for k, v in on_gpu.items()}
        assert all(bool(v.isfinite().all()) for v in on_gpu.values() if v.is_floating_point())
