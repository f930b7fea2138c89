"""Reading a run's anomaly evidence back: `anomalies.jsonl`, `monitor.db` and the CSV files of each rank.

Every reader returns AnomalyEvents in file order and raises InputError naming the file (and line)
when a file is truncated or corrupt, so a post-mortem never silently reports from half the data.
CSV rows carry no pipeline stage: it comes from the rank's `run.json` (`pp_stage`).
"""
from __future__ import annotations

import csv
import json
import re
import sqlite3
from pathlib import Path
from typing import Optional

from trainmon.anomaly.events import AnomalyEvent, phase_of, split_name
from trainmon.anomaly.db_anomalies import read_anomalies
from trainmon.anomaly.processor import ANOMALIES_FILE
from trainmon.writers.db_schema import DB_NAME
_RANK_DIR = re.compile(r"^rank_(\d+)$")
_CSV_FILE = re.compile(r"^(?P<family>[a-z_]+)_(?P<first>\d+)-(?P<last>\d+)\.csv$")


class InputError(ValueError):
    """A run directory or one of its files cannot be read; the message names the file."""


def rank_dirs(run_dir: Path) -> dict[int, Path]:
    """{rank: rank directory} of a run."""
    out = {}
    for child in run_dir.iterdir() if run_dir.is_dir() else ():
        match = _RANK_DIR.match(child.name)
        if match and child.is_dir():
            out[int(match.group(1))] = child
    return dict(sorted(out.items()))


def find_run(path: Path) -> tuple[Path, Optional[str]]:
    """The run directory for `path` (a run, or an output root holding runs) and a note on the choice.

    Raises:
        InputError: `path` is missing or holds no rank directories.
    """
    if not path.is_dir():
        raise InputError(f"{path}: no such directory; pass a run directory ($MONITOR_OUTPUT_DIR/<run>) or "
                         f"the output root")
    if rank_dirs(path):
        return path, None
    runs = sorted((child for child in path.iterdir() if child.is_dir() and rank_dirs(child)),
                  key=lambda child: child.stat().st_mtime)
    if not runs:
        raise InputError(f"{path}: no rank_<R> directories here or one level below; pass a run directory "
                         f"($MONITOR_OUTPUT_DIR/<run>), the output root, or an msprobe dump directory "
                         f"(step<N>/rank<R>/dump.json)")
    note = None if len(runs) == 1 else (f"{len(runs)} runs under {path}; analysing the latest, {runs[-1].name} "
                                        f"(pass its directory to choose another)")
    return runs[-1], note


# ------------------------------------------------------------------------------------ anomalies.jsonl
def read_jsonl(path: Path) -> list[AnomalyEvent]:
    events = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                events.append(AnomalyEvent.from_json(json.loads(line)))
            except (json.JSONDecodeError, ValueError, TypeError) as err:
                cut = "" if line.endswith("\n") else " (the line is cut short: the file looks truncated)"
                raise InputError(f"{path}, line {number}: not an anomaly record: {err}{cut}") from None
    return events


# --------------------------------------------------------------------------------------- monitor.db
_DB_QUERY = """
SELECT t.family, t.name, t.vpp_stage, r.step, r.micro_step, r.call_index, r.pp_stage, r.nans, r.infs
FROM records r JOIN tags t ON t.id = r.tag_id
WHERE r.nans > 0 OR r.infs > 0
ORDER BY r.step, r.call_index
"""


def read_db(path: Path, rank: int) -> list[AnomalyEvent]:
    """Non-finite records and anomalies of a rank's database (read-only; a job may still be writing it)."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = conn.execute(_DB_QUERY).fetchall()
            events = [e for e in read_anomalies(conn) if e.nonfinite]
        finally:
            conn.close()
    except sqlite3.Error as err:
        raise InputError(f"{path}: cannot read the monitor database ({err}); it may be corrupt or not a "
                         f"trainmon database (check with: sqlite3 {path} 'PRAGMA integrity_check')") from None
    for family, name, vpp, step, micro, call, pp, nans, infs in rows:
        op, value = ("nans", nans) if nans else ("infs", infs)
        events.append(_record_event(rank, step, micro, pp, vpp, call, family, name, op, value))
    return events


# ----------------------------------------------------------------------------------------- run.json
def read_metadata(rank_dir: Path) -> dict:
    """The rank's `run.json` ({} when it has none)."""
    path = rank_dir / "run.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise InputError(f"{path}: not a readable run.json ({err})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a run.json (expected a JSON object)")
    return data


# ---------------------------------------------------------------------------------------- CSV files
def csv_files(rank_dir: Path) -> list[tuple[str, Path]]:
    """(family, path) of the statistic CSV files in a rank directory, by family and first step."""
    found = []
    for path in rank_dir.glob("*.csv"):
        match = _CSV_FILE.match(path.name)
        if match:
            found.append((match.group("family"), int(match.group("first")), path))
    return [(family, path) for family, _, path in sorted(found)]


def read_csv(path: Path, family: str, rank: int, pp_stage: int) -> tuple[list[AnomalyEvent], bool]:
    """Non-finite rows of one CSV file, and whether the file has a `nans` or `infs` column at all."""
    with open(path, newline="", encoding="utf-8") as fh:
        rows = csv.reader(fh)
        header = next(rows, None)
        if header is None:
            return [], False
        required = {"vpp_stage", "name", "step"}
        if not required <= set(header):
            raise InputError(f"{path}, line 1: not a trainmon CSV header (needs {sorted(required)}, got {header})")
        counted = [op for op in ("nans", "infs") if op in header]
        col = {name: i for i, name in enumerate(header)}
        events = []
        for number, row in enumerate(rows, 2):
            if len(row) != len(header):
                raise InputError(f"{path}, line {number}: {len(row)} fields where the header has {len(header)} "
                                 f"(the file is truncated or corrupt)")
            try:
                found = [(op, float(row[col[op]])) for op in counted if row[col[op]] and float(row[col[op]]) > 0]
                if found:
                    micro = row[col["micro_step"]] if "micro_step" in col else ""
                    events.append(_record_event(rank, int(row[col["step"]]), int(micro) if micro else None, pp_stage,
                                                int(row[col["vpp_stage"]]), None, family, row[col["name"]],
                                                *found[0]))
            except ValueError as err:
                raise InputError(f"{path}, line {number}: {err}") from None
        return events, bool(counted)


def _record_event(rank, step, micro, pp, vpp, call, family, name, op, value) -> AnomalyEvent:
    module, tensor = split_name(family, name)
    return AnomalyEvent(rank=rank, step=step, micro_step=micro, pp_stage=pp, vpp_stage=vpp, call_index=call,
                        module=module, phase=phase_of(family), tensor=tensor, op=op, value=float(value),
                        rule="record", family=family)


def rank_events(rank: int, rank_dir: Path, metadata: dict) -> tuple[list[AnomalyEvent], list[str], list[str]]:
    """All non-finite evidence of one rank: (events, sources read, notes); `metadata` is its run.json."""
    events, sources, notes = [], [], []
    jsonl = rank_dir / ANOMALIES_FILE
    if jsonl.exists():
        events += [e for e in read_jsonl(jsonl) if e.nonfinite]
        sources.append(ANOMALIES_FILE)
    db = rank_dir / DB_NAME
    if db.exists():
        events += read_db(db, rank)
        sources.append(DB_NAME)
    files = csv_files(rank_dir)
    if files:
        pp_stage = metadata.get("pp_stage")
        if not isinstance(pp_stage, int):
            notes.append(f"rank {rank}: run.json names no pp_stage; its CSV rows are taken as pipeline stage 0")
            pp_stage = 0
        without_counts = []
        for family, path in files:
            found, counted = read_csv(path, family, rank, pp_stage)
            events += found
            if not counted:
                without_counts.append(path.name)
        sources.append("csv")
        if without_counts:
            notes.append(f"rank {rank}: {len(without_counts)} CSV file(s) have no nans/infs column "
                         f"(e.g. {without_counts[0]}); add \"nans\" and \"infs\" to ops to see NaN/Inf there")
    return events, sources, notes
