"""Which tensors of a module's inputs, outputs and grads are recorded, and under which names."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

# The attribute of an activation-grad input tap's alias (each module the tensor reaches gets its own) that holds the
# tensor it stands for (through nested taps): `getattr(t, TAP_ROOT, t)` is that tensor, or `t` itself. An input's
# activation record is then that of the tensor itself, often already taken as another module's output, instead of
# a second pass over the same data; the NaN sentinel knows the tensor by it. Read inline (not through a function)
# as every call does it for every input.
TAP_ROOT = "_trainmon_root"


def floating_leaves(obj: Any, selector=None, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Returns (name, tensor) for the floating-point tensors in `obj`.

    `selector` (from a `targets` entry such as "tuple[2]:0") picks one element of a tuple first.
    A structure with several leaves names them `<prefix>_<i>` by leaf position; a single leaf keeps
    the bare prefix. Integer and bool tensors (token ids, masks) are never recorded.
    """
    if selector is not None:
        index: Optional[int] = getattr(selector, "index", None)
        if index is not None and isinstance(obj, (tuple, list)):
            obj = obj[index] if index < len(obj) else None
    if type(obj) in (tuple, list) and len(obj) == 1 and isinstance(obj[0], torch.Tensor):
        obj = obj[0]  # a single leaf keeps the bare prefix
    if isinstance(obj, torch.Tensor):  # the common case, in every hook call: no list to walk
        return [(prefix, obj)] if obj.is_floating_point() else []
    if type(obj) in (tuple, list) and _flat(obj):
        leaves = obj  # what tree_flatten gives for a flat sequence (None is a leaf too), without its cost
    else:
        leaves = tree_flatten(obj)[0]
    single = len(leaves) == 1
    out = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            out.append((prefix if single else f"{prefix}_{i}", leaf))
    return out


def _flat(items) -> bool:
    """Whether every item is a tensor or None (a loop: `all` over a generator costs a resumption per item)."""
    for x in items:
        if x is not None and not isinstance(x, torch.Tensor):
            return False
    return True


def input_places(args: tuple, kwargs: dict) -> list[tuple[bool, object]]:
    """Where a module call's inputs are: the tensor positional arguments, then the keyword arguments that
    are activations (tensors requiring grad), as (True, index in args) or (False, key in kwargs).

    Their records are named by position in that list (`input` alone, else `input_<i>`), so a layer
    called with `hidden_states=...` (Megatron) has its input recorded as a positional one would be.
    Constant tensors passed by keyword (attention masks, whose -inf entries are no anomaly, rotary
    tables) are left out.
    """
    if len(args) == 1 and not kwargs:  # most calls: a comprehension would cost more than its one item
        return [(True, 0)] if isinstance(args[0], torch.Tensor) else []
    places = [(True, i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    if kwargs:
        places += [(False, k) for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    return places


def input_values(args: tuple, kwargs: dict) -> list:
    """The values at `input_places` of a call, without the places."""
    if len(args) == 1 and not kwargs:
        return [args[0]] if isinstance(args[0], torch.Tensor) else []
    values = [a for a in args if isinstance(a, torch.Tensor)]
    if kwargs:
        values += [v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    return values


def values_at(places: list[tuple[bool, object]], args: tuple, kwargs: dict) -> list:
    """The values at `input_places` of a call."""
    if len(places) == 1:
        positional, key = places[0]
        return [args[key] if positional else kwargs[key]]
    return [args[key] if positional else kwargs[key] for positional, key in places]
