"""The malicious-server measurements of docs/threat-model.md ("Tampered models"): the real server and clients over
the in-process grid of tests/fakegrid.py (no Ray), vit-tiny-32 on photos, 4 clients, 400 training images.

1. each tampering in round 1 without the model check: kept-patch PSNR of `invert --method tampered` and label
   recovery of `labels --method tampered` (beside `labels --method head`), each with its baseline;
2. each tampering with the check on: in round 2 (drift against round 1's model), and in round 1 with and without
   a published hash of the first model;
3. 20 honest rounds with the check on: refusals (false alarms) and how close the models came to the drift limit.

    OMP_NUM_THREADS=1 python experiments/malicious_server.py --out /tmp/malicious
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attacks.tamper import TAMPERINGS  # noqa: E402
from defenses.model_check import state_sha256  # noqa: E402
from eftguard.audit import run_attack  # noqa: E402
from eftguard.config import TrainConfig  # noqa: E402
from eftguard.federation.server import run_server  # noqa: E402
from eftguard.model import build_model  # noqa: E402
from eftguard.rundir import RunDirectory  # noqa: E402
from fakegrid import FakeGrid, task_identity  # noqa: E402
from model_check_margin import margins  # noqa: E402

COMMON = {"clients": 4, "train_samples": 400, "test_samples": 100}


def train(path: Path, check: bool, published: bool = False, **changes) -> RunDirectory:
    cfg = TrainConfig(**{**COMMON, "model_check": check, **changes}).resolved()
    node = {"model-check": check}
    if published:
        model = build_model(cfg.model, 10, cfg.local_layers, seed=cfg.seed)
        node["model-sha256"] = state_sha256({k: v.numpy() for k, v in model.state_dict().items()})
    run = RunDirectory.create(path, cfg)
    with task_identity():
        run_server(FakeGrid(cfg.clients, node_config=node), run.path)
    return run


def refused(run: RunDirectory, round_number: int) -> str:
    dropped = run.metrics()[round_number - 1]["dropped"]
    return f"{sum('refuses' in r for r in dropped.values())}/{COMMON['clients']}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    results = {"attacks": {}, "caught": {}}
    for tamper in ["none", *TAMPERINGS]:
        for batch in (64, 256):
            if batch == 256 and tamper != "label-probe":
                continue
            threat = {} if tamper == "none" else {"threat": "malicious", "tamper": tamper}
            run = train(out / f"attack-{tamper}-b{batch}", False, batch_size=batch, rounds=1, **threat)
            tampered = tamper != "none"  # the tampered attacks refuse a round nobody tampered with
            invert = run_attack(run.path, "invert", "tampered", lpips_backend="stlpips-alex",
                                max_images=0).figures() if tampered else {}
            labels = {m: run_attack(run.path, "labels", m).figures()
                      for m in (("tampered", "head") if tampered else ("head",))}
            results["attacks"][f"{tamper}, B={batch}"] = {
                "psnr_kept": invert.get("psnr_kept"), "baseline_kept.psnr": invert.get("baseline_kept.psnr"),
                **{f"{m} {k}": v[k] for m, v in labels.items() for k in ("l1", "exact_count_accuracy")},
                "baseline l1": labels["head"]["baseline.l1"],
                "baseline exact_count_accuracy": labels["head"]["baseline.exact_count_accuracy"]}
            print(json.dumps({f"{tamper}, B={batch}": results["attacks"][f"{tamper}, B={batch}"]}), flush=True)
    for tamper in TAMPERINGS:
        threat = {"threat": "malicious", "tamper": tamper}
        results["caught"][tamper] = {
            "round 2": refused(train(out / f"check-{tamper}-r2", True, rounds=2, tamper_round=2, **threat), 2),
            "round 1, no hash": refused(train(out / f"check-{tamper}-r1", True, rounds=1, **threat), 1),
            "round 1, published hash": refused(train(out / f"check-{tamper}-r1-hash", True, True, rounds=1,
                                                     **threat), 1)}
        print(json.dumps({tamper: results["caught"][tamper]}), flush=True)
    honest = train(out / "honest-20", True, True, rounds=20)
    shares = [share for _, share, _ in margins(honest)]
    dropped = [reason for r in honest.metrics() for reason in r["dropped"].values()]
    results["honest"] = {"rounds": 20, "client_rounds": sum(len(r["clients"]) for r in honest.metrics()),
                         "refusals": sum("refuses" in reason for reason in dropped), "dropped": len(dropped),
                         "largest_share_of_limit": max(shares),
                         "median_share_of_limit": sorted(shares)[len(shares) // 2]}
    print(json.dumps({"honest": results["honest"]}), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
