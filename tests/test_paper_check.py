"""Issue 37, item 3: experiments/paper/gpu_check.py's CPU preset runs every stage of the paper-scale check (bench,
two rounds of EFTViT and Fed-Full on a generated ImageFolder tree, a decoder inversion, a LiRA) and its JSON holds
real measurements, which make_table.py turns into experiments/results/bench.md#paper-scale-check."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    spec = importlib.util.spec_from_file_location(f"paper_{name}", ROOT / "experiments" / "paper" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_cpu_preset_measures_every_stage_and_the_table_shows_it(tmp_path, capsys):
    check, make_table = script("gpu_check"), script("make_table")
    lines = []
    result = check.run_check("cpu", tmp_path, lines.append)
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == json.loads(json.dumps(result))
    assert not (tmp_path / "work").exists()  # the generated images and runs are removed
    assert any(line.startswith("LiRA") and line.endswith(" s") for line in lines)  # progress per stage

    bench = result["bench"]["clients"]
    assert set(bench) >= {"fedavg", "eftvit r_m 0.75"} and bench["fedavg"]["speedup"] == 1
    assert all(row["step_seconds"] > 0 and row["peak_bytes"] > 0 and math.isfinite(row["bound_fraction"])
               for row in bench.values())
    assert bench["eftvit r_m 0.75"]["flop_ratio"] > 3  # the mask removes three quarters of the tokens' FLOPs
    for method in ("eftvit", "fedavg"):
        run = result["training"][method]
        assert run["rounds"] == 2 and run["seconds"] > 0
        assert all(0 <= a <= 1 for a in run["test_accuracy"]) and all(s > 0 for s in run["client_seconds_max"])
    assert result["training"]["eftvit"]["server_seconds"][0] > 0 == result["training"]["fedavg"]["server_seconds"][0]
    assert result["decoder_inversion"]["seconds"] > 0 and math.isfinite(result["decoder_inversion"]["psnr"])
    assert 0 <= result["lira"]["auc"] <= 1 and result["lira"]["seconds"] > 0
    assert result["machine"]["device"] == "cpu" and result["seconds"] > 0 and "cuda_device" not in result["machine"]
    masked = bench["eftvit r_m 0.75"]
    assert masked["goal"] == "token-aware" and 1 < masked["token_bound"] < masked["flop_ratio"]
    assert bench["fedavg"]["goal"] == "flop" and 0 < result["bench"]["product_share"] <= 1

    make_table.main(["--cpu", str(tmp_path / "gpu_check.json")])
    table = capsys.readouterr().out
    assert f"{result['lira']['auc']:.3f}" in table and f"{result['decoder_inversion']['psnr']:.2f} dB" in table
    assert table.count("not run: no GPU lent in this session") == len(table.splitlines()) - 2


def test_the_check_and_the_table_refuse_a_file_for_a_folder_in_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    for module, argv in ((script("gpu_check"), ["--preset", "cpu", "--out", str(tmp_path / "file")]),
                         (script("make_table"), ["--cpu", str(tmp_path / "missing.json")])):
        with pytest.raises(SystemExit) as exit_:
            module.main(argv)
        assert exit_.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
            ("is a file: give a folder", "is not a file: give the gpu_check.json that gpu_check.py --out wrote"))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal where torch finds no GPU")
@pytest.mark.parametrize("argv", [["--preset", "gpu"], ["--preset", "cpu", "--device", "cuda"]])
def test_the_gpu_preset_where_torch_finds_no_gpu_is_one_line_before_any_stage(tmp_path, capsys, argv):
    """The GPU preset computes on cuda: here it stops at once instead of measuring this machine's CPUs."""
    with pytest.raises(SystemExit) as exit_:
        script("gpu_check").main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "--device cuda: torch finds no CUDA GPU here" in err[-1]
    assert not (tmp_path / "out").exists()
