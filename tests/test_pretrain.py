"""eftguard pretrain: trains on the public split only, its checkpoint starts federated training with the very
model it trained, and neither an interruption nor a bad option leaves anything behind."""

import os
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from PIL import Image

from eftguard import cli
from eftguard.cli import main
from eftguard.data import Dataset, ImageSet, load_dataset
from eftguard.model import PRESETS, build_model
from eftguard.pretrain import (PretrainConfig, PretrainError, patchify, pretrain, public_loss, resume_path,
                               save_pretrained)

QUICK = ["--epochs", "1", "--warmup-epochs", "0", "--batch-size", "8"]


def write_class_tree(root, per_class=10):
    """An ImageFolder tree of three classes of random 40x48 px PNGs (as tests/test_data.py builds them)."""
    rng = np.random.default_rng(0)
    for name in ("beach", "forest", "river"):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(root / name / f"{i}.png")


def two_colour_set(count=32, seed=0) -> ImageSet:
    """Reddish images (class 0) and bluish ones (class 1): a short pretraining can learn them."""
    rng = np.random.default_rng(seed)
    labels = np.arange(count) % 2
    images = rng.integers(0, 120, (count, 32, 32, 3)).astype(np.uint8)
    images[labels == 0, :, :, 0] += 130
    images[labels == 1, :, :, 2] += 130
    return ImageSet(images, labels.astype(np.int64))


class ClientImages:
    """Stands in for the clients' training split: any use of it beyond its length fails the test."""

    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def __getattr__(self, name):
        raise AssertionError(f"pretraining touched the clients' training split (.{name})")


def only_line_of(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_pretraining_reads_only_the_public_split_of_an_imagefolder(tmp_path, monkeypatch, capsys):
    write_class_tree(tmp_path / "ucm")
    real = load_dataset(f"imagefolder:{tmp_path / 'ucm'}", None, 32)
    guarded = Dataset(real.name, real.class_names, ClientImages(len(real.train)), real.test, real.public)
    monkeypatch.setattr(cli, "load_dataset", lambda *args: guarded)
    out = tmp_path / "ckpt.safetensors"
    main(["pretrain", "--dataset", f"imagefolder:{tmp_path / 'ucm'}", "--out", str(out), *QUICK])
    assert out.is_file()
    assert "on the public split" in capsys.readouterr().err
    metadata = safetensors.safe_open(str(out), "pt").metadata()
    assert metadata["classes"] == "beach,forest,river" and metadata["objective"] == "supervised"


@pytest.mark.parametrize("objective", ["supervised", "both"])
def test_checkpoint_gives_the_pretrained_forward_at_any_local_layers(tmp_path, objective):
    model = build_model("vit-tiny-32", 2, local_layers=1, seed=0)
    pretrain(model, two_colour_set(16), PretrainConfig(objective=objective, epochs=1, warmup_epochs=0, batch_size=8))
    out = tmp_path / "ckpt.safetensors"
    save_pretrained(model, out, PretrainConfig(objective=objective), "test", ("red", "blue"))
    images = model.normalize(torch.from_numpy(two_colour_set(6, seed=1).images))
    with torch.no_grad():
        expected = model.eval()(images)
        fresh = build_model("vit-tiny-32", 2, local_layers=2, seed=0).eval()(images)
        assert not torch.allclose(fresh, expected, atol=1e-4)  # pretraining changed the model
        for local_layers in (2, 11):
            loaded = build_model("vit-tiny-32", 2, local_layers=local_layers, seed=1, checkpoint=out).eval()
            torch.testing.assert_close(loaded(images), expected, rtol=0, atol=1e-6)


def test_short_pretraining_lowers_the_public_loss():
    public = two_colour_set(16)
    model = build_model("vit-tiny-32", 2, local_layers=1, seed=0)
    before = public_loss(model, public)
    history = pretrain(model, public, PretrainConfig(objective="supervised", epochs=2, warmup_epochs=0, batch_size=8))
    assert len(history) == 2
    assert public_loss(model, public) < 0.5 * before


def test_patchify_follows_the_patch_embedding_order():
    """The MAE target of patch i must be the pixels the patch embedding turns into token i."""
    model = build_model("vit-tiny-32", 10, local_layers=1, seed=0)
    images = torch.randn(2, 3, 32, 32)
    conv = model.local_module.patch_embed
    as_linear = conv.proj.weight.permute(0, 2, 3, 1).reshape(conv.proj.weight.shape[0], -1)
    tokens = patchify(images, PRESETS["vit-tiny-32"].patch_size) @ as_linear.T + conv.proj.bias
    torch.testing.assert_close(tokens, conv(images), rtol=1e-4, atol=1e-4)


def test_ctrl_c_in_the_first_epoch_leaves_no_file_and_while_saving_keeps_the_epochs(tmp_path, monkeypatch, capsys):
    write_class_tree(tmp_path / "ucm")
    out = tmp_path / "ckpt.safetensors"
    args = ["pretrain", "--dataset", f"imagefolder:{tmp_path / 'ucm'}", "--out", str(out), *QUICK]
    steps = []

    def step_then_interrupt(self, *a, _step=torch.optim.AdamW.step, **k):
        steps.append(1)
        if len(steps) == 1:
            raise KeyboardInterrupt
        return _step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step_then_interrupt)
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert stopped.value.code == 130 and list(tmp_path.iterdir()) == [tmp_path / "ucm"]
    assert "no epoch had finished" in capsys.readouterr().err

    def write_half_then_interrupt(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise KeyboardInterrupt

    with monkeypatch.context() as saving:
        saving.setattr(safetensors.torch, "save_file", write_half_then_interrupt)
        with pytest.raises(SystemExit) as stopped:
            main(args)
    assert stopped.value.code == 130 and "run the same command again to continue" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors.resume", "ucm"]  # no torn checkpoint
    main(args)  # the one epoch is not trained again: the checkpoint is written, the kept state removed
    assert "continuing the interrupted pretraining" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.safetensors", "ucm"]


@pytest.mark.parametrize("objective", ["supervised", "both"])
def test_an_interrupted_pretraining_resumed_ends_with_the_uninterrupted_weights(tmp_path, objective):
    """Stopped after epoch 1 of 3 and continued from its kept state (a fresh model, as a new process builds it):
    the same weights, bit for bit, as three epochs in one go (schedule, optimizer moments, batch order, crops and
    MAE masks all continue)."""
    cfg = PretrainConfig(objective=objective, epochs=3, warmup_epochs=1, batch_size=8)
    public, identity = two_colour_set(24), {"dataset": "two-colour", "model": "vit-tiny-32"}
    whole = build_model("vit-tiny-32", 2, local_layers=2, seed=0)
    history = pretrain(whole, public, cfg)

    resume = tmp_path / "ckpt.safetensors.resume"
    stopped = build_model("vit-tiny-32", 2, local_layers=2, seed=0)
    with pytest.raises(KeyboardInterrupt):
        pretrain(stopped, public, cfg, resume=resume, identity=identity,
                 epoch_done=lambda done, loss: (_ for _ in ()).throw(KeyboardInterrupt) if done == 1 else None)
    resumed = build_model("vit-tiny-32", 2, local_layers=2, seed=0)
    assert pretrain(resumed, public, cfg, resume=resume, identity=identity) == history
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    # a state kept for other settings is not continued from, and not removed
    other = PretrainConfig(objective=objective, epochs=3, warmup_epochs=1, batch_size=8, lr=5e-4)
    with pytest.raises(PretrainError, match=r"other settings \(lr\): run its own command again"):
        pretrain(build_model("vit-tiny-32", 2, local_layers=2, seed=0), public, other, resume=resume,
                 identity=identity)
    assert resume.exists()
    # one of its parts missing (the state altered by hand): named, not trained on
    state = torch.load(resume, weights_only=True)
    del state["optimizer"]
    torch.save(state, resume)
    with pytest.raises(PretrainError, match=r"cannot be resumed from \(KeyError: 'optimizer'\): remove it"):
        pretrain(build_model("vit-tiny-32", 2, local_layers=2, seed=0), public, cfg, resume=resume, identity=identity)


@pytest.mark.parametrize("content", [b"", b"\0" * 100, b"not a torch file", "fifo"])
def test_a_torn_or_foreign_kept_state_is_one_line_and_no_training(tmp_path, capsys, content):
    write_class_tree(tmp_path / "ucm")
    out = tmp_path / "ckpt.safetensors"
    if content == "fifo":  # a named pipe no one writes: read, it would block forever
        os.mkfifo(resume_path(out))
    else:
        resume_path(out).write_bytes(content)
    with pytest.raises(SystemExit) as stopped:
        main(["pretrain", "--dataset", f"imagefolder:{tmp_path / 'ucm'}", "--out", str(out), *QUICK])
    assert stopped.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"eftguard: error: {resume_path(out)} cannot be resumed from") and "remove it" in last
    assert not out.exists() and (content == "fifo" or resume_path(out).read_bytes() == content)


def test_diverging_loss_stops_with_one_line_and_no_file(tmp_path, capsys):
    write_class_tree(tmp_path / "ucm")
    out = tmp_path / "ckpt.safetensors"
    with pytest.raises(SystemExit) as stopped:
        main(["pretrain", "--dataset", f"imagefolder:{tmp_path / 'ucm'}", "--out", str(out), *QUICK, "--lr", "1e30"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err  # the progress bars, then the one error line
    assert "Traceback" not in err and err.count("eftguard: error:") == 1
    assert err.strip().splitlines()[-1].startswith("eftguard: error: the trained model's outputs are not finite")
    assert list(tmp_path.iterdir()) == [tmp_path / "ucm"]


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--warmup-epochs", "3", "--epochs", "3"], "--warmup-epochs must be in"),
    (["--mask-ratio", "1"], "--mask-ratio must be in (0, 1)"),
    (["--label-smoothing", "-0.1"], "--label-smoothing must be in [0, 1)"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "-1"], "--lr must be a positive number, got -1.0"),
    (["--seed", str(2 ** 64)], "--seed must be a whole number in 0..4294967295, got 18446744073709551616"),
    (["--seed", "-1"], "--seed must be a whole number in 0..4294967295, got -1"),
    (["--out", "ckpt.pt"], "give a path ending in .safetensors"),
    (["--out", "EXISTING"], "already exists: pick another path, or pass --force"),
    (["--out", "FOLDER"], "is a folder"),
    (["--dataset", "imagefolder:MISSING"], "is not a folder"),
    pytest.param(["--out", "/proc/ckpt.safetensors"], "is in /proc, which is not writable (",
                 marks=pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")),
])
def test_bad_options_are_one_line_errors(tmp_path, capsys, flags, message):
    (tmp_path / "existing.safetensors").write_bytes(b"keep me")
    (tmp_path / "folder.safetensors").mkdir()
    where = {"EXISTING": tmp_path / "existing.safetensors", "FOLDER": tmp_path / "folder.safetensors",
             "imagefolder:MISSING": f"imagefolder:{tmp_path / 'missing'}"}
    flags = [str(where.get(flag, flag)) for flag in flags]
    before = sorted(tmp_path.iterdir())
    with pytest.raises(SystemExit) as stopped:
        main(["pretrain", "--out", str(tmp_path / "new.safetensors"), *flags])
    assert stopped.value.code == 2
    line = only_line_of(capsys.readouterr().err)
    assert line.startswith("eftguard: error: ") and message in line
    assert sorted(tmp_path.iterdir()) == before and (tmp_path / "existing.safetensors").read_bytes() == b"keep me"
