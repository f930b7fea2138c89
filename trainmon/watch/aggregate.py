"""Cross-rank figures of one step, and the TensorBoard tags they go under.

Per (family, tensor name, op) the step's values of every rank and micro-step are reduced to min, median
and max, and the rank holding the max is kept, so an outlier rank is one click away. NaN is never
dropped: a NaN value makes the max NaN (and names its rank, the smallest one holding a NaN); min and
median are taken over the other values (NaN when there are none). ±Inf is kept as it is. Ties at the
max name the smallest rank. The values of a chunk of steps of every rank are reduced at once with numpy.

Each step also counts its NaN and Inf elements per family, the (tensor, rank) pairs holding one and the first
such place (`Place`); `view` turns all of it into the TensorBoard tags.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np

from trainmon.core.collective_ops import parse_comm_name
from trainmon.config.keys import STAT_OPS
from trainmon.core.records import (ACTV, ACTV_GRAD, COMM, EXP_AVG, EXP_AVG_SQ, GRAD_REDUCED, GRAD_UNREDUCED,
                                      PARAM_ORIGIN, PARAM_UPDATED)
from trainmon.watch.rank_matrix import AlignedRanks, reduce_rows
from trainmon.writers.db_schema import NO_MICRO_STEP

STATS = ("min", "median", "max")
MAX_RANK = "max_rank"
SCALARS = "scalars"
GRAD_NORM = "grad_norm"  # the global grad norm: a logged scalar of that name, else computed from the records
GRAD_NORM_PRECLIP = "grad_norm_preclip"  # the framework's norm before clipping (optimizer_hooks writes it)
PARAMS_NORM = "params_norm"  # the weights' global norm: a logged scalar of that name, else computed from the records
_LAYER = re.compile(r"^((?:[^.]+\.)*?[^.]+\.\d+)(?:\.|$)")  # up to the first numbered component

Key = tuple  # (family, name, vpp_stage, op)


class Place(NamedTuple):
    """Where a NaN/Inf is: a tensor on a rank, in a micro-step (None: a record of the whole step)."""

    family: str
    name: str
    vpp: int
    rank: int
    micro_step: Optional[int] = None


def layer_of(name: str) -> str:
    """The layer group of a tensor name: up to its first numbered component (`decoder.layers.3`,
    `blocks.0`), else its first component (`head`, `emb`); a collective's op and group, whatever the call."""
    comm = parse_comm_name(name)
    if comm is not None:
        return f"{comm['op']}[{comm['group']}]"
    found = _LAYER.match(name)
    if found:
        return found[1]
    return name.split(".", 1)[0] or "root"


def label_of(name: str, vpp_stage: int) -> str:
    """A tensor's name in tags (virtual-pipeline chunks other than 0 keep their `<vpp>:` prefix)."""
    name = name or "<root>"
    return f"{vpp_stage}:{name}" if vpp_stage else name


@functools.lru_cache(maxsize=1 << 16)  # one entry per tensor: the same names come back every step
def tag_base(family: str, name: str, vpp_stage: int) -> str:
    return f"{family}/{layer_of(name)}/{label_of(name, vpp_stage)}"


def reduce_groups(group: np.ndarray, rank: np.ndarray, value: np.ndarray) -> tuple:
    """Per group id (ascending): (ids, min, median, max, rank of the max) of the values; see the module
    docstring for NaN. One sort: by group, then value (NaN last), then rank descending, so that a group's
    last value is its largest, held by the smallest rank, or a NaN of the smallest rank holding one."""
    order = np.lexsort((-rank, value, group))
    group, rank, value = group[order], rank[order], value[order]
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    ends = np.r_[starts[1:], len(group)] - 1
    count = np.add.reduceat(~np.isnan(value), starts)  # the values that are not NaN lead each group
    low, high = starts + np.maximum(count - 1, 0) // 2, starts + count // 2
    with np.errstate(invalid="ignore", over="ignore"):
        median = np.where(count % 2 == 1, value[high], (value[low] + value[high]) / 2)
    empty = count == 0
    return (group[starts], np.where(empty, np.nan, value[starts]), np.where(empty, np.nan, median), value[ends],
            rank[ends])


def reduce_matrix(group: np.ndarray, slot: np.ndarray, slot_rank: np.ndarray, value: np.ndarray) -> Optional[tuple]:
    """`reduce_groups` where each value has its own slot in its group (`slot`, and the rank holding each slot,
    ascending with the slot): the groups become the rows of a matrix, sorted row by row, several times faster
    than one sort of every value. None where two values share a slot (a tensor recorded twice in a micro-step),
    or where most of the matrix would be empty (it would take more memory than the values)."""
    groups, slots = int(group.max(initial=-1)) + 1, len(slot_rank)
    if groups * slots > 4 * len(value):
        return None
    cell = group * slots + slot
    if len(cell) and np.bincount(cell, minlength=groups * slots).max() > 1:
        return None
    filled = np.zeros(groups * slots, dtype=bool)
    filled[cell] = True
    matrix = np.full(groups * slots, np.nan)
    matrix[cell] = value
    return reduce_rows(matrix.reshape(groups, slots), filled.reshape(groups, slots), slot_rank)


def worst(values) -> float:
    """The largest of some values, NaN if any is NaN (NaN when there is none)."""
    out = -math.inf
    seen = False
    for value in values:
        if value != value:
            return math.nan
        seen = True
        out = value if value > out else out
    return out if seen else math.nan


def cross_rank(values: dict[int, float]) -> tuple[float, float, float, int]:
    """(min, median, max, rank of the max) of one value per rank."""
    ranks = np.fromiter(values, dtype=np.int64, count=len(values))
    _, low, median, high, high_rank = reduce_groups(np.zeros(len(values), dtype=np.int64), ranks,
                                                    np.fromiter(values.values(), dtype=np.float64, count=len(values)))
    return float(low[0]), float(median[0]), float(high[0]), int(high_rank[0])


@dataclass
class StepRows:
    """One step's records of every rank, kept for the per-rank heatmap of the latest step."""

    keys: list  # (family, name, vpp) of `tag`
    tag: np.ndarray
    rank: np.ndarray
    values: dict  # op -> figures, NaN where `present` is False
    present: dict


@dataclass
class StepFigures:
    """What one step holds across ranks, reduced, before it is turned into tags."""

    step: int
    stats: dict[Key, tuple[float, float, float, int]] = field(default_factory=dict)  # min, median, max, max rank
    per_rank: dict[tuple, float] = field(default_factory=dict)  # (rank, family, name, vpp, micro, op)
    scalars: dict[str, dict[int, float]] = field(default_factory=dict)
    norm_sumsq: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> family -> sum of norm²
    params_sumsq: Optional[float] = None  # over the run's distinct parameters, each once: see `params_norms`
    params_ranks: tuple = ()  # the ranks holding `param_origin` records at this step
    nonfinite: bool = False
    rows: Optional[StepRows] = None
    nonfinite_elements: dict[str, tuple[float, float]] = field(default_factory=dict)  # family -> (NaN, Inf) counts
    tensors_nonfinite: int = 0  # (tensor, rank) pairs holding a NaN or an Inf
    nonfinite_by_tensor: dict[tuple, float] = field(default_factory=dict)  # (family, name, vpp) -> NaN + Inf elements
    worst: Optional[Place] = None  # the first NaN/Inf: micro-steps, then families, model and rank order
    # (family, layer) -> min, median, max over ranks of each rank's layer value, and the rank of the max
    layer_spread: dict[tuple[str, str], tuple] = field(default_factory=dict)
    recorded: bool = False  # the step has records (not only scalars): a step between collected ones has none
    _series: Optional[dict] = field(default=None, init=False, repr=False, compare=False)  # `scalar_series`, once made

    def grad_norms(self) -> dict[int, float]:
        """The global grad norm per rank: the logged `grad_norm` scalar, else the framework's norm before
        clipping, else from the reduced grads' records (the unreduced ones when only those were recorded)."""
        for logged in (GRAD_NORM, GRAD_NORM_PRECLIP):
            if logged in self.scalars:
                return dict(self.scalars[logged])
        return self._norms(lambda totals: totals.get(GRAD_REDUCED, totals.get(GRAD_UNREDUCED)))

    def params_norms(self) -> dict[int, float]:
        """The weights' global norm, as Megatron's params-norm: a logged `params_norm` per rank, else, for each rank
        holding `param_origin` records, the square root of the sum over the model's distinct parameters of their
        squared norms (`params_sumsq`). A parameter is named alike on every rank that holds it (global layer and
        expert numbers) and its record is of the whole parameter (its pieces merged over the ranks holding them), so
        each counts once: a data-parallel replica or a tensor-parallel piece does not add to it again, and every
        pipeline stage's parameters do."""
        if PARAMS_NORM in self.scalars:
            return dict(self.scalars[PARAMS_NORM])
        total = self.params_sumsq
        if total is None:
            return {}
        norm = math.sqrt(total) if total == total and total >= 0 else total
        return {rank: norm for rank in self.params_ranks}

    def _norms(self, total_of) -> dict[int, float]:
        out = {}
        for rank, totals in self.norm_sumsq.items():
            total = total_of(totals)
            if total is not None:
                out[rank] = math.sqrt(total) if total == total and total >= 0 else total
        return out

    def scalar_series(self) -> dict[str, dict[int, float]]:
        """Per-rank series: the logged scalars, the global grad norm and the weights' global norm. Made once, when
        the step's figures are complete, for every part of the view that asks (a norm per rank each time)."""
        if self._series is None:
            self._series = dict(self.scalars)
            for name, norms in ((GRAD_NORM, self.grad_norms()), (PARAMS_NORM, self.params_norms())):
                if norms:
                    self._series[name] = norms
        return self._series


def step_figures(chunks: list, ranks_kept: frozenset = frozenset(), spread: Optional[tuple] = None
                 ) -> dict[int, StepFigures]:
    """The figures of each step of one chunk of steps read from every rank (`chunk.RankChunk`s), reduced
    across ranks with numpy: memory is ranks x tags x the chunk's steps.

    Args:
        spread: (op, layer_of): also each layer's spread over ranks of that op (`StepFigures.layer_spread`);
            `layer_of(family, name, vpp)` names a tensor's layer.
    """
    index: dict = {}  # (family, name, vpp) -> its number across ranks
    parts = []
    for chunk in chunks:
        if not len(chunk.step):
            continue  # no records in these steps (between collected steps): only its scalars below
        remap = np.array([index.setdefault(key, len(index)) for key in chunk.keys], dtype=np.int64)
        parts.append((chunk, remap[chunk.tag]))
    keys = list(index)
    figures: dict[int, StepFigures] = {}

    def at(step: int) -> StepFigures:
        return figures.setdefault(step, StepFigures(step))

    if parts:
        step = np.concatenate([chunk.step for chunk, _ in parts])
        tag = np.concatenate([tags for _, tags in parts])
        rank = np.concatenate([np.full(len(chunk.step), chunk.rank, dtype=np.int64) for chunk, _ in parts])
        ops = [op for op in STAT_OPS if any(op in chunk.values for chunk, _ in parts)]
        values, present = {}, {}
        for op in ops:
            values[op] = np.concatenate([c.values.get(op, np.full(len(c.step), np.nan)) for c, _ in parts])
            present[op] = np.concatenate([c.present.get(op, np.zeros(len(c.step), dtype=bool)) for c, _ in parts])
        micro = np.concatenate([chunk.micro for chunk, _ in parts]) - NO_MICRO_STEP  # from 0
        first, width = int(step.min()), max(len(keys), 1)
        group = (step - first) * width + tag
        # slots: one per rank (ascending) and micro-step
        micros = int(micro.max(initial=0)) + 1
        ranks_read = np.array(sorted({chunk.rank for chunk, _ in parts}), dtype=np.int64)
        slot = np.searchsorted(ranks_read, rank) * micros + micro
        aligned = AlignedRanks.of(group, micro, rank, ranks_read)
        for op in ops:
            rows = present[op]
            reduced = aligned.reduce(values[op], rows) if aligned else \
                reduce_matrix(group[rows], slot[rows], np.repeat(ranks_read, micros), values[op][rows])
            if reduced is None:
                reduced = reduce_groups(group[rows], rank[rows], values[op][rows])
            if not rows.any():
                continue  # no value of this op in the chunk (min of all-NaN tensors): nothing to reduce
            op_keys = [(*key, op) for key in keys]
            ids, figures_of_group = reduced[0], list(zip(*(column.tolist() for column in reduced[1:])))
            offsets = ids // width
            bounds = np.flatnonzero(np.r_[True, offsets[1:] != offsets[:-1], True])  # ids ascend: step by step
            for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
                at(first + int(offsets[begin])).stats.update(
                    zip([op_keys[t] for t in (ids[begin:end] % width).tolist()], figures_of_group[begin:end]))
        _count_nonfinite(at, keys, step, tag, rank, micro, values, present)
        if spread is not None and spread[0] in values:
            _spread_layers(at, keys, spread, step - first, tag, rank, values, present, first, aligned, width)
        by_step = np.argsort(step, kind="stable")
        bounds = np.flatnonzero(np.r_[True, np.diff(step[by_step]) != 0, True])
        for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            rows = by_step[begin:end]
            figure = at(int(step[rows[0]]))
            figure.recorded = True
            figure.rows = StepRows(keys, tag[rows], rank[rows], {op: values[op][rows] for op in ops},
                                   {op: present[op][rows] for op in ops})
    _sum_params(at, parts, width if parts else 1)
    for chunk in chunks:
        for number in chunk.nonfinite_steps:
            at(number).nonfinite = True
        for number, totals in chunk.norm_sumsq.items():
            at(number).norm_sumsq[chunk.rank] = totals
        for row in chunk.scalars:
            at(row["step"]).scalars.setdefault(row["name"], {})[chunk.rank] = row["value"]
        if chunk.rank in ranks_kept:
            for number, family, name, vpp, micro, op, value in chunk.kept:
                at(number).per_rank[(chunk.rank, family, name, vpp, micro, op)] = value
    return figures


def _sum_params(at, parts: list, width: int) -> None:
    """Per step, `StepFigures.params_sumsq`: the squared norms of the step's `param_origin` records summed over
    the distinct parameters, the first rank's record of each, and `params_ranks`, the ranks holding such records
    (`parts`: (chunk, its tags across ranks))."""
    held = [(chunk, tags) for chunk, tags in parts if len(chunk.param_rows)]
    if not held:
        return
    step = np.concatenate([chunk.step[chunk.param_rows] for chunk, _ in held])
    tag = np.concatenate([tags[chunk.param_rows] for chunk, tags in held])
    sumsq = np.concatenate([chunk.param_sumsq for chunk, _ in held])
    low = int(step.min())
    _, first = np.unique((step - low) * width + tag, return_index=True)
    offsets = step[first] - low
    totals = np.bincount(offsets, weights=sumsq[first])
    for offset in np.unique(offsets).tolist():
        at(low + offset).params_sumsq = float(totals[offset])
    for chunk, _ in held:
        for number in np.unique(chunk.step[chunk.param_rows]).tolist():
            figure = at(number)
            figure.params_ranks = (*figure.params_ranks, chunk.rank)


def _spread_layers(at, keys: list, spread: tuple, offset: np.ndarray, tag: np.ndarray, rank: np.ndarray,
                   values: dict, present: dict, first: int, aligned: Optional[AlignedRanks], width: int) -> None:
    """Per step and (family, layer): the layer's value on each rank (the largest `op` of its tensors over
    micro-steps, NaN winning), reduced over ranks to (min, median, max, rank of the max). `aligned`: the chunk's
    layout when its ranks' rows follow one sequence (its groups: offset * width + tag), else None."""
    op, layer_of = spread
    rows = present[op]
    if not rows.any():
        return
    layers: dict = {}
    layer_id = np.array([layers.setdefault((key[0], layer_of(*key)), len(layers)) for key in keys], dtype=np.int64)
    names, n_layers = list(layers), len(layers)
    if aligned is not None:
        ids = np.arange((int(offset.max()) + 1) * width)  # every group id of the chunk
        layer_cell = ids // width * n_layers + layer_id[ids % width]
        cells, per_rank, held = aligned.largest_per_rank(values[op], rows, layer_cell)
        used, low, median, high, high_rank = reduce_rows(per_rank, held, aligned.ranks)
        groups = cells[used]
    else:
        ranks = rank[rows]
        n_ranks = int(ranks.max()) + 1
        cell = (offset[rows] * n_layers + layer_id[tag[rows]]) * n_ranks + ranks
        cells, _, _, per_rank, _ = reduce_groups(cell, ranks, values[op][rows])
        groups, low, median, high, high_rank = reduce_groups(cells // n_ranks, cells % n_ranks, per_rank)
    for group, figures in zip(groups.tolist(), zip(low.tolist(), median.tolist(), high.tolist(), high_rank.tolist())):
        at(first + group // n_layers).layer_spread[names[group % n_layers]] = figures


def _count_nonfinite(at, keys: list, step: np.ndarray, tag: np.ndarray, rank: np.ndarray, micro: np.ndarray,
                     values: dict, present: dict) -> None:
    """Per step: the NaN and Inf elements of each family and of each tensor, the (tensor, rank) pairs holding one,
    and the first such place, in the order a step runs: micro-steps (whole-step records after them), families in
    FAMILY_ORDER, tensors in model order, then ranks. `micro`: 0 for a whole-step record, else the micro-step + 1."""
    counts = [np.where(present[op], values[op], 0.0) if op in values else np.zeros(len(step))
              for op in ("nans", "infs")]
    bad = np.flatnonzero((counts[0] > 0) | (counts[1] > 0))
    if not len(bad):
        return
    bad = bad[np.argsort(step[bad], kind="stable")]  # step by step, each step's rows in their order
    families = sorted({key[0] for key in keys}, key=family_rank)
    family_of = np.array([families.index(key[0]) for key in keys], dtype=np.int64)[tag[bad]]
    pair = tag[bad] * (int(rank.max()) + 1) + rank[bad]  # a (tensor, rank) pair
    bounds = np.flatnonzero(np.r_[True, step[bad][1:] != step[bad][:-1], True])
    for begin, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        rows, fam = bad[begin:end], family_of[begin:end]
        figure = at(int(step[rows[0]]))
        for index in np.unique(fam).tolist():
            mine = rows[fam == index]
            figure.nonfinite_elements[families[index]] = (float(counts[0][mine].sum()), float(counts[1][mine].sum()))
        figure.tensors_nonfinite = len(np.unique(pair[begin:end]))
        tags, elements = np.unique(tag[rows], return_inverse=True)
        totals = np.bincount(elements, weights=counts[0][rows] + counts[1][rows])
        figure.nonfinite_by_tensor = {keys[t]: total for t, total in zip(tags.tolist(), totals.tolist())}
        in_step = np.where(micro[rows] == 0, np.iinfo(np.int64).max, micro[rows])
        first = rows[np.lexsort((rank[rows], tag[rows], fam, in_step))[0]]
        figure.worst = Place(*keys[int(tag[first])], int(rank[first]), int(micro[first]) - 1 if micro[first] else None)


# The families in the order a fault travels through a step: forward, backward, the update.
FAMILY_ORDER = (ACTV, ACTV_GRAD, COMM, GRAD_UNREDUCED, GRAD_REDUCED, PARAM_ORIGIN, EXP_AVG, EXP_AVG_SQ,
                PARAM_UPDATED)


def family_rank(family: str) -> tuple[int, str]:
    return (FAMILY_ORDER.index(family) if family in FAMILY_ORDER else len(FAMILY_ORDER), family)
