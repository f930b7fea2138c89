"""A launched command's workers end with it, whether it finishes, times out or is interrupted."""
import os
import subprocess
import sys
import time

import pytest

from process_group import run

# A parent that starts a worker which outlives it, as torchrun's ranks or the demo's daemon can, and prints its pid.
SPAWNER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(worker.pid, flush=True)
time.sleep(float(sys.argv[1]))
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has ended: only its parent has not reaped it yet
        return stat.read().split(")")[-1].split()[0] != "Z"


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_the_worker_ends_with_a_command_that_finishes():
    done = run([sys.executable, "-c", SPAWNER, "0"], timeout=60)
    assert done.returncode == 0 and _gone(int(done.stdout.split()[0]))


@pytest.mark.slow
def test_the_worker_ends_with_a_command_that_times_out():
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        run([sys.executable, "-c", SPAWNER, "120"], timeout=3)
    assert _gone(int(timed_out.value.stdout.split()[0]))


def test_pytest_takes_sigterm_as_an_interrupt():
    import signal

    handler = signal.getsignal(signal.SIGTERM)
    assert callable(handler), "conftest's pytest_configure installs it"
    with pytest.raises(KeyboardInterrupt):
        handler(signal.SIGTERM, None)


# What pytest does when a SIGTERM (`timeout`, a CI runner's time limit) reaches it during a launched job.
TERMINATED = f"""
import sys
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from process_group import interrupt_on_sigterm, run
interrupt_on_sigterm()
try:
    run([sys.executable, "-c", {SPAWNER!r}, "120"], timeout=100)
except KeyboardInterrupt:
    sys.exit(2)
"""


@pytest.mark.slow
def test_the_worker_ends_with_a_process_that_gets_sigterm(tmp_path):
    import signal

    parent = subprocess.Popen([sys.executable, "-c", TERMINATED], stdout=subprocess.PIPE, text=True)
    # the spawner prints its worker's pid through `run`'s file only at the end: find the worker as a grandchild
    deadline, worker = time.monotonic() + 30, None
    while worker is None and time.monotonic() < deadline:
        worker = _grandchild(parent.pid)
        time.sleep(0.05)
    assert worker is not None, "the worker did not start"
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 2, "the SIGTERM interrupted it"
    assert _gone(worker)


def _grandchild(pid: int):
    """The pid of a child of a child of `pid` (None: none yet)."""
    def children(p):
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                return [int(c) for c in f.read().split()]
        except FileNotFoundError:
            return []
    return next((g for c in children(pid) for g in children(c)), None)
