"""The output formats: a config `format` name -> the sink that writes it, in one table.

The config's allowed formats are this table's names; `trainmon.writers.registry.build_sinks` makes the sinks.
Built-in sinks are named by "module:class" and imported only when a run uses them (a job that writes CSV
never imports TensorBoard). `register_sink` adds a format of one's own, before the config is loaded:

    class JsonLinesSink(trainmon.writers.base.Sink): ...
    trainmon.register_sink("jsonl", JsonLinesSink)   # then "format": ["csv", "jsonl"]

A sink is made by calling its factory with no arguments; it learns where and what to write in `start`
(`SinkContext`).
"""
from __future__ import annotations

from typing import Callable, Union

Factory = Union[str, Callable[[], object]]

API = "api"  # the in-memory sink behind `generate_*_metrics`: always present, whatever `format` says
_SINKS: dict[str, Factory] = {
    "csv": "trainmon.writers.csv_sink:CsvSink",
    API: "trainmon.writers.api_sink:ApiSink",
    "tensorboard": "trainmon.writers.tensorboard_sink:TensorBoardSink",
    "db": "trainmon.writers.db_sink:DbSink",
}


def formats() -> tuple[str, ...]:
    """The format names a config may give, built-in first, then registered ones in their order."""
    return tuple(_SINKS)


def factory(name: str) -> Factory:
    """The factory of format `name` ("module:class" for built-ins); KeyError for an unknown name."""
    return _SINKS[name]


def register_sink(name: str, make: Callable[[], object]) -> None:
    """Makes `name` a format the config accepts, written by `make()` (a `Sink` subclass, or any callable
    returning a Sink). Registering a name again replaces it; a built-in name cannot be replaced."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a sink format needs a non-empty name, got {name!r}")
    if name in _BUILT_IN:
        raise ValueError(f"{name!r} is a built-in format; register yours under another name")
    if not callable(make):
        raise TypeError(f"register_sink({name!r}, ...) needs a Sink class or a callable returning a Sink, "
                        f"got {make!r}")
    _SINKS[name] = make


def unregister_sink(name: str) -> None:
    """Removes a registered format (built-ins stay)."""
    if name in _BUILT_IN:
        raise ValueError(f"{name!r} is a built-in format and cannot be removed")
    _SINKS.pop(name, None)


_BUILT_IN = frozenset(_SINKS)
