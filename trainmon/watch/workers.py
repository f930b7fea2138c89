"""The daemon's worker processes (the heatmap painter, the readers of `--once`): they die with the daemon.

A `kill -9` of the daemon runs none of its clean-up, and a worker blocked on its task queue would wait for
minutes. On Linux each worker asks the kernel for SIGKILL when its parent dies (PR_SET_PDEATHSIG); elsewhere
a thread of the worker exits it once its parent has changed.
"""
from __future__ import annotations

import ctypes
import gc
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PARENT_CHECK_S = 1.0


def _die_with_parent(parent: int) -> None:
    """The workers' initializer. It first freezes what the worker inherited by fork, so that the worker's garbage
    collector never destroys the parent's objects: a torch process group's destructor, for one, waits for threads
    that a forked child does not have, and the worker would hang."""
    gc.freeze()
    if sys.platform.startswith("linux") and _set_death_signal():
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)
        return
    threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()


def _set_death_signal() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_PARENT_CHECK_S)
    os._exit(1)


class WorkerPool(ProcessPoolExecutor):
    """A process pool (fork where there is one: workers start at once, with trainmon already imported)
    whose workers die with the process that made it. Make it from the daemon's main thread: the kernel
    signals a worker when the thread that forked it ends."""

    def __init__(self, workers: int):
        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
        super().__init__(workers, mp_context=context, initializer=_die_with_parent, initargs=(os.getpid(),))

    def kill(self) -> None:
        """Ends the workers now, dropping their tasks: an exit that must not wait for them."""
        processes = list((self._processes or {}).values())
        self.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.kill()
