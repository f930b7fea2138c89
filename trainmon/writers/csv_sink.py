"""msprobe-compatible CSV files: `<family>_<first>-<last>.csv` per family and range of collected steps.

Within a step, rows are written in the order of their records' call indices.
"""
from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Callable, TextIO

from trainmon.core.layout import family_file_name
from trainmon.core.records import StepBatch
from trainmon.writers.base import Sink, SinkContext


class _RangeFiles:
    """The open files of one range of `step_count_per_record` collected steps.

    A file's name always tells the steps it holds, so it is renamed when a later step of the
    range arrives (a job that stops early leaves correctly named files).
    """

    def __init__(self, directory: Path, first_step: int):
        self.directory = directory
        self.first = first_step
        self.last = first_step
        self.steps = 0
        self.files: dict[str, TextIO] = {}
        self.writers: dict[str, csv.writer] = {}

    def path(self, family: str, last: int) -> Path:
        return self.directory / family_file_name(family, self.first, last)

    def extend_to(self, step: int) -> None:
        if step != self.last:
            for family in self.files:
                os.replace(self.path(family, self.last), self.path(family, step))
            self.last = step
        self.steps += 1

    def writer(self, family: str, header: Callable[[str], list[str]]):
        """The family's CSV writer; `header(family)` is written when its file is opened."""
        if family not in self.writers:
            handle = open(self.path(family, self.last), "w", newline="")
            self.files[family] = handle
            self.writers[family] = csv.writer(handle)
            self.writers[family].writerow(header(family))
        return self.writers[family]

    def flush(self) -> None:
        for handle in self.files.values():
            handle.flush()

    def close(self) -> None:
        for handle in self.files.values():
            handle.close()
        self.files.clear()
        self.writers.clear()


class CsvSink(Sink):
    name = "csv"

    def __init__(self):
        self._context: SinkContext | None = None
        self._range: _RangeFiles | None = None
        self._spec = ""
        self._shapes: dict[tuple, str] = {}  # shape -> its column: a run has few shapes, rows many

    def start(self, context: SinkContext) -> None:
        context.rank_dir.mkdir(parents=True, exist_ok=True)
        self._context = context
        self._spec = f".{context.ndigits}g"

    def _header(self, family: str) -> list[str]:
        index = ["vpp_stage", "name", "step"]
        if family in self._context.per_micro_families:
            index.append("micro_step")
        return index + list(self._context.ops) + ["shape", "dtype"]

    def _format(self, value) -> str:
        return "" if value is None else format(value, self._spec)

    def _shape(self, shape: tuple) -> str:
        text = self._shapes.get(shape)
        if text is None:
            text = self._shapes[shape] = str(list(shape))
        return text

    def write(self, batch: StepBatch) -> None:
        if not batch.keys:
            return
        ctx = self._context
        if self._range is not None and self._range.steps >= ctx.step_count_per_record:
            self._range.close()
            self._range = None
        if self._range is None:
            self._range = _RangeFiles(ctx.rank_dir, batch.step)
        self._range.extend_to(batch.step)
        # Rows in the rank's order of events (records are batched, so keys arrive out of it): a CSV row has
        # no call index, and its position is what orders it within its step and micro-step (nan-analyze).
        for key, figures in sorted(zip(batch.keys, batch.derived), key=lambda row: row[0].call_index):
            row = [key.vpp_stage, key.name, batch.step]
            if key.family in ctx.per_micro_families:
                row.append(key.micro_step)
            row += [self._format(figures.get(op)) for op in ctx.ops]
            row += [self._shape(key.shape), key.dtype]
            self._range.writer(key.family, self._header).writerow(row)

    def flush(self) -> None:
        if self._range is not None:
            self._range.flush()

    def close(self) -> None:
        if self._range is not None:
            self._range.close()
            self._range = None
