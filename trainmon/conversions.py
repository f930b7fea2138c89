"""Conversions between output formats: CSV (trainmon's or msprobe's) to TensorBoard or SQLite, SQLite to TensorBoard.

Each writes `<out>/rank_<R>/` per rank of the source, so the output is a trainmon run directory. An
output directory that is not empty is refused unless `overwrite` is given; then its `rank_<R>/`
directories are replaced, so a conversion run twice never duplicates a record.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Iterable


from trainmon.core.derive import fields_from_figures
from trainmon.core.layout import DB_NAME, rank_dir_name
from trainmon.core.records import RecordKey
from trainmon.read import stream_mirror
from trainmon.output_dir import prepare_output
from trainmon.read.errors import InputError
from trainmon.read.layout import find_run
from trainmon.read.run import Run
from trainmon.writers import db_schema
from trainmon.writers.monitor_db import MonitorDb
from trainmon.writers.tags import tag_for
from trainmon.writers.tensorboard_sink import EventWriter

Progress = Callable[[Iterable, int, str], Iterable]  # (items, total, description) -> items


def no_progress(items: Iterable, total: int, description: str) -> Iterable:
    return items




def to_tensorboard(src: str | Path, out: str | Path, source: str = "auto", progress: Progress = no_progress,
                   overwrite: bool = False) -> int:
    """Writes the figures of every record (and the scalars) of `src` as TensorBoard events.

    Tags and values are those the `tensorboard` format writes during training. Returns the number of
    steps converted.

    Raises:
        InputError: bad input (named), or an output directory that `prepare_output` refuses.
    """
    run = Run(src, source)
    try:
        prepare_output(run.path, Path(out), overwrite)
    except InputError:
        run.close()
        raise
    all_scalars = run.scalars()
    done = 0
    for rank in run.ranks:
        writer = EventWriter(Path(out) / rank_dir_name(rank))
        scalars: dict[int, list] = {}
        for row in all_scalars[all_scalars["rank"] == rank].itertuples():
            scalars.setdefault(row.step, []).append((row.name, row.value))
        try:
            for step, rows in progress(run.iter_steps(rank), run.step_count(rank), f"rank {rank} -> tensorboard"):
                values = [(f"{tag_for(r['family'], r['name'], r['vpp_stage'], r['micro_step'], rank)}_{op}", r[op])
                          for r in rows for op in run.ops(rank) if r.get(op) is not None]
                writer.add(step, values + scalars.pop(step, []))
                done += 1
            for step, values in sorted(scalars.items()):  # scalars of steps without records
                writer.add(step, values)
        finally:
            writer.close()
    run.close()
    return done


def csv_to_db(src: str | Path, out: str | Path, progress: Progress = no_progress, overwrite: bool = False) -> int:
    """Writes every CSV record of `src` into `<out>/rank_<R>/monitor.db`, one transaction per step.

    A CSV row holds figures, not the mergeable record; the fields are rebuilt where the figures and
    the shape determine them (count from the element count minus NaN and Inf, sum = mean x count,
    sumsq = norm², zeros = fraction x elements, min, max) and stored NULL otherwise. Returns the
    number of steps converted.

    Raises:
        InputError: bad input (named), or an output directory that `prepare_output` refuses.
    """
    run = Run(src, source="csv")
    try:
        prepare_output(run.path, Path(out), overwrite)
    except InputError:
        run.close()
        raise
    done = 0
    for rank in run.ranks:
        target = Path(out) / rank_dir_name(rank)
        target.mkdir(parents=True, exist_ok=True)
        db = MonitorDb(target / DB_NAME)
        try:
            meta_written = False
            for step, rows in progress(run.iter_steps(rank), run.step_count(rank), f"rank {rank} -> db"):
                if not meta_written:
                    db.set_meta({"schema_version": db_schema.SCHEMA_VERSION, "rank": rank, "ops": run.ops(rank),
                                 "fields": list(db_schema.FIELDS), "converted_from": str(Path(src).resolve()),
                                 **{k: v for k, v in run.metadata(rank).items() if k not in ("rank", "ops")}})
                    meta_written = True
                keys = [RecordKey(r["family"], r["name"], r["vpp_stage"], r["micro_step"], i,
                                  tuple(r["shape"]) if isinstance(r["shape"], list) else (), r["dtype"])
                        for i, r in enumerate(rows)]
                values, recorded = fields_from_figures(rows, run.ops(rank))
                db.add_step(step, 0, keys, values, {}, recorded)
                done += 1
        finally:
            db.close()
    run.close()
    return done


def stream_to_db(src: str | Path, force: bool = False, warn: Callable[[str], None] = lambda line: None) -> list[int]:
    """Writes `rank_<R>/monitor.db` beside each rank's `records.stream` (what the `db` format writes on a network
    filesystem), in rollback-journal mode: a database any host can open read-only once the job has ended. It is
    built on this host's disk and moved into place whole. Every stream is checked before any database is
    written. Returns the ranks written.

    Args:
        force: also write the ranks whose stream is not whole (said through `warn`, one line each).

    Raises:
        InputError: bad input (named), a rank that already has monitor.db, or (without `force`) a stream that is
            not whole: corrupt, cut mid-frame, or without its end frame (its job is still writing it, or was
            killed): readers prefer monitor.db to the stream, so a database made from it would hide what the
            stream holds or will hold.
    """
    found = find_run(src)
    ranks = [rank_dir for rank_dir in found.ranks if rank_dir.stream is not None]
    mirrors = {}
    for rank_dir in ranks:
        target = rank_dir.path / DB_NAME
        if target.exists():
            raise InputError.at(target, "already there; remove it to build it again from records.stream")
        mirrors[rank_dir.rank] = rank_dir.db
        stream = stream_mirror.findings(rank_dir.stream)
        problems = stream.warnings
        if not stream.ended and stream.tail is None:
            problems.append(f"{rank_dir.stream}: no end frame after its last whole frame (its job is still writing "
                            "it or was killed)")
        if problems and not force:
            raise InputError(f"{problems[0]}; pass --force to write monitor.db from its whole frames")
        for line in problems:
            warn(line)
    for rank_dir in ranks:
        target = rank_dir.path / DB_NAME
        partial = target.with_name(f".{target.name}.partial")
        shutil.copyfile(mirrors[rank_dir.rank], partial)
        partial.replace(target)
    return [rank_dir.rank for rank_dir in ranks]
