"""Starting the daemon from a training job: one detached process, spawned by global rank 0.

This is the only module of the package the monitor imports, and it imports nothing else of it: the
daemon runs in its own interpreter, never as a thread in training.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Optional

logger = logging.getLogger("trainmon")
LOG_FILE = "watch.log"
WATCH_DIR = "watch"  # the default log directory, inside the run (or the root)


def watch_logdir(run: Path, config) -> Path:
    """Where the daemon of `run` writes, by the `watch` section (`WatchConfig`)."""
    return Path(config.logdir) if config.logdir else run / WATCH_DIR


def watch_flags(config) -> list[str]:
    """The `trainmon watch` flags of a `watch` section: each key is the flag of its name (`stall_after`:
    `--stall-after`), so a key added to the section reaches the daemon; `enable` and `logdir` are not flags."""
    flags = []
    for key in fields(config):
        value = getattr(config, key.name)
        if key.name in ("enable", "logdir") or value in ("", [], None):
            continue
        flag = "--" + key.name.replace("_", "-")
        flags += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return flags


def spawn_watch(run: Path, config, parent_pid: Optional[int] = None) -> Optional[subprocess.Popen]:
    """Starts `trainmon watch` on `run` in a new session, its output in `<logdir>/watch.log`.

    Args:
        run: the run directory.
        config: the `watch` section (`WatchConfig`).
        parent_pid: the daemon makes a last round and exits when this process has ended (default: this one).

    Returns:
        The process, or None when it could not be started (logged; training goes on).
    """
    logdir = watch_logdir(run, config)
    command = [sys.executable, "-m", "trainmon.cli", "watch", str(run), "--logdir", str(logdir), *watch_flags(config),
               "--until-done", "--follow-pid", str(parent_pid or os.getpid())]
    try:
        logdir.mkdir(parents=True, exist_ok=True)
        with open(logdir / LOG_FILE, "ab") as log:
            # its own session: a Ctrl-C or SIGTERM sent to the job's process group does not cut its last round
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    except OSError as err:
        logger.error("trainmon: cannot start trainmon watch (%s); training continues without it", err)
        return None
    logger.info("trainmon: trainmon watch started (pid %s), writing %s", process.pid, logdir)
    return process
