"""Builds the sinks named by the config's `format`."""
from __future__ import annotations

from typing import Sequence

from trainmon.writers.base import Sink


def build_sinks(formats: Sequence[str], stream: bool = False) -> list[Sink]:
    """`stream`: the `db` format writes the record stream (the output is on a network filesystem)."""
    sinks: list[Sink] = []
    for fmt in formats:
        if fmt == "csv":
            from trainmon.writers.csv_sink import CsvSink
            sinks.append(CsvSink())
        elif fmt == "tensorboard":
            from trainmon.writers.tensorboard_sink import TensorBoardSink
            sinks.append(TensorBoardSink())
        elif fmt == "db":
            from trainmon.writers.db_sink import DbSink
            sinks.append(DbSink(stream))
        elif fmt == "api":
            pass  # the in-memory api sink is always present
        else:
            raise ValueError(f"format {fmt!r} has no sink")
    return sinks
