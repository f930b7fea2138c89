"""Prints a digest of a trainmon run directory, one line per file, to compare two versions' outputs.

    python scripts/output_digest.py RUN_DIR > a.txt   # (same job, other version) > b.txt; diff a.txt b.txt

Each file is read with its own reader and hashed without what differs between two runs of the same job:
CSV files byte for byte; SQLite tables row by row (sqlite3); TensorBoard events as (tag, step, value)
(TensorBoard's event reader, wall times dropped); JSON and JSONL with times, pids, hosts, paths and versions
dropped (a key/value table's volatile keys too). Everything else is listed by name and size.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sqlite3
import sys
from pathlib import Path

# Keys whose values are wall-clock, machine or path facts, not the job's figures.
VOLATILE = {"time", "wall_time", "start_time", "started", "created", "pid", "host", "hostname", "version",
            "trainmon_version", "torch_version", "output_dir", "path", "dir", "elapsed_s", "seconds",
            "filesystem", "mount", "updated", "last_update", "run"}


def _hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _scrub(value):
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in sorted(value.items()) if k not in VOLATILE and not k.endswith("_time")}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def _json(path: Path) -> str:
    if path.suffix == ".jsonl":
        rows = [_scrub(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    else:
        rows = _scrub(json.loads(path.read_text()))
    return _hash(json.dumps(rows, sort_keys=True).encode())


def _sqlite(path: Path) -> str:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    parts = []
    for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name"):
        cols = [c[1] for c in con.execute(f'PRAGMA table_info("{table}")')
                if c[1] not in VOLATILE and not c[1].endswith("_time")]
        rows = sorted(repr(row) for row in con.execute(f'SELECT {", ".join(cols)} FROM "{table}"')
                      if row[0] not in VOLATILE)   # key/value tables: a volatile key's row
        parts.append(f"{table}:{len(rows)}:{_hash(chr(10).join(rows).encode())}")
    con.close()
    return " ".join(parts)


def _events(path: Path) -> str:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    rows = []
    for event in EventFileLoader(str(path)).Load():
        for value in event.summary.value:
            payload = (value.tensor.SerializeToString() if value.HasField("tensor")
                       else repr(value.simple_value).encode())
            rows.append(f"{value.tag}|{event.step}|{_hash(payload)}")
    return f"{len(rows)} events {_hash(chr(10).join(sorted(rows)).encode())}"


def digest(run: Path) -> list[str]:
    lines = []
    for path in sorted(p for p in run.rglob("*") if p.is_file()):
        rel = path.relative_to(run)
        if "tfevents" in path.name:   # the file name holds a time and a host: key by directory
            lines.append(f"{rel.parent}/<events> {_events(path)}")
        elif path.suffix in (".csv",):
            lines.append(f"{rel} {_hash(path.read_bytes())}")
        elif path.suffix in (".db",):
            lines.append(f"{rel} {_sqlite(path)}")
        elif path.suffix in (".json", ".jsonl"):
            lines.append(f"{rel} {_json(path)}")
        elif path.name.endswith(("-wal", "-shm", ".lock", ".log")):
            continue
        else:
            lines.append(f"{rel} {path.stat().st_size} bytes")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run directory (monitor_output/<run>)")
    args = parser.parse_args(argv)
    if not args.run.is_dir():
        print(f"{args.run}: not a directory; give a run directory, e.g. monitor_output/<run>", file=sys.stderr)
        return 2
    print("\n".join(digest(args.run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
