"""A malicious server (issue 15, item 2): it tampers with the model it sends in one round (attacks/tamper.py), the
clients train and upload as usual over the real server and the in-process grid, and the attack reads what came
back; the clients' model check (defenses/model_check.py) refuses every tampering and passes honest rounds."""

import pytest

from eftguard.audit import run_attack
from eftguard.config import TrainConfig
from eftguard.federation.server import run_server
from eftguard.rundir import RunDirectory
from fakegrid import FakeGrid, task_identity


@pytest.fixture(autouse=True)
def _task_identity():
    with task_identity():
        yield


def config(micro, **changes) -> TrainConfig:
    return TrainConfig(**{"model": micro, "clients": 2, "rounds": 1, "train_samples": 40, "test_samples": 8,
                          "batch_size": 16, "model_check": False, **changes}).resolved()


def train(path, cfg) -> RunDirectory:
    run = RunDirectory.create(path, cfg)
    run_server(FakeGrid(cfg.clients), run.path)
    return run


def kept_psnr(run, method="tampered"):
    report = run_attack(run.path, "invert", method, lpips_backend="stlpips-alex", max_images=4)
    return report


def test_identity_embed_round_gives_the_kept_patches_back_and_an_honest_round_does_not(tmp_path, micro_preset):
    tampered = train(tmp_path / "tampered", config(micro_preset, threat="malicious", tamper="identity-embed"))
    honest = train(tmp_path / "honest", config(micro_preset))
    print(kept_psnr(tampered).figures())
    print(kept_psnr(honest).figures())
