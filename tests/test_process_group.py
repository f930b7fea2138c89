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
