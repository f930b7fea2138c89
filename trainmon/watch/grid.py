"""The rows and columns of a heatmap, grouped so that a picture stays readable at any scale.

- Tensors are grouped into layers (`aggregate.layer_of`: `decoder.layers.3`, `blocks.0`, `embed`; a
  virtual-pipeline chunk keeps its `<vpp>:` prefix), in model order (order of first appearance). A layer's
  cell is the largest value of its tensors, as the cross-rank figure of a tensor is its largest over ranks.
- Ranks (and steps) beyond a limit are put into contiguous buckets, at most `limit` of them, labelled by
  their first and last member (`r0-15`); a bucket's cell is its worst value.

Either way a failure is never hidden: a NaN anywhere in the group makes the cell NaN, else a +Inf makes it
+Inf; a cell is "no record" only when no member has one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from trainmon.watch.aggregate import label_of, layer_of

MAX_RANKS = 64  # rank columns (or rows) of a picture: beyond, ranks are bucketed
MAX_STEPS = 250  # step columns: at least ~2 pixels each, so that no step vanishes when drawn


@dataclass
class Axis:
    """The entries of one side of a picture: each entry's label and the items (row or column numbers of
    the ungrouped matrix) it holds."""

    labels: list[str]
    members: list[np.ndarray]

    def holding(self, item: int) -> Optional[int]:
        """The entry holding `item`, or None."""
        return next((i for i, group in enumerate(self.members) if item in group), None)


def single(labels: Sequence) -> Axis:
    """One entry per item."""
    return Axis([str(label) for label in labels], [np.array([i]) for i in range(len(labels))])


def layers(tensors: Sequence[tuple[str, int]]) -> Axis:
    """The layers of tensors given as (name, vpp stage), in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, (name, vpp) in enumerate(tensors):
        groups.setdefault(label_of(layer_of(name), vpp), []).append(i)
    return Axis(list(groups), [np.array(items) for items in groups.values()])


def buckets(items: Sequence[int], limit: int, prefix: str = "") -> Axis:
    """`items` (ascending numbers) as they are when there are at most `limit`, else in at most `limit`
    contiguous buckets of equal size (the last one smaller)."""
    if len(items) <= limit:
        return single(items)
    size = math.ceil(len(items) / limit)
    members = [np.arange(start, min(start + size, len(items))) for start in range(0, len(items), size)]
    return Axis([f"{prefix}{items[m[0]]}-{items[m[-1]]}" for m in members], members)


def reduce(values: np.ndarray, missing: np.ndarray, axis: Axis, along: int,
           magnitude: bool) -> tuple[np.ndarray, np.ndarray]:
    """`values` (with `missing` cells) with the items along dimension `along` merged into `axis`'s entries:
    NaN if any member is NaN, else +Inf if any is +Inf, else the largest value (`magnitude`: the value of
    largest |value|, the worst for a log-scale picture)."""
    if all(len(group) == 1 for group in axis.members) and len(axis.members) == values.shape[along]:
        return values, missing  # nothing merged
    values, missing = np.moveaxis(values, along, 0), np.moveaxis(missing, along, 0)
    out, empty = [], []
    for group in axis.members:
        part, present = values[group], ~missing[group]
        real = present & ~np.isnan(part)
        if magnitude:
            score = np.where(real, np.abs(part), -1.0)
            cell = np.take_along_axis(part, score.argmax(axis=0)[None], axis=0)[0]
        else:
            cell = np.max(part, axis=0, where=real, initial=-np.inf)
        cell = np.where((part == np.inf).any(axis=0), np.inf, cell)
        none = ~present.any(axis=0)
        out.append(np.where((present & np.isnan(part)).any(axis=0) | none, np.nan, cell))
        empty.append(none)
    return np.moveaxis(np.array(out), 0, along), np.moveaxis(np.array(empty), 0, along)


def holds(name: str, module: str) -> bool:
    """Whether tensor `name` belongs to `module` (`layers.1` holds `layers.1.mlp.0.weight`, not
    `layers.10.output`)."""
    return name == module or name.startswith(module + ".")
