"""One rank's records of a chunk of steps as arrays, ready to be reduced across ranks (`aggregate`).

A database is read with one query (`DbRankReader.columns`): the figures of every row are derived at
once with numpy, where building a dict per record cost ~4 ms per rank and step. CSV files are read row
by row (their reader gives dicts) and turned into the same arrays: that path is slower.
"""
from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from trainmon.config.keys import STAT_OPS
from trainmon.core.records import GRAD_REDUCED, GRAD_UNREDUCED, PARAM_ORIGIN
from trainmon.read.errors import InputError
from trainmon.read.layout import RankDir
from trainmon.read.rank_records import open_rank
from trainmon.read.read_ahead import read_ahead
from trainmon.writers.db_schema import NO_MICRO_STEP

NORM_FAMILIES = (GRAD_REDUCED, GRAD_UNREDUCED)  # whose norms over a rank's tensors the view shows


@dataclass
class RankChunk:
    """Records of one rank within steps first..last.

    `keys[tag[i]]` is row i's (family, name, vpp_stage), `micro[i]` its micro-step (NO_MICRO_STEP: once per
    step); `values[op]` its figures (`present[op]`: the row has that figure). `norm_sumsq`: step -> family -> sum
    of the squared norms of the whole-step records of NORM_FAMILIES. `param_rows`: the rows of the whole-step
    `param_origin` records, `param_sumsq` their squared norms (the weights' global norm is summed over the ranks'
    distinct parameters, `aggregate.step_figures`).
    `kept`: (step, family, name, vpp, micro_step, op, value) of every figure, for ranks exported one by one.
    """

    rank: int
    keys: list = field(default_factory=list)
    step: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    tag: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    micro: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    values: dict = field(default_factory=dict)
    present: dict = field(default_factory=dict)
    nonfinite_steps: set = field(default_factory=set)
    norm_sumsq: dict = field(default_factory=dict)
    param_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    param_sumsq: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float64))
    scalars: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    error: Optional[Exception] = None  # the rank could not be read
    unread: list = field(default_factory=list)  # the errors of its files that could not be read whole (CSV)


class OpenReaders:
    """Readers of a finished run's ranks kept open from one chunk to the next: `watch --once`'s worker processes
    read every rank once a chunk, and opening a database and preparing its statements cost about as much as
    reading 64 of its steps. Up to a quarter of the process's file descriptors are kept (`limit`: 0 opens and
    closes a reader for each read, as the daemon following a live run does); each with a small page cache, as a
    chunk's pages are read once. Each of those databases is read ahead (`read_ahead`): a chunk's steps lie all
    over the file, and the run is read whole."""

    PAGE_CACHE_KIB = 64

    def __init__(self, limit: Optional[int] = None):
        self.limit = _descriptors() // 4 if limit is None else limit
        self._open: dict[tuple, object] = {}

    @contextmanager
    def reader(self, rank_dir: RankDir, source: str) -> Iterator:
        """The read layer's reader of a rank (`open_rank`), closed after use unless kept.

        Raises:
            InputError: the rank's sources cannot be read (named in the message).
        """
        key = (rank_dir.path, source)
        reader = self._open.pop(key, None)
        if reader is None:
            reader = open_rank(rank_dir, source)
            if self.limit and hasattr(reader, "conn"):
                read_ahead(reader.path)
                reader.conn.execute(f"PRAGMA cache_size = -{self.PAGE_CACHE_KIB}")
        try:
            yield reader
        except BaseException:
            reader.close()
            raise
        if len(self._open) < self.limit:
            self._open[key] = reader
        else:
            reader.close()


def _descriptors() -> int:
    """The soft limit of open files of this process (1024 where it cannot be read)."""
    try:
        import resource  # not on Windows
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 1024


def read_chunk(task: tuple, readers: Optional[OpenReaders] = None) -> RankChunk:
    """(rank_dir, source, first, last, keep) -> the rank's chunk; an error is returned, not raised, so that
    a worker process hands it back with the rank it belongs to. `keep`: fill `kept`. `readers`: where the
    rank's reader is kept open (default: opened and closed here)."""
    rank_dir, source, first, last, keep = task
    try:
        with (readers or OpenReaders(0)).reader(rank_dir, source) as reader:
            if hasattr(reader, "columns"):
                chunk = _from_columns(rank_dir.rank, reader.columns(None, first, last), keep)
            else:
                unread = []
                chunk = _from_rows(rank_dir.rank, reader.rows(None, first, last, unread.append), keep)
                chunk.unread = unread
            chunk.scalars = reader.scalars(None, first, last)
    except (InputError, sqlite3.Error, OSError) as err:
        return RankChunk(rank_dir.rank, error=err)
    return chunk


def _from_columns(rank: int, columns, keep: bool) -> RankChunk:
    data = columns.rows
    ops = [op for op in STAT_OPS if op in columns.missing]
    # the tags in the order the rows bring them (that of the heatmaps' rows), not the table's
    used, first_row = np.unique(columns.tag_at, return_index=True)
    used = used[np.argsort(first_row)]
    local = np.zeros(len(columns.tags), dtype=np.int64)
    local[used] = np.arange(len(used))
    chunk = RankChunk(rank, [columns.tags[t] for t in used.tolist()], data["step"], local[columns.tag_at],
                      data["micro_step"], {op: data[op] for op in ops}, {op: ~columns.missing[op] for op in ops})
    # NaN counts that were not recorded are NaN here, and count as none (NaN > 0 is False)
    bad = (data["raw_nans"] > 0) | (data["raw_infs"] > 0)
    chunk.nonfinite_steps = set(np.unique(data["step"][bad]).tolist())
    whole_step = data["micro_step"] == NO_MICRO_STEP
    families = np.array([key[0] for key in columns.tags], dtype=object)[columns.tag_at]
    # the squared norm as torch gives it: NaN with a NaN element, +Inf with an Inf (the record's is finite-only)
    sumsq = np.where(data["raw_nans"] > 0, np.nan, np.where(data["raw_infs"] > 0, np.inf, data["raw_sumsq"]))
    for family in NORM_FAMILIES:
        rows = whole_step & (families == family)
        _add_sumsq(chunk.norm_sumsq, family, data["step"][rows], sumsq[rows])
    _keep_params(chunk, whole_step & (families == PARAM_ORIGIN), sumsq)
    if keep:
        for i in range(len(columns)):
            family, name, vpp = chunk.keys[chunk.tag[i]]
            micro = int(data["micro_step"][i])
            chunk.kept += [(int(data["step"][i]), family, name, vpp, None if micro == NO_MICRO_STEP else micro, op,
                            float(data[op][i])) for op in ops if chunk.present[op][i]]
    return chunk


def _from_rows(rank: int, by_step, keep: bool) -> RankChunk:
    index: dict = {}
    steps, tags, micro, sumsq = [], [], [], []
    figures: dict = {op: [] for op in STAT_OPS}
    chunk = RankChunk(rank)
    for step, rows in by_step:
        for row in rows:
            tags.append(index.setdefault((row["family"], row["name"], row["vpp_stage"]), len(index)))
            steps.append(step)
            micro.append(row["micro_step"])
            for op in STAT_OPS:
                figures[op].append(row.get(op))
            if (row.get("nans") or 0) > 0 or (row.get("infs") or 0) > 0:
                chunk.nonfinite_steps.add(step)
            sumsq.append(None if row.get("norm") is None else row["norm"] ** 2)  # CSV: no stored sum of squares
    chunk.keys, chunk.step, chunk.tag = list(index), np.array(steps, dtype=np.int64), np.array(tags, dtype=np.int64)
    chunk.micro = np.array([NO_MICRO_STEP if m is None else m for m in micro], dtype=np.int64)
    for op, column in figures.items():
        present = np.array([value is not None for value in column], dtype=bool)
        if present.any():
            chunk.present[op] = present
            chunk.values[op] = np.array([np.nan if value is None else value for value in column], dtype=np.float64)
    families = np.array([chunk.keys[t][0] for t in tags], dtype=object)
    whole_step = np.array([m is None and s is not None for m, s in zip(micro, sumsq)], dtype=bool)
    sumsq = np.array(sumsq, dtype=np.float64)  # None (no norm) as NaN: left out by whole_step
    for family in NORM_FAMILIES:
        rows = whole_step & (families == family)
        _add_sumsq(chunk.norm_sumsq, family, chunk.step[rows], sumsq[rows])
    _keep_params(chunk, whole_step & (families == PARAM_ORIGIN), sumsq)
    if keep:
        for i, (step, tag) in enumerate(zip(steps, tags)):
            family, name, vpp = chunk.keys[tag]
            chunk.kept += [(step, family, name, vpp, micro[i], op, chunk.values[op][i]) for op in chunk.values
                           if chunk.present[op][i]]
    return chunk


def _keep_params(chunk: RankChunk, rows: np.ndarray, sumsq: np.ndarray) -> None:
    """Keeps the rows `rows` (the whole-step `param_origin` records) and their squared norms."""
    chunk.param_rows = np.flatnonzero(rows)
    chunk.param_sumsq = sumsq[chunk.param_rows]


def _add_sumsq(totals: dict, family: str, steps: np.ndarray, sumsq: np.ndarray) -> None:
    """Sums per step in row order (bincount adds one weight after the other, as the rows come)."""
    if not len(steps):
        return
    low = int(steps.min())
    sums = np.bincount(steps - low, weights=sumsq)
    for offset in np.flatnonzero(np.bincount(steps - low)).tolist():
        totals.setdefault(low + offset, {})[family] = float(sums[offset])
