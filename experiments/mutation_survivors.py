"""Print the diff of every mutant mutmut did not kill, from mutmut's own mutants/ tree (one process, unlike
`mutmut show` per mutant, which re-parses the tree each time).

    python experiments/mutation_survivors.py WORKDIR SOURCE_FILE   # WORKDIR holds results.txt and mutants/
"""

import ast
import difflib
import re
import sys
from pathlib import Path


def functions(path: Path) -> dict[str, str]:
    """Each function's source by name (line slices: ast.get_source_segment re-splits the file on every call)."""
    source = path.read_text()
    lines = source.splitlines()
    return {node.name: "\n".join(lines[node.lineno - 1:node.end_lineno]) for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def main(work: Path, source_file: str) -> None:
    defs = functions(work / "mutants" / source_file)
    for line in (work / "results.txt").read_text().splitlines():
        name, _, status = line.strip().rpartition(": ")
        if not name or status == "killed":
            continue
        mutant = name.rsplit(".", 1)[1]
        original = re.sub(r"__mutmut_\d+$", "__mutmut_orig", mutant)
        diff = difflib.unified_diff(defs[original].splitlines()[1:], defs[mutant].splitlines()[1:], lineterm="", n=0)
        print(f"# {mutant} ({status})")
        print("\n".join(d for d in diff if d[:1] in "+-" and d[:3] not in ("---", "+++")) or "(signature only)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
