"""One background writer per process: a bounded queue of step batches drained into the sinks."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional

from trainmon.monitor.records import StepBatch
from trainmon.writers.base import Sink

logger = logging.getLogger("trainmon")

_STOP = object()  # private sentinel that ends the worker


class AsyncWriter:
    """Moves step batches from the training thread to the sinks.

    The training thread only enqueues. When the queue is full it waits (policy "block", the wait is
    accounted in `blocked_seconds`) or drops the batch (policy "drop", counted in `dropped_steps`).
    The worker turns records into figures (`derive`) and writes them; a batch that fails is logged
    and skipped, never retried forever.
    """

    def __init__(self, sink: Sink, derive: Callable[[StepBatch], None], max_queue: int = 64,
                 policy: str = "block"):
        if policy not in ("block", "drop"):
            raise ValueError(f"writer policy must be 'block' or 'drop', got {policy!r}")
        self.sink = sink
        self.derive = derive
        self.policy = policy
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.blocked_seconds = 0.0
        self.dropped_steps = 0
        self.failed_steps = 0
        self.written_steps = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainmon-writer", daemon=True)
        self._thread.start()

    def put(self, batch: StepBatch) -> None:
        if self._closed:
            return
        if self.policy == "drop":
            try:
                self._queue.put_nowait(batch)
            except queue.Full:
                self.dropped_steps += 1
                if self.dropped_steps == 1:
                    logger.warning("trainmon: the writer queue is full; step %s and later overflowing "
                                   "steps are dropped (policy 'drop') and counted", batch.step)
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            start = time.perf_counter()
            self._queue.put(batch)
            self.blocked_seconds += time.perf_counter() - start

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            try:
                item.wait()
                self.derive(item)
                self.sink.write(item)
                self.written_steps += 1
            except Exception:
                self.failed_steps += 1
                logger.exception("trainmon: writing step %s failed; the step is skipped", item.step)
            finally:
                self._queue.task_done()
            if self._queue.empty():
                self._flush()

    def _flush(self) -> None:
        try:
            self.sink.flush()
        except Exception:
            logger.exception("trainmon: flushing the sinks failed")

    def drain(self) -> None:
        """Waits until every queued batch is written and flushed."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Writes every queued batch, stops the worker and closes the sinks. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join()
        self._flush()
        try:
            self.sink.close()
        except Exception:
            logger.exception("trainmon: closing the sinks failed")
