"""Where torch.distributed's functions are kept, by torch itself and by frameworks that bound them before
trainmon installed its wrappers, so that `cc_distribution` re-points all of them and puts them back.

A framework that writes `dist_reduce_scatter_func = torch.distributed.reduce_scatter_tensor` at import calls
that object ever after, whatever `torch.distributed` holds later; its binding has to be re-pointed where it
lives. Each entry of `KNOWN_BINDINGS` is (module, attribute path); a binding is re-pointed only while it
still holds the original torch function (a framework may have chosen its own, e.g. Megatron's
`reduce_scatter_with_fp32_accumulation`), and put back only while it still holds the wrapper.
"""
from __future__ import annotations

import sys
from typing import Callable, NamedTuple

from trainmon.core.collective_ops import ALL_OPS

# torch's own modules hold every wrapped function under its name, and `_coalescing_manager`, which defers
# the collectives called inside it to its exit.
COALESCING_MANAGER = "_coalescing_manager"
_TORCH = tuple((module, op) for module in ("torch.distributed", "torch.distributed.distributed_c10d")
               for op in ALL_OPS + (COALESCING_MANAGER,))
# Megatron-Core binds `dist_all_gather_func` / `dist_reduce_scatter_func` at import (the distributed
# optimizer's grad reduce-scatter and param all-gather, tensor-parallel mappings) and imports
# `_coalescing_manager` by name.
_MEGATRON_FUNCS = ("dist_all_gather_func", "dist_reduce_scatter_func")
_MEGATRON = tuple((f"megatron.core.{module}", attribute) for module, attributes in (
    ("distributed.param_and_grad_buffer", _MEGATRON_FUNCS + (COALESCING_MANAGER,)),
    ("distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer", (COALESCING_MANAGER,)),
    ("tensor_parallel.mappings", _MEGATRON_FUNCS),
    ("tensor_parallel.layers", _MEGATRON_FUNCS),
    ("tensor_parallel.utils", ("dist_all_gather_func",)),
    ("transformer.multi_token_prediction", ("dist_all_gather_func",)),
    ("timers", ("dist_all_gather_func",)),
    ("utils", ("dist_all_gather_func",)),
) for attribute in attributes)
# DeepSpeed's torch comm backend (`deepspeed.comm.comm.cdb`) binds these when it initialises; ZeRO's
# all_gather_into_tensor / reduce_scatter_tensor go through them.
_DEEPSPEED = (("deepspeed.comm.comm", "cdb.all_gather_function"), ("deepspeed.comm.comm", "cdb.reduce_scatter_function"))
KNOWN_BINDINGS = _TORCH + _MEGATRON + _DEEPSPEED


class Rebound(NamedTuple):
    holder: object
    attribute: str
    original: Callable
    wrapper: Callable


def repoint(wrappers: dict[str, tuple[Callable, Callable]]) -> list[Rebound]:
    """Replaces every known binding of a wrapped function by its wrapper.

    Args:
        wrappers: {name: (original, wrapper)}.

    Returns:
        What `restore` puts back.
    """
    by_original = {id(original): (original, wrapper) for original, wrapper in wrappers.values()}
    rebound = []
    for module, path in KNOWN_BINDINGS:
        holder = sys.modules.get(module)
        *parents, attribute = path.split(".")
        for parent in parents:
            holder = getattr(holder, parent, None)
        bound = getattr(holder, attribute, None) if holder is not None else None
        original, wrapper = by_original.get(id(bound), (None, None))
        if original is not None and original is bound:
            setattr(holder, attribute, wrapper)
            rebound.append(Rebound(holder, attribute, original, wrapper))
    return rebound


def restore(rebound: list[Rebound]) -> None:
    """Puts the originals back where `repoint` put wrappers, unless something else was bound there since."""
    for entry in rebound:
        if getattr(entry.holder, entry.attribute, None) is entry.wrapper:
            setattr(entry.holder, entry.attribute, entry.original)
