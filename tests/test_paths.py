"""Paths (eftguard/paths.py): the checks of an output or input path, and how the commands outside the attacks
(tests/test_attack_cli.py has those) refuse folders where a file belongs, or files where a folder belongs: one
`eftguard: error:` line that names the problem, exit 2, before any work, and nothing that was there removed. Each
case was a traceback, or a crash after all the work (bench)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LINUX_PROC, run_cli
from eftguard.paths import file_in_the_way, output_file_problem, read_text_file


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


def test_a_file_read_back_must_be_a_regular_file_within_the_limit(places):
    (places / "adir" / "big.json").write_text("x" * 11)
    assert read_text_file(places / "adir" / "kept") == "still here\n"
    assert read_text_file(places / "adir" / "big.json", limit_bytes=11) == "x" * 11
    with pytest.raises(OSError, match=r"big.json is over 10 bytes"):
        read_text_file(places / "adir" / "big.json", limit_bytes=10)
    os.mkfifo(places / "pipe")  # read as a file, a pipe no one writes would block forever
    for path, problem in ((places / "pipe", "is not a regular file"), (places / "adir", "is a folder"),
                          (places / "missing", "does not exist")):
        with pytest.raises(OSError, match=problem):
            read_text_file(path)


def test_the_write_check_leaves_nothing_behind(places):
    assert output_file_problem(places / "adir" / "out.json", "the JSON") is None
    assert sorted(p.name for p in (places / "adir").iterdir()) == ["kept"]




@LINUX_PROC
def test_a_folder_where_no_file_can_be_created_is_refused_even_to_root(capsys):
    """/proc takes no new file, whoever asks: the check creates one rather than asking os.access, which says yes
    to root (the bench ran to its end and then failed to write its JSON)."""
    assert output_file_problem(Path("/proc/out.json"), "the JSON").startswith("is in /proc, which is not writable (")
    code, err = run_cli(capsys, "bench", "--out", "/proc/bench.json")
    assert code == 2 and "--out /proc/bench.json is in /proc, which is not writable" in err


@LINUX_PROC
@pytest.mark.parametrize("argv, message", [
    (["demo", "--out", "/proc/demo"], "--out /proc/demo: no file can be created there"),
    (["audit", "{toml}", "--out", "/proc/audit"], "--out /proc/audit: no file can be created there"),
    (["certs", "--out", "/proc/certs"], "--out /proc/certs: no file can be created there"),
    (["node-key", "--out", "/proc/node/key"], "--out /proc/node/key is in /proc/node, which is not writable ("),
])
def test_an_out_folder_where_nothing_can_be_created_is_one_line_before_any_work(capsys, tmp_path, argv, message):
    """Each was a traceback from mkdir (the demo's in each of its training processes)."""
    toml = tmp_path / "audit.toml"
    toml.write_text('[grid]\nmask_ratio = [0.75]\n[[attack]]\nfamily = "labels"\n')
    code, err = run_cli(capsys, *[a.format(toml=toml) for a in argv])
    assert code == 2 and err.startswith("eftguard: error: ") and err.count("\n") == 1
    assert message in err


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
    (["audit", "/dev/zero"], "audit file /dev/zero is not a regular file: give the TOML file itself"),  # endless
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
