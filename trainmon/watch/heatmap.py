"""The heatmaps of the watch window: per family `<family>_layer_x_step` (the op, max across ranks) and
`<family>_layer_x_rank` (at the first step holding a NaN/Inf once there is one, else at the latest), and
`<series>_rank_x_step` of the loss and of the global grad norm. With `rows="tensor"`, `<family>_tensor_x_step` and
`<family>_tensor_x_rank`: one row per tensor.

Readable at scale (`grid` says how cells are merged, `canvas` how they are drawn): one row per layer, each
labelled, the picture growing with its rows; above 64 ranks, contiguous buckets of ranks (`r0-15`), each
showing its worst rank (NaN, then +Inf, then the largest |value|); above 250 steps, buckets of steps the
same way. A picture of more than `canvas.MAX_ROWS` rows (tensor rows of a large model) is split into
`<name>_part1of3`, `<name>_part2of3`, ... of equal size. The first NaN/Inf (the alert's `first`) is circled
in the row of the layer (or the tensor) holding its module, and the column or row holding its step and rank.
With MoE load, `moe_load_layer_x_expert`: the tokens each expert of each layer received at the latest step.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from trainmon.core.records import MOE_EXPERT_LOAD
from trainmon.watch.aggregate import layer_of
from trainmon.watch.canvas import MAX_ROWS, Picture, draw
from trainmon.watch.grid import MAX_RANKS, MAX_STEPS, Axis, buckets, holds, layers, reduce, single
from trainmon.watch.history import RANK_SERIES, History


def _matrix(cells: list[list[Optional[float]]]) -> tuple[np.ndarray, np.ndarray]:
    missing = np.array([[v is None for v in row] for row in cells], dtype=bool).reshape(len(cells), -1)
    values = np.array([[np.nan if v is None else v for v in row] for row in cells],
                      dtype=np.float64).reshape(len(cells), -1)
    return values, missing


def _first_row(first: Optional[dict], tensors: dict[str, tuple[str, int]], rows: Axis, kind: str) -> Optional[int]:
    """The row holding the first anomaly's module: its layer (by `layer_of`, so that `layers.1` is not
    `layers.10`), or its first tensor."""
    if first is None:
        return None
    module = first["module"] or ""
    if kind == "layer":
        matches = (layer_of(name) == layer_of(module) for name, _ in tensors.values())
    else:
        matches = (holds(name, module) for name, _ in tensors.values())
    index = next((i for i, match in enumerate(matches) if match), None)
    return None if index is None else rows.holding(index)


def _mark(row: Optional[int], columns: Axis, items: list, item) -> Optional[tuple[int, int]]:
    """(row, the column holding `item` of `items`), or None."""
    if row is None or item not in items:
        return None
    return row, columns.holding(items.index(item))


def _drawn(name: str, values: np.ndarray, missing: np.ndarray, rows: Axis, columns: Axis, title: str,
           axes: tuple[str, str], mark: Optional[tuple[int, int]], note: str = "") -> list[Picture]:
    """The pictures of one matrix: one, or parts of at most MAX_ROWS rows."""
    count = len(rows.labels)
    parts = max(1, math.ceil(count / MAX_ROWS))
    size = math.ceil(count / parts) if count else 0
    out = []
    for part in range(parts):
        start, end = part * size, min(count, (part + 1) * size)
        suffix, span = (f"_part{part + 1}of{parts}", f" (rows {start + 1}-{end} of {count})") if parts > 1 else ("", "")
        here = mark if mark is not None and start <= mark[0] < end else None
        out.append(draw(name + suffix, values[start:end], missing[start:end], rows.labels[start:end], columns.labels,
                        title + span, *axes, None if here is None else (here[0] - start, here[1]), note))
    return out


def pictures(history: History, first: Optional[dict] = None, families: Optional[Sequence[str]] = None,
             rows: str = "layer") -> list[Picture]:
    """Every heatmap of the window.

    Args:
        history: the window.
        first: the alert's first place ({rank, step, module, ...}) to circle, or None.
        families: only these families and series (default: all).
        rows: "layer" or "tensor": what a row of a family's pictures is.
    """
    out = []
    steps = history.steps()
    step_axis = buckets(steps, MAX_STEPS)
    note = "" if first is None else (f"circled: first NaN/Inf, rank {first['rank']} step {first['step']} "
                                     f"{first['module'] or '<root>'} {first['phase']} {first['tensor']}")
    for family, tensors in history.rows.items():
        if families is not None and family not in families:
            continue
        row_axis = layers(list(tensors.values())) if rows == "layer" else single(tensors)
        hit = _first_row(first, tensors, row_axis, rows)
        cells = [[column.get(family, {}).get(label) for _, column in history.columns] for label in tensors]
        values, missing = reduce(*_matrix(cells), row_axis, 0, magnitude=False)
        values, missing = reduce(values, missing, step_axis, 1, magnitude=True)
        out += _drawn(f"{family}_{rows}_x_step", values, missing, row_axis, step_axis,
                      f"{family}: {history.op} (max across {'tensors and ' * (rows == 'layer')}ranks), {rows} x step",
                      (rows, "step"),
                      _mark(hit, step_axis, steps, first and first["step"]), note)
        shown_step, grids = history.by_rank
        grid = grids.get(family)
        if grid is not None and len(grid.ranks) > 1:  # one rank: the layer x step picture already says it all
            rank_axis = buckets(grid.ranks, MAX_RANKS, "r")
            values, missing = reduce(grid.values, grid.missing, row_axis, 0, magnitude=False)
            values, missing = reduce(values, missing, rank_axis, 1, magnitude=True)
            at_first = first is not None and first["step"] == shown_step
            out += _drawn(f"{family}_{rows}_x_rank", values, missing, row_axis, rank_axis,
                          f"{family}: {history.op} at step {shown_step}, {rows} x rank", (rows, "rank"),
                          _mark(hit if at_first else None, rank_axis, grid.ranks, first and first["rank"]))
    if history.expert_load is not None and (families is None or MOE_EXPERT_LOAD in families):
        out += _expert_load(*history.expert_load)
    for series in RANK_SERIES:
        if families is not None and series not in families:
            continue
        columns = [(step, values[series]) for step, values in history.rank_columns if series in values]
        if not columns:
            continue
        ranks = sorted({r for _, values in columns for r in values})
        rank_axis, column_steps = buckets(ranks, MAX_RANKS, "r"), [step for step, _ in columns]
        column_axis = buckets(column_steps, MAX_STEPS)
        values, missing = reduce(*_matrix([[values.get(rank) for _, values in columns] for rank in ranks]),
                                 rank_axis, 0, magnitude=True)
        values, missing = reduce(values, missing, column_axis, 1, magnitude=True)
        hit = rank_axis.holding(ranks.index(first["rank"])) if first is not None and first["rank"] in ranks else None
        out += _drawn(f"{series}_rank_x_step", values, missing, rank_axis, column_axis, f"{series}, rank x step",
                      ("rank", "step"), _mark(hit, column_axis, column_steps, first and first["step"]), note)
    return out


def _expert_load(step: int, loads: dict[str, dict[int, float]]) -> list[Picture]:
    """Tokens per expert (columns) of each MoE layer's router (rows) at `step`; above MAX_STEPS experts, contiguous
    buckets of experts, each showing its largest load."""
    routers = list(loads)
    experts = list(range(max(max(by_expert) for by_expert in loads.values()) + 1))
    values, missing = _matrix([[loads[router].get(e) for e in experts] for router in routers])
    columns = buckets(experts, MAX_STEPS, "e")
    values, missing = reduce(values, missing, columns, 1, magnitude=True)
    return _drawn("moe_load_layer_x_expert", values, missing, single(routers), columns,
                  f"MoE tokens per expert at step {step}, layer x expert", ("layer", "expert"), None)
