"""One rank's non-finite evidence, each record read once from the best source present.

The database (monitor.db) is the best source: it holds every record of each step it committed, with its
call index, and the anomalies table. anomalies.jsonl and the CSV files are read only for the steps the
database lacks (a run without `db`, or a database cut short by a crash); a CSV file whose steps the
database all holds is not opened, nor is anomalies.jsonl when the anomalies table holds all its lines. Of a record that both of those hold, the copy with a call index wins.
CSV rows carry no pipeline stage: it comes from the rank's `run.json` (`pp_stage`).

Of the database, only what the report needs becomes an event (`db_nonfinite`: a few queries per rank);
anomalies.jsonl and the CSV files, read only where the database is absent or cut short, give one event
per non-finite record, so a run without a database is read more slowly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from trainmon.core.events import AnomalyEvent
from trainmon.read.csv_rows import read_csv_rows
from trainmon.read.database import DbRankReader
from trainmon.read.db_nonfinite import record_event
from trainmon.read.jsonl import read_jsonl
from trainmon.core.layout import ANOMALIES_FILE, DB_NAME, STREAM_NAME
from trainmon.read.layout import RankDir
from trainmon.read.read_ahead import read_ahead


@dataclass
class RankEvidence:
    """What one rank's sources say: the non-finite events the report needs (of the database: the first of
    each (module, phase) and the collectives'; of the other sources: all), `records`, the distinct
    non-finite records of all sources, the sources present, notes, and warnings (a source cut short by a
    crash, read up to its last whole record)."""

    events: list[AnomalyEvent] = field(default_factory=list)
    records: int = 0
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    incomplete: bool = False  # part of a source could not be read (a corrupt frame): no report may call it clean


def _pending_wal(db: Path) -> bool:
    """Whether a `-wal` beside the database holds transactions: a writer's close checkpoints them into the database
    and empties it, and a WAL a connected reader kept then is empty."""
    try:
        return Path(f"{db}-wal").stat().st_size > 0
    except FileNotFoundError:
        return False


def record_identity(event: AnomalyEvent) -> tuple:
    """What makes two events the same tensor record, whichever source they came from."""
    return (event.rank, event.step, event.micro_step, event.vpp_stage, event.family, event.module, event.tensor)


def rank_evidence(rank_dir: RankDir, metadata: dict) -> RankEvidence:
    """All non-finite evidence of one rank (`metadata` is its run.json).

    Raises:
        InputError: a source is corrupt (named by file and line).
    """
    out = RankEvidence()
    rank = rank_dir.rank
    db_steps: set[int] = set()
    jsonl = rank_dir.jsonl
    in_db = False  # the database's anomalies table holds every line of anomalies.jsonl
    db = rank_dir.db  # or the rank's record stream, read as a database
    if db is not None:
        read_ahead(db)  # its queries visit pages all over the file
        reader = DbRankReader(db)
        try:
            db_steps = reader.steps()
            found = reader.nonfinite(rank)
            in_db = jsonl is not None and reader.holds_lines_of(jsonl)
        finally:
            reader.close()
        out.events, out.records = found.events, found.records
        stream = rank_dir.stream_findings()
        out.sources.append(DB_NAME if stream is None else STREAM_NAME)
        if _pending_wal(db):
            out.warnings.append(f"{db}: its job is still writing it or was stopped (a -wal file is "
                                "beside it); read up to its last committed step")
        if stream is not None:
            out.warnings += stream.warnings
            out.incomplete = bool(stream.lost)

    def lacking(step: int) -> bool:
        return step not in db_steps

    others: dict[tuple, AnomalyEvent] = {}
    if jsonl is not None:
        if not in_db:
            for event in read_jsonl(jsonl, out.warnings.append, skip_step=db_steps.__contains__):
                if event.nonfinite:
                    _keep(others, event)
        out.sources.insert(0, ANOMALIES_FILE)
    all_files = rank_dir.family_files()
    files = [f for f in all_files if not db_steps.issuperset(range(f.first, f.last + 1))]
    if all_files:
        out.sources.append("csv")
    if files:
        pp_stage = metadata.get("pp_stage")
        if not isinstance(pp_stage, int):
            out.notes.append(f"rank {rank}: run.json names no pp_stage; its CSV rows are taken as pipeline stage 0")
            pp_stage = 0
        without_counts = []
        for file in files:
            ops, rows = read_csv_rows(file.path)
            counted = [op for op in ("nans", "infs") if op in ops]
            if not counted:
                without_counts.append(file.path.name)
            for row in rows:
                if not lacking(row["step"]):
                    continue
                found = [(op, row[op]) for op in counted if row[op] is not None and row[op] > 0]
                if found:
                    _keep(others, record_event(rank, row["step"], row["micro_step"], pp_stage, row["vpp_stage"],
                                               None, file.family, row["name"], *found[0]))
        if without_counts:
            out.notes.append(f"rank {rank}: {len(without_counts)} CSV file(s) have no nans/infs column "
                             f"(e.g. {without_counts[0]}); add \"nans\" and \"infs\" to ops to see NaN/Inf there")
    # they hold only steps whose records the database lacks; its anomalies of those steps are all in events
    known = {record_identity(event) for event in out.events}
    out.records += sum(ident not in known for ident in others)
    out.events += others.values()
    return out


def _keep(chosen: dict[tuple, AnomalyEvent], event: AnomalyEvent) -> None:
    """Keeps one copy per record: the first, unless a later copy has the call index it lacks."""
    ident = record_identity(event)
    kept = chosen.get(ident)
    if kept is None or (kept.call_index is None and event.call_index is not None):
        chosen[ident] = event
