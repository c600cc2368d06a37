"""The method table of docs/peft.md from an audit of experiments/peft.toml and an `eftguard bench --out` file.

    python experiments/peft_table.py AUDIT_DIR BENCH.json [--earlier OLDER_AUDIT_DIR]

Accuracy per round and the bytes each client uploaded come from the audit's runs (metrics.jsonl), the accuracy
before any round from each method's round-0 checkpoint, the client lr from the run's configuration, client step
FLOPs and time from the bench, gradient leakage from the audit's iDLG reports; then headprune-lora against fed-lora
with the same client selection, and each headprune-lora ablation against the main row, at each beta. A row and
beta the audit lacks is taken from an --earlier audit of the same file (configurations it did not run again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from eftguard.data.plan import run_dataset
from eftguard.rundir import RunDirectory
from eftguard.training import evaluate

METHODS = ("fedavg", "fed-head", "fed-bias", "fed-prompt", "fed-lora", "headprune-lora", "eftvit")
DEFAULTS = {"client_selection": "random", "head_pruning": "importance", "head_weighting": "importance"}


def variant(varied: dict) -> str:
    """The row label: the method, plus whatever option differs from the defaults (the ablations)."""
    changed = [f"{key.replace('_', '-')} {varied[key]}" for key, default in DEFAULTS.items()
               if varied.get(key, default) != default]
    if varied.get("client_selection") == "loss-gap":
        changed[-1] += f", {varied['clients_per_round']} per round"
    return varied["method"] + (f" ({'; '.join(changed)})" if changed else "")


def run_figures(audit: Path, configuration: dict) -> dict:
    """Test accuracy per round, the mean bytes uploaded per client and round, and the client lr, from the run."""
    run = RunDirectory.open(audit / configuration["run"])
    records = run.metrics()
    uploads = [value for record in records for value in record["upload_bytes"].values()]
    return {"accuracy": [record["test_accuracy"] for record in records], "upload": statistics.mean(uploads),
            "lr": run.config().lr}


def start_accuracy(audit: Path, configuration: dict) -> float:
    """Test accuracy of the model the run started from (its round-0 checkpoint: the pretrained checkpoint plus
    the method's added parameters), on the run's test images."""
    run = RunDirectory.open(audit / configuration["run"])
    cfg = run.config()
    test = run_dataset(cfg.dataset, cfg.data_dir, cfg.model, cfg.train_samples, cfg.test_samples, cfg.seed).test
    return evaluate(run.start_model(1), torch.from_numpy(test.images), torch.from_numpy(test.labels))


def leakage(configuration: dict) -> str:
    """iDLG's PSNR and LPIPS against the mean image's; on the patches the client sent, for a masking method."""
    entry = configuration["attacks"].get("gradient-idlg", {})
    if entry.get("status") != "done":
        return entry.get("status", "–")
    figures = entry["figures"]
    kept = "_kept" if "psnr_kept" in figures else ""
    return (f"{figures['psnr' + kept]:.1f} ({figures[f'baseline{kept}.psnr']:.1f}), LPIPS {figures['lpips' + kept]:.2f} "
            f"({figures[f'baseline{kept}.lpips']:.2f}), label {figures.get('label_accuracy', float('nan')):.0%}")


def table(audits: list[Path], bench: dict) -> tuple[list[str], dict]:
    """The table's lines and its rows. A later audit only completes a row of the first at a beta it lacks, and only
    with a run at the row's lr."""
    rows: dict[str, dict] = {}
    starts: dict[str, float] = {}  # per method: the same checkpoint, added parameters and test images in every run
    for index, audit in enumerate(audits):
        for configuration in json.loads((audit / "summary.json").read_text())["configurations"]:
            if configuration["status"] != "done":
                continue
            label, beta, method = variant(configuration["varied"]), configuration["varied"]["beta"], \
                configuration["varied"]["method"]
            figures = run_figures(audit, configuration)
            if label not in rows and index == 0:
                rows[label] = {"method": method, "lr": figures["lr"]}
            row = rows.get(label)
            if row is None or beta in row or figures["lr"] != row["lr"]:
                continue
            row[beta] = {**figures, "leak": leakage(configuration)}
            if method not in starts:
                starts[method] = start_accuracy(audit, configuration)
            row["start"] = starts[method]
    clients = bench["clients"]
    order = sorted(rows, key=lambda label: (METHODS.index(rows[label]["method"]), label))
    lines = ["| method | client lr | accuracy before round 1 | accuracy β 0.1 (rounds 1, 2, 3) | accuracy β 1.0 "
             "(rounds 1, 2, 3) | client step GFLOP | client step s | upload B per client and round | iDLG on the "
             "upload, β 0.1: PSNR dB (mean image), LPIPS (mean image), label right; eftvit: on the sent patches |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label in order:
        row = rows[label]
        cost = clients.get(row["method"]) or next(v for k, v in clients.items() if v["method"] == row["method"])
        accuracy = {beta: ", ".join(f"{a:.3f}" for a in row[beta]["accuracy"]) if beta in row else "–"
                    for beta in (0.1, 1.0)}
        upload = statistics.mean(row[beta]["upload"] for beta in (0.1, 1.0) if beta in row)
        lines.append(f"| {label} | {row['lr']:g} | {row['start']:.3f} | {accuracy[0.1]} | {accuracy[1.0]} | "
                     f"{cost['flops'] / 1e9:.1f} | {cost['step_seconds']['median']:.3f} | {upload:,.0f} | "
                     f"{row.get(0.1, {}).get('leak', '–')} |")
    return lines, rows


def comparison(rows: dict, bench: dict) -> list[str]:
    """headprune-lora at s = 0.9 against fed-lora: FLOPs and step time (bench), upload (the runs, else the bench),
    the round-3 accuracy gap for each client selection both were run with, and each ablation's round-3 gap to
    headprune-lora's main row."""
    clients = bench["clients"]
    pruned, dense = clients["headprune-lora"], clients["fed-lora"]
    uploads = [rows[label][0.1]["upload"] for label in ("headprune-lora", "fed-lora") if 0.1 in rows.get(label, {})]
    upload = (uploads[0] / uploads[1] if len(uploads) == 2
              else pruned["upload_bytes"]["total"] / dense["upload_bytes"]["total"])
    lines = [f"headprune-lora / fed-lora: client FLOPs {pruned['flops'] / dense['flops']:.2f}, step time "
             f"{pruned['step_seconds']['median'] / dense['step_seconds']['median']:.2f}, upload {upload:.2f}"]
    for label in sorted(rows):
        if rows[label]["method"] != "headprune-lora":
            continue
        ablation = "head-pruning" in label or "head-weighting" in label
        other = "headprune-lora" if ablation else "fed-lora" + label[len("headprune-lora"):]
        for beta in (0.1, 1.0):
            if beta in rows[label] and beta in rows.get(other, {}):
                gap = rows[label][beta]["accuracy"][-1] - rows[other][beta]["accuracy"][-1]
                lines.append(f"accuracy gap {label} − {other}, β {beta}, round 3: {gap:+.3f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("audit", type=Path, help="the --out folder of eftguard audit experiments/peft.toml")
    parser.add_argument("bench", type=Path, help="the --out file of eftguard bench")
    parser.add_argument("--earlier", type=Path, action="append", default=[],
                        help="an earlier audit of experiments/peft.toml, for the rows and beta the audit lacks")
    args = parser.parse_args()
    lines, rows = table([args.audit, *args.earlier], json.loads(args.bench.read_text()))
    print("\n".join(lines + [""] + comparison(rows, json.loads(args.bench.read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
