"""One background writer per process: a bounded queue of step batches drained into the sinks."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional

import numpy as np

from trainmon.core.defaults import WRITER_POLICIES, WRITER_POLICY, WRITER_QUEUE_SIZE
from trainmon.core.records import StepBatch
from trainmon.writers.base import Sink

logger = logging.getLogger("trainmon")

_STOP = object()  # private sentinel that ends the worker


class AsyncWriter:
    """Moves step batches from the training thread to the sinks.

    The training thread only enqueues. When the queue is full it waits (policy "block", the wait is
    accounted in `blocked_seconds`) or drops the batch (policy "drop", counted in `dropped_steps`).
    The worker writes the batches, each with `derive`, which turns its records into figures when a sink
    first asks for them (a step written only to the database derives nothing). A batch that fails is
    logged and skipped, never retried forever. A worker that stops all the same (an error that escapes it)
    is logged once; the batches queued then and later are dropped and counted, so that a training thread
    waiting on a full queue goes on instead of waiting for ever. `report()` gives every count, for the run
    metadata.

    Args:
        sink: where batches go (usually a SinkContainer).
        derive: a batch's `values` -> its figures per key (`StepBatch.derived`).
        max_queue: batches queued before `policy` applies.
        policy: "block" or "drop".
    """

    def __init__(self, sink: Sink, derive: Callable[[np.ndarray], list], max_queue: int = WRITER_QUEUE_SIZE,
                 policy: str = WRITER_POLICY):
        if policy not in WRITER_POLICIES:
            raise ValueError(f"writer policy must be 'block' or 'drop', got {policy!r}")
        if max_queue < 1:
            raise ValueError(f"writer queue size must be >= 1, got {max_queue!r}")
        self.sink = sink
        self.derive = derive
        self.policy = policy
        self.max_queue = max_queue
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._stopped: Optional[BaseException] = None  # what ended the worker before close()
        self.queued_steps = 0
        self.blocked_seconds = 0.0
        self.blocked_puts = 0
        self.dropped_steps = 0
        self.failed_steps = 0
        self.written_steps = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="trainmon-writer", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, batch: StepBatch) -> None:
        """Queues one step batch (training thread); never does I/O."""
        if self._closed:
            return
        if self._stopped is not None:
            self.dropped_steps += 1
            return
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            if self.policy == "drop":
                self.dropped_steps += 1
                if self.dropped_steps == 1:
                    logger.warning("trainmon: the writer queue (%s steps) is full; step %s and later overflowing "
                                   "steps are dropped (writer_policy 'drop') and counted in run.json",
                                   self.max_queue, batch.step)
                return
            if self.blocked_puts == 0:
                logger.warning("trainmon: the writer falls behind (%s steps queued); training waits for it "
                               "(writer_policy 'block'), the time waited is recorded in run.json", self.max_queue)
            start = time.perf_counter()
            queued = self._put_while_the_worker_runs(batch)
            self.blocked_seconds += time.perf_counter() - start
            self.blocked_puts += 1
            if not queued:
                self.dropped_steps += 1
                return
        self.queued_steps += 1

    def _put_while_the_worker_runs(self, batch) -> bool:
        """Waits for room in the queue as long as the worker runs; whether the batch was queued."""
        while self._stopped is None:
            try:
                self._queue.put(batch, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def _run(self) -> None:
        try:
            self._drain_queue()
        except BaseException as exc:            # an error no batch's handling caught: the worker is gone
            self._stopped = exc
            logger.error("trainmon: the writer stopped (%s: %s); the steps queued now and later are not written, "
                         "and are counted in run.json", type(exc).__name__, exc)
            self._discard_queued()

    def _discard_queued(self) -> None:
        """Takes every batch left in the queue, counted as dropped, so that no one waits for them."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self.dropped_steps += 1
            self._queue.task_done()

    def _drain_queue(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            try:
                self._write(item)
                # Flush before task_done, so that drain() returning means the data reached the sinks.
                if self._queue.empty():
                    self._flush()
            finally:
                self._queue.task_done()

    def _write(self, batch: StepBatch) -> None:
        try:
            batch.wait()
            batch.deriver = self.derive
            self.sink.write(batch)
            self.written_steps += 1
        except Exception:
            self.failed_steps += 1
            if self.failed_steps == 1:
                logger.exception("trainmon: writing step %s failed; the step is skipped (later failures are "
                                 "counted in run.json)", batch.step)
            else:
                logger.debug("trainmon: writing step %s failed", batch.step, exc_info=True)
        except BaseException:                       # it ends the worker (see _run): this step is lost with it
            self.dropped_steps += 1
            raise

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
        if self._thread is not None and self._thread.is_alive() and self._put_while_the_worker_runs(_STOP):
            self._thread.join()
        self._flush()
        try:
            self.sink.close()
        except Exception:
            logger.exception("trainmon: closing the sinks failed")

    def report(self) -> dict:
        """Counts for the run metadata: what was queued, written, dropped, failed, and the time waited."""
        sinks = self.sink.report() if hasattr(self.sink, "report") else {}
        return {"policy": self.policy, "queue_size": self.max_queue, "queued_steps": self.queued_steps,
                "written_steps": self.written_steps, "dropped_steps": self.dropped_steps,
                "failed_steps": self.failed_steps, "blocked_seconds": round(self.blocked_seconds, 6),
                "blocked_puts": self.blocked_puts, "disabled_sinks": sinks}
