"""Class and feature fishing (Wen et al. 2022; attacks/tamper.py's class-fish and feature-fish, attacks/fishing.py's
`attack gradient --method fishing` and `--method feature-fishing`): a round sent the fished head leaves the body's
update to the client's images of the fished class alone (class-fish) or to its images above the fished feature's
threshold (feature-fish), so a gradient inversion gets that one image out of the client's batch; each attack refuses
a round that was not sent its head. (The clients' model check refuses both in rounds 1 and 2 like every tampering:
tests/test_malicious.py.)"""

import numpy as np
import pytest
import torch

from conftest import run_cli
from eftguard.attacks.tamper import fished_class
from eftguard.attacks.update_inversion import ADAM_EPS
from eftguard.audit.observe import sent_model
from eftguard.audit.scoring import client_training_set
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


def test_the_fishing_attacks_refuse_a_round_not_sent_their_head(tmp_path, micro_preset, capsys):
    imprinted = train(tmp_path / "imprint", config(micro_preset, threat="malicious", tamper="imprint"))
    capsys.readouterr()
    for method, tamper in (("fishing", "class-fish"), ("feature-fishing", "feature-fish")):
        code, err = run_cli(capsys, "attack", "gradient", imprinted.path, "--method", method)
        assert code == 2 and err.count("\n") == 1 and err.endswith(f"was tampered with imprint: the {method} method "
                                                                   f"reads a round of --tamper {tamper}\n")


def test_feature_fish_needs_a_method_whose_clients_train_the_body(capsys, tmp_path):
    code, err = run_cli(capsys, "train", "--out", tmp_path / "run", "--threat", "malicious", "--tamper", "feature-fish",
                        "--method", "fed-head")
    assert code == 2 and err.count("\n") == 1 and err.endswith(
        "--tamper feature-fish reads the update of local_module.patch_embed.proj.weight, which --method fed-head "
        "clients do not train (methods that do: eftvit, fedavg)\n")
    assert not (tmp_path / "run").exists()


def feature_fished_run(path, micro):
    """Four clients, 64 images; client 0 holds 10 (one local step), exactly one of them above the public split's
    threshold of the fished feature and none of the fished class (whose images below it would leak too)."""
    return train(path, config(micro, clients=4, train_samples=64, threat="malicious", tamper="feature-fish"))


def fished_logits(run, partition: int) -> np.ndarray:
    """The fished logit of each of the client's images under the model its round was sent: its gradient is on above
    +5, off below -5 (every other logit is 0)."""
    model = sent_model(run, 1).eval()
    with torch.no_grad():
        logits = model(model.normalize(torch.from_numpy(client_training_set(run, partition).images)))
    return logits[:, fished_class(run.config(), 10)].numpy()


def test_a_feature_fished_round_uploads_the_step_of_the_one_image_above_the_threshold(tmp_path, micro_preset):
    """The client's one image above the threshold (chosen from the public split) is the only one with a gradient:
    its body update is AdamW's first step of that image's gradient (g / (|g| + eps), B = 10), to a cosine of 0.999,
    and every other image's gradient is below a millionth of its."""
    run = feature_fished_run(tmp_path / "run", micro_preset)
    logits = fished_logits(run, 0)
    data = client_training_set(run, 0)
    assert (logits > 5).sum() == 1 and (np.abs(logits) <= 5).sum() == 0
    assert not (data.labels == fished_class(run.config(), 10)).any()
    model = sent_model(run, 1)
    body = {name: p for name, p in model.named_parameters() if not name.startswith("head.")}
    uploaded = run.load_upload(1, 0, "update")
    cfg = run.config()
    step = torch.cat([((p.detach() - torch.from_numpy(uploaded[name])) / cfg.lr - cfg.weight_decay * p.detach())
                      .flatten().double() for name, p in body.items()])

    def gradient(index: int) -> torch.Tensor:
        image = model.normalize(torch.from_numpy(data.images[index:index + 1]))
        loss = torch.nn.functional.cross_entropy(model(image), torch.from_numpy(data.labels[index:index + 1]))
        return torch.cat([g.flatten().double() for g in torch.autograd.grad(loss, list(body.values()))])

    gradients = [gradient(i) for i in range(len(data.labels))]
    isolated = int(np.argmax(logits))
    first_step = gradients[isolated] / len(data.labels)
    first_step = first_step / (first_step.abs() + ADAM_EPS)
    assert float(first_step @ step / (first_step.norm() * step.norm())) > 0.999
    norms = [float(g.norm()) for g in gradients]
    assert max(n for i, n in enumerate(norms) if i != isolated) < 1e-6 * norms[isolated]


@pytest.mark.slow
def test_feature_fishing_gives_the_one_image_above_the_threshold_back(tmp_path, micro_preset):
    """Inverting Gradients on that upload, matching the fished logit's gradient (100 steps from the mean image): its
    best match among the client's 10 images is the isolated one, 5 dB or more above the mean image (measured:
    19.5 against 13.2 dB)."""
    run = feature_fished_run(tmp_path / "run", micro_preset)
    isolated = int(np.argmax(fished_logits(run, 0)))
    report = run_attack(run.path, "gradient", "feature-fishing", clients=[0], steps=100,
                        lpips_backend="stlpips-alex", power_check=False)
    figures = report.figures()
    assert figures["psnr"] > figures["baseline.psnr"] + 5 and "label_accuracy" not in report.details
    original = np.asarray(report.ranking_rows[0][0], dtype=np.float64)
    assert np.allclose(original, client_training_set(run, 0).images[isolated] / 255, atol=1e-6)


def test_trusting_the_first_model_lets_a_feature_fished_one_through(tmp_path, micro_preset):
    """Trust on first use checks structure only: the feature-fished head (one weight in one row, no zeroed LayerNorm
    or block) passes it, as class-fish does; by default the node rebuilds the initial model and refuses it."""
    cfg = config(micro_preset, threat="malicious", tamper="feature-fish", model_check=True)
    run = RunDirectory.create(tmp_path / "run", cfg)
    run_server(FakeGrid(2, node_config={"model-check": True, "trust-first-model": True}), run.path,
               server_threat_of(cfg))
    assert run.metrics()[0]["tampered"] == "feature-fish" and run.metrics()[0]["dropped"] == {}


def test_an_adaptive_feature_fishing_server_is_never_refused(tmp_path, micro_preset):
    """--threat adaptive --tamper feature-fish: every round each client gets the model nearest the feature-fished one
    that its check accepts (AdaptiveTampering takes any tampering); no node refuses a round."""
    run = train(tmp_path / "run", config(micro_preset, rounds=2, threat="adaptive", tamper="feature-fish",
                                         model_check=True))
    assert [r["dropped"] for r in run.metrics()] == [{}, {}]
    assert [r["tampered"] for r in run.metrics()] == ["feature-fish"] * 2
