"""The window of recent steps the heatmaps draw, bounded in tags × window, never in steps."""
from __future__ import annotations

from collections import deque
from typing import Optional

from trainmon.watch.aggregate import GRAD_NORM, StepFigures, label_of

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
        # family -> {label: (name, vpp)} in order of first appearance
        self.rows: dict[str, dict[str, tuple[str, int]]] = {}
        self._latest: Optional[StepFigures] = None  # the newest step with records of `op`
        self._by_rank: Optional[dict] = None  # its values per rank, once asked for

    def add(self, figures: StepFigures) -> None:
        column: dict[str, dict[str, float]] = {}
        for (family, name, vpp, op), (_, _, high, _) in figures.stats.items():
            if op != self.op:
                continue
            label = label_of(name, vpp)
            self.rows.setdefault(family, {})[label] = (name, vpp)
            column.setdefault(family, {})[label] = high  # the max: an outlier must not be averaged away
        if column:
            self.columns.append((figures.step, column))
            self._latest, self._by_rank = figures, None
        series = {name: values for name, values in figures.scalar_series().items() if name in RANK_SERIES}
        if series:
            self.rank_columns.append((figures.step, series))

    @property
    def latest(self) -> tuple[Optional[int], dict]:
        """(step, {family: {label: {rank: value}}}) of the newest step, computed when a heatmap is drawn."""
        if self._latest is None or self._latest.rows is None:
            return None, {}
        if self._by_rank is None:
            self._by_rank = self._latest.rows.rank_maxima(self.op)
        return self._latest.step, self._by_rank

    def steps(self) -> list[int]:
        return [step for step, _ in self.columns]
