"""The layers of eftguard (issue 35): the import-linter contracts of pyproject.toml hold, no module imports one that
imports it back, and an import inside a function says why it is there (what it keeps out of a start-up)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"eftguard": ROOT / "eftguard", "eftguard.attacks": ROOT / "attacks", "eftguard.defenses": ROOT / "defenses"}


def installed_layout(folder: Path) -> Path:
    """eftguard as `pip install .` lays it out, attacks/ and defenses/ inside it, made of links to the sources:
    import-linter and grimp find a package's modules by walking its folder, and the repository's eftguard/ holds
    neither."""
    package = folder / "eftguard"
    package.mkdir()
    for child in SOURCES["eftguard"].iterdir():
        (package / child.name).symlink_to(child)
    (package / "attacks").symlink_to(SOURCES["eftguard.attacks"])
    (package / "defenses").symlink_to(SOURCES["eftguard.defenses"])
    return folder


def run_python(code: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=path, env={**os.environ, "PYTHONPATH": str(path)},
                          capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_hold(tmp_path):
    layout = installed_layout(tmp_path)
    lint = subprocess.run([Path(sys.executable).with_name("lint-imports"), ROOT / "pyproject.toml", "--no-cache"],
                          cwd=layout, env={**os.environ, "PYTHONPATH": str(layout)}, capture_output=True, text=True,
                          timeout=300)
    assert lint.returncode == 0, lint.stdout[-4000:] + lint.stderr[-2000:]
    assert "0 broken" in lint.stdout


def test_no_module_imports_one_that_imports_it_back(tmp_path):
    """Directly or through others, function-local and TYPE_CHECKING imports included (as grimp counts them)."""
    checked = run_python(
        "import grimp, eftguard\n"
        "assert eftguard.__file__.startswith(%r)\n"
        "graph = grimp.build_graph('eftguard', cache_dir=None)\n"
        "assert {'eftguard.attacks.base', 'eftguard.defenses.dp'} <= graph.modules\n"
        "for importer in sorted(graph.modules):\n"
        "    for imported in sorted(graph.find_modules_directly_imported_by(importer)):\n"
        "        if graph.chain_exists(importer=imported, imported=importer):\n"
        "            print(importer, '->', ' -> '.join(graph.find_shortest_chain(imported, importer)))\n"
        % str(tmp_path), installed_layout(tmp_path))
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert checked.stdout == ""  # each line: an import that closes a cycle


def test_the_cli_starts_without_the_packages_its_local_imports_keep_out():
    """What the function-local imports save: `eftguard --help`, `eftguard attack ...` and every other command start
    without Flower, Ray, Opacus, timm, matplotlib, LPIPS or the Fleet gateway's web stack."""
    started = subprocess.run([sys.executable, "-c", "import sys, eftguard.cli; eftguard.cli.build_parser(); "
                              "print(sorted({m.split('.')[0] for m in sys.modules}))"],
                             capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr[-3000:]
    loaded = set(ast.literal_eval(started.stdout))
    assert loaded & {"flwr", "ray", "opacus", "timm", "matplotlib", "lpips", "stlpips_pytorch", "torchvision",
                     "uvicorn", "httpx", "starlette"} == set()


def local_imports_without_reason(source: str) -> list[int]:
    """The lines of the imports inside functions that give no reason: a comment on their line, on the first line of
    the run of imports they belong to (blank lines between its groups included) or on the line above it."""
    lines = source.splitlines()

    def is_import(index: int) -> bool:
        return index >= 0 and lines[index].strip().startswith(("import ", "from "))

    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for statement in ast.walk(node):
            if not isinstance(statement, (ast.Import, ast.ImportFrom)):
                continue
            first = statement.lineno - 1
            while is_import(first - 1) or lines[first - 1].strip() == "" and is_import(first - 2):
                first -= 1
            if not any("#" in line for line in (lines[statement.lineno - 1], lines[first], lines[first - 1])):
                found.add(statement.lineno)
    return sorted(found)


def test_every_import_inside_a_function_says_why():
    unexplained = [f"{path.relative_to(ROOT)}:{line}" for folder in SOURCES.values()
                   for path in sorted(folder.rglob("*.py")) for line in local_imports_without_reason(path.read_text())]
    assert unexplained == []


def test_an_import_inside_a_function_without_a_reason_is_found():
    source = ("def f():\n    import json\n\n    return json\n\n\n"
              "def g():\n    # Flower (0.4 s): only this command trains\n    import flwr\n    from flwr import app\n\n"
              "    import ray\n    return flwr, app, ray\n\n\n"
              "def h():\n    import lpips  # 2 s\n    return lpips\n")
    assert local_imports_without_reason(source) == [2]
