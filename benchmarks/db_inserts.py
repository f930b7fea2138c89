"""Cost of writing a step's records into monitor.db: `executemany` (one call into SQLite per row) against
`db_schema.insert_records` (one multi-row INSERT per chunk), in the inserting thread's CPU time, alone and
while another thread runs torch reductions (the training thread of a monitored job).

    python benchmarks/db_inserts.py                  # 1,560 records per step, 40 steps
    python benchmarks/db_inserts.py --records 500 --steps 100

The schema, its indexes and the rows are those of the db sink (a `records` row per record, no NaN).

With `--growth`, whole step batches through the writer (`MonitorDb.add_step`) over a long run, healthy and with
every record non-finite: the writer's CPU per step in each fifth of the run, with today's schema and with
schema version 4's indexes led by the tag; then one tag's rows over all steps, read by skip-scan, by the
tag index, and by a scan.

    python benchmarks/db_inserts.py --growth --steps 1000
"""
from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import numpy as np
import torch

from trainmon.writers import db_schema

_EXECUTEMANY = (f"INSERT INTO records (tag_id, step, micro_step, call_index, pp_stage, "
                f"{', '.join(repr(f) for f in db_schema.FIELDS)}, nan_fields) "
                f"VALUES ({', '.join('?' * (len(db_schema.FIELDS) + 6))})")


def by_row(conn, rows):
    conn.executemany(_EXECUTEMANY, rows)


def step_rows(step: int, values: np.ndarray) -> list[tuple]:
    fields, masks = db_schema.encode_fields(values)
    return [(i % 700, step, i % 4, i, 0, *f, int(m)) for i, (f, m) in enumerate(zip(fields, masks))]


def run(insert, records: int, steps: int, busy: bool) -> tuple[float, float]:
    """(thread CPU ms, wall ms) per step of inserting `records` rows in one transaction."""
    conn = db_schema.connect(os.path.join(tempfile.mkdtemp(prefix="trainmon_db_"), "monitor.db"))
    values = np.random.default_rng(0).standard_normal((records, len(db_schema.FIELDS)))
    values[:, 1:3] = 0                               # no NaN or Inf counts: the partial indexes stay empty
    stop = threading.Event()

    def reductions():
        x = torch.randn(20_000)
        while not stop.is_set():
            x.sum()
    other = threading.Thread(target=reductions)
    if busy:
        other.start()
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    for step in range(steps):
        conn.execute("BEGIN")
        insert(conn, step_rows(step, values))
        conn.execute("COMMIT")
    cpu, wall = (time.thread_time() - cpu0) / steps * 1e3, (time.perf_counter() - wall0) / steps * 1e3
    stop.set()
    if busy:
        other.join()
    conn.close()
    return cpu, wall


# Schema version 4's indexes of `records` led by the tag, which today's schema replaced (db_schema).
_SCHEMA_4_INDEXES = ("CREATE INDEX records_tag_step ON records (tag_id, step); "
                     "CREATE INDEX records_nonfinite_tag ON records (tag_id, step, micro_step, nans, infs) "
                     "WHERE nans > 0 OR infs > 0;")


def growth(records: int, steps: int, schema_4: bool, nonfinite: bool) -> tuple[list[float], str]:
    """The writer's CPU ms per step in each fifth of `steps` step batches, and the database's path."""
    from trainmon.core.records import RecordKey
    from trainmon.writers.db_sink import MonitorDb

    path = os.path.join(tempfile.mkdtemp(prefix="trainmon_db_"), "monitor.db")
    db = MonitorDb(path)
    if schema_4:
        db.conn.executescript(_SCHEMA_4_INDEXES)
    keys = [RecordKey("actv", f"layers.{i // 4}.output", 0, i % 4, i, (64, 2, 64), "torch.float32")
            for i in range(records)]
    values = np.random.default_rng(0).standard_normal((records, len(db_schema.FIELDS)))
    values[:, 1:3] = 0
    values[:, 1] = 3.0 if nonfinite else 0.0        # nans
    fifths, start = [], time.thread_time()
    for step in range(steps):
        db.add_step(step, 0, keys, values, {})
        if (step + 1) % (steps // 5) == 0:
            fifths.append((time.thread_time() - start) / (steps // 5) * 1e3)
            start = time.thread_time()
    db.close()
    return fifths, path


def one_tag_reads(path: str) -> dict[str, float]:
    """ms to read one tag's rows over every step: by skip-scan of `records_step_tag`, by a (tag_id, step)
    index, and by a scan; the faster of two reads each (the first also reads the file into the page cache)."""
    import sqlite3

    query = "SELECT step, sumsq FROM records {} WHERE tag_id = 100 ORDER BY step"
    conn = sqlite3.connect(path)
    times = {}
    for name, hint in (("skip-scan", "INDEXED BY records_step_tag"), ("tag index", "INDEXED BY records_tag_step"),
                       ("scan", "NOT INDEXED")):
        reads = []
        for _ in range(2):
            start = time.perf_counter()
            conn.execute(query.format(hint)).fetchall()
            reads.append((time.perf_counter() - start) * 1e3)
        times[name] = min(reads)
    conn.close()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1560)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--growth", action="store_true", help="the writer's cost over a long run (see above)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.growth:
        print(f"{args.records} records per step, {args.steps} steps: the writer's CPU ms per step, per fifth")
        for schema_4 in (False, True):
            for nonfinite in (False, True):
                fifths, path = growth(args.records, args.steps, schema_4, nonfinite)
                print(f"  {'schema 4 indexes' if schema_4 else 'schema 5':17s} "
                      f"{'every record NaN' if nonfinite else 'healthy':17s} {' '.join(f'{f:6.2f}' for f in fifths)}")
        print("one tag's rows over all steps, ms: " +
              ", ".join(f"{name} {ms:.1f}" for name, ms in one_tag_reads(path).items()))
        return 0
    print(f"{args.records} records per step, {args.steps} steps: inserting thread's CPU / wall ms per step")
    for busy in (False, True):
        for name, insert in (("executemany", by_row), ("multi-row INSERT", db_schema.insert_records)):
            cpu, wall = run(insert, args.records, args.steps, busy)
            print(f"  {'with torch thread' if busy else 'alone':17s} {name:17s} {cpu:6.2f} / {wall:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
