"""One package (issue 35): the repository keeps attacks/ and defenses/ at its top, and `pip install .` puts them
inside eftguard, so nothing but eftguard lands in site-packages."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_AS = {"eftguard": "eftguard", "attacks": "eftguard/attacks", "defenses": "eftguard/defenses"}


def test_the_wheel_holds_eftguard_alone_with_every_source_file(tmp_path):
    """Built from a copy of the sources, tracked or new (a build writes build/ and *.egg-info beside its
    pyproject.toml), with the installed setuptools (no index needed)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "pyproject.toml",
                             "README.md", *INSTALLED_AS], cwd=ROOT, capture_output=True, text=True, check=True)
    sources = [name for name in listed.stdout.split() if (ROOT / name).is_file()]  # not a deletion to commit
    source = tmp_path / "source"
    for name in sources:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(tmp_path / "wheel"), str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        [top_level] = [name for name in names if name.endswith(".dist-info/top_level.txt")]
        assert archive.read(top_level).decode().split() == ["eftguard"]
    assert {name.split("/")[0] for name in names} == {"eftguard", top_level.split("/")[0]}
    expected = {INSTALLED_AS[name.split("/")[0]] + name[name.index("/"):] for name in sources if "/" in name}
    assert expected - names == set()  # a new sub-package is missing from [tool.setuptools] packages
