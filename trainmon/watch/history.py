"""The window of recent steps the heatmaps draw, bounded in tags × window, never in steps."""
from __future__ import annotations

from collections import deque
from typing import Optional

from trainmon.watch.aggregate import GRAD_NORM, StepFigures, label_of, value_of

LOSS = "loss"
RANK_SERIES = (LOSS, GRAD_NORM)


class History:
    """Recent steps of one op per (family, tensor), of the loss and grad norm per rank, and the latest
    step per (family, tensor, rank).

    Args:
        op: the op the module heatmaps show (e.g. "norm").
        window: steps kept.
    """

    def __init__(self, op: str = "norm", window: int = 200):
        self.op = op
        self.columns: deque = deque(maxlen=window)  # (step, {family: {label: max across ranks}})
        self.rank_columns: deque = deque(maxlen=window)  # (step, {series: {rank: value}})
        self.rows: dict[str, dict[str, None]] = {}  # family -> labels in order of first appearance
        self.latest: tuple[Optional[int], dict] = (None, {})  # (step, {family: {label: {rank: value}}})

    def add(self, figures: StepFigures) -> None:
        column: dict[str, dict[str, float]] = {}
        by_rank: dict[str, dict[str, dict[int, float]]] = {}
        for (family, name, vpp, op), values in figures.values.items():
            if op != self.op:
                continue
            label = label_of(name, vpp)
            self.rows.setdefault(family, {})[label] = None
            column.setdefault(family, {})[label] = value_of(values)
            ranks = by_rank.setdefault(family, {}).setdefault(label, {})
            for value, rank in values:  # micro-steps of one rank: keep the largest (NaN wins)
                old = ranks.get(rank)
                ranks[rank] = value if old is None or value != value or value > old else old
        if column:
            self.columns.append((figures.step, column))
            self.latest = (figures.step, by_rank)
        series = {name: values for name, values in figures.scalar_series().items() if name in RANK_SERIES}
        if series:
            self.rank_columns.append((figures.step, series))

    def steps(self) -> list[int]:
        return [step for step, _ in self.columns]
