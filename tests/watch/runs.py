"""Runs for the daemon's tests: a finished one written by benchmarks/generate_run.py, and ranks written
step by step while a daemon follows them."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from trainmon.config.output import write_json
from trainmon.core.layout import DB_NAME, RUN_JSON, WRITER_REPORT
from trainmon.core.records import ACTV, GRAD_REDUCED, RecordKey
from trainmon.writers import db_schema
from trainmon.writers.db_sink import MonitorDb
from trainmon.writers.record_stream import RecordStream
from trainmon.core.layout import STREAM_NAME
from trainmon.watch.view import MAX_RUN

ROOT = Path(__file__).resolve().parents[2]
OPS = ["min", "max", "norm", "nans", "infs"]
KEYS = [RecordKey(ACTV, f"layers.{i}.output", 0, 0, i, (4, 4), "torch.float32") for i in range(3)] + \
       [RecordKey(GRAD_REDUCED, f"layers.{i}.weight", 0, None, 10 + i, (4, 4), "torch.float32") for i in range(3)]


def generate(run: Path, ranks: int, steps: int, inf_step: int, origin: int = 1) -> Path:
    """A finished run with an Inf entering `origin`'s layers.3 at `inf_step` (spreading through an all_reduce)."""
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "generate_run.py"), str(run), "--ranks", str(ranks),
                    "--steps", str(steps), "--inf-step", str(inf_step), "--origin-rank", str(origin),
                    "--workers", "1"], check=True, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return run


class LiveRank:
    """One rank's monitor.db (with `stream`: its records.stream, as on a network filesystem), written a step at a
    time (as a training rank's writer commits them)."""

    def __init__(self, run: Path, rank: int, stream: bool = False):
        self.dir = run / f"rank_{rank}"
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json(self.dir / RUN_JSON, {"rank": rank, "pp_stage": 0})
        self.db = RecordStream(self.dir / STREAM_NAME) if stream else MonitorDb(self.dir / DB_NAME)
        self.db.set_meta({"schema_version": db_schema.SCHEMA_VERSION, "rank": rank, "ops": OPS,
                          "fields": list(db_schema.FIELDS)})
        self.rank = rank

    def write(self, step: int, nan: bool = False) -> None:
        """Commits `step`; `nan`: every tensor is all NaN (no finite element: min, max and mean have no value)."""
        if nan:
            fields = {"nans": 16.0, "min": math.inf, "max": -math.inf}
        else:
            fields = {"count": 16.0, "sum": 1.0, "sumsq": 4.0 * (1 + self.rank) + step, "min": -1.0, "max": 1.0}
        values = np.tile([fields.get(f, 0.0) for f in db_schema.FIELDS], (len(KEYS), 1))
        self.db.add_step(step, 0, KEYS, values, {"loss": math.nan if nan else 1.0 / (1 + step)})

    def finish(self) -> None:
        """What TrainerMon.stop() does: the writer's report in run.json says the rank has finished (the file
        replaced whole, as TrainerMon replaces it, so the daemon never reads it half written)."""
        self.close()
        write_json(self.dir / RUN_JSON, {"rank": self.rank, "pp_stage": 0, WRITER_REPORT: {"steps": 1}})

    def close(self) -> None:
        self.db.close()


def watch(*args, **popen) -> subprocess.Popen:
    """`trainmon watch ARGS` as a subprocess (stderr captured as text)."""
    return subprocess.Popen([sys.executable, "-m", "trainmon.cli", "watch", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, **popen)


def watch_once(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmon.cli", "watch", *map(str, args), "--once"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def terminate(process: subprocess.Popen) -> tuple[int, str]:
    """SIGTERM, then the exit status and stderr."""
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    return process.returncode, err


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def read_texts(logdir: Path) -> dict[str, list[tuple[int, str]]]:
    """{tag: [(step, markdown)]} of the text entries of the daemon's view, in file order."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    out: dict = {}
    for path in sorted((logdir / MAX_RUN).glob("events.out.tfevents.*")):
        for record in RawEventFileLoader(str(path)).Load():
            event = Event.FromString(record)
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "text":
                    out.setdefault(value.tag, []).append((event.step, value.tensor.string_val[0].decode()))
    return out


def read_events(logdir: Path, run: str = MAX_RUN) -> tuple[dict, dict]:
    """({tag: [(step, value)]} of the scalars, {tag: [steps]} of every value: scalars, images, text) of the event
    files of one run of the daemon's view (`logdir/<run>`), in file order, repeats kept."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    scalars: dict = {}
    steps: dict = {}
    for path in sorted((logdir / run).glob("events.out.tfevents.*")):
        for record in RawEventFileLoader(str(path)).Load():  # as written (no conversion to tensors)
            event = Event.FromString(record)
            for value in event.summary.value:
                steps.setdefault(value.tag, []).append(event.step)
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars, steps
