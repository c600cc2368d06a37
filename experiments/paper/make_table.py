"""The paper-scale table (experiments/results/bench.md#paper-scale-check) from gpu_check.py's JSON: one column per
preset, a preset without a file reads "not run" and why.

    python experiments/paper/make_table.py --cpu experiments/results/paper/cpu.json \\
        [--gpu experiments/results/paper/gpu.json | --gpu-missing "no GPU lent in this session"]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows_of(check: dict) -> dict[str, str]:
    """Figure name -> cell, in the table's order."""
    rows = {}
    for key, row in check["bench"]["clients"].items():
        token = "" if row.get("token_bound") is None else f", {row['token_bound_fraction']:.2f}"
        rows[f"bench: {key} step (speed-up, of FLOP bound, of token-aware bound)"] = (
            f"{row['step_seconds']:.3f} s ({row['speedup']:.2f}x, {row['bound_fraction']:.2f}{token}; goal "
            f"{row.get('goal', 'flop')})")
    rows["bench: server feature training"] = f"{check['bench']['server_samples_per_second']:.1f} samples/s"
    for method, run in check["training"].items():
        accuracy = ", ".join(f"{a:.3f}" for a in run["test_accuracy"])
        rows[f"{method}: 2 rounds (test accuracy per round)"] = f"{run['seconds']:.1f} s ({accuracy})"
    decoder = check["decoder_inversion"]
    rows["decoder inversion (PSNR, SSIM)"] = (f"{decoder['seconds']:.1f} s ({decoder['psnr']:.2f} dB, "
                                              f"{decoder['ssim']:.3f})")
    rows["LiRA (AUC)"] = f"{check['lira']['seconds']:.1f} s ({check['lira']['auc']:.3f})"
    rows["whole check"] = f"{check['seconds']:.0f} s"
    return rows


def header(check: dict) -> str:
    m, s = check["machine"], check["settings"]
    if m["device"].startswith("cuda"):
        gpu = f", {m['cuda_device']}, peak {m['cuda_peak_bytes'] / 2 ** 30:.1f} GiB allocated"
    else:
        gpu = ", a CUDA GPU unused" if m["cuda_available"] else ""
    return f"{s['model']}, {m['device']} ({m['cpu_count']} cores, {m['torch_threads']} torch threads{gpu})"


def table(cpu: dict, gpu: dict | None, gpu_missing: str) -> str:
    cpu_rows = rows_of(cpu)
    gpu_rows = rows_of(gpu) if gpu else {}
    lines = [f"| figure | `--preset cpu`: {header(cpu)} | `--preset gpu`: "
             f"{header(gpu) if gpu else 'vit-b16-224'} |", "| --- | --- | --- |"]
    for name in {**cpu_rows, **gpu_rows}:
        lines.append(f"| {name} | {cpu_rows.get(name, '–')} | "
                     f"{gpu_rows.get(name, '–') if gpu else 'not run: ' + gpu_missing} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", type=Path, required=True, help="gpu_check.json of --preset cpu")
    parser.add_argument("--gpu", type=Path, help="gpu_check.json of --preset gpu")
    parser.add_argument("--gpu-missing", default="no GPU lent in this session", help="why the GPU column is empty")
    args = parser.parse_args(argv)
    for path in (args.cpu, args.gpu):
        if path is not None and not path.is_file():
            parser.error(f"{path} is not a file: give the gpu_check.json that gpu_check.py --out wrote")
    print(table(json.loads(args.cpu.read_text()), json.loads(args.gpu.read_text()) if args.gpu else None,
                args.gpu_missing))


if __name__ == "__main__":
    main()
