"""Two runs' statistic records side by side: aligned, differenced, and ordered by the ordering key.

Records align by (family, name, step, micro-step, rank); names of run B pass through the `--map`
(`NameMap`) first. Megatron's global layer numbers and `squash_name` make names the same across
parallel layouts. Each op both records have is differenced: abs = |a - b|, rel = abs / max(|a|, |b|);
two NaNs are equal, one NaN is a divergence. A record diverges when some op differs by more than
`atol + rtol * max(|a|, |b|)` (numpy's `isclose`, made symmetric). The first divergent record is the
earliest by the ordering key (forward before backward before optimizer, step by step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from trainmon.core.ordering import order_key
from trainmon.compare.names import NameMap
from trainmon.compare.thresholds import DEFAULT_ATOL, DEFAULT_RTOL
from trainmon.core.records import PHASES
from trainmon.core.schema import OPS
from trainmon.read import InputError, Run, coverage

EQUAL, CLOSE, DIVERGED, ONLY_A, ONLY_B = "equal", "close", "diverged", "only_a", "only_b"


@dataclass
class Aligned:
    """One record of either run or both; the fields the ordering key reads, then both runs' figures."""

    family: str
    name: str
    step: int
    micro_step: Optional[int]
    rank: int
    vpp_stage: int = 0
    pp_stage: int = 0
    call_index: Optional[int] = None
    a: Optional[dict] = None
    b: Optional[dict] = None
    diffs: dict = field(default_factory=dict)  # op -> (abs, rel)
    verdict: str = EQUAL

    @property
    def phase(self) -> str:
        return PHASES.get(self.family, "unknown")

    @property
    def worst(self) -> float:
        """The largest relative difference of its ops (inf for a record one run lacks)."""
        if self.verdict in (ONLY_A, ONLY_B):
            return math.inf
        return max((rel for _, rel in self.diffs.values()), default=0.0)


def op_difference(a: Optional[float], b: Optional[float]) -> Optional[tuple[float, float]]:
    """(abs, rel) of two figures; None when neither has a value. NaN against NaN is no difference."""
    if a is None and b is None:
        return None
    if a is None or b is None:
        return math.inf, math.inf
    if math.isnan(a) or math.isnan(b):
        return (0.0, 0.0) if math.isnan(a) and math.isnan(b) else (math.inf, math.inf)
    if a == b:  # also equal infinities
        return 0.0, 0.0
    diff = abs(a - b)
    scale = max(abs(a), abs(b))
    return diff, (diff / scale if scale > 0 else math.inf)


def judge(record: Aligned, rtol: float, atol: float) -> None:
    """Fills `diffs` and `verdict` of a record both runs hold."""
    ops = [op for op in OPS if op in record.a and op in record.b]
    verdict = EQUAL
    for op in ops:
        a, b = record.a[op], record.b[op]
        diff = op_difference(_number(a), _number(b))
        if diff is None:
            continue
        record.diffs[op] = diff
        if diff[0] == 0.0:
            continue
        scale = max(abs(_number(a) or 0.0), abs(_number(b) or 0.0))
        if diff[0] <= atol + rtol * scale:
            verdict = CLOSE if verdict == EQUAL else verdict
        else:
            verdict = DIVERGED
    record.verdict = verdict


def _number(value) -> Optional[float]:
    return None if value is None else float(value)


def _figures(row: dict) -> dict:
    return {op: row[op] for op in OPS if op in row}


def _rows(run: Run, rank: int, steps, rename: Optional[NameMap]) -> dict:
    out = {}
    for _, rows in run.iter_steps(rank, steps=steps):
        for row in rows:
            name = rename(row["name"]) if rename else row["name"]
            key = (row["family"], name, row["step"], row.get("micro_step"), rank)
            out.setdefault(key, row)  # a duplicate name (same tensor twice) keeps its first record
    return out


def rank_pairs(run_a: Run, run_b: Run, ranks: Optional[list[int]]) -> list[int]:
    """The ranks to compare one to one.

    Raises:
        InputError: one of `ranks` is missing from a run, or the runs have different ranks and no `ranks`
            were given.
    """
    if ranks:
        for run in (run_a, run_b):
            missing = [rank for rank in ranks if rank not in run.ranks]
            if missing:
                raise InputError.at(run.path, f"has no rank {', '.join(map(str, missing))} (ranks: "
                                              f"{_ranks(run.ranks)})")
        return sorted(set(ranks))
    if run_a.ranks != run_b.ranks:
        raise InputError(f"the runs have different ranks: {run_a.path} has {len(run_a.ranks)} "
                         f"({_ranks(run_a.ranks)}), {run_b.path} has {len(run_b.ranks)} ({_ranks(run_b.ranks)}); "
                         "ranks are compared one to one: pick one with --rank R")
    return run_a.ranks


def check_steps(runs: tuple[Run, Run], ranks: list[int], steps) -> None:
    """A step range must hold steps of both runs (on the ranks compared).

    Raises:
        InputError: a run holds no step of `steps` (first, last), naming the steps it holds.
    """
    for run in runs:
        coverage.check_steps(run, ranks, steps)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")


def align(run_a: Run, run_b: Run, ranks: list[int], steps=None, name_map: Optional[NameMap] = None,
          rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL) -> Iterator[Aligned]:
    """Every record of either run, judged, rank by rank (in no particular order; see `execution_order`)."""
    for rank in ranks:
        rows_a = _rows(run_a, rank, steps, None)
        rows_b = _rows(run_b, rank, steps, name_map)
        for key in list(rows_a) + [k for k in rows_b if k not in rows_a]:
            row_a, row_b = rows_a.get(key), rows_b.get(key)
            where = row_a or row_b
            record = Aligned(*key, vpp_stage=where.get("vpp_stage") or 0, pp_stage=where.get("pp_stage") or 0,
                             call_index=where.get("call_index"),
                             a=None if row_a is None else _figures(row_a), b=None if row_b is None else _figures(row_b))
            if row_a is None or row_b is None:
                record.verdict = ONLY_B if row_a is None else ONLY_A
            else:
                judge(record, rtol, atol)
            yield record


def divergent_steps(run_a: Run, run_b: Run, rank: int, rtol: float = DEFAULT_RTOL,
                    atol: float = DEFAULT_ATOL) -> list[int]:
    """The steps of `rank` holding a record of both runs with an op that may differ beyond the tolerance, ascending:
    every step that holds a DIVERGED record, and perhaps a few more (`align` judges them), found over all steps at
    once with numpy. A figure without a value counts as NaN here: a record whose only difference is a NaN against
    no value is not found (its NaN and Inf counts differ too, unless neither recorded them)."""
    keys = ["family", "name", "step", "micro_step"]
    frames = [run.records(ranks=[rank]) for run in (run_a, run_b)]
    ops = [op for op in OPS if all(op in frame.columns for frame in frames)]
    # align keeps a name's first record of a (step, micro-step); once per step is micro-step -1 (NaN keys never meet)
    frames = [frame.assign(micro_step=frame.micro_step.fillna(-1))[keys + ops].drop_duplicates(keys)
              for frame in frames]
    both = frames[0].merge(frames[1], on=keys, suffixes=("_a", "_b"))
    a = both[[f"{op}_a" for op in ops]].to_numpy(dtype=float)
    b = both[[f"{op}_b" for op in ops]].to_numpy(dtype=float)
    with np.errstate(invalid="ignore", over="ignore"):
        beyond = np.abs(a - b) > atol + rtol * np.maximum(np.abs(a), np.abs(b))
        infinite = (a != b) & (np.isinf(a) | np.isinf(b))  # the tolerance of an infinite scale is no screen
    differs = (np.isnan(a) != np.isnan(b)) | beyond | infinite
    return sorted(set(both.step[differs.any(axis=1)].astype(int).tolist()))


def execution_order(records: list[Aligned]) -> list[Aligned]:
    """Sorted by the ordering key: step, micro-step, phase, stage, call index, rank."""
    return sorted(records, key=order_key)
