"""The aten ops a piece of code runs, seen through a dispatch mode: what tests of host syncs and of idle hooks count."""
from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode


class Ops(TorchDispatchMode):
    """The aten ops run inside the mode, in order (`ops`) and counted (`counts`). A copy to another device (`.cpu()`,
    `.to(device)`) is named "to another device": a dtype cast is the same aten op without a device."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name == "aten._to_copy" and (kwargs or {}).get("device") is not None:
            name = "to another device"
        self.ops.append(name)
        return func(*args, **(kwargs or {}))

    @property
    def counts(self) -> collections.Counter:
        return collections.Counter(self.ops)
