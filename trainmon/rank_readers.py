"""Reading one rank's output back: from `monitor.db` (full records) or from the CSV files (figures)."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from trainmon.monitor import stats
from trainmon.run_files import RankDir, read_csv_rows
from trainmon.writers.db_schema import FIELDS

RAW_PREFIX = "raw_"  # columns of the stored record fields: raw_count, raw_nans, ..., raw_max
Rows = list[dict]  # one dict per record: family, name, vpp_stage, micro_step, step, ..., ops


class DbRankReader:
    """Records of one `monitor.db`, with the figures (`ops`) derived from the stored fields.

    Opened read-only, so reading a database a running job writes (WAL) is safe.
    """

    def __init__(self, path: Path):
        self.path = path
        self.conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        self.meta = {k: json.loads(v) for k, v in self.conn.execute("SELECT key, value FROM meta")}
        self.ops = list(self.meta.get("ops", []))

    def rows(self, family: Optional[str], first: Optional[int], last: Optional[int]) -> Iterator[tuple[int, Rows]]:
        """(step, rows) in step order; each row has the stored fields (`raw_<field>`, NaN when NULL),
        `nan_fields` and the derived ops (None where the op has no value, e.g. the min of a tensor
        without finite elements)."""
        where, args = _step_filter("r.step", first, last)
        if family is not None:
            where.append("t.family = ?")
            args.append(family)
        fields = ", ".join(f'r."{f}"' for f in FIELDS)
        query = (f"SELECT t.family, t.name, t.vpp_stage, r.micro_step, r.step, r.call_index, r.pp_stage, t.shape, "
                 f"t.dtype, r.nan_fields, {fields} FROM records r JOIN tags t ON t.id = r.tag_id "
                 f"{'WHERE ' + ' AND '.join(where) if where else ''} ORDER BY r.step, r.call_index")
        names = ("family", "name", "vpp_stage", "micro_step", "step", "call_index", "pp_stage", "shape", "dtype",
                 "nan_fields") + FIELDS
        step, rows = None, []
        for values in self.conn.execute(query, args):
            row = dict(zip(names, values))
            if row["step"] != step and rows:
                yield step, rows
                rows = []
            step = row["step"]
            rows.append(self._with_ops(row))
        if rows:
            yield step, rows

    def _with_ops(self, row: dict) -> dict:
        stored = [np.nan if value is None else value for value in (row.pop(f) for f in FIELDS)]
        row.update({RAW_PREFIX + f: value for f, value in zip(FIELDS, stored)})  # min, max, nans... are ops too
        row["shape"] = json.loads(row["shape"])
        record = np.array(stored, dtype=np.float64)
        # NaN and Inf counts that were not recorded (CSV conversions) count as none; see db_schema.
        record[1:3] = np.nan_to_num(record[1:3], nan=0.0)
        figures = stats.derive_ops(record, self.ops)
        if not row["nan_fields"]:
            # no field is NaN, so a NaN figure comes from fields that were not recorded: it has no value
            figures = {op: None if v is not None and v != v else v for op, v in figures.items()}
        row.update(figures)
        return row

    def step_count(self) -> int:
        return self.conn.execute("SELECT COUNT(DISTINCT step) FROM batches").fetchone()[0]

    def scalars(self, name: Optional[str], first: Optional[int], last: Optional[int]) -> list[dict]:
        where, args = _step_filter("step", first, last)
        if name is not None:
            where.append("name = ?")
            args.append(name)
        query = (f"SELECT name, step, value, is_nan FROM scalars {'WHERE ' + ' AND '.join(where) if where else ''} "
                 "ORDER BY step, rowid")
        return [{"name": n, "step": s, "value": float("nan") if is_nan else v}
                for n, s, v, is_nan in self.conn.execute(query, args)]

    def close(self) -> None:
        self.conn.close()


class CsvRankReader:
    """Records of one rank's CSV files (trainmon's or msprobe's), figures as written."""

    def __init__(self, rank_dir: RankDir):
        self.rank_dir = rank_dir
        self.meta = _run_json(rank_dir.path)
        self.ops: list[str] = []

    def rows(self, family: Optional[str], first: Optional[int], last: Optional[int]) -> Iterator[tuple[int, Rows]]:
        """(step, rows) in step order; ops missing in the file (empty cells) are None."""
        by_step: dict[int, Rows] = {}
        for file in self.rank_dir.family_files(family):
            if not file.overlaps(first, last):
                continue
            ops, rows = read_csv_rows(file.path)
            self.ops += [op for op in ops if op not in self.ops]
            for row in rows:
                if (first is None or row["step"] >= first) and (last is None or row["step"] <= last):
                    row["family"] = file.family
                    row["shape"] = json.loads(row["shape"]) if row["shape"].startswith("[") else row["shape"]
                    by_step.setdefault(row["step"], []).append(row)
        for step in sorted(by_step):
            yield step, by_step[step]

    def step_count(self) -> int:
        return len({step for f in self.rank_dir.family_files() for step in range(f.first, f.last + 1)})

    def scalars(self, name: Optional[str], first: Optional[int], last: Optional[int]) -> list[dict]:
        return []  # the CSV format holds no training scalars

    def close(self) -> None:
        pass


def open_rank(rank_dir: RankDir, source: str = "auto"):
    """The reader of one rank: its database when there is one (or `source="db"`), else its CSV files.

    Raises:
        ValueError: `source` is not auto/db/csv, or "db" was asked for and the rank has no monitor.db.
        sqlite3.DatabaseError: the database cannot be read.
    """
    if source not in ("auto", "db", "csv"):
        raise ValueError(f"source must be 'auto', 'db' or 'csv', got {source!r}")
    if source == "db" and rank_dir.db is None:
        raise ValueError(f"{rank_dir.path} has no monitor.db (written when `format` includes \"db\")")
    if source != "csv" and rank_dir.db is not None:
        return DbRankReader(rank_dir.db)
    return CsvRankReader(rank_dir)


def _step_filter(column: str, first: Optional[int], last: Optional[int]) -> tuple[list[str], list]:
    where, args = [], []
    if first is not None:
        where.append(f"{column} >= ?")
        args.append(first)
    if last is not None:
        where.append(f"{column} <= ?")
        args.append(last)
    return where, args


def _run_json(path: Path) -> dict:
    try:
        return json.loads((path / "run.json").read_text())
    except (OSError, ValueError):
        return {}
