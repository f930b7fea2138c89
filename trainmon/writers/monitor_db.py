"""Writing one monitor database (`db_schema` has the layout): what the `db` sink writes during training, and
what the read layer builds from a record stream (read.stream_mirror) and the conversions write. It needs no
torch, so the read side starts without it."""
from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from trainmon.core.records import RecordKey
from trainmon.writers import db_schema


CLOSE_WAIT_S, CLOSE_RETRY_S = 1.0, 0.05  # how long `close` waits for readers to let go of the WAL, and how often


class MonitorDb:
    """Writes step batches into one monitor database (see db_schema for the layout).

    Args:
        path: the database file; created if missing, appended to if it is a monitor database.

    Raises:
        sqlite3.DatabaseError: the file exists and is not a monitor database.
    """

    def __init__(self, path: Path, journal_mode: str = "WAL"):
        self.path = path
        self.conn = db_schema.connect(str(path), journal_mode)
        self._last_keys: Optional[list[RecordKey]] = None
        self._last_tag_ids: list[int] = []
        # by (family, name, vpp_stage, shape as a tuple, dtype): the JSON of a shape is made only for a new tag,
        # and read once per distinct shape (a reader of a record stream opens this at every poll)
        shapes: dict[str, tuple] = {}
        self._tag_ids = {(family, name, vpp, shapes[shape] if shape in shapes else
                          shapes.setdefault(shape, tuple(json.loads(shape))), dtype): tag_id
                         for tag_id, family, name, vpp, shape, dtype in
                         self.conn.execute("SELECT id, family, name, vpp_stage, shape, dtype FROM tags")}

    def known_tags(self) -> dict[int, tuple]:
        """{tag id: (family, name, vpp_stage, shape as a tuple, dtype)} of the tags in the database."""
        return {tag_id: ident for ident, tag_id in self._tag_ids.items()}

    def add_tag(self, tag_id: int, ident: tuple) -> None:
        """Inserts a tag under the id another writer gave it (read.stream_mirror keeps the stream's ids)."""
        self.conn.execute("INSERT INTO tags (id, family, name, vpp_stage, shape, dtype) VALUES (?, ?, ?, ?, ?, ?)",
                          (tag_id, *ident[:3], json.dumps(list(ident[3])), ident[4]))
        self._tag_ids[ident] = tag_id

    def set_meta(self, items: dict) -> None:
        with self._transaction():
            db_schema.write_meta(self.conn, items)

    def add_step(self, step: int, pp_stage: int, keys: Sequence[RecordKey], values: np.ndarray,
                 scalars: dict, recorded: Optional[np.ndarray] = None, wall_time: Optional[float] = None) -> None:
        """Commits one step batch: its records, its scalars and a `batches` row, in one transaction.

        Args:
            values: float64 [len(keys), N_FIELDS] records in db_schema.FIELDS order.
            recorded: see db_schema.encode_fields (None: every field was recorded).
        """
        fields, masks = db_schema.encode_fields(values, recorded)
        with self._transaction():
            # A job's steps mostly bring the same keys in the same order: the tag ids of the last step serve again.
            tag_ids = self._last_tag_ids if keys == self._last_keys else [self._tag_id(key) for key in keys]
            self._last_keys, self._last_tag_ids = list(keys), tag_ids
            micro_steps, call_indexes = [key.micro_step for key in keys], [key.call_index for key in keys]
            rows = np.empty((len(keys), fields.shape[1] + 6), dtype=object)
            for column, value in enumerate((tag_ids, step, micro_steps, call_indexes, pp_stage)):
                rows[:, column] = value
            rows[:, 5:-1], rows[:, -1] = fields, masks
            db_schema.insert_records(self.conn, rows)
            block = db_schema.encode_block(tag_ids, micro_steps, call_indexes, values, masks, recorded)
            self.conn.execute("INSERT INTO record_blocks (step, pp_stage, records) VALUES (?, ?, ?)",
                              (step, pp_stage, block))
            self.conn.executemany("INSERT INTO scalars (name, step, value, is_nan) VALUES (?, ?, ?, ?)",
                                  [_scalar_row(name, step, value) for name, value in scalars.items()])
            self.conn.execute("INSERT INTO batches (step, wall_time, records, scalars) VALUES (?, ?, ?, ?)",
                              (step, wall_time or time.time(), len(keys), len(scalars)))

    def _tag_id(self, key: RecordKey) -> int:
        ident = (key.family, key.name, key.vpp_stage, tuple(key.shape), key.dtype)
        tag_id = self._tag_ids.get(ident)
        if tag_id is None:
            tag_id = self.conn.execute("INSERT INTO tags (family, name, vpp_stage, shape, dtype) "
                                       "VALUES (?, ?, ?, ?, ?)",
                                       (*ident[:3], json.dumps(list(key.shape)), key.dtype)).lastrowid
            self._tag_ids[ident] = tag_id
        return tag_id

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """BEGIN ... COMMIT, or ROLLBACK on error: a failed step leaves nothing half-written, and the
        tag cache forgets the tags whose insert was rolled back. Inside a transaction the caller opened, it
        joins that one (the caller commits many steps at once)."""
        if self.conn.in_transaction:
            yield
            return
        known = set(self._tag_ids)
        self.conn.execute("BEGIN")
        try:
            yield
            self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:  # SQLite may have rolled back already (e.g. on a full disk)
                self.conn.execute("ROLLBACK")
            for ident in set(self._tag_ids) - known:
                del self._tag_ids[ident]
            self._last_keys = None
            raise

    def close(self) -> None:
        """Checkpoints the WAL into the database file and closes without a `-wal` beside it, which readers take for a
        job still writing or stopped. Only the last connection can remove it: while a reader is connected (the
        daemon, a few milliseconds a poll) the journal's switch out of WAL fails, and is tried again for up to
        CLOSE_WAIT_S; failing that, the WAL stays, empty."""
        deadline = time.monotonic() + CLOSE_WAIT_S
        while True:
            try:
                self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                if self.conn.execute("PRAGMA journal_mode=DELETE").fetchone()[0] == "delete":
                    break
            except sqlite3.Error:
                pass  # another connection is open (or the disk failed: nothing more to save)
            if time.monotonic() >= deadline:
                break
            time.sleep(CLOSE_RETRY_S)
        self.conn.close()


def _scalar_row(name: str, step: int, value) -> tuple:
    return (name, step, *db_schema.encode_real(float(value)))
