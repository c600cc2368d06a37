"""The federated PEFT baselines (fed-head, fed-bias, fed-prompt, fed-lora): each trains through the real client and
server from one pretrained checkpoint, changes and uploads only its own parameters, and starts as the
checkpoint's model; the LoRA and prompt modules compute what they claim; the CLI and the gradient attack take
their runs."""

import copy
import json
import types

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from eftguard.aggregate import fedavg
from eftguard.cli import main
from eftguard.defenses.clipping import make_private
from eftguard.defenses.dp import DPSGD
from eftguard.defenses.ledger import PrivacyLedger
from eftguard.federation.apps import default_ledger_dir
from eftguard.headprune import (head_importance, importance_weighted_average, kept_heads, loss_gap_selection,
                                model_head_importance)
from eftguard.methods import METHODS, method_spec
from eftguard.model import build_model
from eftguard.peft import LoRALinear, lora_averaging_gap
from eftguard.rundir import RunDirectory
from conftest import MICRO_DEPTH, MICRO_PRESET, MICRO_WIDTH, random_images, run_cli, train_in_process

pytestmark = pytest.mark.usefixtures("micro_preset")  # the methods' mechanics do not depend on the model's size

PEFT = ("fed-head", "fed-bias", "fed-prompt", "fed-lora")
OPTIONS = types.SimpleNamespace(lora_rank=4, prompt_tokens=3)
TINY = dict(model=MICRO_PRESET, train_samples=32, test_samples=8, batch_size=16, rounds=2, lora_rank=4, prompt_tokens=3)


def own_parameter(method: str, name: str) -> bool:
    """What each method trains, written out independently of the method table."""
    return name.startswith("head.") or {
        "fed-head": False,
        "fed-bias": name.endswith(".bias"),
        "fed-prompt": name == "local_module.prompt_tokens.tokens",
        "fed-lora": name.endswith((".attn.qkv.lora_a", ".attn.qkv.lora_b", ".attn.proj.lora_a", ".attn.proj.lora_b")),
    }[method]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, micro_preset):
    """A 'pretrained' base model (another seed than any run's) saved as a checkpoint, and its path."""
    model = build_model(MICRO_PRESET, 10, 2, seed=7).eval()
    path = tmp_path_factory.mktemp("pretrained") / "ckpt.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return model, path


@pytest.mark.parametrize("method", PEFT)
def test_each_method_trains_two_rounds_from_the_checkpoint_changing_and_uploading_only_its_own_parameters(
        tmp_path, pretrained, method):
    base, path = pretrained
    run = RunDirectory.open(train_in_process(tmp_path / method, method=method, checkpoint=str(path), **TINY))
    start, end = run.load_checkpoint(0), run.load_checkpoint(2)
    assert all(torch.equal(start[k], v) for k, v in base.state_dict().items())  # the pretrained start
    own = {k for k in start if own_parameter(method, k)}
    assert own and own == set(method_spec(method).uploaded_state(run.start_model(1)))
    assert {k for k in start if not torch.equal(start[k], end[k])} == own
    record = run.metrics()[1]
    uploads = [run.load_upload(2, k, "update") for k in range(2)]
    assert all(set(u) == own for u in uploads)
    assert record["feature_sets"] == {} and record["server_loss"] is None
    assert record["upload_bytes"]["0"] == sum(a.nbytes for a in uploads[0].values())
    averaged = fedavg(uploads, [record["num_examples"][str(k)] for k in range(2)])
    assert all(torch.equal(end[k], torch.from_numpy(v)) for k, v in averaged.items())


@pytest.mark.parametrize("method", METHODS)
def test_the_pretrained_checkpoint_loads_into_every_method_and_gives_its_forward(pretrained, method):
    """Before training, phi -> theta -> h of every method is the checkpoint's model (fed-prompt: once its prompt
    tokens are taken out, since prompts change the output by design)."""
    base, path = pretrained
    model = build_model(MICRO_PRESET, 10, 2, checkpoint=path, seed=0,
                        adapt=method_spec(method).model_adapter(OPTIONS)).eval()
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in base.state_dict().items())
    model.local_module.prompt_tokens = None
    with torch.no_grad():
        assert torch.equal(model(random_images()), base(random_images()))


def test_lora_with_zero_b_is_the_base_layer_and_with_trained_factors_the_merged_weight(pretrained):
    base, _ = pretrained
    model = build_model(MICRO_PRESET, 10, 2, seed=7, adapt=METHODS["fed-lora"].model_adapter(OPTIONS)).eval()
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert len(layers) == 2 * MICRO_DEPTH and all(layer.rank == 4 for layer in layers)
    with torch.no_grad():
        assert torch.equal(model(random_images()), base(random_images()))
        merged = build_model(MICRO_PRESET, 10, 2, seed=7).eval()
        merged_layers = dict(merged.named_modules())
        for name, layer in model.named_modules():
            if isinstance(layer, LoRALinear):
                layer.lora_b.normal_(0, 0.05)
                merged_layers[name].weight += layer.lora_b @ layer.lora_a
        adapted = model(random_images())
        assert not torch.allclose(adapted, base(random_images()), atol=1e-3)
        torch.testing.assert_close(adapted, merged(random_images()), rtol=1e-4, atol=1e-5)


def test_prompt_tokens_change_the_output_only_through_the_added_tokens(pretrained):
    base, _ = pretrained
    model = build_model(MICRO_PRESET, 10, 2, seed=7, adapt=METHODS["fed-prompt"].model_adapter(OPTIONS)).eval()
    tokens = model.local_module.prompt_tokens.tokens
    assert tokens.shape == (1, 3, MICRO_WIDTH)
    assert set(model.state_dict()) - set(base.state_dict()) == {"local_module.prompt_tokens.tokens"}
    x = random_images()
    prompted = model(x)
    assert not torch.allclose(prompted, base(x), atol=1e-3)
    assert model.local_module(x).shape[1] == 1 + 3 + 64  # cls, prompts, every patch
    (gradient,) = torch.autograd.grad(prompted.sum(), tokens)
    assert gradient.abs().sum() > 0
    with torch.no_grad():
        tokens.zero_()
        assert not torch.allclose(model(x), prompted, atol=1e-4)  # the tokens' values matter
        model.local_module.prompt_tokens = None
        assert torch.equal(model(x), base(x))


def test_averaging_lora_factors_misses_their_covariance():
    """Two clients, rank-1 scalar factors (A, B) = (1, 1) and (3, 3), equal weights: the average of the products
    is 5, the product of the averages 4; the gap is the covariance sum_k w_k (B_k - B)(A_k - A) = 1, i.e. 1/5."""
    uploads = [{"x.lora_a": np.array([[a]]), "x.lora_b": np.array([[a]])} for a in (1.0, 3.0)]
    assert lora_averaging_gap(uploads, [10, 10]) == {"x": pytest.approx(0.2)}
    start = {"x.lora_a": np.array([[2.0]]), "x.lora_b": np.array([[2.0]])}  # the round's update: 5 - 4 = 1
    assert lora_averaging_gap(uploads, [10, 10], start) == {"x": pytest.approx(1.0)}
    same_b = [{"x.lora_a": np.array([[a, 2 * a]]), "x.lora_b": np.array([[1.0], [2.0]])} for a in (1.0, 3.0)]
    assert lora_averaging_gap(same_b, [1, 3]) == {"x": pytest.approx(0.0, abs=1e-12)}  # shared B: averaging is exact


@pytest.mark.parametrize("argv, message", [
    (["--lora-rank", "0"], "--lora-rank must be > 0, got 0"),
    (["--prompt-tokens", "0"], "--prompt-tokens must be > 0, got 0"),
    (["--lora-rank", "193"], "--lora-rank must be between 1 and the model's width 192, got 193"),
])
def test_peft_sizes_that_cannot_work_are_refused_in_one_line(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--out", str(tmp_path / "run"), "--method", "fed-lora", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and not (tmp_path / "run").exists()
    assert err.strip().splitlines()[-1] == f"eftguard: error: {message}"


def test_cli_trains_fed_lora_at_rank_4_and_the_gradient_attack_reads_its_upload(capsys, tmp_path,
                                                                                  in_process_simulation):
    run_path = tmp_path / "run"
    code, err = run_cli(capsys, "train", "--out", run_path, "--method", "fed-lora", "--lora-rank", "4",
                        "--rounds", 1, "--clients", 2, "--train-samples", 40, "--test-samples", 8, "--batch-size", 16)
    assert code == 0, err
    run = RunDirectory.open(run_path)
    upload = run.load_upload(1, 0, "update")
    assert upload["local_module.blocks.0.attn.qkv.lora_a"].shape == (4, 192)
    assert upload["global_module.blocks.9.attn.proj.lora_b"].shape == (192, 4)
    code, err = run_cli(capsys, "attack", "gradient", run_path, "--observe", "upload", "--method", "idlg",
                        "--steps", 2, "--lpips-backend", "stlpips-alex", "--out", tmp_path / "reports")
    assert code == 0, err
    report = json.loads((tmp_path / "reports" / "gradient-idlg" / "report.json").read_text())
    assert report["metrics"]["psnr"]["n"] == 1 and "treated as one gradient" in report["details"]["observation"]
    code, err = run_cli(capsys, "attack", "gradient", run_path, "--observe", "upload",
                        "--lpips-backend", "stlpips-alex", "--out", tmp_path / "refused")  # the default --method: analytic
    assert code == 2 and not (tmp_path / "refused").exists()
    assert err.strip().splitlines()[-1] == (
        "eftguard: error: the analytic attack reads the gradient of local_module.token_embedding.pos_embed, "
        "local_module.patch_embed.proj.weight, which a fed-lora client neither trains nor uploads: use --method "
        "dlg or idlg or ig or updates")


# --- headprune-lora's pure parts (wired into client and server: tests/test_headprune.py) -------------------------

def test_head_importance_is_the_sample_mean_of_the_largest_scaled_query_key_product():
    """Two samples, two heads, two tokens, d_h = 4 (scale 1/2). Head 0: the largest q.k is 2 in sample 0 and 3 in
    sample 1, so alpha = (1 + 1.5) / 2; head 1: every product is <= 0, the largest 0 (the zero query)."""
    queries, keys = torch.zeros(2, 2, 2, 4), torch.zeros(2, 2, 2, 4)
    queries[0, 0, 0, 0], keys[0, 0, 1, 0] = 1.0, 2.0
    queries[1, 0, 1, 1], keys[1, 0, 0, 1], keys[1, 0, 1, 1] = 3.0, 1.0, -1.0
    queries[:, 1, 0, 2], keys[:, 1, :, 2] = 1.0, -5.0
    assert head_importance(queries, keys).tolist() == [1.25, 0.0]


def test_model_head_importance_reads_q_and_k_of_every_block_averaged_over_all_images(tiny_model):
    x = random_images(5)
    model = copy.deepcopy(tiny_model)
    alpha = model_head_importance(model, x, batch_size=3)  # batches of 3 and 2, weighted by their size
    assert alpha.shape == (12, 3)
    block = model.global_module.blocks[0]  # block 2 of the ViT
    seen = {}
    hook = block.norm1.register_forward_hook(lambda module, inputs, output: seen.setdefault("x", output))
    with torch.no_grad():
        model(x)
    hook.remove()
    qkv = block.attn.qkv(seen["x"]).reshape(5, 65, 3, 3, 64).permute(2, 0, 3, 1, 4)
    torch.testing.assert_close(alpha[2], head_importance(qkv[0], qkv[1]))


def test_each_client_keeps_the_top_fraction_of_heads_per_layer_and_at_least_one():
    scores = torch.tensor([[0.1, 0.5, 0.3], [3.0, 2.0, 1.0]])
    assert kept_heads(scores, 0.9).tolist() == [[False, True, False], [True, False, False]]
    assert kept_heads(scores, 0.5).tolist() == [[False, True, True], [True, True, False]]
    with pytest.raises(ValueError, match=r"head sparsity must be in \[0, 1\), got 1.0"):
        kept_heads(scores, 1.0)


def test_importance_weighted_aggregation_averages_each_head_over_the_clients_that_kept_it():
    updates = torch.tensor([[1.0, 10.0], [3.0, 20.0], [5.0, 30.0]])  # [clients, heads]
    importance = torch.tensor([[1.0, 1.0], [3.0, 2.0], [0.5, 4.0]])
    current = torch.tensor([7.0, 99.0])
    kept = torch.tensor([[True, False], [True, False], [False, False]])
    torch.testing.assert_close(importance_weighted_average(updates, importance, kept, current),
                               torch.tensor([(1 * 1 + 3 * 3) / 4, 99.0]))  # head 1: nobody kept it
    kept = torch.tensor([[True, True], [True, False], [False, True]])
    torch.testing.assert_close(importance_weighted_average(updates, importance, kept, current),
                               torch.tensor([2.5, (1 * 10 + 4 * 30) / 5]))
    matrices = updates[:, :, None, None].expand(3, 2, 2, 2)  # a head's LoRA rows: the same weights apply to each
    assert importance_weighted_average(matrices, importance, kept, current[:, None, None].expand(2, 2, 2)).shape \
        == (2, 2, 2)


def test_loss_gap_selection_picks_the_clients_whose_local_loss_most_exceeds_the_global_models():
    local = {0: 2.0, 1: 1.0, 2: 3.0, 3: 0.5}
    global_ = {0: 1.0, 1: 1.5, 2: 2.9, 3: 0.1}  # gaps 1.0, -0.5, 0.1, 0.4
    assert loss_gap_selection(local, global_, 2) == [0, 3]
    assert loss_gap_selection(local, global_, 3) == [0, 2, 3]


# --- DP-SGD for the PEFT methods ------------------------------------------------------------------------------

def seeded_batch(size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randint(0, 256, (size, 32, 32, 3), generator=generator, dtype=torch.uint8),
            torch.randint(0, 10, (size,), generator=generator))


@pytest.mark.parametrize("method", (*PEFT, "headprune-lora"))
def test_the_dp_step_of_each_peft_method_is_the_mean_of_its_clipped_per_sample_gradients(method):
    """Per-sample clipping as the client trains (make_private), at zero noise, against a one-sample-at-a-time loop, with
    a clipping norm between the middle two of four per-sample norms: a wrong norm clips the wrong samples. LoRA's
    B factors are drawn non-zero so that every factor has a gradient; headprune-lora keeps head 0 of each layer."""
    spec = method_spec(method)
    model = build_model(MICRO_PRESET, 10, 2, seed=0, adapt=spec.model_adapter(OPTIONS)).train()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("lora_b", "qkv_b.weight", "proj_b.weight")):
                parameter.normal_(0, 0.1)
            parameter.requires_grad_(spec.trains_parameter(name))
    images, labels = seeded_batch()
    with spec.heads.training(model, torch.tensor([[True, False]] * MICRO_DEPTH)):
        x = model.normalize(images)
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        reference = []
        for i in range(len(labels)):
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x[i:i + 1]), labels[i:i + 1]).backward()
            reference.append({name: p.grad.clone() for name, p in trained})
        model.zero_grad(set_to_none=True)
        norms = torch.stack([torch.sqrt(sum((g * g).sum() for g in r.values())) for r in reference])
        clip = float(norms.sort().values[1:3].mean())
        optimizer = torch.optim.SGD([p for _, p in trained], lr=0.0)
        wrapped, dp_optimizer, criterion, _ = make_private(model, optimizer, DPSGD(0.0, clip, 1.0, 0), len(labels))
        criterion(wrapped(x), labels).backward()
        dp_optimizer.step()
        for name, p in trained:
            expected = sum(r[name] * min(1.0, clip / float(n)) for r, n in zip(reference, norms)) / len(labels)
            torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6, msg=name)
        wrapped.to_standard_module()


def test_a_fed_lora_dp_round_is_noised_recorded_in_each_clients_ledger_and_reported(tmp_path, pretrained):
    _, path = pretrained
    run = RunDirectory.open(train_in_process(tmp_path / "run", method="fed-lora", checkpoint=str(path), dp_eps=3.0,
                                             accountant="rdp", **{**TINY, "rounds": 1}))
    record = run.metrics()[0]
    assert record["dropped"] == {} and record["epsilon_features"] is None
    for k in (0, 1):
        terms, spends = PrivacyLedger(default_ledger_dir(), k).read(run.run_id)
        assert [(s.round, s.channel, s.noise_multiplier) for s in spends] == [
            (1, "parameters", record["noise_multiplier"][str(k)])]
        assert (terms.declared_epsilon, terms.feature_share) == (3.0, 0.0) and 0 < record["epsilon"][str(k)] <= 3.0
        assert record["epsilon"][str(k)] == record["epsilon_parameters"][str(k)]
    assert record["client_loss"] is None  # a DP client reports no loss


def test_the_cli_refuses_dp_for_headprune_lora_saying_why(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--out", str(tmp_path / "run"), "--method", "headprune-lora", "--dp-eps", "1"])
    assert exit_info.value.code == 2 and not (tmp_path / "run").exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "eftguard: error: --dp-eps: --method headprune-lora has no DP-SGD: its clients upload head importances and "
        "kept heads computed from their data outside DP-SGD (methods with DP-SGD: eftvit, fed-head, fed-bias, "
        "fed-prompt, fed-lora)")
