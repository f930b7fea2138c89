"""A chunk's values as matrices of a row per (step, tensor) and a column per rank and micro-step, reduced row by row.

Ranks of one job record the same tensors in the same order, so every rank's rows of a chunk usually follow one
sequence: then each op's values, one rank after the other, are already a matrix of a row per rank, and a
gather of its columns and a transpose give the rows to reduce (`AlignedRanks`), instead of a scatter of every
value into its cell (`aggregate.reduce_matrix`, for chunks whose ranks differ). A row's columns are its ranks
in ascending order, each with its micro-steps in order, so that the first column holding the max belongs to
the smallest rank holding it.
"""
from __future__ import annotations

from typing import Optional

import numpy as np


def reduce_rows(matrix: np.ndarray, filled: np.ndarray, column_rank: np.ndarray) -> tuple:
    """Per row holding a value: (row, min, median, max, rank of the max) of its filled cells (`column_rank`: the
    rank of each column), as `aggregate.reduce_groups` gives them: a NaN makes the max NaN and names the first
    column holding one; min and median are taken over the other values (NaN when there are none)."""
    nan = filled & np.isnan(matrix)
    ordered = np.sort(matrix, axis=1)  # the values that are not NaN lead each row, the empty cells are NaN too
    count = filled.sum(axis=1) - nan.sum(axis=1)
    rows = np.arange(len(matrix))
    low, high = np.maximum(count - 1, 0) // 2, count // 2
    with np.errstate(invalid="ignore", over="ignore"):
        median = np.where(count % 2 == 1, ordered[rows, high], (ordered[rows, low] + ordered[rows, high]) / 2)
    largest = ordered[rows, np.maximum(count - 1, 0)]
    has_nan = nan.any(axis=1)
    largest[has_nan] = np.nan
    with np.errstate(invalid="ignore"):
        holder = np.where(has_nan[:, None], nan, filled & (matrix == largest[:, None])).argmax(axis=1)
    empty = count == 0
    used = filled.any(axis=1)
    return (rows[used], np.where(empty, np.nan, ordered[:, 0])[used], np.where(empty, np.nan, median)[used],
            largest[used], column_rank[holder][used])


class AlignedRanks:
    """The layout of a chunk whose ranks' rows follow one sequence: `rank_rows` rows per rank, the ranks one after
    the other in ascending order. Its groups (a step's tensor) hold either one whole-step record per rank, or
    the same micro-steps on every rank.

    Made by `of`; `parts`: per kind of group (whole-step, per micro-step), the positions of its rows in a rank's
    sequence (a group's rows together, micro-steps ascending), the groups' ids ascending, and the rows a group.
    """

    def __init__(self, ranks: np.ndarray, rank_rows: int, parts: list[tuple[np.ndarray, np.ndarray, int]]):
        self.ranks, self.rank_rows, self.parts = ranks, rank_rows, parts

    @classmethod
    def of(cls, group: np.ndarray, micro: np.ndarray, rank: np.ndarray, ranks: np.ndarray) -> Optional["AlignedRanks"]:
        """The layout of rows with these group ids, micro-steps (+ 1; 0 for a record of the whole step) and ranks
        (`ranks`: the distinct ones, ascending), or None where the ranks' rows do not follow one sequence (ranks
        that recorded other tensors, a tensor recorded twice in a micro-step, a tensor with both whole-step and
        micro-step records)."""
        if not len(ranks) or len(group) % len(ranks):
            return None
        per_rank = len(group) // len(ranks)
        shaped = [array.reshape(len(ranks), per_rank) for array in (group, micro, rank)]
        if not all((array == array[:1]).all() for array in shaped[:2]) or not (shaped[2] == ranks[:, None]).all():
            return None
        group, micro = shaped[0][0], shaped[1][0]
        parts = []
        for whole in (True, False):
            positions = np.flatnonzero((micro == 0) == whole)
            if not len(positions):
                continue
            positions = positions[np.lexsort((micro[positions], group[positions]))]
            ids = np.unique(group[positions])
            steps = len(positions) // len(ids)
            if len(ids) * steps != len(positions) or not (
                    (group[positions].reshape(len(ids), steps) == ids[:, None]).all()
                    and (micro[positions].reshape(len(ids), steps) == micro[positions][:steps]).all()
                    and len(np.unique(micro[positions][:steps])) == steps):
                return None
            parts.append((positions, ids, steps))
        if len(parts) == 2 and np.intersect1d(parts[0][1], parts[1][1]).size:
            return None
        return cls(ranks, per_rank, parts)

    def reduce(self, value: np.ndarray, present: np.ndarray) -> tuple:
        """`aggregate.reduce_groups` of the rows where `present`: (group ids ascending, min, median, max, rank of
        the max)."""
        out = []
        for positions, ids, steps in self.parts:
            matrix, filled = (self._matrix(array, positions, steps) for array in (value, present))
            matrix[~filled] = np.nan  # a cell without a value is empty
            rows, *figures = reduce_rows(matrix, filled, np.repeat(self.ranks, steps))
            out.append((ids[rows], *figures))
        if len(out) == 1:
            return out[0]
        order = np.argsort(np.concatenate([part[0] for part in out]))
        return tuple(np.concatenate(columns)[order] for columns in zip(*out))

    def largest_per_rank(self, value: np.ndarray, present: np.ndarray, key: np.ndarray) -> tuple:
        """Per key and rank, the largest value of the key's groups and micro-steps where `present`, a NaN winning
        (`key`: each group id's key, >= 0): (keys ascending, values: a row per key and a column per rank, NaN where
        the key has no value on the rank, and where it has one)."""
        keys, largest, held = [], [], []
        for positions, ids, steps in self.parts:
            matrix, filled = (self._matrix(array, positions, steps).reshape(len(ids), len(self.ranks), steps)
                              for array in (value, present))
            top = np.where(filled, matrix, -np.inf).max(axis=2)  # a NaN stays the max
            keys.append(key[ids])
            largest.append(top)
            held.append(filled.any(axis=2))
        keys, largest, held = np.concatenate(keys), np.concatenate(largest), np.concatenate(held)
        order = np.argsort(keys, kind="stable")
        keys, largest, held = keys[order], largest[order], held[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        largest, held = np.maximum.reduceat(largest, starts), np.logical_or.reduceat(held, starts)
        largest[~held] = np.nan  # as `reduce_rows` takes an empty cell
        return keys[starts], largest, held

    def _matrix(self, array: np.ndarray, positions: np.ndarray, steps: int) -> np.ndarray:
        """A row per group, its columns the ranks ascending, each with its `steps` micro-steps in order."""
        taken = array.reshape(len(self.ranks), self.rank_rows)[:, positions]  # rank, group x micro-step
        groups = len(positions) // steps
        return np.ascontiguousarray(taken.reshape(len(self.ranks), groups, steps).transpose(1, 0, 2)
                                    ).reshape(groups, len(self.ranks) * steps)
