"""Runs a command in a process group of its own and ends the whole group with it: a test that launches
workers (torchrun's ranks, the demo's daemon) leaves none behind when it passes, fails, times out or is
interrupted (Ctrl-C, the launcher's own timeout, or a SIGTERM to pytest: see `interrupt_on_sigterm`)."""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading


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


_owner = None  # the process whose SIGTERM `interrupt_on_sigterm` turns into an interrupt


def interrupt_on_sigterm() -> None:
    """Makes a SIGTERM to this process (what `timeout`, a CI runner's or a launcher's time limit sends) interrupt it
    as Ctrl-C does, so that `run`'s cleanup ends the groups it launched: by default SIGTERM ends the interpreter
    without it, and their workers, in sessions of their own, would outlive it. Processes forked from this one keep
    SIGTERM's default. Leaves a handler someone else installed in place."""
    global _owner
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    _owner = os.getpid()
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame) -> None:
    if os.getpid() != _owner:  # a forked child: end as the default would
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
