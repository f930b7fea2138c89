"""`trainmon.open_run(path)`: a run's statistics, across all its ranks, as pandas DataFrames.

Example:
    run = trainmon.open_run("monitor_output/run-20260101-120000")
    grads = run.family("grad_reduced", steps=(100, 200))      # steps 100..200, every rank
    norm = run.tag("0:head.weight/rank0/post_grad")[["step", "norm"]]
    at_step = run.step(150)                                    # every tag of step 150
    loss = run.scalars("loss")
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from trainmon.read.database import DbRankReader
from trainmon.read.layout import find_run
from trainmon.read.parallel import map_ranks
from trainmon.read.rank_records import open_rank
from trainmon.writers.tags import split_tag, tag_for

Steps = Union[None, int, range, slice, Sequence[int]]
_LEADING = ["rank", "family", "tag", "vpp_stage", "name", "micro_step", "step"]


def _pandas():
    try:
        import pandas
    except ImportError as err:
        raise ImportError("reading a run into DataFrames needs pandas: pip install pandas") from err
    return pandas


def step_range(steps: Steps) -> tuple[Optional[int], Optional[int]]:
    """(first, last) inclusive from None (all), an int, a range, a slice, or a (first, last) pair.

    Raises:
        ValueError: anything else.
    """
    if steps is None:
        return None, None
    if isinstance(steps, int):
        return steps, steps
    if isinstance(steps, (range, slice)):
        if steps.step not in (None, 1):
            raise ValueError(f"steps {steps!r}: a stride is not supported")
        return steps.start, None if steps.stop is None else steps.stop - 1
    if isinstance(steps, (tuple, list)) and len(steps) == 2:
        return steps[0], steps[1]
    raise ValueError(f"steps must be an int, a range, a slice or a (first, last) pair, got {steps!r}")


class Run:
    """The statistics of one run, every rank, read from `monitor.db` where present, else from the CSVs.

    A figure without a value (the min of a tensor with no finite element, an op a file lacks) is NaN in
    the DataFrames, as is a NaN figure; the `nans` column (and, from a database, the `count`, `nans`,
    `infs` fields) tell them apart.

    What a caller should say beside the answers: `missing_warning` (ranks without a directory) and
    `stream_warnings` (corrupt parts of a record stream, skipped; a tail); `incomplete` is true when a part of a
    record stream could not be read, so no answer may call the run clean.

    Args:
        path: a run directory (holding `rank_<R>/`), one rank directory, msprobe's output root
            (holding `<time>-rank<R>-<uuid>/`), or an output root (its latest run, with a warning).
        source: "auto" (database if present), "db" or "csv".
    """

    def __init__(self, path: Union[str, Path], source: str = "auto"):
        found = find_run(path)
        if found.note:
            warnings.warn(found.note, stacklevel=3)
        self.path = found.path
        self.missing_ranks, self.missing_warning = found.missing_ranks, found.missing_warning  # said by the caller
        self._readers = {}
        try:
            for rank_dir in found.ranks:
                self._readers[rank_dir.rank] = open_rank(rank_dir, source)
            streams = found.stream_findings() if source != "csv" else []
        except Exception:
            self.close()
            raise
        # said by the caller too: what reading the ranks' record streams found besides whole frames
        self.stream_warnings = [line for stream in streams for line in stream.warnings]
        self.incomplete = any(stream.lost for stream in streams)  # a part could not be read

    @property
    def ranks(self) -> list[int]:
        return sorted(self._readers)

    def metadata(self, rank: Optional[int] = None) -> dict:
        """The run metadata of `rank` (default: the first): config, versions, world size, writer counts."""
        return self._readers[self.ranks[0] if rank is None else rank].meta

    def iter_steps(self, rank: int, family: Optional[str] = None, steps: Steps = None) -> Iterator[tuple[int, list]]:
        """(step, rows) of one rank in step order, rows as dicts (ops None where there is no value)."""
        return self._readers[rank].rows(family, *step_range(steps))

    def steps(self, rank: int) -> set[int]:
        """The steps `rank` holds (for CSV sources: the steps the file names span, an upper bound)."""
        return self._readers[rank].steps()

    def step_count(self, rank: int) -> int:
        """Steps `rank` holds (for CSV sources: the steps the file names span, an upper bound)."""
        return self._readers[rank].step_count()

    def ops(self, rank: int) -> list[str]:
        """The figures available for `rank` (known once its rows were read, for CSV sources)."""
        return self._readers[rank].ops

    def records(self, family: Optional[str] = None, tag: Optional[str] = None, steps: Steps = None,
                ranks: Optional[Sequence[int]] = None):
        """One row per record: rank, family, tag, vpp_stage, name, micro_step, step, the ops, shape, dtype
        (and call_index, pp_stage, nan_fields and the record's fields `raw_count` ... `raw_sat` when read
        from a database).

        Args:
            family: only this family (e.g. "actv", "grad_reduced").
            tag: only this tag, as written to TensorBoard without the `_{op}` suffix.
            steps: see `step_range`.
            ranks: only these ranks.
        """
        pd = _pandas()
        if tag is not None:
            tag_family, tag_rank = split_tag(tag)
            family = family or tag_family
            ranks = [tag_rank]
        ranks = self.ranks if ranks is None else list(ranks)
        for rank in ranks:
            if rank not in self._readers:
                raise ValueError(f"rank {rank} is not in {self.path} (ranks: {self.ranks})")
        first, last = step_range(steps)
        if all(isinstance(self._readers[rank], DbRankReader) for rank in ranks):
            # databases are read in worker processes when there are many (each read is its own query)
            datas = map_ranks(_db_columns, [(self._readers[rank].path, family, first, last) for rank in ranks])
        else:
            datas = [self._rank_data(rank, family, first, last) for rank in ranks]
        frame = pd.DataFrame(_concat([_with_tags(data, rank) for data, rank in zip(datas, ranks)]))
        if frame.empty:
            return pd.DataFrame(columns=_LEADING)
        if tag is not None:
            frame = frame[frame["tag"] == tag]
        # None (no value) becomes NaN, also in a column that has no value at all
        numeric = {op for rank in self._readers for op in self.ops(rank)}
        frame = frame.astype({c: float for c in frame.columns if c in numeric})
        ordered = _LEADING + [c for c in frame.columns if c not in _LEADING]
        return frame[ordered].reset_index(drop=True)

    def _rank_data(self, rank: int, family: Optional[str], first: Optional[int], last: Optional[int]) -> dict:
        """One rank's records as columns (name -> array or list)."""
        reader = self._readers[rank]
        if isinstance(reader, DbRankReader):
            return reader.columns(family, first, last).data
        rows = [row for _, step_rows in reader.rows(family, first, last) for row in step_rows]
        return {name: [row.get(name) for row in rows] for name in dict.fromkeys(k for r in rows for k in r)}

    def family(self, family: str, steps: Steps = None):
        """Every record of one family, every rank."""
        return self.records(family=family, steps=steps)

    def tag(self, tag: str, steps: Steps = None):
        """One tag over steps (a tag names one rank)."""
        return self.records(tag=tag, steps=steps)

    def step(self, step: int):
        """Every record of one step, every rank."""
        return self.records(steps=step)

    def tags(self):
        """The distinct tags: rank, family, tag, vpp_stage, name, micro_step."""
        return self.records()[_LEADING[:-1]].drop_duplicates().reset_index(drop=True)

    def scalars(self, name: Optional[str] = None, steps: Steps = None):
        """Training scalars (`log_scalar`): rank, name, step, value (database sources only)."""
        pd = _pandas()
        rows = [{"rank": rank, **row} for rank in self.ranks
                for row in self._readers[rank].scalars(name, *step_range(steps))]
        return pd.DataFrame(rows, columns=["rank", "name", "step", "value"])

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _db_columns(job: tuple) -> dict:
    """The columns of one database (job: path, family, first, last), read in a worker process."""
    path, family, first, last = job
    reader = DbRankReader(path)
    try:
        return reader.columns(family, first, last).data
    finally:
        reader.close()


def _with_tags(data: dict, rank: int) -> dict:
    """`data` with its rank and tags as columns."""
    count = len(data.get("step", ()))
    data["rank"] = np.full(count, rank, dtype=np.int64)
    tags: dict[tuple, str] = {}  # one string per tag, not per record
    data["tag"] = [tags.get(key) or tags.setdefault(key, tag_for(*key, rank)) for key in
                   zip(data.get("family", ()), data.get("name", ()), data.get("vpp_stage", ()),
                       data.get("micro_step", ()))]
    return data


def _concat(parts: list[dict]) -> dict:
    """The columns of several ranks end to end; a column a rank lacks is None there."""
    out = {}
    for name in dict.fromkeys(name for part in parts for name in part):
        pieces = [part[name] if name in part else [None] * len(part["rank"]) for part in parts]
        if all(isinstance(piece, np.ndarray) for piece in pieces):
            out[name] = np.concatenate(pieces)
        else:
            out[name] = [value for piece in pieces for value in piece]
    return out


def open_run(path: Union[str, Path], source: str = "auto") -> Run:
    """Opens a run's output for reading; see `Run`.

    Raises:
        InputError: `path` does not exist, holds no monitor output, or a source cannot be read.
    """
    return Run(path, source)
