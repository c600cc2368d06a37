"""Feature-inversion leakage over mask ratio r_m and local depth M (issue 4's must-show table).

For every (r_m, M): a short EFTViT run on the bundled photos, then the inversion decoder (positions known,
`eftguard.audit.run_attack(run, "invert")`) on its last round; prints and writes a markdown table of PSNR / SSIM / LPIPS over the whole
image and over the kept patches, with the mean-image baseline.

    python experiments/inversion_table.py --out experiments/results/inversion
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from eftguard.audit import read_attack_report, run_attack

TRAIN_ARGS = ["--rounds", "1", "--clients", "2", "--train-samples", "600", "--test-samples", "100",
              "--local-epochs", "1", "--server-epochs", "1"]


def eftguard(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "eftguard.cli", *args], check=True)


def cell(stat: dict) -> str:
    return f"{stat['mean']:.2f} ± {stat['std']:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/inversion"))
    parser.add_argument("--mask-ratios", type=float, nargs="+", default=[0.0, 0.5, 0.75, 0.9])
    parser.add_argument("--local-layers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=1000, help="decoder training steps")
    parser.add_argument("--max-images", type=int, default=64, help="feature sets attacked per client")
    args = parser.parse_args()

    rows = []
    for m in args.local_layers:
        for ratio in args.mask_ratios:
            run = args.out / f"r{ratio:g}-m{m}"
            report_file = run / "reports" / "invert-decoder" / "report.json"
            if report_file.exists():  # resumable: finished cells are kept
                report = read_attack_report(report_file)
            else:
                if not (run / "metrics.jsonl").exists():
                    subprocess.run(["rm", "-rf", str(run)], check=True)
                    eftguard("train", "--out", str(run), "--mask-ratio", str(ratio), "--local-layers", str(m),
                             *TRAIN_ARGS)
                start = time.perf_counter()
                report = run_attack(run, "invert", steps=args.steps, max_images=args.max_images,
                                    lpips_backend="stlpips-alex", out=run / "reports")
                print(f"r_m={ratio} M={m}: attack {time.perf_counter() - start:.0f} s", flush=True)
            rows.append((ratio, m, report))

    lines = ["| r_m | M | PSNR | SSIM | LPIPS | PSNR kept | SSIM kept | LPIPS kept | baseline PSNR | baseline LPIPS | n |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for ratio, m, r in rows:
        w, k, b = r.groups["metrics"], r.groups["metrics_kept"], r.groups["baseline"]
        lines.append(f"| {ratio:g} | {m} | {cell(w['psnr'])} | {cell(w['ssim'])} | {cell(w['lpips'])} | "
                     f"{cell(k['psnr'])} | {cell(k['ssim'])} | {cell(k['lpips'])} | {cell(b['psnr'])} | "
                     f"{cell(b['lpips'])} | {w['psnr']['n']} |")
    table = "\n".join(lines)
    backend = rows[0][2].lpips_backend if rows else "?"
    (args.out / "table.md").write_text(f"LPIPS backend: {backend}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
