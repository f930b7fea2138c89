"""The window of recent steps the heatmaps draw, bounded in tags × window, never in steps."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

from trainmon.core.records import FEATURE_FAMILIES, MOE_EXPERT_LOAD
from trainmon.watch.aggregate import GRAD_NORM, StepFigures, StepRows, label_of, reduce_groups

LOSS = "loss"
RANK_SERIES = (LOSS, GRAD_NORM)


@dataclass
class RankGrid:
    """One family's values at one step: its tensors (in `History.rows` order) × `ranks`, each the largest over
    the rank's micro-steps (NaN wins); `missing` where a rank has no record of the tensor."""

    ranks: list[int]
    values: np.ndarray
    missing: np.ndarray


def rank_grids(rows: StepRows, op: str, tensors: dict[str, dict]) -> dict[str, RankGrid]:
    """The `RankGrid` of each family of `tensors` ({family: {label: ...}}), with numpy: at 1,000 ranks a
    family holds ~10^5 cells or more."""
    if op not in rows.values:
        return {}
    present = rows.present[op]
    tag, rank = rows.tag[present], rows.rank[present]
    width = int(rank.max(initial=0)) + 1
    ids, _, _, high, _ = reduce_groups(tag * width + rank, rank, rows.values[op][present])
    tags, ranks = ids // width, ids % width
    out = {}
    for family, labels in tensors.items():
        position = {label: i for i, label in enumerate(labels)}
        row_of_tag = np.array([position.get(label_of(name, vpp), -1) if key == family else -1
                               for key, name, vpp in rows.keys] + [-1], dtype=np.int64)
        row = row_of_tag[tags]
        kept = row >= 0
        columns = np.unique(ranks[kept])
        values, missing = np.full((len(labels), len(columns)), np.nan), np.ones((len(labels), len(columns)), dtype=bool)
        cells = (row[kept], np.searchsorted(columns, ranks[kept]))
        values[cells], missing[cells] = high[kept], False
        out[family] = RankGrid(columns.tolist(), values, missing)
    return out


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
        # (step, {router: {expert: tokens}}) of the newest step with MoE expert loads (the same on every EP rank)
        self.expert_load: Optional[tuple[int, dict[str, dict[int, float]]]] = None
        self._latest: Optional[StepFigures] = None  # the newest step with records of `op`
        self._by_rank: Optional[dict] = None  # its values per rank, once asked for

    def add(self, figures: StepFigures) -> None:
        column: dict[str, dict[str, float]] = {}
        experts: dict[str, dict[int, float]] = {}
        for (family, name, vpp, op), (_, _, high, _) in figures.stats.items():
            if family == MOE_EXPERT_LOAD and op == "max":
                router, _, expert = name.rpartition(".expert_")
                experts.setdefault(label_of(router, vpp), {})[int(expert)] = high
            if op != self.op or family in FEATURE_FAMILIES:  # one-value families: no per-op picture of theirs
                continue
            label = label_of(name, vpp)
            self.rows.setdefault(family, {})[label] = (name, vpp)
            column.setdefault(family, {})[label] = high  # the max: an outlier must not be averaged away
        if experts:
            self.expert_load = (figures.step, experts)
        if column:
            self.columns.append((figures.step, column))
            self._latest, self._by_rank = figures, None
        series = {name: values for name, values in figures.scalar_series().items() if name in RANK_SERIES}
        if series:
            self.rank_columns.append((figures.step, series))

    @property
    def latest(self) -> tuple[Optional[int], dict]:
        """(step, {family: RankGrid}) of the newest step, computed when a heatmap is drawn."""
        if self._latest is None or self._latest.rows is None:
            return None, {}
        if self._by_rank is None:
            self._by_rank = rank_grids(self._latest.rows, self.op, self.rows)
        return self._latest.step, self._by_rank

    def steps(self) -> list[int]:
        return [step for step, _ in self.columns]
