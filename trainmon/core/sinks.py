"""The output formats: the names a config's `format` may give, in one table.

The built-in formats' sinks are made by `trainmon.writers.registry.build_sinks` (which imports each only when a run
uses it: a job that writes CSV never imports TensorBoard). `register_sink` adds a format of one's own, before the
config is loaded:

    class JsonLinesSink(trainmon.writers.base.Sink): ...
    trainmon.register_sink("jsonl", JsonLinesSink)   # then "format": ["csv", "jsonl"]

A sink is made by calling its factory with no arguments; it learns where and what to write in `start`
(`SinkContext`).
"""
from __future__ import annotations

from typing import Callable, Optional

API = "api"  # the in-memory sink behind `generate_*_metrics`: always present, whatever `format` says
BUILT_IN: tuple[str, ...] = ("csv", API, "tensorboard", "db")
_REGISTERED: dict[str, Callable[[], object]] = {}


def formats() -> tuple[str, ...]:
    """The format names a config may give, built-in first, then registered ones in their order."""
    return BUILT_IN + tuple(_REGISTERED)


def registered(name: str) -> Optional[Callable[[], object]]:
    """The factory of a format registered with `register_sink`; None for another name."""
    return _REGISTERED.get(name)


def register_sink(name: str, make: Callable[[], object]) -> None:
    """Makes `name` a format the config accepts, written by `make()` (a `Sink` subclass, or any callable
    returning a Sink). Registering a name again replaces it; a built-in name cannot be replaced."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a sink format needs a non-empty name, got {name!r}")
    if name in BUILT_IN:
        raise ValueError(f"{name!r} is a built-in format; register yours under another name")
    if not callable(make):
        raise TypeError(f"register_sink({name!r}, ...) needs a Sink class or a callable returning a Sink, "
                        f"got {make!r}")
    _REGISTERED[name] = make


def unregister_sink(name: str) -> None:
    """Removes a registered format (built-ins stay)."""
    if name in BUILT_IN:
        raise ValueError(f"{name!r} is a built-in format and cannot be removed")
    _REGISTERED.pop(name, None)
