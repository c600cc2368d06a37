"""The imprint tampering ("Robbing the Fed", Fowl et al. 2022, on the ViT's patch tokens; attacks/tamper.py) and its
attack (attacks/imprint.py, `attack gradient --method imprint`): a round sent the imprint gives patches back exactly
from the client's parameter update; the clients' model check refuses the imprint; the attack refuses a round that
was not sent it; an adaptive server stays within the check's bounds."""

import numpy as np
import pytest

from conftest import run_cli
from eftguard.audit import run_attack
from eftguard.config import TrainConfig
from eftguard.federation.server import run_server
from eftguard.rundir import RunDirectory
from eftguard.runs import server_threat_of
from fakegrid import FakeGrid, run_with_checking_nodes, task_identity

pytestmark = pytest.mark.usefixtures("task_identity_set")


def config(micro, **changes) -> TrainConfig:
    return TrainConfig(**{"model": micro, "clients": 2, "rounds": 1, "train_samples": 16, "test_samples": 8,
                          "batch_size": 16, "method": "fedavg", **changes}).resolved()


def train(path, cfg) -> RunDirectory:
    run = RunDirectory.create(path, cfg)
    run_server(FakeGrid(cfg.clients, node_config={"model-check": cfg.model_check}), run.path, server_threat_of(cfg))
    return run


def imprint_report(run, **options):
    return run_attack(run.path, "gradient", "imprint", lpips_backend="stlpips-alex", **options)


@pytest.fixture(scope="module")
def imprinted(tmp_path_factory, micro_preset):
    """A fedavg round sent the imprint, the clients' check off: one local step on the client's images (client 0: 5
    images, 320 tokens for the 256 units of the micro ViT's first MLP)."""
    with task_identity():
        return train(tmp_path_factory.mktemp("imprint") / "run", config(micro_preset, threat="malicious",
                                                                            tamper="imprint", model_check=False))


def test_an_imprint_round_gives_single_patches_back_exactly(imprinted):
    """Every bin that one token fell into returns its patch at float precision (PSNR capped at 60 dB), far above
    the mean image; the power check (the same attack on the same crafted model, public images) does the same."""
    report = imprint_report(imprinted)
    figures, details = report.figures(), report.details
    assert details["single_token_bins"] >= 20 and details["patches_returned"] == details["single_token_bins"]
    assert details["patches_above_30_db"] >= 0.9 * details["patches_returned"]
    assert figures["psnr_kept"] > 50 > 25 > figures["baseline_kept.psnr"]
    assert figures["control.psnr_kept"] > 50 > 25 > figures["control_baseline.psnr_kept"]
    assert report.capabilities["server"] == "malicious"


def test_the_imprint_attack_refuses_a_round_not_sent_the_imprint(tmp_path, micro_preset, capsys, imprinted):
    honest = train(tmp_path / "honest", config(micro_preset, model_check=False))
    other = train(tmp_path / "other", config(micro_preset, method="eftvit", threat="malicious",
                                              tamper="identity-embed", model_check=False))
    capsys.readouterr()
    code, err = run_cli(capsys, "attack", "gradient", honest.path, "--method", "imprint")
    assert code == 2 and err.count("\n") == 1 and "was never tampered with" in err
    code, err = run_cli(capsys, "attack", "gradient", other.path, "--method", "imprint")
    assert code == 2 and err.count("\n") == 1 and err.endswith("was tampered with identity-embed: the imprint method "
                                                               "reads a round of --tamper imprint\n")
    code, err = run_cli(capsys, "attack", "gradient", imprinted.path, "--method", "imprint", "--observe", "probe")
    assert code == 2 and err.endswith("the imprint attack reads the update of a tampered round: use --observe "
                                      "upload\n")


@pytest.mark.parametrize("tamper_round", [1, 2])
def test_the_model_check_refuses_the_imprint(tmp_path, micro_preset, tamper_round):
    cfg = config(micro_preset, rounds=2, threat="malicious", tamper="imprint", tamper_round=tamper_round)
    run = train(tmp_path / "run", cfg)
    reasons = run.metrics()[tamper_round - 1]["dropped"]
    assert sorted(reasons) == ["0", "1"]
    assert all(reason.startswith("client failed: client refuses: ") for reason in reasons.values())
    assert run.metrics()[2 - tamper_round]["dropped"] == {}


def test_the_imprint_needs_a_method_that_trains_the_first_mlp(capsys, tmp_path):
    from eftguard.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--out", str(tmp_path / "run"), "--threat", "malicious", "--tamper", "imprint",
              "--method", "fed-head"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(
        "--tamper imprint reads the update of local_module.blocks.0.mlp.fc1.weight, which --method fed-head clients "
        "do not train (methods that do: eftvit, fedavg)")


def test_an_adaptive_imprint_server_stays_within_every_bound(tmp_path, micro_preset):
    """--threat adaptive --tamper imprint: every round each client gets the model nearest the imprint that its check
    accepts; no client refuses a round, no coordinate moved further than DRIFT_MARGIN of what the rounds allow, and
    the imprint stays far out of reach (its brightness weights are thousands, the bound a few lr per round)."""
    from eftguard.attacks.tamper import DRIFT_MARGIN, ImprintLayout, tamper_state
    from eftguard.federation.client import model_check_limits

    cfg = config(micro_preset, rounds=3, train_samples=40, threat="adaptive", tamper="imprint")
    run, received = run_with_checking_nodes(tmp_path, cfg)
    records = run.metrics()
    assert [r["dropped"] for r in records] == [{}] * 3 and [r["tampered"] for r in records] == ["imprint"] * 3
    initial = run.load_checkpoint(0)
    target = tamper_state("imprint", initial, cfg, 0)
    key = "local_module.blocks.0.mlp.fc1.weight"
    start = {k: v.numpy() for k, v in initial.items()}
    limit = model_check_limits(cfg)(3, start, 2)[key]
    moved = np.abs(received[key] - start[key])
    assert np.all(moved <= DRIFT_MARGIN * limit * (1 + 1e-6))
    weight = initial["local_module.patch_embed.proj.weight"]
    brightness = target[key].numpy()[:, ImprintLayout.of(weight.shape[0], weight[0].numel()).brightness]
    assert np.abs(brightness).min() > 1e3 * limit.max()  # far out of reach after 3 rounds
