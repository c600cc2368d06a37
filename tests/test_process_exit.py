"""How eftguard's processes end: the `eftguard` command skips the interpreter's teardown but keeps what an exit must
do (threads joined, atexit handlers, flushed output, the exit status), and stop_processes does not wait for a
killed process to be reaped."""

import importlib.metadata
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil

from eftguard.federation.simulation import stop_processes

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
