"""Builds the sinks named by the config's `format`: the built-in formats' (core.sinks.BUILT_IN), each imported only
when a run uses it, and the registered ones."""
from __future__ import annotations

import importlib
from typing import Sequence

from trainmon.core import sinks as table
from trainmon.writers.base import Sink

# The built-in formats' sinks, "module:class" (`api` is the monitor's own, made by it).
_BUILT_IN = {"csv": "trainmon.writers.csv_sink:CsvSink",
             "tensorboard": "trainmon.writers.tensorboard_sink:TensorBoardSink",
             "db": "trainmon.writers.db_sink:DbSink"}


def build_sinks(formats: Sequence[str]) -> list[Sink]:
    """One sink per format; `api` is left out: the monitor always holds its own."""
    out: list[Sink] = []
    for name in formats:
        if name == table.API:
            continue
        make = _BUILT_IN.get(name) or table.registered(name)
        if make is None:
            raise ValueError(f"format {name!r} has no sink; known: {', '.join(table.formats())}")
        if isinstance(make, str):
            module, _, attr = make.partition(":")
            make = getattr(importlib.import_module(module), attr)
        out.append(make())
    return out
