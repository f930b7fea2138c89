"""The records of one rank as (step, rows): from `monitor.db` (full records) or from the CSV files (figures)."""
from __future__ import annotations

from typing import Callable, Iterator, Optional

from trainmon.read.csv_rows import read_csv_rows
from trainmon.read.database import DbRankReader
from trainmon.read.errors import InputError
from trainmon.read.layout import RankDir

SOURCES = ("auto", "db", "csv")


class CsvRankReader:
    """Records of one rank's CSV files (trainmon's or msprobe's), figures as written."""

    def __init__(self, rank_dir: RankDir):
        self.rank_dir = rank_dir
        self.meta = rank_dir.metadata()
        self.ops: list[str] = []

    def rows(self, family: Optional[str], first: Optional[int], last: Optional[int],
             on_error: Optional[Callable[[InputError], None]] = None) -> Iterator[tuple[int, list]]:
        """(step, rows) in step order; ops missing in the file (empty cells) are None.

        Args:
            on_error: called with the error of a file that cannot be read whole, whose rows up to the bad line are
                kept and the rest skipped; None: the error is raised.
        """
        by_step: dict[int, list] = {}
        for file in self.rank_dir.family_files(family):
            if not file.overlaps(first, last):
                continue
            try:
                ops, rows = read_csv_rows(file.path)
                self.ops += [op for op in ops if op not in self.ops]
                for row in rows:
                    if (first is None or row["step"] >= first) and (last is None or row["step"] <= last):
                        row["family"] = file.family
                        by_step.setdefault(row["step"], []).append(row)
            except InputError as err:
                if on_error is None:
                    raise
                on_error(err)
        for step in sorted(by_step):
            yield step, by_step[step]

    def steps(self) -> set[int]:
        """The steps the files' names span (an upper bound: a file's range may have gaps)."""
        return {step for f in self.rank_dir.family_files() for step in range(f.first, f.last + 1)}

    def step_count(self) -> int:
        return len(self.steps())

    def scalars(self, name: Optional[str], first: Optional[int], last: Optional[int]) -> list[dict]:
        return []  # the CSV format holds no training scalars

    def close(self) -> None:
        pass


def open_rank(rank_dir: RankDir, source: str = "auto"):
    """The reader of one rank: its database when there is one (or `source="db"`), else its CSV files.

    Raises:
        ValueError: `source` is not auto/db/csv.
        InputError: "db" was asked for and the rank has no monitor.db, or the database cannot be read.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be 'auto', 'db' or 'csv', got {source!r}")
    if source == "db" and rank_dir.db is None:
        raise InputError.at(rank_dir.path, "no monitor.db here (written when `format` includes \"db\")")
    if source != "csv" and rank_dir.db is not None:
        return DbRankReader(rank_dir.db)
    return CsvRankReader(rank_dir)
