"""Runs one multi-process job under torchrun on 127.0.0.1 with a free port and a hard timeout."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from process_group import run

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int, args: list[str], output_dir, env: dict | None = None) -> str:
    """Runs `script` (in this directory) on `nproc` processes; returns its combined output, fails with it."""
    # PYTHONFAULTHANDLER: a rank ended by a signal (SIGSEGV, SIGBUS) prints every thread's Python stack first
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "MONITOR_OUTPUT_DIR": str(output_dir),
                "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    full_env.pop("DYNAMIC_MONITOR", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", os.path.join(HERE, script)] + args
    try:
        done = run(cmd, TIMEOUT_S, env=full_env)  # the ranks end with torchrun, whatever ends it
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{script} {args} hung for {TIMEOUT_S}s:\n{err.stdout}\n{err.stderr}") from None
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} {args} failed ({done.returncode}):\n{_fatal_stacks(output)}{output[-6000:]}"
    return output


def _fatal_stacks(output: str) -> str:
    """The faulthandler dumps of ranks a signal ended, which the other ranks' tracebacks would push out of the
    tail the failure shows."""
    start = output.find("Fatal Python error")
    if start < 0 or start >= len(output) - 6000:
        return ""
    return output[start:start + 6000] + "\n...\n"
