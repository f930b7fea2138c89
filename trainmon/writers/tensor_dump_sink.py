"""Writes the captures of the `dump` config block, in the writer thread.

`rank_<R>/dumps/step<S>/tensors.safetensors` holds the stored tensors; `index.json` lists every captured
tensor in call order (module, phase, role, micro-step, shape, dtype, whether it was stored, its
statistic record), the stack of each module's first call, and what the size cap cut. A capture is
written with the first step batch of its step or a later one, and at the latest when the writer closes.
"""
from __future__ import annotations

import json
import logging
import threading

import torch

from trainmon.writers.tensor_files import save_tensors
from trainmon.engine import stats
from trainmon.core.derive import derive_ops
from trainmon.core.schema import OPS
from trainmon.hooks.tensor_dump import StepCapture
from trainmon.writers.base import Sink, SinkContext
from trainmon.core.layout import DUMPS_DIR, INDEX_FILE, TENSOR_FILE  # noqa: F401 (the layout readers find)
from trainmon.core.layout import dump_step_dir_name

logger = logging.getLogger("trainmon")
_ALL_FIELDS = stats.fields_for_ops(OPS)


class TensorDumpSink(Sink):
    """Receives StepCaptures from the training thread (`add`) and writes them in the writer thread."""

    name = "dump"

    def __init__(self):
        self._pending: list[StepCapture] = []
        self._lock = threading.Lock()
        self._rank_dir = None
        self._eps = 1e-8

    def start(self, context: SinkContext) -> None:
        self._rank_dir = context.rank_dir
        self._eps = float(context.metadata.get("config", {}).get("eps", self._eps))

    def add(self, capture: StepCapture) -> None:
        with self._lock:
            self._pending.append(capture)

    def write(self, batch) -> None:
        self._write(lambda capture: capture.step <= batch.step)

    def close(self) -> None:
        self._write(lambda capture: True)

    def _write(self, due) -> None:
        with self._lock:
            ready = [c for c in self._pending if due(c)]
            self._pending = [c for c in self._pending if not due(c)]
        for capture in ready:
            directory = self._rank_dir / DUMPS_DIR / dump_step_dir_name(capture.step)
            directory.mkdir(parents=True, exist_ok=True)
            index = self._index(capture.wait())
            save_tensors(directory / TENSOR_FILE, {t.key: t.host for t in capture.tensors if t.host is not None})
            (directory / INDEX_FILE).write_text(json.dumps(index, indent=1, default=str))
            logger.info("trainmon: tensors of step %s dumped to %s", capture.step, directory)

    def _index(self, capture: StepCapture) -> dict:
        stored = [t for t in capture.tensors if t.host is not None]
        records = {}
        if stored:  # the statistic record of each stored tensor, computed here from its host copy
            rows = torch.cat([stats.tensor_records([t.host], self._eps, _ALL_FIELDS) for t in stored])
            records = {t.key: derive_ops(row.tolist(), OPS) for t, row in zip(stored, rows)}
        cut = [t for t in capture.tensors if t.host is None]
        return {"format": "trainmon-dump", "version": 1, "rank": capture.rank, "step": capture.step,
                "file": TENSOR_FILE, "max_mb_per_step": capture.max_bytes >> 20, "stored_bytes": capture.stored_bytes,
                "cut": [{"key": t.key, "bytes": t.nbytes} for t in cut],
                "cut_bytes": sum(t.nbytes for t in cut),
                "tensors": [{"key": t.key, "call": t.call, "module": t.module, "phase": t.phase, "role": t.role,
                             "micro_step": t.micro_step, "shape": t.shape, "dtype": t.dtype,
                             "stored": t.host is not None, "record": records.get(t.key)} for t in capture.tensors],
                "stacks": capture.stacks}
