"""What the post-mortem needs of one `monitor.db`, in a few SQL queries instead of one Python object per
non-finite record.

The report needs of a rank: how many distinct records were non-finite, the first appearance of each
(module, phase), and every non-finite record of a collective (`cross_rank` follows them). So per
database: a COUNT over the partial index of non-finite records; the non-finite records at each tag's
first non-finite step (the first of a (module, phase) is among them, as the ordering key starts with the
step); the same of the anomalies table per (module, phase); the collectives' non-finite rows; and the
anomalies no non-finite record holds (a NaN loss, a rule that flagged an infinite figure), counted by an
anti-join. `rank_summary.summarize` then orders that handful of events exactly as it ordered all of them.

The writers' table `first_nonfinite` and partial index `anomalies_nonfinite` make these queries seeks (a
database of schema version 4 has the partial index `records_nonfinite_tag` instead); a database written
before they existed is read the same way, by scans.
"""
from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from typing import Optional

from trainmon.core.events import AnomalyEvent, phase_of, split_name
from trainmon.core.records import COMM
from trainmon.writers import db_schema

_RECORD_NONFINITE = f"({db_schema.nonfinite_record('r')})"
_ANOMALY_NONFINITE = f"({db_schema.nonfinite_anomaly('a')})"
_RECORD_COLUMNS = "r.tag_id, r.step, r.micro_step, r.call_index, r.pp_stage, r.nans, r.infs"
_ANOMALY_COLUMNS = ", ".join(f"a.{c}" for c in db_schema.ANOMALY_COLUMNS) + ", a.is_nan"


@dataclass
class DbNonfinite:
    """One database's part of the report: `records` distinct non-finite records, and `events`, the
    non-finite events the report can need (every first appearance of a (module, phase), every collective's,
    every anomaly of a step without committed records), anomalies-table rows before records, each in the
    order the database gives them."""

    records: int = 0
    events: list[AnomalyEvent] = field(default_factory=list)


def read_nonfinite(conn: sqlite3.Connection, rank: int, has_anomalies: bool) -> DbNonfinite:
    """The summary of one read-only connection's non-finite records (`rank`: the rank directory's).

    Raises:
        sqlite3.Error: the database cannot be read (the caller names the file).
    """
    places = {tag: (family, name, vpp) for tag, family, name, vpp in
              conn.execute("SELECT id, family, name, vpp_stage FROM tags")}
    count = conn.execute(f"SELECT COUNT(*) FROM records r WHERE {_RECORD_NONFINITE}").fetchone()[0]
    anomalies: list[AnomalyEvent] = []
    if has_anomalies:
        uncommitted = [step for (step,) in conn.execute(_UNCOMMITTED)]  # usually none
        anomalies = [_anomaly_event(row[:-1]) for row in conn.execute(
            _ANOMALY_QUERY.replace("{uncommitted}", _marks(uncommitted)), uncommitted)]
        count += _anomalies_beside_records(conn, rank, places, uncommitted)
    comm_tags = [tag for tag, (family, _, _) in places.items() if family == COMM]
    rows = conn.execute(_first_records_query(conn)).fetchall()
    if comm_tags:
        rows += conn.execute(f"SELECT {_RECORD_COLUMNS}, r.rowid FROM records r WHERE {_RECORD_NONFINITE} AND "
                             f"r.tag_id IN ({_marks(comm_tags)})", comm_tags).fetchall()
    # the order the records query used to give (step, call index, then rowid: the index's tie order)
    rows = sorted(set(rows), key=lambda row: (row[1], row[3], row[-1]))
    return DbNonfinite(count, anomalies + [_record_event(rank, places[row[0]], row) for row in rows])


def _first_records_query(conn: sqlite3.Connection) -> str:
    """The query of the non-finite records at their tag's first non-finite step that this database answers
    fastest."""
    objects = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    if "first_nonfinite" in objects:
        return _FIRST_RECORDS_NOTED
    return _FIRST_RECORDS_SEEK if "records_nonfinite_tag" in objects else _FIRST_RECORDS


# The non-finite records at their tag's first non-finite step: from the steps `first_nonfinite` notes, a seek per
# tag; with schema version 4's partial index, also one seek per tag (MATERIALIZED: flattened, SQLite would scan
# the whole index instead); without either, a scan.
_FIRST_RECORDS_NOTED = f"""
SELECT {_RECORD_COLUMNS}, r.rowid FROM first_nonfinite f JOIN records r ON r.step = f.step AND r.tag_id = f.tag_id
WHERE {_RECORD_NONFINITE}"""
_FIRST_RECORDS_SEEK = f"""
WITH f AS MATERIALIZED (SELECT t.id AS tag_id, (SELECT MIN(r.step) FROM records r WHERE r.tag_id = t.id
                                               AND {_RECORD_NONFINITE}) AS step FROM tags t)
SELECT {_RECORD_COLUMNS}, r.rowid FROM f JOIN records r INDEXED BY records_nonfinite_tag
    ON r.tag_id = f.tag_id AND r.step = f.step WHERE {_RECORD_NONFINITE}"""
_FIRST_RECORDS = f"""
SELECT {_RECORD_COLUMNS}, r.rowid
FROM (SELECT r.tag_id, MIN(r.step) AS step FROM records r WHERE {_RECORD_NONFINITE} GROUP BY r.tag_id) AS f
JOIN records r ON r.tag_id = f.tag_id AND r.step = f.step
WHERE {_RECORD_NONFINITE}"""

# The non-finite anomalies at their (phase, module)'s first non-finite step, those of collectives, and
# those of steps whose records were not committed (anomalies.jsonl may hold them too: they are compared).
# Every part seeks the partial index `anomalies_nonfinite` where the database has it.
_ANOMALY_QUERY = f"""
WITH f AS MATERIALIZED (SELECT a.phase, a.module, MIN(a.step) AS step FROM anomalies a
                        WHERE {_ANOMALY_NONFINITE} GROUP BY a.phase, a.module)
SELECT {_ANOMALY_COLUMNS}, a.rowid FROM f JOIN anomalies a ON a.phase = f.phase AND a.module = f.module
    AND a.step = f.step WHERE {_ANOMALY_NONFINITE}
UNION SELECT {_ANOMALY_COLUMNS}, a.rowid FROM anomalies a WHERE {_ANOMALY_NONFINITE} AND a.phase = '{phase_of(COMM)}'
    AND a.family = '{COMM}'
UNION SELECT {_ANOMALY_COLUMNS}, a.rowid FROM anomalies a WHERE {_ANOMALY_NONFINITE} AND a.step IN ({{uncommitted}})
ORDER BY 2, 16"""
# The steps of the anomalies table whose records were not committed (distinct steps first: few, against the rows).
_UNCOMMITTED = "SELECT s.step FROM (SELECT DISTINCT step FROM anomalies) s WHERE s.step NOT IN (SELECT step FROM batches)"


def _anomalies_beside_records(conn: sqlite3.Connection, rank: int, places: dict, uncommitted: list[int]) -> int:
    """How many distinct non-finite anomalies no non-finite record holds (the same record: rank, step,
    micro-step, stage, family, module, tensor; `evidence.record_identity`).

    An anomaly of this rank with op nans or infs of a record's family, at a step whose records were
    committed, is such a record: the rule raised it because the record counted NaN or Inf elements, and the
    step's records are committed together. Only the others (a NaN loss, an infinite figure, an anomaly of
    an uncommitted step) are compared with the records, one by one.
    """
    conn.execute("PRAGMA temp_store = MEMORY")  # nothing is written beside the source
    conn.execute("CREATE TEMP TABLE IF NOT EXISTS places "
                 "(id INTEGER PRIMARY KEY, family TEXT, module TEXT, tensor TEXT, vpp_stage INTEGER)")
    conn.execute("CREATE INDEX IF NOT EXISTS temp.places_record ON places (family, module, tensor, vpp_stage)")
    conn.execute("DELETE FROM temp.places")
    conn.executemany("INSERT INTO temp.places VALUES (?, ?, ?, ?, ?)",
                     [(tag, family, *split_name(family, name), vpp) for tag, (family, name, vpp) in places.items()])
    families = sorted({family for family, _, _ in places.values()})
    return conn.execute(f"""
        SELECT COUNT(*) FROM (
            SELECT DISTINCT a.rank, a.step, a.micro_step, a.vpp_stage, a.family, a.module, a.tensor
            FROM anomalies a WHERE {_ANOMALY_NONFINITE}
            AND NOT (a.op IN ('nans', 'infs') AND a.rank = ? AND a.family IN ({_marks(families)})
                     AND a.step NOT IN ({_marks(uncommitted)}))
            AND NOT (a.rank = ? AND EXISTS (
                SELECT 1 FROM records r WHERE r.step = a.step AND r.micro_step IS a.micro_step AND {_RECORD_NONFINITE}
                AND r.tag_id IN (SELECT p.id FROM temp.places p WHERE p.family = a.family AND p.module = a.module
                                 AND p.tensor = a.tensor AND p.vpp_stage = a.vpp_stage))))""",
                        (rank, *families, *uncommitted, rank)).fetchone()[0]


def _marks(values: list) -> str:
    return ", ".join("?" * len(values))


def _anomaly_event(row: tuple) -> AnomalyEvent:
    fields = dict(zip(db_schema.ANOMALY_COLUMNS, row))
    fields["value"] = db_schema.decode_real(fields["value"], row[-1])
    fields["first"] = bool(fields["first"])
    return AnomalyEvent(**fields)


def _record_event(rank: int, place: tuple, row: tuple) -> AnomalyEvent:
    family, name, vpp = place
    _, step, micro, call, pp, nans, infs, _ = row
    return record_event(rank, step, micro, pp, vpp, call, family, name, *(("nans", nans) if nans else ("infs", infs)))


def record_event(rank, step, micro, pp, vpp, call, family, name, op, value: Optional[float]) -> AnomalyEvent:
    """The AnomalyEvent of a non-finite record (rule "record")."""
    module, tensor = split_name(family, name)
    return AnomalyEvent(rank=rank, step=step, micro_step=micro, pp_stage=pp, vpp_stage=vpp, call_index=call,
                        module=module, phase=phase_of(family), tensor=tensor, op=op, value=float(value),
                        rule="record", family=family)
