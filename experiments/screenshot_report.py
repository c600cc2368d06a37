"""Render a run report and an audit report and screenshot them in headless Chromium, as a reader sees them.

    python experiments/screenshot_report.py --run runs/run42 --audit audits/mask_ratio [--out docs/img]

--run: a run with attack reports under RUN/reports (`eftguard attack ...`); its report is rewritten there
(as `eftguard report RUN` does). --audit: an `eftguard audit --out` folder holding summary.json; its
report.html is rewritten there. Writes OUT/run-report.png and OUT/audit-report.png (1200 px wide, the page's
first 2400 px). docs/reports.md names the commands behind the checked-in screenshots.
"""

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from eftguard.cli import main as eftguard
from eftguard.report import write_audit_report

WINDOW = "1200,2400"


def screenshot(chromium: str, page: Path, png: Path) -> None:
    """Headless Chromium, no network needed: the reports inline every image."""
    png.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={png.resolve()}", f"--window-size={WINDOW}", page.resolve().as_uri()],
                   check=True, timeout=120, capture_output=True)
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="run directory with attack reports")
    parser.add_argument("--audit", type=Path, help="audit output folder holding summary.json")
    parser.add_argument("--out", type=Path, default=Path("docs/img"), help="folder for the PNGs (default: docs/img)")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium",
                        help="Chromium or Chrome binary (default: chromium on PATH)")
    args = parser.parse_args()
    if not args.run and not args.audit:
        parser.error("pass --run RUN, --audit DIR or both")
    if not Path(args.chromium).exists() and not shutil.which(args.chromium):
        parser.error(f"--chromium {args.chromium} not found: install Chromium or pass its path")
    if args.run:
        eftguard(["report", str(args.run)])
        screenshot(args.chromium, args.run / "reports" / "report.html", args.out / "run-report.png")
    if args.audit:
        summary = json.loads((args.audit / "summary.json").read_text())
        write_audit_report(summary, args.audit)
        screenshot(args.chromium, args.audit / "report.html", args.out / "audit-report.png")


if __name__ == "__main__":
    sys.exit(main())
