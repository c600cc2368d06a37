"""headprune-lora wired into the real client and server: pruned heads are neither computed, trained nor uploaded,
the server averages each head over the clients that kept it weighted by their importance (checked against the
formula written out here), loss-gap selection picks the clients the issue names, and hostile head records are
dropped with a reason."""

import re

import numpy as np
import pytest
import torch
from flwr.app import Message, Metadata, RecordDict
from torch.utils.flop_counter import FlopCounterMode

from eftguard.bench import step_memory, upload_bytes
from eftguard.cli import main
from eftguard.config import TrainConfig
from eftguard.data.plan import client_partition, run_dataset
from eftguard.federation.client import client_round
from eftguard.federation.records import ClientSettings, UploadError
from eftguard.federation.server import parse_reply, run_server, upload_spec
from eftguard.headprune import keep_only, model_head_importance, pruned
from eftguard.methods import METHODS
from eftguard.model import build_model
from eftguard.rundir import RunDirectory
from eftguard.training import mean_loss
from conftest import MICRO_PRESET, random_images, run_cli, train_in_process
from fakegrid import FakeGrid, task_identity
from replies import FLOAT_EDITS, INT_EDITS, by_name, edit_array, encode, plain, set_one, with_part

pytestmark = pytest.mark.usefixtures("micro_preset")

TINY = dict(model=MICRO_PRESET, method="headprune-lora", train_samples=48, test_samples=8, batch_size=16,
            lora_rank=4)
OPTIONS = TrainConfig(lora_rank=4)
LOCAL_LAYERS = 2  # TrainConfig's default M: blocks 0-1 in phi, 2-3 in theta


def position(name: str) -> tuple[int, int] | None:
    """(layer, head) of a per-head LoRA parameter, read from its name (phi's blocks first); None for others."""
    match = re.fullmatch(r"(local|global)_module\.blocks\.(\d+)\.attn\.head_lora\.(\d+)\.\w+\.weight", name)
    if not match:
        return None
    return int(match[2]) + (LOCAL_LAYERS if match[1] == "global" else 0), int(match[3])


# --- the model: a pruned head is not computed, not trained ---------------------------------------------------

def test_a_pruned_head_is_left_out_of_the_forward_and_gets_no_gradient():
    """Head 1 of every layer pruned: the output is the base model's with head 1's proj columns zeroed (its
    contribution), computed with fewer FLOPs; head 1's factors get no gradient, head 0's B does."""
    base = build_model(MICRO_PRESET, 10, LOCAL_LAYERS, seed=3).eval()
    model = build_model(MICRO_PRESET, 10, LOCAL_LAYERS, seed=3, adapt=METHODS["headprune-lora"].model_adapter(OPTIONS))
    model.eval()
    x = random_images()
    with torch.no_grad():
        assert torch.equal(model(x), base(x))  # all heads, B = 0: the base model exactly
    kept = torch.tensor([[True, False]] * 4)
    head_dim = 32  # width 64, 2 heads
    with torch.no_grad():
        for block in [*base.local_module.blocks, *base.global_module.blocks]:
            block.attn.proj.weight[:, head_dim:] = 0
    with FlopCounterMode(display=False) as full:
        model(x)
    with pruned(model, kept):
        with FlopCounterMode(display=False) as fewer:
            out = model(x)
        torch.testing.assert_close(out, base(x), rtol=1e-5, atol=1e-5)
        out.logsumexp(dim=1).sum().backward()
    assert fewer.get_total_flops() < full.get_total_flops()
    for name, parameter in model.named_parameters():
        where = position(name)
        if where and where[1] == 1:
            assert parameter.grad is None, name
        elif where and ".qkv_b." in name:
            assert parameter.grad.abs().sum() > 0, name
    assert all(p.requires_grad for p in model.parameters())  # pruned() gives the frozen factors back
    assert all(block.attn.kept is None for block in [*model.local_module.blocks, *model.global_module.blocks])


# --- two real rounds: upload, aggregation ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_rounds(tmp_path_factory, micro_preset):
    """Three clients, two rounds, s = 0.5 (one of two heads kept per layer)."""
    return RunDirectory.open(train_in_process(tmp_path_factory.mktemp("headprune") / "run", clients=3, rounds=2,
                                              head_sparsity=0.5, **TINY))


def test_clients_upload_only_their_kept_heads_and_the_server_averages_each_head_by_importance(two_rounds):
    run = two_rounds
    before, after = run.load_checkpoint(1), run.load_checkpoint(2)
    record = run.metrics()[1]
    clients = record["clients"]
    assert clients == [0, 1, 2] and record["dropped"] == {}
    uploads = {k: run.load_upload(2, k, "update") for k in clients}
    heads = {k: run.load_upload(2, k, "heads") for k in clients}
    expected = {}
    for k in clients:
        assert heads[k]["importance"].shape == (4, 2) and heads[k]["kept"].shape == (4, 1)
        kept = {(layer, int(head)) for layer, (head,) in enumerate(heads[k]["kept"])}
        owned = {name for name in before if name.startswith("head.") or position(name) in kept}
        assert set(uploads[k]) == owned  # the kept heads' factors and the classifier, nothing else
        assert record["upload_bytes"][str(k)] == sum(a.nbytes for part in (uploads[k], heads[k]) for a in part.values())
    for name in before:
        where = position(name)
        if name.startswith("head."):  # the classifier: FedAvg by sample count
            counts = [record["num_examples"][str(k)] for k in clients]
            expected[name] = sum(n * uploads[k][name].astype(np.float64) for n, k in zip(counts, clients)) / sum(counts)
        elif where:
            keepers = [k for k in clients if name in uploads[k]]
            alpha = {k: float(heads[k]["importance"][where]) for k in keepers}
            total = sum(alpha.values()) + 1e-8
            expected[name] = (sum(alpha[k] / total * uploads[k][name].astype(np.float64) for k in keepers)
                              if keepers else before[name].numpy())
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed <= set(expected)  # nothing but the classifier and the per-head LoRA moved
    assert any(position(name) and name.endswith(("qkv_b.weight", "proj_b.weight")) for name in changed)
    for name, value in expected.items():
        np.testing.assert_allclose(after[name].numpy(), value, rtol=1e-5, atol=1e-7, err_msg=name)


def test_a_client_reports_the_importance_of_the_model_it_received_and_keeps_its_top_heads(two_rounds):
    run = two_rounds
    cfg = run.config()
    model = run.start_model(2)  # the global model of round 2's start: checkpoint 1
    model.load_state_dict(run.load_checkpoint(1))
    data = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).train
    mine = data.subset(client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed,
                                        cfg.clients, cfg.beta)[1])
    alpha = model_head_importance(model, model.normalize(torch.from_numpy(mine.images)))
    heads = run.load_upload(2, 1, "heads")
    torch.testing.assert_close(torch.from_numpy(heads["importance"]), alpha.clamp(min=0))
    assert heads["kept"][:, 0].tolist() == alpha.argmax(dim=1).tolist()


def test_weighting_by_samples_and_random_pruning_are_the_ablations(tmp_path):
    run = RunDirectory.open(train_in_process(tmp_path / "run", clients=2, rounds=1, head_sparsity=0.5,
                                             head_pruning="random", head_weighting="samples", **TINY))
    before, after = run.load_checkpoint(0), run.load_checkpoint(1)
    record = run.metrics()[0]
    uploads = {k: run.load_upload(1, k, "update") for k in (0, 1)}
    importance = {k: run.load_upload(1, k, "heads")["importance"] for k in (0, 1)}
    kept = {k: run.load_upload(1, k, "heads")["kept"][:, 0] for k in (0, 1)}
    assert any(kept[k].tolist() != importance[k].argmax(axis=1).tolist() for k in (0, 1))  # not by importance
    counts = {k: record["num_examples"][str(k)] for k in (0, 1)}
    for name in before:
        where = position(name)
        if where:
            keepers = [k for k in (0, 1) if name in uploads[k]]
            expected = (sum(counts[k] * uploads[k][name].astype(np.float64) for k in keepers)
                        / (sum(counts[k] for k in keepers) + 1e-8) if keepers else before[name].numpy())
            np.testing.assert_allclose(after[name].numpy(), expected, rtol=1e-5, atol=1e-7, err_msg=name)


# --- loss-gap selection ---------------------------------------------------------------------------------------

def test_loss_gap_selection_picks_the_unseen_client_then_the_largest_reported_gap(tmp_path):
    """Four clients, two per round. Round 1 is seeded random; in round 2 the two unseen clients come first; in
    round 3 the two largest gaps local loss - received model's loss, from each client's last report."""
    run = RunDirectory.open(train_in_process(tmp_path / "run", clients=4, clients_per_round=2, rounds=3,
                                             client_selection="loss-gap", **TINY))
    first, second, third = run.metrics()
    assert sorted(second["clients"]) == sorted(set(range(4)) - set(first["clients"]))
    gaps = {int(k): first["local_losses"][k] - first["global_losses"][k] for k in first["global_losses"]}
    gaps |= {int(k): second["local_losses"][k] - second["global_losses"][k] for k in second["global_losses"]}
    assert third["clients"] == sorted(sorted(gaps, key=lambda k: -gaps[k])[:2])
    assert len(set(gaps.values())) == 4  # no ties, so the order above is the only one
    cfg = run.config()
    data = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed).train
    model = run.start_model(1)
    for k in first["clients"]:  # what the client reported: the received model's loss on its own data
        mine = data.subset(client_partition(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.seed,
                                            cfg.clients, cfg.beta)[k])
        assert first["global_losses"][str(k)] == pytest.approx(
            mean_loss(model, torch.from_numpy(mine.images), torch.from_numpy(mine.labels)), rel=1e-6)


# --- hostile replies ------------------------------------------------------------------------------------------

CFG = TrainConfig(clients=3, clients_per_round=2, client_selection="loss-gap", head_sparsity=0.5, **TINY)


@pytest.fixture(scope="module")
def honest(micro_preset):
    cfg = CFG.resolved()
    dataset = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, 0, cfg.seed)
    model = build_model(cfg.model, dataset.num_classes, cfg.local_layers,
                        adapt=METHODS["headprune-lora"].model_adapter(cfg))
    upload = client_round(ClientSettings.from_config(cfg, 1), {k: v.numpy() for k, v in model.state_dict().items()},
                          1, cfg.clients)
    metrics = {"partition-id": 1, "num-examples": upload.num_examples, "loss": upload.loss,
               "epoch-seconds": upload.epoch_seconds, "epoch-cpu-seconds": upload.epoch_cpu_seconds,
               "feature-seconds": upload.feature_seconds, "global-loss": upload.global_loss}
    content = {"update": upload.update, "heads": upload.heads, "metrics": metrics}
    return content, upload_spec(model, cfg, dataset), upload


def reply(content: RecordDict) -> Message:
    metadata = Metadata(run_id=1, message_id="m", src_node_id=101, dst_node_id=0, reply_to_message_id="q",
                        group_id="", created_at=0.0, ttl=60.0, message_type="train")
    return Message(content=content, metadata=metadata)


def pruned_factor(content):
    """A per-head factor the client pruned (it must not be uploaded)."""
    layer0 = int(content["heads"]["kept"][0, 0])
    return f"local_module.blocks.0.attn.head_lora.{1 - layer0}.qkv_b.weight"


HOSTILE_HEADS = {
    **{f"importance {edit}": ("heads", edit_array("heads", by_name("importance"), fn))
       for edit, fn in FLOAT_EDITS.items()},
    "importance -1": ("importance", edit_array("heads", by_name("importance"), set_one(-1.0))),
    "importance 1e5": ("MAX_IMPORTANCE", edit_array("heads", by_name("importance"), set_one(1e5))),
    **{f"kept {edit}": ("heads", edit_array("heads", by_name("kept"), fn)) for edit, fn in INT_EDITS.items()},
    "kept head 2 of 2": ("kept", edit_array("heads", by_name("kept"), set_one(2))),
    "kept twice": ("kept", lambda c, rng: with_part(c, "heads", {**c["heads"], "kept": np.repeat(
        c["heads"]["kept"], 2, axis=1)})),
    "no heads record": ("heads", lambda c, rng: encode({k: v for k, v in c.items() if k != "heads"})),
    "pruned head uploaded": ("update", lambda c, rng: with_part(c, "update", {
        **c["update"], pruned_factor(c): np.zeros((96, 4), np.float32)})),
    "kept head missing": ("update", lambda c, rng: with_part(c, "update", {
        k: v for k, v in c["update"].items() if ".head_lora." not in k or not k.endswith("proj_a.weight")})),
    "kept head NaN": ("NaN", lambda c, rng: with_part(c, "update", {
        k: np.full_like(v, np.nan) if ".head_lora." in k else v for k, v in c["update"].items()})),
    "no global-loss": ("global-loss", lambda c, rng: with_part(c, "metrics", {
        k: v for k, v in c["metrics"].items() if k != "global-loss"})),
    "global-loss NaN": ("global-loss", lambda c, rng: with_part(c, "metrics", {
        **c["metrics"], "global-loss": float("nan")})),
    "global-loss -1": ("global-loss", lambda c, rng: with_part(c, "metrics", {**c["metrics"], "global-loss": -1.0})),
}


@pytest.mark.parametrize("name", HOSTILE_HEADS)
def test_a_hostile_head_record_or_update_is_refused_with_a_reason(honest, name):
    content, spec, _ = honest
    accepted, _ = parse_reply(reply(encode(content)), 1, spec, "headprune-lora", record_truth=False)
    assert accepted.global_loss == content["metrics"]["global-loss"] and accepted.heads is not None
    reason, mutate = HOSTILE_HEADS[name]
    with pytest.raises(UploadError) as refused:
        parse_reply(reply(mutate(content, np.random.default_rng(0))), 1, spec, "headprune-lora", record_truth=False)
    assert reason in str(refused.value) and "\n" not in str(refused.value)


def test_a_client_claiming_a_huge_importance_is_dropped_and_the_honest_one_sets_the_heads(tmp_path):
    def tamper(node, message):
        if node != 100 or message.metadata.message_type != "train":
            return message
        content = plain(message.content)
        content["heads"]["importance"] = np.full_like(content["heads"]["importance"], 1e9)
        return Message(content=encode(content), metadata=message.metadata)

    cfg = TrainConfig(clients=2, rounds=1, head_sparsity=0.5, **TINY).resolved()
    run = RunDirectory.create(tmp_path / "run", cfg)
    with task_identity():
        run_server(FakeGrid(cfg.clients, tamper=tamper), run.path)
    record = run.metrics()[0]
    assert record["dropped"] == {"0": "heads 'importance' must be finite and in [0, 10000] (MAX_IMPORTANCE)"}
    honest_update, after = run.load_upload(1, 1, "update"), run.load_checkpoint(1)
    for name, value in honest_update.items():  # alone on its heads: alpha / (alpha + 1e-8) of its factors
        np.testing.assert_allclose(after[name].numpy(), value, rtol=1e-5, atol=1e-8, err_msg=name)


# --- the command line -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--head-sparsity", "1"], "--head-sparsity must be in [0, 1) (fraction of each layer's heads a client prunes; "
                               "at least one is kept), got 1.0"),
    (["--client-selection", "loss-gap", "--clients", "4"],
     "--client-selection loss-gap picks --clients-per-round of the --clients: set --clients-per-round below 4"),
    (["--client-selection", "loss-gap", "--clients", "4", "--clients-per-round", "2", "--dp-eps", "8"],
     "--client-selection loss-gap: with --dp-eps clients report no loss (it is not noised) and no client can know "
     "its rounds in advance for its budget; use random"),
])
def test_head_pruning_options_that_cannot_work_are_refused_in_one_line(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--out", str(tmp_path / "run"), "--method", "headprune-lora", *argv])
    assert exit_info.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"eftguard: error: {message}"


def test_cli_trains_headprune_lora_one_round_and_the_gradient_attack_reads_its_upload(capsys, tmp_path,
                                                                                      in_process_simulation):
    """vit-tiny-32 (3 heads per layer) at s = 0.5: two heads kept per layer, their rank-2 factors uploaded."""
    run_path = tmp_path / "run"
    code, err = run_cli(capsys, "train", "--out", run_path, "--method", "headprune-lora", "--head-sparsity", 0.5,
                        "--lora-rank", 2, "--rounds", 1, "--clients", 2, "--train-samples", 40, "--test-samples", 8,
                        "--batch-size", 16)
    assert code == 0, err
    run = RunDirectory.open(run_path)
    heads, update = run.load_upload(1, 0, "heads"), run.load_upload(1, 0, "update")
    assert heads["importance"].shape == (12, 3) and heads["kept"].shape == (12, 2)
    kept = int(heads["kept"][0, 0])
    assert update[f"local_module.blocks.0.attn.head_lora.{kept}.qkv_a.weight"].shape == (2, 192)
    assert update[f"local_module.blocks.0.attn.head_lora.{kept}.proj_b.weight"].shape == (192, 2)
    assert len(update) == 12 * 2 * 4 + 2  # four factors of each kept head, and the classifier
    code, err = run_cli(capsys, "attack", "gradient", run_path, "--observe", "upload", "--method", "idlg",
                        "--steps", 2, "--lpips-backend", "stlpips-alex", "--out", tmp_path / "reports")
    assert code == 0, err


def test_the_bench_counts_only_the_kept_heads_upload_and_memory():
    """eftguard bench prunes as a client does: the kept heads' factors (and the classifier) are uploaded and hold
    gradients and AdamW moments; the head record adds float32 importances and int64 ids."""
    spec = METHODS["headprune-lora"]
    model = build_model(MICRO_PRESET, 10, LOCAL_LAYERS, adapt=spec.model_adapter(OPTIONS))
    keep_only(model, torch.tensor([[True, False]] * 4))
    kept_factors = [name for name, _ in model.named_parameters() if position(name) and position(name)[1] == 0]
    trained = sum(p.numel() * 4 for name, p in model.named_parameters()
                  if name.startswith("head.") or name in kept_factors)
    assert len(kept_factors) == 4 * 4  # four factors of head 0 in each of the four layers
    assert upload_bytes(model, spec, 0.0, [], 10, "median", 0)["parameters"] == trained + 4 * 2 * 4 + 4 * 1 * 8
    assert step_memory(model, spec, 0)["gradients"] == trained
