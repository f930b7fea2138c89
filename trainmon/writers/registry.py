"""Builds the sinks named by the config's `format` from the sink table (trainmon.core.sinks)."""
from __future__ import annotations

import importlib
from typing import Sequence

from trainmon.core import sinks as table
from trainmon.writers.base import Sink


def build_sinks(formats: Sequence[str]) -> list[Sink]:
    """One sink per format; `api` is left out: the monitor always holds its own."""
    out: list[Sink] = []
    for name in formats:
        if name == table.API:
            continue
        try:
            make = table.factory(name)
        except KeyError:
            raise ValueError(f"format {name!r} has no sink; known: {', '.join(table.formats())}") from None
        if isinstance(make, str):
            module, _, attr = make.partition(":")
            make = getattr(importlib.import_module(module), attr)
        out.append(make())
    return out
