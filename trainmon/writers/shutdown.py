"""Writes every queued step when the process receives SIGTERM, then lets the signal do what it did before."""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Callable

logger = logging.getLogger("trainmon")


class SigtermDrain:
    """A SIGTERM handler, installed from the main thread, that saves the monitor's queued output.

    If a handler was installed before (a framework that checkpoints on SIGTERM and may go on training),
    the queue is drained and that handler is called. If SIGTERM had its default action, the monitor
    is closed (every queued step written, files closed, run.json updated) and the process is
    terminated by the signal as it would have been. An ignored SIGTERM stays ignored.

    Args:
        drain: writes every queued step and returns.
        close: writes every queued step and closes the output.
    """

    def __init__(self, drain: Callable[[], None], close: Callable[[], None]):
        self._drain = drain
        self._close = close
        self._previous = None
        self._installed = False

    def install(self) -> bool:
        """Installs the handler; returns False (and does nothing) off the main thread or if SIGTERM is ignored."""
        if threading.current_thread() is not threading.main_thread():
            logger.info("trainmon: set_monitor runs off the main thread, so no SIGTERM handler is installed; "
                        "steps queued at SIGTERM may be lost")
            return False
        previous = signal.getsignal(signal.SIGTERM)
        if previous == signal.SIG_IGN:
            return False
        self._previous = previous
        signal.signal(signal.SIGTERM, self._handle)
        self._installed = True
        return True

    def remove(self) -> None:
        """Restores the previous handler, unless someone replaced ours meanwhile (then theirs stays)."""
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        self._installed = False

    def _handle(self, signum, frame) -> None:
        previous = self._previous
        chained = callable(previous)
        try:
            (self._drain if chained else self._close)()
        except Exception:
            logger.exception("trainmon: saving the queued steps at SIGTERM failed")
        if chained:
            previous(signum, frame)
            return
        # Default action: terminate by the same signal, so the exit status tells the parent what happened.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
