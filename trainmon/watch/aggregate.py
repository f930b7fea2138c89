"""Cross-rank figures of one step, and the TensorBoard tags they go under.

Per (family, tensor name, op) the step's values of every rank and micro-step are reduced to min, median
and max, and the rank holding the max is kept, so an outlier rank is one click away. NaN is never
dropped: a NaN value makes the max NaN (and names its rank); min and median are taken over the other
values (NaN when there are none). ±Inf is kept as it is.

Tags are `<family>/<layer>/<tensor>/<op>_<stat>`: TensorBoard groups tags by their first component and
its tag filter (a regex) then narrows by layer. Training scalars (loss, ...) and the global grad norm
are `scalars/<name>/...`, with one series per rank.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

from trainmon.monitor.config_keys import STAT_OPS
from trainmon.monitor.records import GRAD_REDUCED, GRAD_UNREDUCED

STATS = ("min", "median", "max")
MAX_RANK = "max_rank"
SCALARS = "scalars"
GRAD_NORM = "grad_norm"  # the global grad norm: a logged scalar of that name, else computed from the records
_LAYER = re.compile(r"^((?:[^.]+\.)*?[^.]+\.\d+)(?:\.|$)")  # up to the first numbered component

Key = tuple  # (family, name, vpp_stage, op)


def layer_of(name: str) -> str:
    """The layer group of a tensor name: up to its first numbered component (`decoder.layers.3`,
    `blocks.0`), else its first component (`head`, `emb`)."""
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


@functools.lru_cache(maxsize=1 << 18)
def _stat_tags(family: str, name: str, vpp_stage: int, op: str) -> tuple[str, str, str, str]:
    base = f"{tag_base(family, name, vpp_stage)}/{op}"
    return f"{base}_min", f"{base}_median", f"{base}_max", f"{base}_{MAX_RANK}"


def cross_rank(values: list[tuple[float, int]]) -> tuple[float, float, float, int]:
    """(min, median, max, rank of the max) of (value, rank) pairs; see the module docstring for NaN."""
    # plain Python: the lists are one value per rank and micro-step, where numpy's call overhead dominates
    if len(values) == 1 and values[0][0] == values[0][0]:
        value, rank = values[0]
        return value, value, value, rank
    ordered = sorted(pair for pair in values if pair[0] == pair[0])
    nan_ranks = [rank for value, rank in values if value != value]
    if not ordered:
        return math.nan, math.nan, math.nan, nan_ranks[0]
    n = len(ordered)
    median = ordered[n // 2][0] if n % 2 else (ordered[n // 2 - 1][0] + ordered[n // 2][0]) / 2
    top = max(values, key=lambda pair: (pair[0], -pair[1])) if not nan_ranks else (math.nan, nan_ranks[0])
    return ordered[0][0], median, top[0], top[1]


@dataclass
class StepFigures:
    """What one step holds across ranks, gathered before it is turned into tags."""

    step: int
    values: dict[Key, list[tuple[float, int]]] = field(default_factory=dict)
    per_rank: dict[tuple, float] = field(default_factory=dict)  # (rank, family, name, vpp, micro, op)
    scalars: dict[str, dict[int, float]] = field(default_factory=dict)
    grad_sumsq: dict[int, dict[str, float]] = field(default_factory=dict)  # rank -> family -> sum of norm²
    nonfinite: bool = False

    def add_rows(self, rank: int, rows: Iterable[dict], ranks_kept: frozenset) -> None:
        for row in rows:
            family, name, vpp = row["family"], row["name"], row["vpp_stage"]
            for op in STAT_OPS:
                value = row.get(op)
                if value is None:
                    continue
                self.values.setdefault((family, name, vpp, op), []).append((value, rank))
                if rank in ranks_kept:
                    self.per_rank[(rank, family, name, vpp, row["micro_step"], op)] = value
            if (row.get("nans") or 0) > 0 or (row.get("infs") or 0) > 0 or row.get("raw_nans", 0) > 0 \
                    or row.get("raw_infs", 0) > 0:
                self.nonfinite = True
            if family in (GRAD_REDUCED, GRAD_UNREDUCED) and row["micro_step"] is None:
                sumsq = row.get("raw_sumsq")
                if sumsq is None and row.get("norm") is not None:
                    sumsq = row["norm"] ** 2
                if sumsq is not None:
                    totals = self.grad_sumsq.setdefault(rank, {})
                    totals[family] = totals.get(family, 0.0) + sumsq

    def add_scalars(self, rank: int, rows: Iterable[dict]) -> None:
        for row in rows:
            self.scalars.setdefault(row["name"], {})[rank] = row["value"]

    def grad_norms(self) -> dict[int, float]:
        """The global grad norm per rank: the logged `grad_norm` scalar, else from the reduced grads'
        records (the unreduced ones when only those were recorded)."""
        if GRAD_NORM in self.scalars:
            return dict(self.scalars[GRAD_NORM])
        out = {}
        for rank, totals in self.grad_sumsq.items():
            total = totals.get(GRAD_REDUCED, totals.get(GRAD_UNREDUCED))
            out[rank] = math.sqrt(total) if total == total and total >= 0 else total
        return out

    def scalar_series(self) -> dict[str, dict[int, float]]:
        """Per-rank series: the logged scalars and the global grad norm."""
        out = dict(self.scalars)
        norms = self.grad_norms()
        if norms:
            out[GRAD_NORM] = norms
        return out

    def tag_values(self) -> list[tuple[str, float]]:
        """(tag, value) of everything this step writes."""
        out = []
        for (family, name, vpp, op), values in self.values.items():
            low, median, high, high_rank = cross_rank(values)
            tags = _stat_tags(family, name, vpp, op)
            out += [(tags[0], low), (tags[1], median), (tags[2], high), (tags[3], float(high_rank))]
        for (rank, family, name, vpp, micro, op), value in self.per_rank.items():
            suffix = "" if micro is None else f":{micro}"
            out.append((f"rank{rank}/{tag_base(family, name, vpp)}{suffix}/{op}", value))
        for name, by_rank in self.scalar_series().items():
            low, median, high, high_rank = cross_rank([(v, r) for r, v in by_rank.items()])
            out += [(f"{SCALARS}/{name}/min", low), (f"{SCALARS}/{name}/median", median),
                    (f"{SCALARS}/{name}/max", high), (f"{SCALARS}/{name}/{MAX_RANK}", float(high_rank))]
            out += [(f"{SCALARS}/{name}/rank{rank}", value) for rank, value in sorted(by_rank.items())]
        return out


def margin_charts(keys: Iterable[Key], scalar_names: Iterable[str]) -> dict[str, list[tuple[str, str, str, str]]]:
    """Per family (and `scalars`), the margin charts (title, median tag, min tag, max tag): the median
    with a min–max band across ranks."""
    out: dict[str, list[tuple[str, str, str, str]]] = {}
    for family, name, vpp, op in sorted(keys):
        base = f"{tag_base(family, name, vpp)}/{op}"
        out.setdefault(family, []).append((f"{label_of(name, vpp)} {op}", f"{base}_median", f"{base}_min",
                                           f"{base}_max"))
    for name in sorted(scalar_names):
        base = f"{SCALARS}/{name}"
        out.setdefault(SCALARS, []).append((name, f"{base}/median", f"{base}/min", f"{base}/max"))
    return out


def value_of(values: Optional[list[tuple[float, int]]]) -> Optional[float]:
    """The max across ranks (what a heatmap shows: an outlier must not be averaged away)."""
    return None if not values else cross_rank(values)[2]
