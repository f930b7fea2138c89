"""What a step has noted about tensors, found again by the tensor object itself."""
from __future__ import annotations

import weakref
from typing import Hashable

import torch


class TensorMemo:
    """Values noted under keys that name a tensor (its `id`, alone or with more), valid while that tensor lives.

    `get` returns a value only for the very tensor it was noted for: an `id` reused by another tensor after
    the first one died does not match. The weak references and the values are kept in two dicts, so that a
    value made of numbers leaves Python's garbage collector nothing to track; a tuple of a weak reference and a
    value per tensor would live for the step, long enough to reach the collector's oldest generation, whose
    full collections pause the process for a time that grows with its heap. Values are never None.
    """

    __slots__ = ("_refs", "_values")

    def __init__(self):
        self._refs: dict[Hashable, weakref.ref] = {}
        self._values: dict[Hashable, object] = {}

    def get(self, key: Hashable, tensor: torch.Tensor):
        """The value noted under `key` for `tensor`, or None."""
        ref = self._refs.get(key)
        return self._values[key] if ref is not None and ref() is tensor else None

    def put(self, key: Hashable, tensor: torch.Tensor, value) -> None:
        self._refs[key] = weakref.ref(tensor)     # the tensor's one plain weak reference, made once
        self._values[key] = value

    def clear(self) -> None:
        self._refs.clear()
        self._values.clear()
