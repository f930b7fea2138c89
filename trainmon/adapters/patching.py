"""Reversible replacement of one attribute of one object (a bound method of a framework's instance)."""
from __future__ import annotations

from typing import Callable

_ABSENT = object()


def patch_attribute(owner, name: str, value) -> Callable[[], None]:
    """Sets `owner.<name> = value` and returns the function that undoes exactly that.

    An attribute the instance held itself is put back; otherwise the instance attribute is deleted so
    the class's shows through again.
    """
    previous = owner.__dict__.get(name, _ABSENT)
    setattr(owner, name, value)

    def restore() -> None:
        if previous is _ABSENT:
            owner.__dict__.pop(name, None)
        else:
            setattr(owner, name, previous)

    return restore
