"""eftguard bench: FLOPs and activation memory against hand counts, a short bench end to end (its JSON has the keys
docs/bench.md documents), bad options refused in one line before any work."""

import json
import re
from pathlib import Path

import pytest
import torch
from timm.models.vision_transformer import Block
from torch import nn

from eftguard.bench import Timed, count_flops, interleave
from eftguard.training import saved_activation_bytes
from eftguard.cli import main
from eftguard.methods import METHODS
from eftguard.training import TrainResult

DOCS = Path(__file__).resolve().parents[1] / "docs" / "bench.md"


def test_linear_flops_are_forward_plus_both_backward_products():
    layer = nn.Linear(24, 10)
    x = torch.randn(5, 24, requires_grad=True)
    # forward x W^T, backward grad_x = g W and grad_W = g^T x: three products of 2 * 5 * 24 * 10 FLOPs each
    assert count_flops(lambda: layer(x).sum().backward()) == 3 * 2 * 5 * 24 * 10


@pytest.mark.parametrize("fused", [True, False])
def test_attention_block_flops_match_a_hand_count(fused):
    batch, tokens, width = 2, 17, 48
    block = Block(dim=width, num_heads=3)
    block.attn.fused_attn = fused  # fused: the CPU flash-attention kernel, which torch's counter does not know
    x = torch.randn(batch, tokens, width, requires_grad=True)
    # qkv 3D^2, proj D^2, MLP 2 * 4D^2 per token, Q K^T and A V N D each per token; backward twice the forward,
    # and the fused kernel's backward computes Q K^T once more (it keeps no attention matrix)
    scores = 2 * batch * tokens * tokens * width
    forward = 2 * batch * tokens * width * (3 * width + width + 8 * width) + 2 * scores
    assert count_flops(lambda: block(x).sum().backward()) == 3 * forward + (scores if fused else 0)


def test_saved_activations_count_each_storage_once_and_leave_parameters_out():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    # the first Linear saves its input x; ReLU saves its output, which the second Linear saves as its input too;
    # the weights the second Linear saves for grad_x are parameters
    assert saved_activation_bytes(model, lambda: model(x).sum().backward()) == 5 * 8 * 4 + 5 * 16 * 4


def test_configurations_take_turns_and_only_the_step_after_the_warmup_counts():
    calls = []

    def configuration(name: str) -> Timed:
        def run(epochs: int) -> TrainResult:
            calls.append((name, epochs))
            return TrainResult(0.0, epochs, [100.0] * (epochs - 1) + [float(len(calls))])  # warm-up steps are slow
        return Timed(name, run, [])

    timed = [configuration("a"), configuration("b")]
    interleave(timed, steps=3, warmup=2, progress=None)
    assert calls == [("a", 3), ("b", 3)] * 3
    assert timed[0].seconds == [1.0, 3.0, 5.0] and timed[1].seconds == [2.0, 4.0, 6.0]


def documented_keys() -> list[str]:
    """The dotted key paths in docs/bench.md's "JSON keys" table."""
    section = DOCS.read_text().split("## JSON keys", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)`", section, flags=re.MULTILINE)


def resolve(document: dict, path: str) -> list:
    """The values at a dotted path; a <placeholder> part stands for every key at that level."""
    values = [document]
    for part in path.split("."):
        values = [v for d in values for v in (d.values() if part.startswith("<") else [d[part]])]
    return values


def test_short_bench_writes_every_documented_key(tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["bench", "--steps", "2", "--warmup", "0", "--batch-size", "4", "--attack-steps", "1", "--mask-ratios",
          "0.75", "0.9", "--out", str(out)])
    result = json.loads(out.read_text())
    keys = documented_keys()
    assert len(keys) > 20
    for key in keys:
        assert resolve(result, key), key  # KeyError names a key the bench does not write
    clients = result["clients"]
    assert set(clients) == {"fedavg", "eftvit r_m 0.75", "eftvit r_m 0.9"} | {
        name for name, spec in METHODS.items() if not spec.masked}
    fedavg, eftvit = clients["fedavg"], clients["eftvit r_m 0.75"]
    assert eftvit["flops"] < fedavg["flops"] and clients["eftvit r_m 0.9"]["flops"] < eftvit["flops"]
    assert eftvit["flop_ratio"] == fedavg["flops"] / eftvit["flops"]
    assert eftvit["speedup"] == fedavg["step_seconds"]["median"] / eftvit["step_seconds"]["median"]
    # fedavg trains and uploads the whole model: AdamW keeps two moments of every parameter
    assert fedavg["memory_bytes"]["optimizer_state"] == 2 * fedavg["memory_bytes"]["parameters"]
    assert fedavg["upload_bytes"] == {"parameters": fedavg["memory_bytes"]["parameters"], "features": 0,
                                      "total": fedavg["memory_bytes"]["parameters"]}
    assert 0 < eftvit["upload_bytes"]["parameters"] < fedavg["upload_bytes"]["parameters"]
    assert eftvit["upload_bytes"]["features"] > clients["eftvit r_m 0.9"]["upload_bytes"]["features"] > 0
    assert eftvit["memory_bytes"]["activations"] < fedavg["memory_bytes"]["activations"]
    assert result["dp"]["eftvit"]["step_seconds"]["n"] == 2 and result["config"]["steps"] == 2
    # per-sample clipping: norms and clipped sums of phi and h on top of the plain step (ghost clipping's second
    # backward pass, through the frozen global module too, made it 1.56x)
    assert 1 < result["dp"]["eftvit"]["flop_ratio"] < 1.25
    # the token-aware bound beside the FLOP bound: below it where fewer tokens are kept than FLOPs are saved
    assert 0 < result["product_share"] <= 1 and result["machine"]["device"] == "cpu"
    assert 1 < eftvit["token_bound"] < eftvit["flop_ratio"]
    assert eftvit["token_bound_fraction"] == eftvit["speedup"] / eftvit["token_bound"]
    assert eftvit["goal"] == "token-aware" and fedavg["goal"] == "flop" and fedavg["token_bound"] is None
    assert "fedavg" in capsys.readouterr().out


def test_a_bf16_bench_records_its_precision_and_benches_no_dp_sgd(tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(["bench", "--methods", "fedavg", "eftvit", "--precision", "bf16", "--steps", "1", "--warmup", "0",
          "--batch-size", "4", "--attack-steps", "1", "--mask-ratios", "0.75", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["config"]["precision"] == "bf16" and result["dp"] == {}
    assert set(result["clients"]) == {"fedavg", "eftvit r_m 0.75"}
    assert "DP-SGD: not benched (bf16: DP-SGD runs in fp32 only)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--mask-ratios", "1.0"], "--mask-ratios: 1.0 is not in [0, 1) (fraction of patches dropped)"),
    (["--mask-ratios", "nan"], "--mask-ratios: nan is not in [0, 1) (fraction of patches dropped)"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--methods", "eftvit"], "--methods must include fedavg: every speed-up is relative to it"),
    (["--out", "/nonexistent/folder/bench.json"], "--out /nonexistent/folder/bench.json is in /nonexistent/folder, which "
                                                 "does not exist: create that folder, or give a path in an existing one"),
])
def test_bad_bench_options_are_one_line_before_any_work(capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.strip().splitlines() == [f"eftguard: error: {message}"]  # one line, no progress: nothing measured


@pytest.mark.slow
def test_sigterm_stops_a_command_on_one_line_and_writes_nothing(tmp_path):
    """SIGTERM (a scheduler's or `kill`'s stop) acts as Ctrl-C: a command without a stop of its own, the bench here,
    ends with one line and status 130, not a traceback, and writes no half of its JSON."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    process = subprocess.Popen([sys.executable, "-m", "eftguard.cli", "bench", "--steps", "1000", "--out", str(out)],
                               env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:  # wait for the bench to be at work, not on a clock
            if line.startswith("bench: "):
                process.send_signal(signal.SIGTERM)
                break
        err = process.stderr.read()
        assert process.wait(timeout=60) == 130, err[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    assert err.strip().splitlines()[-1] == "eftguard: interrupted" and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_the_bench_replaces_its_json_whole_or_not_at_all(capsys, tmp_path, monkeypatch):
    """The JSON is written at the end of a long bench: a disk that fills half-way through the write leaves the
    earlier file intact and no temporary file behind."""
    import errno
    import pathlib

    import eftguard.bench

    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "kept").write_text("still here\n")
    out = tmp_path / "adir" / "bench.json"
    out.write_text('{"earlier": true}\n')
    monkeypatch.setattr(eftguard.bench, "run_bench", lambda cfg, progress=None: {"config": {"steps": 10}})
    monkeypatch.setattr(eftguard.bench, "print_tables", lambda result: None)
    write_text = pathlib.Path.write_text

    def full_disk(path, text, *args, **kwargs):
        write_text(path, text[:len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        main(["bench", "--out", str(out)])
    monkeypatch.undo()
    assert json.loads(out.read_text()) == {"earlier": True}
    assert sorted(p.name for p in out.parent.iterdir()) == ["bench.json", "kept"]


def test_the_token_aware_bound_is_the_documented_formula():
    """docs/bench.md's two bounds at p = 0.706 (vit-tiny-32's products and attention share of Fed-Full's step):
    5.48x FLOPs with 17 of 65 tokens gives 4.86x, 13.39x with 7 of 65 gives 11.85x; all the time in products
    leaves the FLOP bound, none of it the token ratio."""
    from eftguard.bench import token_bound

    assert round(token_bound(0.706, 5.48, 65 / 17), 2) == 4.86
    assert round(token_bound(0.706, 13.39, 65 / 7), 2) == 11.85
    assert token_bound(1.0, 13.39, 65 / 7) == pytest.approx(13.39)
    assert token_bound(0.0, 13.39, 65 / 7) == pytest.approx(65 / 7)


@pytest.mark.parametrize("device_type, goal", [("cpu", "token-aware"), ("cuda", "flop")])
def test_the_goal_of_a_masked_step_is_the_token_aware_bound_on_a_cpu_and_the_flop_bound_on_a_gpu(device_type, goal):
    from eftguard.bench import add_bounds

    clients = {"fedavg": {"method": "fedavg", "mask_ratio": 0.0, "flop_ratio": 1.0, "speedup": 1.0},
               "eftvit r_m 0.9": {"method": "eftvit", "mask_ratio": 0.9, "flop_ratio": 13.39, "speedup": 10.66}}
    add_bounds(clients, 0.706, 65, device_type)
    masked = clients["eftvit r_m 0.9"]
    assert round(masked["token_bound"], 2) == 11.85 and round(masked["token_bound_fraction"], 2) == 0.90
    assert masked["goal"] == goal and clients["fedavg"]["goal"] == "flop"
    assert clients["fedavg"]["token_bound"] is None is clients["fedavg"]["token_bound_fraction"]
