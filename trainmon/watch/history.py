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
    """Recent steps of one op per (family, tensor), of the loss and grad norm per rank, and one step per (family,
    tensor, rank): the first holding a NaN/Inf (the incident) once there is one, else the newest.

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
        self._incident: Optional[StepFigures] = None  # the first step holding a NaN/Inf, with every rank's values
        self._by_rank: Optional[tuple] = None  # (step, values per rank) of the step shown, once asked for

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
            self._latest = figures
        self.keep_incident(figures)
        self._by_rank = None  # its rows may have grown
        series = {name: values for name, values in figures.scalar_series().items() if name in RANK_SERIES}
        if series:
            self.rank_columns.append((figures.step, series))

    def keep_incident(self, figures: StepFigures) -> None:
        """Keeps `figures` as the incident's when it is the first step seen holding a NaN/Inf with every rank's values
        (a restarted daemon gives it again, however far before its window it was)."""
        if self._incident is None and figures.worst is not None and figures.rows is not None:
            self._incident = figures

    @property
    def by_rank(self) -> tuple[Optional[int], dict]:
        """(step, {family: RankGrid}) of the incident's step once there is one, else of the newest step; computed when
        a heatmap is drawn."""
        shown = self._incident or self._latest
        if shown is None or shown.rows is None:
            return None, {}
        if self._by_rank is None:
            self._by_rank = (shown.step, rank_grids(shown.rows, self.op, self.rows))
        return self._by_rank

    def steps(self) -> list[int]:
        return [step for step, _ in self.columns]
