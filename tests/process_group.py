"""Runs a command in a process group of its own and ends the whole group with it: a test that launches
workers (torchrun's ranks, the demo's daemon) leaves none behind when it passes, fails, times out or is
interrupted (Ctrl-C, the launcher's own timeout)."""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile


def run(cmd: list[str], timeout: float, **popen) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)`, with every process the command
    started killed when it returns or raises. The output goes through files, not pipes, so that a worker still
    holding them cannot keep the call waiting after the command itself has ended."""
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, start_new_session=True, **popen)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            raise subprocess.TimeoutExpired(cmd, timeout, _read(stdout), _read(stderr)) from None
        finally:
            _kill_group(process)  # workers the command left running, and the command itself on Ctrl-C
        return subprocess.CompletedProcess(cmd, process.returncode, _read(stdout), _read(stderr))


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone: every process in it has ended
    process.wait()


def _read(file) -> str:
    file.seek(0)
    return file.read()
