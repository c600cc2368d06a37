"""An audit's training and attacks replaced by fakes that write minimal runs and reports, and `eftguard audit` run
in-process: shared by the audit tests (tests/test_audit_grid.py, tests/test_audit_cluster.py)."""

import json
from pathlib import Path

import torch

from eftguard import audit as audit_api, cli, runs
from eftguard.attacks.base import AttackError
from eftguard.audit import AttackReport
from eftguard.report import write_attack_report
from eftguard.rundir import RunDirectory

TWO_METHODS = """
[train]
model = "vit-micro-32"
rounds = 1
clients = 2
train_samples = 100
test_samples = 40
batch_size = 32

[grid]
method = ["eftvit", "fedavg"]
"""  # the real audits' one round of each method (two tiny configurations of the micro preset, which every process
# the audit starts can build), to which a test adds its attacks

SWEEP = """
title = "mask sweep"
[train]
rounds = 2
clients = 2
train_samples = 40
test_samples = 20

[[grid]]
method = ["eftvit"]
mask_ratio = [0.0, 0.5, 0.75, 0.9]

[[grid]]
method = ["fedavg"]

[[attack]]
family = "invert"
steps = 5

[[attack]]
family = "labels"
"""
SWEEP_IDS = ["mask_ratio=0.0,method=eftvit", "mask_ratio=0.5,method=eftvit", "mask_ratio=0.75,method=eftvit",
             "mask_ratio=0.75,method=fedavg", "mask_ratio=0.9,method=eftvit"]


class Fakes:
    """Stand-ins for training and run_attack that record what they were asked to do.

    Training writes real run directories (checkpoint + metrics line per round); attacks write report.json.
    interrupt_at / fail_at: the (1-based) training call that raises KeyboardInterrupt after one round, or fails."""

    def __init__(self, monkeypatch, interrupt_at=None, fail_at=None):
        self.trained, self.attacked, self.calls = [], [], 0
        self.interrupt_at, self.fail_at = interrupt_at, fail_at
        monkeypatch.setattr(runs, "prepare", lambda cfg: None)
        monkeypatch.setattr(runs, "train_run", self.train)
        monkeypatch.setattr(audit_api, "run_attack", self.attack)

    def train(self, run_dir, verbose, undo=None):
        run = RunDirectory.open(run_dir)
        cfg = run.config()
        self.calls += 1
        for round_number in range(run.completed_rounds() + 1, cfg.rounds + 1):
            self.trained.append((cfg.method, cfg.mask_ratio, round_number))
            if self.calls == self.fail_at:
                raise RuntimeError("CUDA out of memory")
            run.save_checkpoint(round_number, {"w": torch.zeros(1)})
            run.append_metrics({"round": round_number, "method": cfg.method, "test_accuracy": 0.5 - cfg.mask_ratio / 10,
                                "epsilon": None, "client_epoch_seconds": {"0": 0.1}})
            if self.calls == self.interrupt_at:
                raise KeyboardInterrupt

    def attack(self, run, family, method=None, *, key=None, out=None, progress=None, **options):
        cfg = RunDirectory.open(run).config()
        self.attacked.append((cfg.method, cfg.mask_ratio, family))
        if family == "invert" and cfg.method == "fedavg":
            raise AttackError(f"{run} is a fedavg run: it uploads no patch features")
        method = method or {"invert": "decoder", "labels": "head"}[family]
        groups = ({"metrics": stats(psnr=15.0), "metrics_kept": stats(psnr=30 - 10 * cfg.mask_ratio),
                   "baseline_kept": stats(psnr=12.0)} if family == "invert" else
                  {"metrics": stats(l1=0.2 + cfg.mask_ratio / 10), "baseline": stats(l1=0.9)})
        report = AttackReport(family, method, f"{family}-{method}", str(run), cfg.rounds, [0, 1], {}, options, groups,
                              {}, {})
        write_attack_report(Path(out), report)
        return report


def stats(**means):
    return {metric: {"mean": mean, "std": 0.0, "n": 4} for metric, mean in means.items()}


def audit_cli(capsys, tmp_path, *argv, text=SWEEP):
    """Run `eftguard audit` in-process on text; (exit code, stdout, stderr, summary or None)."""
    audit_file = tmp_path / "sweep.toml"
    audit_file.write_text(text)
    out = tmp_path / "out"
    try:
        cli.main(["audit", str(audit_file), "--out", str(out), *argv])
        code = 0
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    summary_file = out / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
    return code, captured.out, captured.err, summary
