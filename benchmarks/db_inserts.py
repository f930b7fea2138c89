"""Cost of writing a step's records into monitor.db: `executemany` (one call into SQLite per row) against
`db_schema.insert_records` (one multi-row INSERT per chunk), in the inserting thread's CPU time, alone and
while another thread runs torch reductions (the training thread of a monitored job).

    python benchmarks/db_inserts.py                  # 1,560 records per step, 40 steps
    python benchmarks/db_inserts.py --records 500 --steps 100

The schema, its indexes and the rows are those of the db sink (a `records` row per record, no NaN).
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=1560)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{args.records} records per step, {args.steps} steps: inserting thread's CPU / wall ms per step")
    for busy in (False, True):
        for name, insert in (("executemany", by_row), ("multi-row INSERT", db_schema.insert_records)):
            cpu, wall = run(insert, args.records, args.steps, busy)
            print(f"  {'with torch thread' if busy else 'alone':17s} {name:17s} {cpu:6.2f} / {wall:6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
