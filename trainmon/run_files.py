"""Finding the ranks of a run on disk, and reading its CSV files (trainmon's and msprobe's layouts).

trainmon writes `<run>/rank_<R>/`; msprobe writes `<Mon DD_HH-MM-SS>-rank<R>-<uuid8>/` under the
output root. Both hold `<family>_<first>-<last>.csv` files with the same columns.
"""
from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from trainmon.monitor.records import FAMILIES
from trainmon.writers.db_schema import DB_NAME

_RANK_DIR = re.compile(r"^rank_(\d+)$|-rank(\d+)-")
_FAMILY_FILE = re.compile(r"^(?P<family>.+)_(?P<first>\d+)-(?P<last>\d+)\.csv$")
INDEX_COLUMNS = ("vpp_stage", "name", "step", "micro_step")
KEY_COLUMNS = ("shape", "dtype")


@dataclass(frozen=True)
class RankDir:
    rank: int
    path: Path

    @property
    def db(self) -> Optional[Path]:
        path = self.path / DB_NAME
        return path if path.is_file() else None

    def family_files(self, family: Optional[str] = None) -> list["FamilyFile"]:
        """The CSV files of one family (or all), ordered by first step."""
        files = []
        for path in self.path.glob("*.csv"):
            match = _FAMILY_FILE.match(path.name)
            if match and match["family"] in FAMILIES and family in (None, match["family"]):
                files.append(FamilyFile(match["family"], int(match["first"]), int(match["last"]), path))
        return sorted(files, key=lambda f: (f.first, f.family))


@dataclass(frozen=True)
class FamilyFile:
    family: str
    first: int
    last: int
    path: Path

    def overlaps(self, first: Optional[int], last: Optional[int]) -> bool:
        return (first is None or self.last >= first) and (last is None or self.first <= last)


def find_rank_dirs(path: str | Path) -> list[RankDir]:
    """Every rank directory of the run at `path` (a run directory, one rank directory, an output root
    holding one run, or an msprobe output root holding `*-rank<R>-*` directories), ordered by rank.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: `path` holds no monitor output, or two directories claim the same rank.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory; give a run directory (holding rank_<R>/), a rank "
                                "directory, or msprobe's output directory")
    dirs = [d for d in root.iterdir() if d.is_dir() and _RANK_DIR.search(d.name) and _has_output(d)]
    if not dirs and _has_output(root):
        dirs = [root]
    if not dirs:
        runs = sorted(d.name for d in root.iterdir() if d.is_dir() and any(d.glob("rank_*")))
        if len(runs) == 1:  # an output root with a single run
            return find_rank_dirs(root / runs[0])
        if runs:
            raise ValueError(f"{root} holds several runs ({', '.join(runs)}); give one of them, e.g. {root / runs[-1]}")
        raise ValueError(f"{root} holds no monitor output (no monitor.db, no <family>_<a>-<b>.csv, no rank_<R>/ "
                         "directories)")
    ranks: dict[int, Path] = {}
    for d in dirs:
        rank = _rank_of(d)
        if rank in ranks:
            raise ValueError(f"{ranks[rank]} and {d} both hold rank {rank}; {root} mixes several runs, "
                             "give one run's directory")
        ranks[rank] = d
    return [RankDir(rank, ranks[rank]) for rank in sorted(ranks)]


def _has_output(d: Path) -> bool:
    return (d / DB_NAME).is_file() or bool(RankDir(0, d).family_files())


def _rank_of(d: Path) -> int:
    match = _RANK_DIR.search(d.name)
    if match:
        return int(match[1] if match[1] is not None else match[2])
    try:
        return int(json.loads((d / "run.json").read_text())["rank"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def read_csv_rows(path: Path) -> tuple[list[str], Iterator[dict]]:
    """(op columns, rows) of one family CSV. A row maps the index columns to int/str, each op to a
    float (NaN when the file says nan) or None (empty cell: no value), shape and dtype to str.

    Raises:
        ValueError: the header lacks `vpp_stage`, `name` or `step`.
    """
    handle = open(path, newline="")
    reader = csv.reader(handle)
    header = next(reader, [])
    missing = [c for c in ("vpp_stage", "name", "step") if c not in header]
    if missing:
        handle.close()
        raise ValueError(f"{path} is not a monitor CSV: its header {header} lacks {missing}")
    ops = [c for c in header if c not in INDEX_COLUMNS and c not in KEY_COLUMNS]

    def rows() -> Iterator[dict]:
        with handle:
            for line, cells in enumerate(reader, start=2):
                if len(cells) != len(header):
                    raise ValueError(f"{path}:{line} has {len(cells)} cells, the header has {len(header)} "
                                     "(a truncated file?)")
                row = dict(zip(header, cells))
                out = {"vpp_stage": int(row["vpp_stage"]), "name": row["name"], "step": int(row["step"]),
                       "micro_step": int(row["micro_step"]) if row.get("micro_step", "") != "" else None,
                       "shape": row.get("shape", ""), "dtype": row.get("dtype", "")}
                out.update({op: float(row[op]) if row[op] != "" else None for op in ops})
                yield out

    return ops, rows()
