"""Starting the daemon from a training job: one detached process, spawned by global rank 0.

This is the only module of the package the monitor imports, and it imports nothing else of it: the
daemon runs in its own interpreter, never as a thread in training.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

logger = logging.getLogger("trainmon")
LOG_FILE = "watch.log"
WATCH_DIR = "watch"  # the default log directory, inside the run (or the root)


def watch_logdir(run: Path, config) -> Path:
    """Where the daemon of `run` writes, by the `watch` section (`WatchConfig`)."""
    return Path(config.logdir) if config.logdir else run / WATCH_DIR


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
    command = [sys.executable, "-m", "trainmon.cli", "watch", str(run), "--logdir", str(logdir),
               "--interval", str(config.interval), "--stall-after", str(config.stall_after),
               "--heatmap-every", str(config.heatmap_every), "--until-done",
               "--follow-pid", str(parent_pid or os.getpid())]
    if config.ranks:
        command += ["--ranks", *map(str, config.ranks)]
    if config.detail:
        command += ["--detail", *config.detail]
    if config.on_anomaly:
        command += ["--on-anomaly", config.on_anomaly]
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
