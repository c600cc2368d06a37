"""A malicious server (issue 15, item 2): it tampers with the model it sends in one round (attacks/tamper.py), the
clients train and upload as usual over the real server and the in-process grid, and the attack reads what came
back; the clients' model check (defenses/model_check.py) refuses every tampering and every mid-run change of the
settings, and passes honest rounds."""

import dataclasses
import json

import numpy as np
import pytest

from eftguard.attacks.inversion import TamperedInversion
from eftguard.attacks.labels import TamperedHeadAttack
from conftest import attacks_guarded
from eftguard.attacks.tamper import PROBE_SCALE
from eftguard.audit import observe, run_attack
from eftguard.cli import main
from eftguard.runs import server_threat_of
from eftguard.config import TAMPERINGS, TrainConfig
from eftguard.errors import FederationError
from eftguard.federation.server import run_server
from eftguard.federation.simulation import forget_received_models
from eftguard.methods import METHODS
from eftguard.model import build_model
from eftguard.rundir import RunDirectory
from fakegrid import FakeGrid

pytestmark = pytest.mark.usefixtures("task_identity_set")  # messages are built outside Flower


def config(micro, **changes) -> TrainConfig:
    return TrainConfig(**{"model": micro, "clients": 2, "rounds": 1, "train_samples": 40, "test_samples": 8,
                          "batch_size": 16, **changes}).resolved()


def train(path, cfg) -> RunDirectory:
    run = RunDirectory.create(path, cfg)
    run_server(FakeGrid(cfg.clients, node_config={"model-check": cfg.model_check}), run.path, server_threat_of(cfg))
    return run


def kept_patch_psnr(run) -> float:
    return run_attack(run.path, "invert", "tampered", lpips_backend="stlpips-alex", max_images=4).figures()["psnr_kept"]


@pytest.mark.parametrize("tamper", ["identity-embed", "stealth-embed"])
def test_an_embedding_tampered_round_gives_the_kept_patches_back(tmp_path, micro_preset, tamper, monkeypatch):
    """The clients train through the tampered model as usual; the closed-form inverse of what they upload is the
    kept patches to float precision (PSNR is capped at 60 dB)."""
    tampered = train(tmp_path / "tampered", config(micro_preset, threat="malicious", tamper=tamper,
                                                   model_check=False))
    assert tampered.metrics()[0]["tampered"] == tamper
    calls = attacks_guarded(monkeypatch, tampered.path, TamperedInversion)  # the attack never reads truth/
    assert kept_patch_psnr(tampered) > 40 and calls == ["TamperedInversion"] * 2  # and on its power check


@pytest.mark.parametrize("family", ["invert", "labels"])
def test_a_tampered_attack_on_a_round_nobody_tampered_with_is_refused_in_one_line(tmp_path, micro_preset, capsys,
                                                                                   family):
    """Issue 34: its figures on an honest round (12.7 dB, an L1 worse than the prior) read as a measurement of
    nothing, with no word that nothing was tampered: refused, naming the round to attack where there is one."""
    from conftest import run_cli

    honest = train(tmp_path / "honest", config(micro_preset, model_check=False))
    late = train(tmp_path / "late", config(micro_preset, model_check=False, rounds=2, threat="malicious",
                                           tamper="label-probe", tamper_round=2))
    capsys.readouterr()  # the trainings' progress
    code, err = run_cli(capsys, "attack", family, honest.path, "--method", "tampered")
    assert code == 2 and err == (f"eftguard: error: {honest.path} was never tampered with: the tampered method reads "
                                 "a round whose model a malicious server crafted (eftguard train --threat malicious "
                                 "--tamper NAME); use another --method\n")
    code, err = run_cli(capsys, "attack", family, late.path, "--method", "tampered", "--round", "1")
    assert code == 2 and err.count("\n") == 1 and err.endswith(f"round 1 of {late.path} was not tampered with: the "
                                                                "tampered method reads the round a malicious server "
                                                                "crafted; attack --round 2\n")
    assert not (honest.path / "reports").exists() and not (late.path / "reports").exists()


@pytest.mark.parametrize("method", sorted(METHODS))
def test_the_model_check_passes_honest_rounds(tmp_path, micro_preset, caplog, method):
    caplog.set_level("INFO", logger="eftguard.client")
    run = train(tmp_path / "run", config(micro_preset, rounds=3, server_epochs=2, method=method))
    assert [r["dropped"] for r in run.metrics()] == [{}, {}, {}]
    passed = [r.getMessage() for r in caplog.records if "passed the check" in r.getMessage()]
    assert len(passed) == 6


def test_the_model_check_passes_honest_rounds_under_an_lr_schedule_and_with_canaries(tmp_path, micro_preset, caplog):
    """Warm-up and cosine change the lr each round and canaries add images (so steps) to a client: neither is a
    tampering. The check bounds by the run's peak lr and counts every canary a client may hold."""
    caplog.set_level("INFO", logger="eftguard.client")
    run = train(tmp_path / "run", config(micro_preset, rounds=3, warmup_rounds=2, lr_schedule="cosine", canaries=8,
                                         train_samples=32))
    assert [r["dropped"] for r in run.metrics()] == [{}, {}, {}]
    assert len([r for r in caplog.records if "passed the check" in r.getMessage()]) == 6


@pytest.mark.parametrize("tamper", sorted(TAMPERINGS))
@pytest.mark.parametrize("tamper_round", [1, 2])
def test_the_model_check_refuses_every_tampering_and_a_refused_round_uploads_nothing(tmp_path, micro_preset, tamper,
                                                                                      tamper_round):
    """Round 1 must send the run's initial model, which each node rebuilds itself from the configuration; round 2
    may have moved one round of training from it and from round 1's model. Every node refuses, the server records
    why, nothing of the round is stored, the other round is fine."""
    cfg = config(micro_preset, rounds=2, threat="malicious", tamper=tamper, tamper_round=tamper_round)
    run = RunDirectory.create(tmp_path / "run", cfg)
    run_server(FakeGrid(2, node_config={"model-check": True}), run.path, server_threat_of(cfg))
    records = run.metrics()
    assert records[tamper_round - 1]["tampered"] == tamper
    reasons = records[tamper_round - 1]["dropped"]
    assert sorted(reasons) == ["0", "1"]
    assert all(reason.startswith("client failed: client refuses: ") for reason in reasons.values())
    assert not (run.path / "observed" / f"round-{tamper_round:04d}").exists()
    assert records[2 - tamper_round]["dropped"] == {}


def test_trusting_the_first_model_refuses_only_a_crude_one(tmp_path, micro_preset):
    """The limit of trust on first use (trust-first-model): a first model that avoids exact zeros and isometries
    passes (stealth-embed), a crude one does not (identity-embed). By default the node rebuilds the initial model
    and refuses both (above)."""
    crude, stealthy = (RunDirectory.create(tmp_path / name, config(micro_preset, threat="malicious", tamper=name,
                                                                  tamper_round=1))
                       for name in ("identity-embed", "stealth-embed"))
    for run in (crude, stealthy):
        run_server(FakeGrid(2, node_config={"model-check": True, "trust-first-model": True}), run.path,
                   server_threat_of(run.config()))
    assert sorted(crude.metrics()[0]["dropped"]) == ["0", "1"]
    assert stealthy.metrics()[0]["dropped"] == {}


def test_a_run_from_a_checkpoint_needs_the_nodes_copy_of_it(tmp_path, micro_preset):
    """The initial model a node rebuilds from the configuration is the seeded one: a run that starts from a
    checkpoint is refused in round 1 unless the node holds that checkpoint (initial-model), as simulated nodes do."""
    from safetensors.torch import save_file

    checkpoint = tmp_path / "start.safetensors"
    save_file({k: v.contiguous() for k, v in build_model(micro_preset, 10, 2, seed=7).state_dict().items()},
              checkpoint)
    cfg = config(micro_preset, checkpoint=str(checkpoint))
    for name, node in (("blind", {}), ("holder", {"initial-model": str(checkpoint)})):
        run = RunDirectory.create(tmp_path / name, cfg)
        run_server(FakeGrid(2, node_config={"model-check": True, **node}), run.path)
        dropped = run.metrics()[0]["dropped"]
        if name == "blind":
            assert sorted(dropped) == ["0", "1"] and "copy: initial-model" in dropped["0"]
        else:
            assert dropped == {}


def test_a_label_probe_round_gives_the_class_counts_away(tmp_path, micro_preset, monkeypatch):
    """With one batch per local epoch (B >= n_k) the head update of a label-probe round holds the class fractions
    exactly: every count right. The same reading of another tampering's round is no better than the prior (n_k
    spread over the classes with uploads)."""
    tampered = train(tmp_path / "tampered", config(micro_preset, threat="malicious", tamper="label-probe",
                                                   model_check=False, batch_size=64))
    other = train(tmp_path / "other", config(micro_preset, threat="malicious", tamper="identity-embed",
                                             model_check=False, batch_size=64))
    calls = attacks_guarded(monkeypatch, tampered.path, TamperedHeadAttack)
    read = run_attack(tampered.path, "labels", "tampered").figures()
    assert calls == ["TamperedHeadAttack"] * 2  # the attack, then its power check on the same crafted model
    assert read["exact_count_accuracy"] == 1.0 and read["l1"] < 0.02 < read["baseline.l1"]
    assert read["control.l1"] < 0.02 < read["control_baseline.l1"]  # the control trains from the crafted start
    misread = run_attack(other.path, "labels", "tampered").figures()
    assert misread["l1"] > 0.99 * misread["baseline.l1"]


def test_dp_sgd_stops_the_label_probe(tmp_path, micro_preset, monkeypatch):
    """DP-SGD's noise (std sigma * C on every gradient) drowns the probe's 1e-11 gradients: the reading falls to
    the prior's error or worse, where without DP it was exact (above). The low stands: its power check trains
    public images from the tampered model the round was sent (not the server's own start model, from which the
    probe reads nothing on a trained model) and reads them exactly. On the micro ViT the start model's head reads
    the mix too, so the control's training is watched: it must start from the probe's final LayerNorm."""
    run = train(tmp_path / "dp", config(micro_preset, threat="malicious", tamper="label-probe", model_check=False,
                                        batch_size=64, dp_eps=1.0))
    starts, train_local = [], observe.train_local

    def watched(model, *args, **kwargs):
        norm = model.global_module.norm
        starts.append((norm.weight.detach().clone(), norm.bias.detach().clone()))
        return train_local(model, *args, **kwargs)

    monkeypatch.setattr(observe, "train_local", watched)
    report = run_attack(run.path, "labels", "tampered")
    read = report.figures()
    assert read["l1"] >= read["baseline.l1"]
    assert read["control.l1"] < 0.02 < read["control_baseline.l1"]
    assert "from the tampered model the round was sent" in report.details["power_check"]
    assert starts and all(bool((weight == 0).all()) and bool((bias == PROBE_SCALE).all()) for weight, bias in starts)


@pytest.mark.parametrize("argv, message", [
    (["--threat", "malicious"], "--threat malicious needs --tamper NAME, one of identity-embed, stealth-embed, "
                                "label-probe, imprint, class-fish, feature-fish; got ''"),
    (["--tamper", "identity-embed"], "--tamper and --tamper-round need --threat malicious"),
    (["--tamper-round", "2"], "--tamper and --tamper-round need --threat malicious"),
    (["--threat", "malicious", "--tamper", "identity-embed", "--rounds", "2", "--tamper-round", "3"],
     "--tamper-round must be in 1..--rounds (2) or 0 (the last), got 3"),
    (["--threat", "malicious", "--tamper", "identity-embed", "--method", "fedavg"],
     "--method fedavg uploads no features"),
    (["--threat", "malicious", "--tamper", "identity-embed", "--federation", "deployment", "--superlink", "h:1"],
     "--threat malicious is for measuring attacks in simulation only"),
    (["--threat", "evil"], "argument --threat: invalid choice: 'evil'"),
    (["--threat", "malicious", "--tamper", "nonsense"], "argument --tamper: invalid choice: 'nonsense'"),
])
def test_bad_threat_flags_are_one_clear_error_before_any_work(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and "Traceback" not in err
    assert len(err.strip().splitlines()[-1]) and not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, message", [
    (["--initial-model", "/nonexistent/start.safetensors"], "--initial-model /nonexistent/start.safetensors does not "
                                                            "exist"),
    (["--initial-model", "/dev/null", "--trust-first-model"], "--initial-model and --trust-first-model exclude "
                                                               "each other"),
])
def test_a_bad_initial_model_is_one_clear_error_before_the_node_starts(capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["supernode", "--superlink", "127.0.0.1:1", "--insecure", "--partition", "0", "--clients", "2", *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err.strip().splitlines()[-1] and "Traceback" not in err


def test_adams_step_bound_holds_for_gradients_built_to_break_it():
    """The drift limit rests on adam_step_bound: torch's AdamW (no decay) on one coordinate, with the gradients that
    maximise its step (growing by b2 / b1 each step: equality in Cauchy-Schwarz) and with a lone spike after
    zeros (Kingma and Ba's worst case), never steps beyond it; the growing gradients reach it."""
    import torch

    from eftguard.defenses.model_check import ADAM_BETAS, adam_step_bound

    b1, b2 = ADAM_BETAS
    steps = 1000
    shares = {}
    for case, gradients in {"growing": [(b2 / b1) ** t for t in range(steps)],
                            "spike": [0.0] * (steps - 1) + [1.0]}.items():
        weight = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        optimizer = torch.optim.AdamW([weight], lr=1.0, weight_decay=0.0, eps=1e-30)
        shares[case] = []
        for t, gradient in enumerate(gradients, start=1):
            before = float(weight.detach())
            weight.grad = torch.tensor([gradient], dtype=torch.float64)
            optimizer.step()
            shares[case].append(abs(float(weight.detach()) - before) / adam_step_bound(t))
    assert max(shares["growing"] + shares["spike"]) <= 1 + 1e-9
    assert shares["growing"][-1] > 0.999 and adam_step_bound(steps) > 3.2  # beyond Kingma and Ba's 3.16


def test_method_all_runs_only_what_a_curious_server_can(tmp_path, micro_preset, capsys):
    """The tampered attacks read a round the server crafted: on an honest run they are run only when named."""
    run = train(tmp_path / "run", config(micro_preset, model_check=False))
    main(["attack", "labels", str(run.path), "--out", str(tmp_path / "reports")])
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == [
        "labels-bias-corrected", "labels-head", "labels-linkage", "labels-llg", "labels-presence"]


def test_a_tampering_the_model_cannot_take_fails_before_any_round(tmp_path, micro_preset, monkeypatch):
    """A model with a pre-norm LayerNorm (it would drop each token's mean and scale) cannot be made an identity
    embedding: one clear error, before round 1."""
    from eftguard.attacks import tamper

    def pre_norm_found(state):
        raise tamper.TamperError("identity-embed needs a ViT without a pre-norm LayerNorm")

    monkeypatch.setattr(tamper, "_check_no_pre_norm", pre_norm_found)
    cfg = config(micro_preset, threat="malicious", tamper="identity-embed")
    run = RunDirectory.create(tmp_path / "run", cfg)
    with pytest.raises(FederationError, match="^--tamper identity-embed: identity-embed needs a ViT without"):
        run_server(FakeGrid(2), run.path, server_threat_of(cfg))
    assert run.metrics() == []


def test_simulated_nodes_forget_the_models_they_held_once_the_run_is_complete(tmp_path, micro_preset):
    cfg = config(micro_preset, model_check=False)
    run = train(tmp_path / "run", cfg)
    held = run.path / "nodes" / "received" / "model.npz"
    held.parent.mkdir(parents=True)
    held.write_bytes(b"x")
    forget_received_models(run.path, dataclasses.replace(cfg, rounds=2))  # a run that can go on keeps them
    assert held.exists()
    forget_received_models(run.path, cfg)
    assert not held.parent.exists() and (run.path / "nodes").is_dir()


def test_a_resent_round_must_be_unchanged_and_training_settings_must_not_change_mid_run(tmp_path):
    """A resumed server re-sends its round unchanged (passes); the same round with other weights, or a next round
    whose learning rate was raised to widen the drift limit, is refused."""
    from eftguard.defenses.model_check import ModelCheck, ModelCheckError
    from eftguard.federation.records import ClientSettings
    from eftguard.methods import method_spec

    settings = ClientSettings.from_config(TrainConfig(), 1, run_id="0" * 32)
    state = {"head.weight": np.full((2, 3), 0.1, dtype=np.float32)}
    check = ModelCheck(tmp_path, 0, initial_model=None)  # trust on first use: round 1's model is the anchor

    def verify(round_settings, received):
        return check.verify(round_settings, method_spec("eftvit"), received, [100, 50], 400)

    verify(settings, state)
    verify(settings, state)  # re-sent, unchanged
    with pytest.raises(ModelCheckError, match="'head.weight' moved by up to 0.001 from the first model this node "
                                              "trusted, more than 0 round"):
        verify(settings, {"head.weight": state["head.weight"] + np.float32(1e-3)})
    raised = dataclasses.replace(settings, round=2, lr=1.0, peak_lr=1.0)
    with pytest.raises(ModelCheckError, match=r"the server changed the settings \['peak_lr'\] mid-run"):
        verify(raised, state)
    with pytest.raises(ModelCheckError, match=r"the round's lr 1.0 exceeds the run's --lr 0.001"):
        verify(dataclasses.replace(settings, round=2, lr=1.0), state)


@pytest.mark.parametrize("family, options", [("invert", ["--max-images", "3", "--lpips-backend", "stlpips-alex"]),
                                             ("labels", [])])
def test_the_api_and_the_cli_write_the_same_tampered_report(tmp_path, micro_preset, family, options):
    run = train(tmp_path / "run", config(micro_preset, threat="malicious", tamper="identity-embed",
                                         model_check=False))
    main(["attack", family, str(run.path), "--method", "tampered", "--out", str(tmp_path / "cli"), *options])
    keywords = {o.lstrip("-").replace("-", "_"): v for o, v in zip(options[::2], options[1::2])}
    run_attack(run.path, family, "tampered", out=tmp_path / "api", **keywords)
    reports = [json.loads((tmp_path / side / f"{family}-tampered" / "report.json").read_text())
               for side in ("cli", "api")]
    for report in reports:
        del report["details"]["attack_seconds"]
    assert reports[0] == reports[1] and reports[0]["capabilities"]["server"] == "malicious"
