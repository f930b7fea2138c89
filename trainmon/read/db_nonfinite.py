"""What the post-mortem needs of one `monitor.db`, in a few SQL queries instead of one Python object per
non-finite record, reading as few pages of the file as it can (a cold file costs its pages, not its rows).

The report needs of a rank: how many distinct records were non-finite, the first appearance of each
(module, phase), and every non-finite record of a collective (`cross_rank` follows them). So per
database: a COUNT over the partial index of non-finite records; the non-finite records at each tag's
first non-finite step (the first of a (module, phase) is among them, as the ordering key starts with the
step); the collectives' non-finite records; and of the anomalies table, the rows that can change what
those records say: the anomalies at the records' first places (their copies of those records, which name
the rule that raised them), and the anomalies no record explains (a NaN loss, an infinite figure, a
sentinel's finding, an anomaly of a step whose records were not committed), found by one pass over the
table: those at their (phase, module)'s first step, the collectives', the uncommitted steps', and how
many no non-finite record holds. The other anomalies are copies of non-finite records: an anomaly of this
rank with op nans or infs, of a record's family, at a step whose records were committed, was raised
because that record counted NaN or Inf elements. `rank_summary.summarize` then orders that handful of
events exactly as it ordered all of them (a collective's record stands for its anomaly copy: they are the
same place).

The writers' table `first_nonfinite` and partial indexes `records_nonfinite` and `anomalies_nonfinite`
make these queries seeks (a database of schema version 4 has the partial index `records_nonfinite_tag`
instead); a database written before they existed is read the same way, by scans.
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
    objects = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    count = conn.execute(f"SELECT COUNT(*) FROM records r WHERE {_RECORD_NONFINITE}").fetchone()[0]
    firsts = conn.execute(_first_records_query(objects)).fetchall()
    comm_tags = [tag for tag, (family, _, _) in places.items() if family == COMM]
    comm = conn.execute(_comm_records_query(objects, len(comm_tags)), comm_tags).fetchall() if comm_tags else []
    # the order the records query used to give (step, call index, then rowid: the index's tie order)
    rows = sorted(set(firsts + comm), key=lambda row: (row[1], row[3], row[-1]))
    records = [_record_event(rank, places[row[0]], row) for row in rows]
    if not has_anomalies:
        return DbNonfinite(count, records)
    uncommitted = [step for (step,) in conn.execute(_UNCOMMITTED)]  # usually none
    first_places = {(phase_of(places[tag][0]), split_name(*places[tag][:2])[0], step)
                    for tag, step, *_ in firsts}
    beside, anomalies = _anomalies(conn, rank, places, uncommitted, first_places)
    return DbNonfinite(count + beside, anomalies + records)


def _first_records_query(objects: set[str]) -> str:
    """The query of the non-finite records at their tag's first non-finite step that a database with these
    tables and indexes (`objects`) answers fastest."""
    if "first_nonfinite" in objects:
        return _FIRST_RECORDS_NOTED
    return _FIRST_RECORDS_SEEK if "records_nonfinite_tag" in objects else _FIRST_RECORDS


def _comm_records_query(objects: set[str], tags: int) -> str:
    """The query of the non-finite records of `tags` tags (bound): through the partial index of non-finite
    records where the database has it, which reads the pages of the non-finite steps only (SQLite would
    otherwise seek every step, and so read the whole file)."""
    index = "INDEXED BY records_nonfinite " if "records_nonfinite" in objects else ""
    return (f"SELECT {_RECORD_COLUMNS}, r.rowid FROM records r {index}WHERE {_RECORD_NONFINITE} "
            f"AND r.tag_id IN ({', '.join('?' * tags)})")


# The non-finite records at their tag's first non-finite step: from the steps `first_nonfinite` notes, a seek per
# tag (a row-value IN: as a join, SQLite scans `records` first to build a Bloom filter); with schema version 4's
# partial index, also one seek per tag (MATERIALIZED: flattened, SQLite would scan the whole index instead);
# without either, a scan.
_FIRST_RECORDS_NOTED = f"""
SELECT {_RECORD_COLUMNS}, r.rowid FROM records r
WHERE (r.step, r.tag_id) IN (SELECT step, tag_id FROM first_nonfinite) AND {_RECORD_NONFINITE}"""
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

# The steps of the anomalies table whose records were not committed (distinct steps first: few, against the rows).
_UNCOMMITTED = "SELECT s.step FROM (SELECT DISTINCT step FROM anomalies) s WHERE s.step NOT IN (SELECT step FROM batches)"

# temp tables (nothing is written beside the source): the tags' places, the records' first places, and the
# anomalies no record explains (their columns, is_nan, the source row's rowid)
_TEMP_TABLES = (
    "CREATE TEMP TABLE IF NOT EXISTS places (id INTEGER PRIMARY KEY, family TEXT, module TEXT, tensor TEXT, "
    "vpp_stage INTEGER)",
    "CREATE INDEX IF NOT EXISTS temp.places_record ON places (family, module, tensor, vpp_stage)",
    "CREATE TEMP TABLE IF NOT EXISTS first_places (phase TEXT, module TEXT, step INTEGER)",
    f"CREATE TEMP TABLE IF NOT EXISTS unexplained ({', '.join(db_schema.ANOMALY_COLUMNS)}, is_nan, source)",
)
# Of the anomalies no record explains: those at their (phase, module)'s first step, the collectives', those of
# steps whose records were not committed (anomalies.jsonl may hold them too: they are compared); and every
# anomaly at the records' first places, a seek each in `anomalies_nonfinite` (phase, module, step).
_ANOMALY_QUERY = f"""
WITH f AS MATERIALIZED (SELECT phase, module, MIN(step) AS step FROM temp.unexplained GROUP BY phase, module)
SELECT u.* FROM f JOIN temp.unexplained u ON u.phase = f.phase AND u.module = f.module AND u.step = f.step
UNION SELECT * FROM temp.unexplained WHERE phase = '{phase_of(COMM)}' AND family = '{COMM}'
UNION SELECT * FROM temp.unexplained WHERE step IN ({{uncommitted}})
UNION SELECT {_ANOMALY_COLUMNS}, a.rowid FROM temp.first_places p CROSS JOIN anomalies a
    ON a.phase = p.phase AND a.module = p.module AND a.step = p.step WHERE {_ANOMALY_NONFINITE}
ORDER BY 2, {len(db_schema.ANOMALY_COLUMNS) + 2}"""


def _anomalies(conn: sqlite3.Connection, rank: int, places: dict, uncommitted: list[int],
               first_places: set[tuple]) -> tuple[int, list[AnomalyEvent]]:
    """(how many distinct non-finite anomalies no non-finite record holds, the anomaly events the report can
    need) of the anomalies table; `first_places`: the (phase, module, step) of the records' first places.

    Distinct: the same record (rank, step, micro-step, stage, family, module, tensor;
    `evidence.record_identity`). The anomalies that no record explains by their kind (module docstring) are
    compared with the records one by one.
    """
    conn.execute("PRAGMA temp_store = MEMORY")
    for statement in _TEMP_TABLES:
        conn.execute(statement)
    for table in ("places", "first_places", "unexplained"):
        conn.execute(f"DELETE FROM temp.{table}")
    conn.executemany("INSERT INTO temp.places VALUES (?, ?, ?, ?, ?)",
                     [(tag, family, *split_name(family, name), vpp) for tag, (family, name, vpp) in places.items()])
    conn.executemany("INSERT INTO temp.first_places VALUES (?, ?, ?)", sorted(first_places))
    families = sorted({family for family, _, _ in places.values()})
    # one pass over the table's rows: through the partial index, SQLite would seek each row from its entry
    conn.execute(f"""
        INSERT INTO temp.unexplained SELECT {_ANOMALY_COLUMNS}, a.rowid FROM anomalies a NOT INDEXED
        WHERE {_ANOMALY_NONFINITE}
        AND NOT (a.op IN ('nans', 'infs') AND a.rank = ? AND a.family IN ({_marks(families)})
                 AND a.step NOT IN ({_marks(uncommitted)}))""", (rank, *families, *uncommitted))
    beside = conn.execute(f"""
        SELECT COUNT(*) FROM (
            SELECT DISTINCT a.rank, a.step, a.micro_step, a.vpp_stage, a.family, a.module, a.tensor
            FROM temp.unexplained a WHERE NOT (a.rank = ? AND EXISTS (
                SELECT 1 FROM records r WHERE r.step = a.step AND r.micro_step IS a.micro_step AND {_RECORD_NONFINITE}
                AND r.tag_id IN (SELECT p.id FROM temp.places p WHERE p.family = a.family AND p.module = a.module
                                 AND p.tensor = a.tensor AND p.vpp_stage = a.vpp_stage))))""", (rank,)).fetchone()[0]
    rows = conn.execute(_ANOMALY_QUERY.replace("{uncommitted}", _marks(uncommitted)), uncommitted).fetchall()
    return beside, [_anomaly_event(row[:-1]) for row in rows]


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
