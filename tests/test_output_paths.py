"""Paths that are folders where a file belongs, or files where a folder belongs, for the commands outside the
attacks (tests/test_bad_input.py has those): one `eftguard: error:` line that names the problem, exit 2, before
any work, and nothing that was there removed. Each case was a traceback, or a crash after all the work (bench)."""

import json
import os
import subprocess
import sys

import pytest

from eftguard.cli import main
from eftguard.data.cifar import load_cifar
from eftguard.data import DataError
from eftguard.paths import file_in_the_way, output_file_problem


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    return exit_info.value.code, capsys.readouterr().err


@pytest.fixture
def places(tmp_path):
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "kept").write_text("still here\n")
    return tmp_path


def test_file_in_the_way_finds_the_nearest_file_at_or_above_the_path(places):
    assert file_in_the_way(places / "adir" / "new" / "deeper") is None
    assert file_in_the_way(places / "afile") == places / "afile"
    assert file_in_the_way(places / "afile" / "x" / "y") == places / "afile"


def test_output_file_problem_names_each_reason(places):
    assert output_file_problem(places / "adir" / "out.json", "the JSON") is None
    assert output_file_problem(places / "adir", "the JSON") == "is a folder: give a file path for the JSON"
    assert output_file_problem(places / "afile" / "out.json", "the JSON") == (
        f"is under {places / 'afile'}, which is a file: give a path in a folder for the JSON")
    assert output_file_problem(places / "missing" / "out.json", "the JSON").startswith(
        f"is in {places / 'missing'}, which does not exist")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_output_file_problem_refuses_a_read_only_folder(places):
    (places / "adir").chmod(0o500)
    try:
        assert "which is not writable" in output_file_problem(places / "adir" / "out.json", "the JSON")
    finally:
        (places / "adir").chmod(0o700)


@pytest.mark.parametrize("argv, message", [
    (["node-key", "--out", "{tmp}/adir"], "{tmp}/adir is a folder: give --out a file path for the node's key"),
    (["node-key", "--out", "{tmp}/adir", "--force"], "{tmp}/adir is a folder: give --out a file path"),
    (["node-key", "--out", "{tmp}/afile/key"], "--out {tmp}/afile/key is under {tmp}/afile, which is a file"),
    (["certs", "--out", "{tmp}/afile/certs"], "--out {tmp}/afile/certs is under {tmp}/afile, which is a file: "
                                              "give a folder for the certificate files"),
    (["train", "--config", "{tmp}/adir", "--out", "{tmp}/run"], "config file {tmp}/adir is a folder: give the TOML "
                                                                 "file itself"),
    (["train", "--config", "{tmp}/afile/c.toml", "--out", "{tmp}/run"], "config file {tmp}/afile/c.toml cannot be read"),
    (["audit", "{tmp}/adir"], "audit file {tmp}/adir is a folder: give the TOML file itself"),
    (["train", "--dataset", "cifar10", "--data-dir", "{tmp}/afile", "--out", "{tmp}/run"],
     "--data-dir {tmp}/afile is not a folder"),
    (["bench", "--out", "{tmp}/adir"], "--out {tmp}/adir is a folder: give a file path for the bench's JSON"),
    (["bench", "--out", "{tmp}/afile/b.json"], "--out {tmp}/afile/b.json is under {tmp}/afile, which is a file"),
])
def test_a_path_of_the_wrong_kind_is_one_line_before_any_work(capsys, places, argv, message):
    code, err = run_cli(capsys, *[a.format(tmp=places) for a in argv])
    assert code == 2
    assert err.strip().splitlines() == [err.strip()] and err.startswith("eftguard: error: ")
    assert message.format(tmp=places) in err
    assert sorted(p.name for p in places.iterdir()) == ["adir", "afile"]  # no run, key or bench started
    assert (places / "adir" / "kept").read_text() == "still here\n"  # --force did not touch the folder


def test_load_cifar_names_a_data_dir_that_is_a_file(places):
    with pytest.raises(DataError, match="afile is a file: give the folder that holds"):
        load_cifar("cifar10", places / "afile")


def test_the_bench_replaces_its_json_whole_or_not_at_all(capsys, places, monkeypatch):
    """The JSON is written at the end of a long bench: a disk that fills half-way through the write leaves the
    earlier file intact and no temporary file behind."""
    import errno
    import pathlib

    import eftguard.bench

    out = places / "adir" / "bench.json"
    out.write_text('{"earlier": true}\n')
    monkeypatch.setattr(eftguard.bench, "run_bench", lambda cfg, progress=None: {"config": {"steps": 10}})
    monkeypatch.setattr(eftguard.bench, "print_tables", lambda result: None)
    write_text = pathlib.Path.write_text

    def full_disk(path, text, *args, **kwargs):
        write_text(path, text[:len(text) // 2], *args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        main(["bench", "--out", str(out)])
    monkeypatch.undo()
    assert json.loads(out.read_text()) == {"earlier": True}
    assert sorted(p.name for p in out.parent.iterdir()) == ["bench.json", "kept"]


def test_flower_stays_quiet_when_it_is_first_imported_after_the_setting():
    """Flower's import sets its logger to DEBUG: a resumed run (flwr not yet imported) printed Flower's
    deprecation warning until configure_ray_and_flower imported it before quietening it."""
    code = ("from eftguard.federation.simulation import configure_ray_and_flower\n"
            "import sys, logging\n"
            "assert 'flwr' not in sys.modules\n"
            "configure_ray_and_flower(verbose=False)\n"
            "from flwr.simulation import run_simulation\n"
            "print(logging.getLogger('flwr').level)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "40"  # logging.ERROR
