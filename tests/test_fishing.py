"""Class fishing (Wen et al. 2022; attacks/tamper.py's class-fish, attacks/fishing.py's `attack gradient --method
fishing`): a round sent the fished head leaves the body's update to the client's images of the fished class alone,
so a gradient inversion gets that one image out of a batch of 16; the attack refuses a round that was not sent the
fished head. (The clients' model check refuses class-fish like every tampering: tests/test_malicious.py.)"""

import pytest

from conftest import run_cli
from eftguard.attacks.tamper import fished_class
from eftguard.audit import run_attack
from eftguard.config import TrainConfig
from eftguard.federation.server import run_server
from eftguard.rundir import RunDirectory
from eftguard.runs import server_threat_of
from fakegrid import FakeGrid

pytestmark = pytest.mark.usefixtures("task_identity_set")


def config(micro, **changes) -> TrainConfig:
    """Client 1 holds 16 images, one of the fished class (class 0, the public split's rarest); one local step."""
    return TrainConfig(**{"model": micro, "clients": 2, "rounds": 1, "train_samples": 32, "test_samples": 8,
                          "batch_size": 16, "method": "fedavg", "model_check": False, **changes}).resolved()


def train(path, cfg) -> RunDirectory:
    run = RunDirectory.create(path, cfg)
    run_server(FakeGrid(cfg.clients, node_config={"model-check": cfg.model_check}), run.path, server_threat_of(cfg))
    return run


@pytest.mark.slow
def test_a_fished_round_gives_the_one_image_of_the_fished_class_back(tmp_path, micro_preset):
    """One image of the fished class among 16: Inverting Gradients on the body update (only that image moved it)
    brings it back far above the mean image, and it is that image (the matched original is of the fished class,
    which no other of the client's images is)."""
    cfg = config(micro_preset, threat="malicious", tamper="class-fish")
    run = train(tmp_path / "fished", cfg)
    truth = run.load_truth(1, 1)
    assert fished_class(cfg, 10) == 0 and truth["class_counts"][0] == 1 and truth["class_counts"].sum() == 16
    report = run_attack(run.path, "gradient", "fishing", clients=[1], steps=100, start="prior",
                        lpips_backend="stlpips-alex", power_check=False)
    figures = report.figures()
    assert figures["psnr"] > figures["baseline.psnr"] + 6 and report.details["label_accuracy"]["mean"] == 1.0
    assert report.capabilities["server"] == "malicious"


def test_the_fishing_attack_refuses_a_round_not_sent_the_fished_head(tmp_path, micro_preset, capsys):
    imprinted = train(tmp_path / "imprint", config(micro_preset, threat="malicious", tamper="imprint"))
    capsys.readouterr()
    code, err = run_cli(capsys, "attack", "gradient", imprinted.path, "--method", "fishing")
    assert code == 2 and err.count("\n") == 1 and err.endswith("was tampered with imprint: the fishing method reads a "
                                                               "round of --tamper class-fish\n")
