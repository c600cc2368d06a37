"""Bad input ends in one clear line and exit code 2, before any federation starts."""

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import run_cli
from eftguard.config import TrainConfig
from eftguard.model import build_model


@pytest.mark.parametrize("argv, message", [
    (["--mask-ratio", "1.0"], "--mask-ratio must be in [0, 1)"),
    (["--mask-ratio", "-0.1"], "--mask-ratio must be in [0, 1)"),
    (["--local-layers", "0"], "--local-layers must be between 1 and 11"),
    (["--local-layers", "12"], "--local-layers must be between 1 and 11"),
    (["--model", "vit-micro-32", "--local-layers", "4"], "--model vit-micro-32: --local-layers must be between 1 and 3 "
                                                         "for a depth-4 ViT, got 4"),
    (["--model", "vit-micro-32", "--pretrained"], "--pretrained: the vit-micro-32 preset has no pretrained weights"),
    (["--dataset", "mnist"], "unknown dataset 'mnist'"),
    (["--dataset", "cifar10"], "needs --data-dir"),
    (["--dataset", "cifar10", "--data-dir", "/nonexistent/data"], "--data-dir /nonexistent/data does not exist"),
    (["--clients-per-round", "9"], "--clients-per-round must be between 1 and --clients"),
    (["--checkpoint", "/nonexistent/w.safetensors"], "checkpoint /nonexistent/w.safetensors does not exist"),
    (["--checkpoint", "/dev/null"], "checkpoint /dev/null is not a regular file: give the checkpoint file"),
    (["--checkpoint", "{tmp}"], "checkpoint {tmp} is a folder: give the checkpoint file"),
    (["--checkpoint", "{tmp}/objects.pt"], "cannot read checkpoint {tmp}/objects.pt (not a torch.save file of tensors "
                                           "alone: eftguard unpickles nothing else)"),
    (["--dp-eps", "0.01", "--accountant", "rdp", "--rounds", "2"], "--dp-eps 0.01 cannot be met"),
    (["--feature-noise", "1.0"], "set --feature-clip C > 0 too"),
    # issue 34: each was a traceback, a hang, or a run that trained from nothing
    (["--seed", str(2 ** 64)], "--seed must be a whole number in 0..4294967295, got 18446744073709551616"),
    (["--config", "{tmp}/big-seed.toml"], "--seed must be a whole number in 0..4294967295"),
    (["--dp-eps", "1e-9", "--rounds", "1"], "client 0 (33 samples, 1 rounds): --dp-eps 1e-09 cannot be met"),
    (["--dp-eps", "1e300"], "--dp-eps must be in [0, 100] (0: no DP-SGD; above 100 the guarantee"),
    (["--dp-eps", "8", "--dp-delta", "1e-300"], "the prv accountant cannot work at --dp-delta 1e-300"),
    (["--dp-eps", "8", "--rounds", "1000000000"], "--rounds 1000000000 with --dp-eps: each client's noise"),
    (["--dp-eps", "8", "--local-epochs", "100000000"], "DP-SGD steps are more than the prv accountant calibrates"),
    (["--method", "fed-prompt", "--prompt-tokens", "100000000"], "--prompt-tokens must be between 1 and 256 (4 per "
                                                                 "patch token of vit-tiny-32), got 100000000"),
    (["--canaries", "1000000000"], "--canaries 1000000000 needs 1000000000 held-out training images"),
    (["--canaries", "1000000000", "--canary-kind", "gradient"], "--canaries 1000000000 is more than the"),
    (["--checkpoint", "{tmp}/diverged.safetensors"], "checkpoint {tmp}/diverged.safetensors holds NaN or infinite "
                                                     "values (in 'head.bias'): give the checkpoint of a training"),
    (["--federation", "deployment", "--insecure", "--superlink", "not an address"],
     "--superlink 'not an address' is not HOST:PORT"),
    (["--federation", "deployment", "--insecure", "--superlink", "127.0.0.1:70000"], "is not HOST:PORT"),
])
def test_bad_training_options(capsys, tmp_path, argv, message):
    torch.save({"weights": torch.zeros(2), "note": Path("x")}, tmp_path / "objects.pt")  # a pickled object
    (tmp_path / "big-seed.toml").write_text(f"seed = {2 ** 64}\n")
    diverged = build_model("vit-tiny-32", 10, 2).state_dict()
    diverged["head.bias"][3] = float("nan")
    save_file(diverged, str(tmp_path / "diverged.safetensors"))
    code, err = run_cli(capsys, "train", "--out", str(tmp_path / "run"), *[a.format(tmp=tmp_path) for a in argv])
    assert code == 2
    assert message.format(tmp=tmp_path) in err and "Traceback" not in err and "weights_only=False" not in err
    assert err.startswith("eftguard: error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_checkpoint_that_does_not_fit(capsys, tmp_path):
    path = tmp_path / "small.safetensors"
    save_file({"pos_embed": torch.zeros(1, 17, 192), "cls_token": torch.zeros(1, 1, 192)}, str(path))
    code, err = run_cli(capsys, "train", "--out", str(tmp_path / "run"), "--checkpoint", str(path))
    assert code == 2 and "does not fit model vit-tiny-32" in err


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "does not exist"),
    (lambda d: d.mkdir(), "not an eftguard run directory"),
    (lambda d: (d.mkdir(), (d / "manifest.json").write_text("garbage")), "manifest.json is missing or corrupt"),
])
def test_resume_refuses_foreign_or_corrupt_directories(capsys, tmp_path, setup, message):
    setup(tmp_path / "run")
    code, err = run_cli(capsys, "train", "--resume", str(tmp_path / "run"))
    assert code == 2 and message in err


def test_config_file_with_flags_overriding(tmp_path):
    from eftguard.cli import build_parser, config_from_args

    (tmp_path / "c.toml").write_text('mask_ratio = 0.5\nrounds = 7\nlocal-layers = 4\n')
    args = build_parser().parse_args(["train", "--config", str(tmp_path / "c.toml"), "--rounds", "2"])
    cfg = config_from_args(args)
    assert (cfg.mask_ratio, cfg.rounds, cfg.local_layers, cfg.clients_per_round) == (0.5, 2, 4, 8)


def test_config_file_with_unknown_key(capsys, tmp_path):
    (tmp_path / "c.toml").write_text('mask_ration = 0.5\n')
    code, err = run_cli(capsys, "train", "--config", str(tmp_path / "c.toml"))
    assert code == 2 and "unknown option 'mask_ration'" in err


def test_resume_cannot_extend_a_dp_run(capsys, tmp_path):
    from eftguard.config import TrainConfig
    from eftguard.rundir import RunDirectory

    RunDirectory.create(tmp_path / "run", TrainConfig(dp_eps=8.0, rounds=2).resolved())
    code, err = run_cli(capsys, "train", "--resume", str(tmp_path / "run"), "--rounds", "4")
    assert code == 2 and "--rounds cannot change on a DP-SGD run" in err


NUMERIC_OPTIONS = [f.name for f in dataclasses.fields(TrainConfig) if f.type in ("int", "float")]
FLOAT_OPTIONS = {f.name for f in dataclasses.fields(TrainConfig) if f.type == "float"}


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", NUMERIC_OPTIONS)
def test_every_numeric_option_rejects_nan_and_inf(capsys, tmp_path, name, value):
    """`--dp-eps nan` once passed validation (`nan < 0` is False) and the clients then skipped DP-SGD."""
    flag = "--" + name.replace("_", "-")
    code, err = run_cli(capsys, "train", "--out", str(tmp_path / "run"), f"{flag}={value}")
    assert code == 2 and flag in err.strip().splitlines()[-1] and "Traceback" not in err
    if name in FLOAT_OPTIONS:  # int options are refused by argparse itself ("invalid int value")
        assert err.startswith("eftguard: error:") and "finite" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", NUMERIC_OPTIONS)
def test_config_file_with_nan_or_inf_is_refused(capsys, tmp_path, name, value):
    config = tmp_path / "bad.toml"
    config.write_text(f"{name} = {value}\n")
    code, err = run_cli(capsys, "train", "--out", str(tmp_path / "run"), "--config", str(config))
    assert code == 2 and name in err.replace("-", "_") and "Traceback" not in err
    assert err.startswith("eftguard: error:") and not (tmp_path / "run").exists()
