"""How eftguard's processes end: the `eftguard` command skips the interpreter's teardown but keeps what an exit must
do (threads joined, atexit handlers, flushed output, the exit status), and stop_processes does not wait for a
killed process to be reaped, and a Ray session's helpers are stopped once its driver is gone."""

import importlib.metadata
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import OWN_PID_NAMESPACE, can_make_pid_namespaces
from eftguard.federation.simulation import RAY_SESSION_VARIABLE, stop_processes, stop_ray_leftovers

# run in a fresh interpreter: cli.run() ends the process. Ordered by events, not by clocks: the thread can only finish
# once main has returned, so the exit must have waited for it; the atexit handler records whether it ran after it.
EXIT_SCRIPT = textwrap.dedent("""
    import atexit, sys, threading
    from pathlib import Path
    from eftguard import cli
    folder = Path(sys.argv[1])
    atexit.register(lambda: (folder / "atexit").write_text(
        "ran after the thread" if (folder / "thread").exists() else "ran before the thread finished"))
    main_returned = threading.Event()
    def late_writer():
        main_returned.wait()
        (folder / "thread").write_text("finished")
    threading.Thread(target=late_writer).start()
    if sys.argv[2] == "message":
        def command():
            raise SystemExit("a message instead of a status")
    elif sys.argv[2] == "late-output":  # printed once the test has closed its end of our stdout (then our stdin)
        def command():
            sys.stdin.read()
            print("output nobody reads")
    else:
        command = cli.main
    def main():
        try:
            command()
        finally:
            main_returned.set()
    cli.main = main
    sys.argv = ["eftguard", *sys.argv[3:]]
    cli.run()
    print("not reached")
""")


BUFFERED = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # piped output waits for a flush
STARTS_IN = 300  # seconds a fresh interpreter may take to import torch and Flower on a loaded machine


def run_script(tmp_path, mode, *argv):
    return subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path), mode, *argv], capture_output=True,
                          text=True, timeout=STARTS_IN, env=BUFFERED)


def test_the_command_is_run():
    (command,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "eftguard"]
    assert command.value == "eftguard.cli:run"


def test_a_finished_command_flushes_its_output_runs_atexit_and_joins_threads(tmp_path):
    result = run_script(tmp_path, "plain", "demo", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: eftguard demo") and "not reached" not in result.stdout
    assert (tmp_path / "thread").read_text() == "finished"
    assert (tmp_path / "atexit").read_text() == "ran after the thread"


def test_an_error_keeps_its_exit_status_and_message(tmp_path):
    result = run_script(tmp_path, "plain", "demo", "--attack-steps", "-1")
    assert result.returncode == 2
    assert "eftguard: error: --attack-steps -1" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "atexit").read_text() == "ran after the thread"


def test_an_exit_with_a_message_prints_it_and_exits_1(tmp_path):
    result = run_script(tmp_path, "message")
    assert result.returncode == 1
    assert result.stderr.strip() == "a message instead of a status"


def test_output_to_a_reader_that_has_gone_exits_120_without_a_traceback(tmp_path):
    """`eftguard ... | head`: Python's own exit status for an unflushable stdout, and no traceback."""
    process = subprocess.Popen([sys.executable, "-c", EXIT_SCRIPT, str(tmp_path), "late-output"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=BUFFERED)
    process.stdout.close()
    _, err = process.communicate(timeout=STARTS_IN)  # closes its stdin: it prints now, to no reader
    assert process.returncode == 120 and err == ""
    assert (tmp_path / "atexit").read_text() == "ran after the thread"


SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]
DEAF_SLEEPER = [sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                "time.sleep(300)"]


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace():
    process = subprocess.Popen(DEAF_SLEEPER, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "ready\n"
        stop_processes([psutil.Process(process.pid)], grace_seconds=0.3)
        assert process.wait(timeout=10) == -signal.SIGKILL
    finally:
        process.kill()
        process.wait(timeout=10)
        process.stdout.close()


def test_a_killed_process_counts_as_stopped_before_its_parent_reaps_it():
    """Ray's actors outlive their raylet as orphans, reaped by init whenever it gets to them: here the parent
    never reaps, so waiting for the process to disappear would take the whole 5 s timeout."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               f"child = subprocess.Popen({SLEEPER!r}); print(child.pid, flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        started = time.monotonic()
        stop_processes([child], grace_seconds=0)
        assert time.monotonic() - started < 4.0
        assert child.status() == psutil.STATUS_ZOMBIE  # killed, and not reaped by its sleeping parent
    finally:
        parent.kill()
        parent.wait(timeout=10)
        parent.stdout.close()


# --- the helpers of a Ray session whose driver is gone (stop_ray_leftovers) -------------------------------------

REPOSITORY = Path(__file__).resolve().parents[1]
SESSION_HOLDER = """
import subprocess, sys
from eftguard.federation.simulation import ray_session
with ray_session() as session:
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(session.tag, flush=True)
    sys.stdin.read()  # until the test closes our stdin (or kills us)
    helper.kill()
    helper.wait()
"""
def start_session(namespace: list[str]) -> tuple[subprocess.Popen, str, list[psutil.Process]]:
    """A driver holding a Ray session (in its own PID namespace if namespace is given) and a helper process that
    inherited the session's tag: (driver, tag, the helper as this process sees it)."""
    driver = subprocess.Popen([*namespace, sys.executable, "-c", SESSION_HOLDER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPOSITORY)})
    ready, _, _ = select.select([driver.stdout], [], [], 120)
    assert ready, "the session holder did not start"
    tag = driver.stdout.readline().strip()
    deadline = time.monotonic() + 30  # under load the helper's /proc entry may lag its start: poll, bounded
    while True:
        helpers = [p for p in psutil.process_iter() if environ_of(p).get(RAY_SESSION_VARIABLE) == tag and
                   p.cmdline()[-1:] == ["import time; time.sleep(300)"]]
        if helpers or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(helpers) == 1
    return driver, tag, helpers


def environ_of(process: psutil.Process) -> dict:
    try:
        return process.environ()
    except psutil.Error:
        return {}


def stop_session(driver: subprocess.Popen, helpers: list[psutil.Process]) -> None:
    driver.stdin.close()
    driver.stdout.close()
    try:
        driver.wait(timeout=30)
    finally:
        driver.kill()
        driver.wait(timeout=30)
        stop_processes(helpers, grace_seconds=0)


@pytest.mark.parametrize("namespace", [
    pytest.param([], id="same PID namespace"),
    pytest.param(OWN_PID_NAMESPACE, id="own PID namespace", marks=pytest.mark.skipif(
        not can_make_pid_namespaces(), reason="unprivileged user and PID namespaces are off here")),
])
def test_only_helpers_of_a_session_whose_driver_is_gone_are_stopped(tmp_path, namespace):
    """Issue 34, item 2: a live run's Ray processes are never taken for leftovers, even where their driver's
    process id means nothing here (a container: its own PID namespace); a killed driver's are stopped, and the
    session folder it left goes with them. Tags naming a folder this process cannot see, or another token, are
    left alone too."""
    live, live_tag, live_helpers = start_session(namespace)
    killed, killed_tag, orphans = start_session([])
    unseen, killed_folder = tmp_path / "eftguard-ray-elsewhere", killed_tag.partition(":")[2]
    strangers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                  env={**os.environ, RAY_SESSION_VARIABLE: tag})
                 for tag in (f"0123:{unseen}", f"wrong-token:{killed_folder}")]
    try:
        killed.kill()  # SIGKILL: the driver's lock goes with it, its helper stays
        killed.wait(timeout=30)
        stopped = stop_ray_leftovers()
        assert [p.pid for p in stopped] == [orphans[0].pid]
        assert not Path(killed_tag.partition(":")[2]).exists() and Path(live_tag.partition(":")[2]).is_dir()
        assert all(helper.is_running() for helper in live_helpers) and all(s.poll() is None for s in strangers)
    finally:
        for stranger in strangers:
            stranger.kill()
            stranger.wait(timeout=30)
        stop_session(live, live_helpers)
        stop_session(killed, orphans)
