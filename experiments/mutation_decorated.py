"""Hand-made mutants of the core functions mutmut 3 skips because they are decorated (@torch.no_grad,
@property, @functools.lru_cache): each is applied in a scratch copy of the tree and the given tests are run.

    python experiments/mutation_decorated.py     # from the repository root; prints one line per mutant
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TESTS = ["tests/test_training.py", "-k", "extracted or accuracy or duration"]
MUTANTS = [  # (file, original text, mutant text); the first is the unmutated control, which must pass
    ("eftguard/training.py", "def evaluate(", "def evaluate("),
    ("eftguard/training.py", "keep_ids[i:i + batch_size]", "keep_ids[i:i - batch_size]"),
    ("eftguard/training.py", "images[i:i + batch_size]), keep_ids", "images[i:i - batch_size]), keep_ids"),
    ("eftguard/training.py", "torch.cat(features)", "torch.cat(features[:1])"),
    ("eftguard/training.py", "correct / max(len(labels), 1)", "correct / max(len(labels), 2)"),
    ("eftguard/training.py", "correct += int(", "correct = int("),
    ("eftguard/training.py", "== labels[i:i + batch_size]", "== labels[i:i - batch_size]"),
    ("eftguard/training.py", "return float(sum(self.epoch_seconds))", "return float(self.epoch_seconds[0])"),
]


def main() -> None:
    root = Path.cwd()
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "eftguard", "defenses", "attacks", "tests"],
                           capture_output=True, text=True, check=True).stdout.split()
    for file, original, mutant in MUTANTS:
        with tempfile.TemporaryDirectory() as scratch:
            for name in files:  # laid out as installed: attacks/ and defenses/ inside eftguard/
                copy = Path(scratch) / (f"eftguard/{name}" if name.startswith(("attacks/", "defenses/")) else name)
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / name, copy)
            target = Path(scratch) / file
            source = target.read_text()
            assert source.count(original) == 1, f"{original!r} is not unique in {file}"
            control = original == mutant
            target.write_text(source.replace(original, mutant))
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS],
                                 cwd=scratch, env={**os.environ, "PYTHONPATH": scratch},
                                 capture_output=True, text=True)
            if control and run.returncode:
                sys.exit(f"the tests fail without any mutant:\n{run.stdout[-2000:]}")
            verdict = "control passed" if control else "killed" if run.returncode else "SURVIVED"
            print(f"{verdict}  {file}: {original!r} -> {mutant!r}", flush=True)


if __name__ == "__main__":
    main()
