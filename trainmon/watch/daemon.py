"""The daemon's loop over a run or an output root (new runs under a root are picked up), and its signals.

SIGTERM and SIGINT end the current round, draw the heatmaps, save the state and exit 0. `--exit-on-anomaly`
exits (status 3) as soon as the alert is written, without drawing: the job's supervisor waits on it.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Optional

from trainmon.read.errors import InputError
from trainmon.core.layout import RANK_DIR
from trainmon.read.layout import find_run
from trainmon.watch.run_watcher import RunWatcher, WatchOptions
from trainmon.watch.spawn import WATCH_DIR

logger = logging.getLogger("trainmon.watch")
EXIT_ON_ANOMALY_STATUS = 3  # --exit-on-anomaly: an alert was written
_TICK_S = 0.2  # how often the wait between rounds looks at signals and at stalls that fall due


def is_run(path: Path) -> bool:
    """Whether `path` is one run (it holds rank directories, or is one rank's output) rather than a root."""
    if any(RANK_DIR.search(child.name) and child.is_dir() for child in path.iterdir()):
        return True
    try:
        return find_run(path).path == path
    except InputError:
        return False


class Daemon:
    """Follows `path` (a run directory or an output root) until told to stop.

    Args:
        path: the run or the root.
        options: the settings.
        until_done: exit once every rank of every run has finished and been exported.
        follow_pid: exit (after a last round) when this process has ended (the training job that spawned it).

    Raises:
        InputError: `path` is not a directory.
    """

    def __init__(self, path: Path, options: WatchOptions, until_done: bool = False, follow_pid: Optional[int] = None):
        if not path.is_dir():
            raise InputError.at(path, "no such directory; pass a run directory ($MONITOR_OUTPUT_DIR/<run>) or the "
                                      "output root")
        self.path = path
        self.options = options
        self.until_done = until_done
        self.follow_pid = follow_pid
        self.watchers: dict[Path, RunWatcher] = {}
        self._stopping = False

    def _logdir(self, run: Path) -> Path:
        if run == self.path:
            return self.options.logdir or run / WATCH_DIR
        return (self.options.logdir or self.path / WATCH_DIR) / run.name

    def _discover(self) -> None:
        if is_run(self.path):
            runs = [self.path]
        else:
            runs = sorted(child for child in self.path.iterdir() if child.is_dir() and is_run(child))
        if not runs and self.options.once:
            raise InputError.at(self.path, "no run here: no rank_<R> directory with monitor output (monitor.db, records.stream, "
                                           "<family>_<a>-<b>.csv) in it or one level below; pass a run directory "
                                           "($MONITOR_OUTPUT_DIR/<run>) or the output root")
        for run in runs:
            if run not in self.watchers and run != self.options.logdir:
                self.watchers[run] = RunWatcher(run, self._logdir(run), self.options)
                logger.info("trainmon watch: following %s, writing %s", run, self.watchers[run].logdir)

    def _check_read(self) -> None:
        """`--once` never exits 0 on a run it could not read whole: the ranks it could not read are an error
        (after the others were exported)."""
        unreadable = [f"{run.name} rank {rank}: {error}" for run, watcher in self.watchers.items()
                      for rank, error in watcher.unreadable().items()]
        if unreadable:
            raise InputError(f"could not read {'; '.join(unreadable)}. Everything else was exported; repair or "
                             "remove those files and run again")

    def stop(self, *_) -> None:
        self._stopping = True

    def run(self) -> int:
        """The loop; returns the exit status."""
        previous = {sig: signal.signal(sig, self.stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        status = None
        try:
            status = self._loop()
            return status
        finally:
            for watcher in self.watchers.values():
                watcher.finish(draw=status != EXIT_ON_ANOMALY_STATUS)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> int:
        while True:
            # rounds start every interval: a long round shortens the wait, so the lag stays within an interval
            deadline = time.monotonic() + self.options.interval
            parent_gone = self.follow_pid is not None and not _alive(self.follow_pid)
            self._discover()
            for watcher in self.watchers.values():
                alerts = watcher.poll(final=self.options.once)
                if alerts and self.options.exit_on_anomaly:
                    return EXIT_ON_ANOMALY_STATUS
            if self.options.once:
                self._check_read()
            if self.options.once or self._stopping or parent_gone:
                return 0
            if self.until_done and self.watchers and all(w.done for w in self.watchers.values()):
                return 0
            while time.monotonic() < deadline and not self._stopping:
                time.sleep(min(_TICK_S, self.options.interval))
                for watcher in self.watchers.values():
                    watcher.check_stalls()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
